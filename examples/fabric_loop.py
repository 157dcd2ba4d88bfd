"""SLowcal-SGD with Lightning Fabric: one machine per process, averaged every K steps.

The loop is an ordinary Fabric loop; ``strategy="periodic_averaging"`` (or
``PeriodicAveragingFabricStrategy(sync_every=K)``) leaves gradients local and averages parameters
and the optimizer's iterate over the processes after every K-th ``optimizer.step()``::

    python examples/fabric_loop.py --processes 2 --steps 64 --sync-every 8 --out x.pt

Machine i trains on the same heterogeneous least-squares data as in ``examples/torch_loop.py``, so
``torch_loop.py --processes 1 --machines 2`` gives the same x_T up to float rounding.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from lightning.fabric import Fabric

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_loop import initial_model, make_data, make_optimizer  # noqa: E402

from lit_slowcal import PeriodicAveragingFabricStrategy  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=2, help="machines, one per process")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--sync-every", type=int, default=8, help="K")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--optimizer", choices=("slowcal", "sgd"), default="slowcal")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args(argv)

    strategy = PeriodicAveragingFabricStrategy(sync_every=args.sync_every, process_group_backend="gloo")
    fabric = Fabric(accelerator="cpu", devices=args.processes, strategy=strategy)
    fabric.launch()
    dtype = getattr(torch, args.dtype)
    x, y = make_data(args.processes, args.steps, args.batch, args.seed, dtype)
    x, y = x[:, fabric.global_rank], y[:, fabric.global_rank]  # this machine's data only

    model = initial_model(dtype)
    model, optimizer = fabric.setup(model, make_optimizer(args.optimizer, model.parameters(), args.lr))
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = ((model(x[step]) - y[step]) ** 2).mean()
        fabric.backward(loss)
        optimizer.step()  # averaged over the processes after every K-th step
    strategy.close_rounds()  # the last round, if it was not over: one model on every process
    if fabric.global_rank == 0 and args.out:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, args.out)
    # No process tears gloo down while its peer still talks to it (an abort at exit otherwise, under load).
    fabric.barrier()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
