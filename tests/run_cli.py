"""Runs the CLI in this process (and, through Lightning's launcher, in its DDP children), counting
the collective calls made during training steps, and saves each rank's final state to OUT/rank{r}.pt.

Usage: python tests/run_cli.py OUT fit --num_machines ... (any CLI arguments)

KILL=SIGNAL:STEP in the environment sends SIGNAL (e.g. SIGKILL, SIGTERM) to this process just before
its STEP-th local step of this run (1-based): a job killed mid-training.
FAIL=RANK:ROUND makes process RANK raise RuntimeError at the start of round ROUND (1-based).
INIT_NOISE_RANK=RANK perturbs the initial weights on process RANK only (before the strategy's setup).
"""

import os
import signal
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from lit_slowcal.experiments.sweep.contract import MEASURED
from lit_slowcal.experiments.train.model import MachinesModel

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce", "gather")
calls: Counter = Counter()
in_training = [False]


def _counting(name, fn):
    def wrapper(*args, **kwargs):
        if in_training[0]:
            calls[name] += 1
        return fn(*args, **kwargs)

    return wrapper


for _name in COLLECTIVES:
    setattr(dist, _name, _counting(_name, getattr(dist, _name)))

_training_step = MachinesModel.training_step


def training_step(self, batch, batch_idx, *args, **kwargs):
    if os.environ.get("FAIL"):
        rank, at = map(int, os.environ["FAIL"].split(":"))
        if self.global_rank == rank and batch_idx + 1 == at:
            raise RuntimeError(f"injected failure on rank {rank} in round {at}")
    in_training[0] = True
    try:
        return _training_step(self, batch, batch_idx, *args, **kwargs)
    finally:
        in_training[0] = False


MachinesModel.training_step = training_step

_configure_model = MachinesModel.configure_model


def configure_model(self):
    _configure_model(self)
    if os.environ.get("INIT_NOISE_RANK") == str(self.global_rank):
        with torch.no_grad():
            for p in self.machines.parameters():
                p.add_(1.0)


MachinesModel.configure_model = configure_model

if os.environ.get("KILL"):
    _signal, _at = os.environ["KILL"].split(":")
    _machine_losses = MachinesModel._machine_losses
    _calls = [0]

    def machine_losses(self, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] == int(_at):
            os.kill(os.getpid(), getattr(signal, _signal))  # SIGTERM: Lightning stops after this round
        return _machine_losses(self, *args, **kwargs)

    MachinesModel._machine_losses = machine_losses

from lightning.pytorch.utilities.exceptions import SIGTERMException  # noqa: E402

from lit_slowcal.experiments.run.cli import SlowcalCLI  # noqa: E402

out = Path(sys.argv[1])
try:
    cli = SlowcalCLI(args=sys.argv[2:])
except SIGTERMException:
    raise SystemExit(128 + signal.SIGTERM) from None
opt = cli.trainer.optimizers[0]
params = dict(cli.model.machines.stacked_parameters())
state = {
    "params": {k: v.detach().clone() for k, v in params.items()},
    "w": {k: opt.state[p]["w"].clone() for k, p in params.items() if "w" in opt.state[p]},
    # every method's whole per-parameter state (tensors and counts)
    "state": {
        k: {key: v.clone() if isinstance(v, torch.Tensor) else v for key, v in opt.state[p].items()}
        for k, p in params.items()
    },
    "collectives": dict(calls),
    "num_syncs": cli.trainer.strategy.num_syncs,
    "num_rounds": cli.datamodule.shape().rounds,
    "world_size": cli.trainer.world_size,
    "metrics": {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k not in MEASURED},
}
out.mkdir(parents=True, exist_ok=True)
torch.save(state, out / f"rank{cli.trainer.global_rank}.pt")
