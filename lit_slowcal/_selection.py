"""What a synchronisation averages: the machines of a model and the tensors of theirs to average.

A machine is a process of the process group, or one of the m machines a ``SimulatedMachines``
module hosts in a process (``machines_per_process``). With several optimizers each floating buffer
is averaged by one of their averagers (``buffer_owners``). Of a model sharded by FSDP2, each rank
averages its local shards (``check_sharding``, ``local``), and its buffers that are not DTensors over its
machine's shard processes first (``shard_group``, ``machine_buffers``).

Every tensor comes with whether it is stacked: a parameter or buffer of a ``SimulatedMachines``
module (or optimizer state of the parameter's shape) holds one slice per machine along dimension 0.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lit_slowcal.simulated import SimulatedMachines

__all__ = [
    "all_modules", "among", "averaged_tensors", "averaged_units", "buffer_owners", "check_sharding", "check_state_keys", "floats_sent",
    "fingerprint", "is_averaged", "local", "machine_buffers", "machines_per_process", "names_of", "reshard",
    "shard_group", "state_key",
]  # fmt: skip

Modules = Union[nn.Module, Sequence[nn.Module]]
#: Tensors to average, each with whether it is stacked (a leading machine dimension).
Tensors = list[tuple[Tensor, bool]]


def all_modules(modules: Modules) -> Iterable[nn.Module]:
    """Every module of ``modules`` (one module or a sequence of them), submodules included."""
    for module in [modules] if isinstance(modules, nn.Module) else modules:
        yield from module.modules()


def machines_per_process(modules: Modules) -> int:
    """m: machines the ``SimulatedMachines`` of ``modules`` host in this process (1 without any)."""
    sims = {m.num_machines for m in all_modules(modules) if isinstance(m, SimulatedMachines)}
    if len(sims) > 1:
        raise ValueError(f"All SimulatedMachines of a model must host the same number of machines, got {sorted(sims)}")
    return sims.pop() if sims else 1


def buffer_owners(module: nn.Module, optimizers: Sequence[Optimizer]) -> list[list[Tensor]]:
    """Each floating buffer of ``module`` given to exactly one optimizer's averager: ``out[i]`` for ``optimizers[i]``.

    A buffer belongs to the optimizer that steps the parameters of the smallest submodule holding
    it whose parameters one optimizer alone steps (a discriminator's BatchNorm statistics go with
    the discriminator's optimizer); a buffer no single optimizer claims goes to the first. So a
    buffer is averaged once per round, by one averager, however many optimizers there are.
    """
    owner = {id(p): i for i, opt in enumerate(optimizers) for g in opt.param_groups for p in g["params"]}
    parents: dict[int, Optional[nn.Module]] = {id(module): None}
    for m in module.modules():
        for child in m.children():
            parents.setdefault(id(child), m)
    out: list[list[Tensor]] = [[] for _ in optimizers]
    seen: set[int] = set()
    for m in module.modules():
        for b in m.buffers(recurse=False):
            if id(b) in seen or not is_averaged(b):
                continue
            seen.add(id(b))
            index, node = 0, m
            while node is not None:
                claims = {owner[id(p)] for p in node.parameters() if id(p) in owner}
                if len(claims) == 1:
                    index = claims.pop()
                    break
                if len(claims) > 1:
                    break
                node = parents.get(id(node))
            out[index].append(b)
    return out


def check_sharding(modules: Modules, optimizer: Optimizer, process_group: Optional[Any]) -> bool:
    """Whether the model holds DTensors that ``average`` can average by their local shards; refuse, in one
    line, what it cannot.

    Supported: FSDP2's ``fully_shard`` over a one-dimensional mesh (placements ``(Shard(0),)``) whose
    ranks other than this one lie outside ``process_group`` (the replicate dimension of a 2-D mesh):
    every rank of the group then holds the same shard. Refused: other placements (tensor parallel,
    HSDP's 2-D mesh), a mesh sharing ranks with the group (an average would mix shards), FSDP1.
    """
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", None)
    if fsdp is not None and any(isinstance(m, fsdp) for m in all_modules(modules)):
        raise ValueError(
            "PeriodicAverager: the model is wrapped in FullyShardedDataParallel (FSDP1), whose parameters are flat "
            "shards; supported: FSDP2's fully_shard over the shard dimension of a mesh (docs/sharded.md)"
        )
    dtensor = _dtensor_type()
    if dtensor is None:
        return False
    names = {id(t): name for m in _as_list(modules) for name, t in (*m.named_parameters(), *m.named_buffers())}
    tensors = [p for g in optimizer.param_groups for p in g["params"]]
    tensors += [t for m in _as_list(modules) for t in (*m.parameters(), *m.buffers())]
    sharded = [t for t in tensors if isinstance(t, dtensor)]
    if not sharded:
        return False
    group = set(dist.get_process_group_ranks(process_group if process_group is not None else dist.group.WORLD))
    for t in sharded:
        name = names.get(id(t), "a parameter of the optimizer")
        mesh = t.device_mesh
        if mesh.ndim != 1 or not t.placements[0].is_shard(0):
            raise ValueError(
                f"PeriodicAverager: {name!r} is a DTensor with placements {tuple(t.placements)} over a {mesh.ndim}-D "
                "mesh (tensor parallel or HSDP); supported: FSDP2's fully_shard over a 1-D shard mesh, placements "
                "(Shard(dim=0),), averaged over the replicate group (docs/sharded.md)"
            )
        shared = sorted(set(mesh.mesh.flatten().tolist()) & group - {dist.get_rank()})
        if shared:
            raise ValueError(
                f"PeriodicAverager: {name!r} is sharded with ranks {shared} of the process_group, whose average "
                "would mix different shards; pass the replicate dimension's group (mesh['replicate'].get_group()) "
                "as process_group (docs/sharded.md)"
            )
    return True


def shard_group(modules: Modules, optimizer: Optimizer) -> Optional[Any]:
    """The process group of a sharded model's machine: the processes of its DTensors' 1-D shard mesh, over which
    its buffers that are not DTensors are averaged (``machine_buffers``); ``None`` with one shard process.
    Refused in one line: DTensors on meshes of different processes, where the model has such buffers."""
    dtensor = _dtensor_type()
    tensors = [p for g in optimizer.param_groups for p in g["params"]]
    tensors += [t for m in _as_list(modules) for t in (*m.parameters(), *m.buffers())]
    meshes = {tuple(t.device_mesh.mesh.flatten().tolist()): t.device_mesh for t in tensors if isinstance(t, dtensor)}
    if len(meshes) > 1 and any(_plain(b) for m in _as_list(modules) for b in m.buffers()):
        raise ValueError(
            f"PeriodicAverager: the model's DTensors lie on shard meshes of different processes {sorted(meshes)}, so "
            "its buffers have no one machine to be averaged over; supported: one shard mesh (docs/sharded.md)"
        )
    mesh = next(iter(meshes.values()), None)
    return None if mesh is None or mesh.size() == 1 else mesh.get_group()


def machine_buffers(modules: Modules, buffers: Optional[Sequence[Tensor]], group: Optional[Any]) -> None:
    """Before a round of a sharded model: reshard its FSDP2 modules (``reshard``) and replace each floating buffer
    that is not a DTensor (of ``buffers``; ``None``: every buffer of ``modules``) by its mean over the machine's
    shard processes, ``group`` (``shard_group``): every process of a machine then holds the same buffers."""
    reshard(modules)
    chosen = buffers if buffers is not None else [b for m in _as_list(modules) for b in m.buffers()]
    plain = [b for b in dict.fromkeys(chosen) if _plain(b) and b.numel()]
    if group is None or not plain:
        return
    size = dist.get_world_size(group)
    with torch.no_grad():
        for kind in dict.fromkeys((b.dtype, b.device) for b in plain):  # one all-reduce a dtype and device
            same = [b for b in plain if (b.dtype, b.device) == kind]
            flat = torch.cat([b.reshape(-1) for b in same])
            dist.all_reduce(flat, group=group)
            flat.div_(size)
            for b, mean in zip(same, flat.split([b.numel() for b in same])):
                b.copy_(mean.view_as(b))


def reshard(modules: Modules) -> None:
    """Reshard every FSDP2 module of ``modules`` that holds its parameters unsharded (as the root does after
    a forward without backward, an evaluation): its next forward then gathers the shards as they are now,
    not the full parameters of before an average."""
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if fsdp is None:
        return
    for module in all_modules(modules):
        if isinstance(module, fsdp):
            module.reshard()


def local(t: Tensor) -> Tensor:
    """A DTensor's local shard (the same tensor at every call: writing it writes the DTensor), else ``t``."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        with torch.no_grad():
            return t.to_local()
    return t


def _plain(t: Tensor) -> bool:
    """Whether ``t`` is averaged and not a DTensor: one copy per process (a BatchNorm's running statistics)."""
    dtensor = _dtensor_type()
    return is_averaged(t) and not (dtensor is not None and isinstance(t, dtensor))


def _as_list(modules: Modules) -> list[nn.Module]:
    return [modules] if isinstance(modules, nn.Module) else list(modules)


def _dtensor_type() -> Optional[type]:
    """``DTensor`` where torch.distributed has it (loaded only if torch already loaded it: no DTensor exists otherwise)."""
    if not dist.is_available():
        return None
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "DTensor"):
            return module.DTensor
    return None


def is_averaged(t: Tensor) -> bool:
    """Whether a synchronisation averages ``t``: a floating-point or complex tensor."""
    return t.is_floating_point() or t.is_complex()


def averaged_tensors(
    modules: Sequence[nn.Module],
    optimizer: Optimizer,
    keys: Sequence[str],
    buffers: Optional[Sequence[Tensor]],
    simulated: bool = True,
) -> Tensors:
    """The floating tensors to average, each with whether it has a leading machine dimension: every
    parameter of ``optimizer``, its state under ``keys``, and ``buffers`` (``None``: every buffer of
    ``modules``), each once; of a DTensor, its local shard (``local``).

    A tensor is stacked when it is a parameter or buffer of a ``SimulatedMachines`` module, or
    optimizer state of such a parameter with the parameter's shape.

    The units of ``averaged_units`` one after another, without their names (this runs at every round:
    ``_walk``); ``simulated=False``: ``modules`` hold no ``SimulatedMachines`` (``has_simulated``), not looked for again.
    """
    return [(t, stacked) for _, t, stacked in _walk(modules, optimizer, keys, buffers, simulated)]


def has_simulated(modules: Modules) -> bool:
    """Whether ``modules`` hold a ``SimulatedMachines``."""
    return any(isinstance(m, SimulatedMachines) for m in all_modules(modules))


def _stacked_ids(modules: Sequence[nn.Module]) -> set[int]:
    """The ids of the parameters and buffers of the ``SimulatedMachines`` among ``modules``."""
    stacked_ids: set[int] = set()
    for module in all_modules(modules):
        if isinstance(module, SimulatedMachines):
            stacked_ids.update(id(t) for t in (*module.parameters(), *module.buffers()))
    return stacked_ids


def among(tensors: Tensors, kept: Tensors) -> Tensors:
    """The pairs of ``tensors`` whose tensor is one of ``kept``'s, by address, shape and dtype (a DTensor's local
    shard is a new object at each call): a round's tensors without the optimizer state (``state_every``)."""
    key = lambda t: (t.data_ptr(), t.shape, t.dtype)  # noqa: E731
    keys = {key(t) for t, _ in kept}
    return [(t, s) for t, s in tensors if key(t) in keys]


def check_state_keys(optimizer: Optimizer, keys: Sequence[str]) -> bool:
    """Whether ``optimizer`` holds state yet; then one ``ValueError`` line for a key of ``keys`` (``average_state``)
    that no parameter's state holds (a misspelt key would never be averaged)."""
    states = [state for state in optimizer.state.values() if state]
    if not states:
        return False
    held = set().union(*(state.keys() for state in states))
    missing = [key for key in keys if key not in held]
    if missing:
        raise ValueError(
            f"Invalid average_state: {missing[0]!r} (no parameter's {type(optimizer).__name__} state holds it; its "
            f"state keys: {', '.join(sorted(map(str, held)))})"
        )
    return True


def averaged_units(
    modules: Sequence[nn.Module], optimizer: Optimizer, keys: Sequence[str], buffers: Optional[Sequence[Tensor]]
) -> list[Tensors]:
    """``averaged_tensors`` in units, in the same order: a parameter with its state under ``keys``, or
    a buffer; each unit's first tensor is its parameter or buffer (units with nothing to average left out)."""
    units: dict[tuple[str, int], Tensors] = {}  # by the unit's parameter or buffer: the walk gives a unit in one run
    for (kind, index, _), t, stacked in _walk(modules, optimizer, keys, buffers):
        units.setdefault((kind, index), []).append((t, stacked))
    return list(units.values())


def names_of(
    tensors: Tensors,
    modules: Sequence[nn.Module],
    optimizer: Optimizer,
    keys: Sequence[str],
    buffers: Optional[Sequence[Tensor]],
) -> list[str]:
    """Each of ``tensors``' (some of ``averaged_tensors``) name, the same for the tensor that takes its place
    (optimizer state loaded afresh): ``"param i"`` (the i-th of the optimizer's parameters), ``"param i
    key"`` (its state under ``key``), ``"buffer j"``."""
    # By storage, shape and dtype: a DTensor's local shard (``local``) is a new object at each call.
    key = lambda t: (t.data_ptr(), tuple(t.shape), t.dtype, 0 if t.numel() else id(t))  # noqa: E731
    name = lambda kind, index, state: f"{kind} {index}" if state is None else f"{kind} {index} {state}"  # noqa: E731
    where = {key(t): name(*position) for position, t, _ in _walk(modules, optimizer, keys, buffers)}
    return [where[key(t)] for t, _ in tensors]


def state_key(name: str) -> Optional[str]:
    """The optimizer state key of a name of ``names_of`` (``"param i key"``); ``None`` for a parameter or a buffer."""
    parts = name.split(" ", 2)
    return parts[2] if len(parts) == 3 and parts[0] == "param" else None


#: Where ``_walk`` found a tensor: ``("param", i, None)``, the i-th of the optimizer's parameters; ``("param", i,
#: key)``, its state under ``key``; ``("buffer", j, None)``, the j-th buffer (``names_of`` spells it).
Position = tuple[str, int, Optional[str]]


def _walk(
    modules: Sequence[nn.Module],
    optimizer: Optimizer,
    keys: Sequence[str],
    buffers: Optional[Sequence[Tensor]],
    simulated: bool = True,
) -> Iterator[tuple[Position, Tensor, bool]]:
    """Every tensor ``averaged_tensors`` gives, once and in its order, with its position and whether it is
    stacked; of a DTensor, its local shard. ``simulated``: as ``averaged_tensors``'."""
    stacked_ids = _stacked_ids(modules) if simulated else set()
    dtensor = _dtensor_type()
    shard = lambda t: local(t) if dtensor is not None and isinstance(t, dtensor) else t  # noqa: E731
    seen: set[int] = set()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        if id(p) not in seen and is_averaged(p):
            seen.add(id(p))
            yield ("param", i, None), shard(p), id(p) in stacked_ids
        state = optimizer.state.get(p) if keys else None
        for key in keys if state else ():
            t = state[key] if key in state else None
            if not isinstance(t, Tensor):
                continue
            _check_like(t, p, key)
            if id(t) not in seen and is_averaged(t):
                seen.add(id(t))
                yield ("param", i, key), shard(t), id(p) in stacked_ids and t.shape == p.shape
    for j, b in enumerate(buffers if buffers is not None else (b for m in modules for b in m.buffers())):
        if id(b) not in seen and is_averaged(b):
            seen.add(id(b))
            yield ("buffer", j, None), shard(b), id(b) in stacked_ids


def _check_like(state: Tensor, p: Tensor, key: str) -> None:
    """Refuse, in one line, averaged state that is not laid out as its parameter (a DTensor of other placements)."""
    layout = [getattr(t, "placements", None) for t in (state, p)]
    if layout[0] != layout[1]:
        raise ValueError(
            f"PeriodicAverager: the optimizer state {key!r} has placements {layout[0]} and its parameter {layout[1]}; "
            "averaged state must be sharded as its parameter (docs/sharded.md)"
        )


def floats_sent(tensors: Tensors, num_machines: int, participants: int) -> Union[int, float]:
    """Floats one machine sends in a synchronisation of ``tensors`` (one machine's slice of each) when M > 1
    (a complex number is two); with S < M participants, what they send per machine on average."""
    floats = sum((t[0].numel() if s else t.numel()) * (2 if t.is_complex() else 1) for t, s in tensors)
    if participants == num_machines:
        return floats
    return floats * participants / num_machines


def fingerprint(tensors: Tensors, keys: Sequence[str], optimizer: Optimizer) -> dict[str, tuple[int, str]]:
    """What every rank's averaged tensors must share, each as (an integer code, its readable value): their number,
    shapes, dtypes and contiguity, the averaged state keys and the optimizer's class (``check_same_point``)."""
    shapes = ";".join(f"{tuple(t.shape)}:{t.dtype}:{int(s)}:{int(t.is_contiguous())}" for t, s in tensors)
    joined, kind = ",".join(keys), type(optimizer).__qualname__
    crc = lambda text: zlib.crc32(text.encode())  # noqa: E731
    return {
        "averaged tensors": (len(tensors), str(len(tensors))),
        "their shapes, dtypes and contiguity": (crc(shapes), f"crc32 {crc(shapes):08x}"),
        "averaged state keys": (crc(joined), repr(joined)),
        "optimizer": (crc(kind), kind),
    }
