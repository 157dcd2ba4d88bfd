"""Each machine's own optimizer state: what a synchronisation leaves per machine, kept across a resume.

A synchronisation averages the parameters, the floating buffers and the optimizer state the
optimizer declares (``averaged_state``); every other tensor of the optimizer's state stays per
machine: SGD's ``momentum_buffer``, AdamW's ``exp_avg`` and ``exp_avg_sq`` (DiLoCo's inner
optimizer), SCAFFOLD's control variate ``c_local``. A checkpoint written by one process holds that
process's optimizer state only, so the averager's ``state_dict()`` carries this process's
per-machine state and ``gather_state_dict()`` every process's; ``load_state_dict`` gives each
process its own back (after the optimizer's own ``load_state_dict``, which it overwrites).

The saved form, ``state["per_machine"]``::

    {"world_size": P, "ranks": {rank: {param_index: {key: tensor}}}}

``param_index`` is the parameter's position in the optimizer's param groups (as in
``Optimizer.state_dict()``), ``key`` a state key not averaged whose value is a tensor (of a DTensor,
an FSDP2 shard's state, this process's local shard: it is put back into the DTensor at a load). Python
numbers in the state (``SlowcalSGD``'s step count) are the same on every machine (one schedule) and
travel in the optimizer's own state dict.

Which state a resume gives to each process (``select``):

- the same number of processes, every rank saved: each process its own, exactly;
- another number of processes (2 -> 1, 1 -> 2) where every saved process held the same per-machine
  state (one process saved, or state that happens to agree): every process gets it;
- per-machine state that differs between the saved processes, on another number of processes, or a
  state holding one rank's per-machine tensors loaded on another rank: refused with one line, since
  no machine of the new run is a machine of the old one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lit_slowcal._selection import local

__all__ = ["KEY", "load", "local_state", "select"]

#: Where ``PeriodicAverager.state_dict()`` keeps the per-machine optimizer state.
KEY = "per_machine"

PerParam = dict[int, dict[str, Tensor]]


def _params(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def local_state(optimizer: Optimizer, averaged: Sequence[str]) -> PerParam:
    """This process's per-machine optimizer state: every tensor of the state not under ``averaged`` (of a
    DTensor, its local shard)."""
    out: PerParam = {}
    for index, p in enumerate(_params(optimizer)):
        own = {
            key: local(value).detach()
            for key, value in optimizer.state.get(p, {}).items()
            if key not in averaged and isinstance(value, Tensor)
        }
        if own:
            out[index] = own
    return out


def _same(a: PerParam, b: PerParam) -> bool:
    if a.keys() != b.keys():
        return False
    return all(a[i].keys() == b[i].keys() and all(torch.equal(a[i][k].cpu(), b[i][k].cpu()) for k in a[i]) for i in a)


def _keys(states: Sequence[PerParam]) -> str:
    return ", ".join(sorted({k for state in states for per in state.values() for k in per}))


def _differing_keys(states: Sequence[PerParam]) -> str:
    """The keys whose tensors are not the same on every saved process."""
    first = states[0]
    differ = set()
    for state in states[1:]:
        for i in first.keys() | state.keys():
            a, b = first.get(i, {}), state.get(i, {})
            differ |= {
                k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k].cpu(), b[k].cpu())
            }
    return ", ".join(sorted(differ))


def select(saved: dict[str, Any], rank: int, world_size: int) -> Optional[PerParam]:
    """The per-machine state this process resumes with (see the module docstring), ``None`` if there is none to restore."""
    ranks: dict[int, PerParam] = {int(r): s for r, s in saved["ranks"].items()}
    saved_world = int(saved["world_size"])
    if not any(ranks.values()):
        return None
    if saved_world == world_size and rank in ranks:
        return ranks[rank]
    states = list(ranks.values())
    if len(ranks) == saved_world and all(_same(states[0], s) for s in states[1:]):
        return states[0]
    if len(ranks) < saved_world:
        raise ValueError(
            f"Cannot resume the per-machine optimizer state ({_keys(states)}): the state holds rank(s) {sorted(ranks)} "
            f"of {saved_world} processes and this is rank {rank} of {world_size}; save it with gather_state_dict() on "
            "every rank (the strategies' checkpoints do), or every rank's state_dict() in a file of its own"
        )
    raise ValueError(
        f"Cannot resume the per-machine optimizer state ({_differing_keys(states)}) of {saved_world} processes on {world_size}: "
        f"it differs between the saved processes and no machine of this run is one of theirs; resume on "
        f"{saved_world} processes, or delete the checkpoint's per-machine state to give every machine rank 0's"
    )


def _like_parameter(p: Tensor, shard: Tensor) -> Tensor:
    """``shard`` as the local shard of a DTensor placed as the DTensor ``p``."""
    from torch.distributed.tensor import DTensor

    assert isinstance(p, DTensor)
    return DTensor.from_local(shard, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def load(optimizer: Optimizer, state: PerParam, averaged: Sequence[str] = ()) -> None:
    """Put ``state`` into the optimizer's state, each tensor cast as ``Optimizer.load_state_dict`` casts it;
    a per-machine tensor (not under ``averaged``) that ``state`` does not hold is removed: this machine
    held none at the save (the optimizer's own load gave it rank 0's)."""
    params = _params(optimizer)
    if state and max(state) >= len(params):
        raise ValueError(
            f"Cannot resume the per-machine optimizer state: it names parameter {max(state)} and the optimizer has {len(params)}"
        )
    for index, own in state.items():
        p = params[index]
        target = optimizer.state[p]
        for key, value in own.items():
            if value.is_floating_point() and key != "step":
                value = value.to(device=p.device, dtype=p.dtype)
            else:
                value = value.to(device=p.device)
            current = target.get(key)
            if isinstance(current, Tensor) and local(current).shape != value.shape:
                raise ValueError(
                    f"Cannot resume the per-machine optimizer state: {key!r} of parameter {index} has shape "
                    f"{tuple(value.shape)} and the optimizer's has {tuple(local(current).shape)}"
                )
            if isinstance(current, Tensor) and current is not local(current):  # a DTensor: its local shard
                local(current).copy_(value)
            elif local(p) is not p and value.shape == local(p).shape:  # a shard's state not there yet: a DTensor
                target[key] = _like_parameter(p, value.clone(memory_format=torch.preserve_format))
            else:
                target[key] = value.clone(memory_format=torch.preserve_format)
    for index, p in enumerate(params):
        current = optimizer.state.get(p)
        if not current:
            continue
        for key in [
            k
            for k, v in current.items()
            if k not in averaged and isinstance(v, Tensor) and k not in state.get(index, {})
        ]:
            del current[key]
        if not current:  # a parameter this machine never stepped: no state at all, as before the save
            del optimizer.state[p]
