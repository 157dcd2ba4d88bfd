"""2 gloo processes x 2 simulated machines running the server-side cases of tests/core/test_server.py.

    python tests/server_side_run.py OUT.pt

Rank r hosts machines 2r and 2r + 1 of the quadratics of test_server (seed 5); OUT.pt maps each
case to both ranks' final stacked x.
"""

import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "core")]  # helpers, test_server
from helpers import Quadratics  # noqa: E402
from test_server import CASES, DIM, ROUNDS, K, M, Point  # noqa: E402

from lit_slowcal import PeriodicAverager, SimulatedMachines  # noqa: E402


def run(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    problem = Quadratics(machines=M, dim=DIM, steps=ROUNDS * K, seed=5)
    mine = [2 * rank, 2 * rank + 1]
    results = {}
    for name, S in (("diloco_inner_adam", None), ("fedadam", None), ("fedavg", 2)):
        _, _, make_inner, make_outer = CASES[name]
        machines = SimulatedMachines(Point(problem.x0), 2)
        optimizer = make_inner(machines.parameters())
        averager = PeriodicAverager(
            machines, optimizer, sync_every=K, outer_optimizer=make_outer, participation=S, participation_seed=11
        )
        for t in range(ROUNDS * K):
            x = machines.x.detach()
            machines.x.grad = torch.stack([problem.grad(i, x[j], t) for j, i in enumerate(mine)])
            optimizer.step()
            averager.step()
        results[name] = machines.x.detach().clone()
        if name == "fedavg":
            results["fedavg_floats"] = averager.floats_communicated
        averager.remove_hooks()
    torch.save(results, f"{out}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(run, args=(port, out), nprocs=2, start_method="fork")
    ranks = [torch.load(f"{out}.rank{r}") for r in (0, 1)]
    merged = {name: [r[name] for r in ranks] for name in ("diloco_inner_adam", "fedadam", "fedavg")}
    merged["fedavg_floats"] = ranks[0]["fedavg_floats"]
    torch.save(merged, out)
