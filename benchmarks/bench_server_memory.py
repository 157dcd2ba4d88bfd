"""What the server's side of a round holds in memory: the outer optimizer at M simulated machines.

The paper's model (``nn.Linear(784, 10)``) on M simulated machines in one process (default M = 1024),
SLowcal-SGD inside, averaged by ``PeriodicAverager`` every K steps. Three averagers over the same
machines: plain averaging (the baseline), DiLoCo's outer step (Nesterov SGD, lr 0.7, momentum 0.9) and
FedAdam's (Adam). After a few rounds each, the script prints

* the floats the machines hold (stacked parameters: the baseline's whole model state),
* the floats the server side adds: the round's start x_s (``averager.global_params``) and the outer
  optimizer's state, counted from the tensors themselves (one machine's shape each, per process, not
  per simulated machine), and their ratio to the stacked parameters.

    python benchmarks/bench_server_memory.py [--machines 1024] [--local-steps 16]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from lit_slowcal import PeriodicAverager, SimulatedMachines, SlowcalSGD


def _floats(tensors) -> int:
    return sum(t.numel() for t in tensors)


def _outer_state_floats(averager: PeriodicAverager) -> int:
    """x_s and every tensor of the outer optimizer's state."""
    if averager.outer is None:
        return 0
    state = [v for s in averager.outer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return _floats(averager.global_params) + _floats(state)


def _train(averager: PeriodicAverager, machines: SimulatedMachines, optimizer, steps: int) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(machines.num_machines, 1, 784), torch.randint(0, 10, (machines.num_machines, 1))
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(machines(x).flatten(0, 1), y.flatten(), reduction="sum").backward()
        optimizer.step()
        averager.step()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--machines", type=int, default=1024)
    p.add_argument("--local-steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    opts = p.parse_args()
    torch.set_num_threads(1)
    outers = {
        "plain average (baseline)": None,
        "DiLoCo (outer Nesterov SGD)": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
        "FedAdam (outer Adam)": lambda ps: torch.optim.Adam(ps, lr=0.01),
    }
    print(f"M = {opts.machines} simulated machines of nn.Linear(784, 10), SLowcal-SGD inside, K = {opts.local_steps}")
    for name, outer in outers.items():
        machines = SimulatedMachines(nn.Linear(784, 10), opts.machines)
        optimizer = SlowcalSGD(machines.parameters(), lr=0.01)
        averager = PeriodicAverager(machines, optimizer, opts.local_steps, outer_optimizer=outer)
        _train(averager, machines, optimizer, opts.rounds * opts.local_steps)
        stacked = _floats(machines.parameters())
        server = _outer_state_floats(averager)
        print(f"  {name}: machines' parameters {stacked:,} floats; server side {server:,} floats "
              f"({100 * server / stacked:.3f}% of them; one machine's model is {stacked // opts.machines:,}); "
              f"syncs {averager.num_syncs}")  # fmt: skip


if __name__ == "__main__":
    main()
