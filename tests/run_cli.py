"""Runs the CLI in this process (and, through Lightning's launcher, in its DDP children), counting
all-reduce calls, and saves each rank's final state to OUT/rank{r}.pt.

Usage: python tests/run_cli.py OUT fit --num_machines ... (any CLI arguments)
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

calls = {"all_reduce": 0}
_all_reduce = dist.all_reduce


def counting_all_reduce(*args, **kwargs):
    calls["all_reduce"] += 1
    return _all_reduce(*args, **kwargs)


dist.all_reduce = counting_all_reduce

from lit_slowcal.cli import SlowcalCLI  # noqa: E402

out = Path(sys.argv[1])
cli = SlowcalCLI(args=sys.argv[2:])
opt = cli.trainer.optimizers[0]
params = dict(cli.model.machines.stacked_parameters())
state = {
    "params": {k: v.detach().clone() for k, v in params.items()},
    "w": {k: opt.state[p]["w"].clone() for k, p in params.items() if "w" in opt.state[p]},
    "all_reduce_calls": calls["all_reduce"],
    "num_syncs": cli.trainer.strategy.num_syncs,
    "world_size": cli.trainer.world_size,
    "metrics": {k: float(v) for k, v in cli.trainer.callback_metrics.items()},
}
out.mkdir(parents=True, exist_ok=True)
torch.save(state, out / f"rank{cli.trainer.global_rank}.pt")
