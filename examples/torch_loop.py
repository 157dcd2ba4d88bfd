"""SLowcal-SGD and Local-SGD in a plain torch loop: no framework, just ``PeriodicAverager``.

M machines minimise the average of their own least-squares losses (every machine has its own
target, so the data is heterogeneous). P processes (gloo on CPU, or CUDA tensors through gloo on one
GPU) each host M / P machines stacked in one ``SimulatedMachines`` module; the averager averages
all M machines every K optimizer steps, over the machine dimension and the processes::

    python examples/torch_loop.py --processes 2 --machines 4 --steps 64 --sync-every 8 --optimizer slowcal --out x.pt

writes the final synchronised parameters x_T to ``x.pt``. The same run with ``--processes 1`` (one
process hosting all machines) gives the same parameters up to float rounding.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from lit_slowcal import PeriodicAverager, SimulatedMachines, SlowcalSGD

DIM = 5


def make_data(
    machines: int, steps: int, batch: int, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """Every machine's samples: x ``(steps, M, batch, DIM)``, y ``(steps, M, batch, 1)``, y = x theta_i + noise."""
    xs, ys = [], []
    for i in range(machines):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        theta = 2 * torch.randn(DIM, 1, generator=g, dtype=torch.float64) + i  # machine i's own minimiser
        x = torch.randn(steps, batch, DIM, generator=g, dtype=torch.float64)
        xs.append(x)
        ys.append(x @ theta + 0.1 * torch.randn(steps, batch, 1, generator=g, dtype=torch.float64))
    return torch.stack(xs, 1).to(dtype), torch.stack(ys, 1).to(dtype)


def initial_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    """x_0: the same on every process (and broadcast from rank 0 anyway)."""
    torch.manual_seed(0)
    return nn.Linear(DIM, 1).to(dtype)


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    return SlowcalSGD(params, lr=lr) if name == "slowcal" else torch.optim.SGD(params, lr=lr)


def train(rank: int, world: int, args: argparse.Namespace, init_file: str) -> None:
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    m = args.machines // world
    x, y = make_data(args.machines, args.steps, args.batch, args.seed, dtype)
    mine = slice(rank * m, (rank + 1) * m)  # this process hosts machines rank*m ... rank*m + m - 1
    x, y = x[:, mine].to(device), y[:, mine].to(device)

    machines = SimulatedMachines(initial_model(dtype), m).to(device)
    optimizer = make_optimizer(args.optimizer, machines.parameters(), args.lr)
    averager = PeriodicAverager(machines, optimizer, sync_every=args.sync_every)
    averager.broadcast()  # every machine starts at rank 0's x_0
    with averager:  # averages all machines after every K-th optimizer.step()
        for step in range(args.steps):
            optimizer.zero_grad()
            per_machine = ((machines(x[step]) - y[step]) ** 2).mean(dim=(1, 2))  # each machine's own loss
            per_machine.sum().backward()
            optimizer.step()
    averager.close_round()  # the last round, if it was not over: the output is the synchronised x_T
    if rank == 0 and args.out:
        torch.save({k: v.cpu() for k, v in machines.averaged_state().items()}, args.out)
        print(f"{args.optimizer}: {averager.num_syncs} syncs, {averager.floats_communicated} floats sent per machine")
    if world > 1:
        dist.barrier()  # no process tears gloo down while its peer still talks to it
        dist.destroy_process_group()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--machines", type=int, default=4, help="M, over all processes (a multiple of --processes)")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--sync-every", type=int, default=8, help="K")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--optimizer", choices=("slowcal", "sgd"), default="slowcal")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the final synchronised parameters here (torch.save)")
    args = p.parse_args(argv)
    if args.machines % args.processes:
        p.error(f"--machines {args.machines} is not a multiple of --processes {args.processes}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        if args.processes == 1:
            train(0, 1, args, init_file)
        else:
            mp.spawn(train, args=(args.processes, args, init_file), nprocs=args.processes, join=True)


if __name__ == "__main__":
    main()
