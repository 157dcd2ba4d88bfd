"""The server's side of a round: which machines take part, and the outer optimizer's step.

By default the round's new model is the plain average of the machines. Two server-side options of
``PeriodicAverager`` change that, on every path (plain loop, Fabric, Trainer, simulated machines,
several processes):

``outer_optimizer``: a factory ``params -> torch.optim.Optimizer`` over the *global* parameters (one
copy of the model's parameters per process, of one machine's shape; not one per simulated machine).
At every synchronisation the machines' parameters are averaged to x_bar; the global parameters
still hold the round's start x_s; the outer optimizer is fed the pseudo-gradient
Delta = x_s - x_bar as their gradient and steps; every machine then starts the next round at the new
global parameters. DiLoCo is an outer ``SGD(lr=0.7, momentum=0.9, nesterov=True)``; FedAvgM an outer
SGD with momentum; FedAdam an outer Adam; an outer ``SGD(lr=1)`` is the plain average. The
optimizer's declared averaged state (SLowcal-SGD's w) and the buffers are averaged plainly, not
stepped. The outer optimizer's state and x_s travel in the averager's ``state_dict()``.

``participation``: S machines of the M take part in each round (an int S, or a fraction of M), drawn
afresh every round from ``participation_seed`` and the round's index, the same on every rank. The
new model is the average over the S participants (each with weight 1/S); every machine, the others
included, starts the next round from it. ``floats_communicated`` counts what the participants send
(per machine on average: S/M of a full round's floats). With S = M it is the plain average, bitwise.

The functions here hold no state: the averager keeps the round's start and the outer optimizer
(``PeriodicAverager.global_params``, ``PeriodicAverager.outer``) and passes them in.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.optim import Optimizer

from lit_slowcal._selection import local

__all__ = [
    "fingerprint",
    "load_state", "num_participants", "outer_step", "parameters",
    "participant_weights", "reset_round_start", "start_outer", "state_dict",
]  # fmt: skip

#: A parameter of the inner optimizer, with whether it is stacked (one slice per simulated machine).
Pairs = list[tuple[Tensor, bool]]
OuterFactory = Callable[[list[Tensor]], Optimizer]


def num_participants(participation: Optional[Union[int, float]], num_machines: int) -> int:
    """S: the machines of the M that take part in each round."""
    M, p = num_machines, participation
    if p is None:
        return M
    if isinstance(p, float):
        return max(1, round(p * M))
    if p > M:
        raise ValueError(f"Invalid participation: {p} (must be <= M = {M}, the machines in all)")
    return p


def participant_weights(num_machines: int, participants: int, seed: int, round_index: int) -> Optional[Tensor]:
    """The weights (1/S for the participants, 0 for the others) of the M machines in round
    ``round_index``; ``None`` when all take part."""
    M, S = num_machines, participants
    if S == M:
        return None
    g = torch.Generator().manual_seed((seed * 1_000_003 + round_index) % 2**64)  # the generator takes 64 bits
    weights = torch.zeros(M, dtype=torch.float64)
    weights[torch.randperm(M, generator=g)[:S]] = 1.0 / S
    return weights


def parameters(optimizer: Optimizer, tensors: list[tuple[Tensor, bool]]) -> Pairs:
    """The optimizer's parameters (of a DTensor, its local shard), each with whether it is stacked (so among
    ``tensors``, the averaged ones)."""
    stacked = {id(t) for t, s in tensors if s}
    params = [local(p) for group in optimizer.param_groups for p in group["params"]]
    return [(p, id(p) in stacked) for p in params]


def start_outer(factory: OuterFactory, pairs: Pairs) -> tuple[list[Tensor], Optimizer]:
    """The global parameters (the round's start: machine 0's parameters now) and the outer optimizer over them."""
    global_params = [(p[0] if s else p).detach().clone() for p, s in pairs]
    outer = factory(global_params)
    if not isinstance(outer, Optimizer):
        raise TypeError(f"Invalid outer_optimizer: it returned {outer!r} (must return a torch.optim.Optimizer)")
    return global_params, outer


def outer_step(outer: Optimizer, global_params: list[Tensor], pairs: Pairs) -> None:
    """The pseudo-gradient x_s - x_bar into the outer optimizer; its step is everyone's next start."""
    for g, (p, stacked) in zip(global_params, pairs):
        g.grad = g - (p[0] if stacked else p)
    outer.step()
    for g, (p, stacked) in zip(global_params, pairs):
        p.copy_(g.expand_as(p) if stacked else g)
        g.grad = None


def reset_round_start(global_params: list[Tensor], pairs: Pairs) -> None:
    """The round's start set to the parameters now (after a broadcast)."""
    with torch.no_grad():
        for g, (p, stacked) in zip(global_params, pairs):
            g.copy_(p[0] if stacked else p)


def state_dict(outer: Optimizer, global_params: list[Tensor]) -> dict[str, Any]:
    """The round's start and the outer optimizer's state (``PeriodicAverager.state_dict()["outer"]``)."""
    return {"round_start": [g.detach().clone() for g in global_params], "optimizer": outer.state_dict()}


def load_state(outer: Optimizer, global_params: list[Tensor], state: dict[str, Any]) -> None:
    """Restore what ``state_dict`` saved."""
    with torch.no_grad():
        for g, saved in zip(global_params, state["round_start"]):
            g.copy_(saved)
    outer.load_state_dict(state["optimizer"])


def fingerprint(outer: Optional[Optimizer]) -> dict[str, tuple[int, str]]:
    """What the ranks compare of the outer optimizer the factory built: its class and every group's settings
    (a factory written as a closure reads alike on every rank whatever its learning rate)."""
    if outer is None:
        return {"the outer optimizer": (0, "None")}
    groups = [{k: v for k, v in sorted(g.items()) if k != "params"} for g in outer.param_groups]
    text = f"{type(outer).__module__}.{type(outer).__qualname__}{groups}"
    return {"the outer optimizer": (zlib.crc32(text.encode()), text)}
