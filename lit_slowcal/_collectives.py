"""The process group and the averager's small collectives: ranks, broadcast, gathers, and the check
that every rank is at the same point; a compressed round's exchanges of parts (``all_to_all_parts``, ``gather_parts``).

Without an initialised process group there is one process, of rank 0 (``world_size``, ``rank``).
``check_same_point`` opens each of the averager's collectives (``COLLECTIVES``) with one all-gather
of a fixed length: ranks in different collectives, at different points or set up differently get one
``RuntimeError`` each, before anything is averaged or gathered. ``Machines`` is ``PeriodicAverager``'s
part that names its machines: the processes, m per process, M, and the S that take part in a round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lit_slowcal import _server
from lit_slowcal._selection import Modules, _as_list, local, machines_per_process
from lit_slowcal.options import AveragingOptions

if dist.is_available():
    # torch.distributed.nn.functional binds ``group.WORLD`` as its functions' default argument when
    # it is imported (torch._dynamo imports it, on the first optimizer's construction in a plain
    # torch loop). Imported after init_process_group it would keep the default group alive past
    # destroy_process_group: gloo's threads would then run into the interpreter's exit, where a
    # process occasionally aborts ("terminate called without an active exception"). Imported here,
    # with lit_slowcal and before any process group, it binds None.
    import torch.distributed.nn.functional  # noqa: F401

__all__ = [
    "Machines",
    "all_to_all_parts",
    "broadcast_module",
    "check_same_point",
    "gather_ints",
    "gather_ints_on",
    "gather_objects",
    "gather_parts",
    "rank",
    "world_size",
]


def world_size(process_group: Optional[Any]) -> int:
    """Processes of ``process_group`` (1 without an initialised process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(process_group)


def rank(process_group: Optional[Any]) -> int:
    """This process's rank in ``process_group`` (0 without an initialised process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(process_group)


def gather_objects(obj: Any, dst: int, process_group: Optional[Any]) -> Optional[list[Any]]:
    """Every rank's ``obj`` (picklable, CPU tensors), in rank order, on group rank ``dst``; ``None`` on the others."""
    group = process_group if process_group is not None else dist.group.WORLD
    mine = rank(process_group) == dst
    out: Optional[list[Any]] = [None] * world_size(process_group) if mine else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, dst), group=process_group)
    return out


def broadcast_module(
    modules: Modules, src: int = 0, *, process_group: Optional[Any] = None, extra: Sequence[Tensor] = ()
) -> None:
    """Copy group rank ``src``'s parameters and buffers (and the ``extra`` tensors) to every process; of a
    DTensor, its local shard.

    No-op without an initialised process group of more than one process.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(process_group) == 1:
        return
    group = process_group if process_group is not None else dist.group.WORLD
    src_rank = dist.get_global_rank(group, src)
    seen: set[int] = set()
    with torch.no_grad():
        for module in _as_list(modules):
            for t in (*map(local, (*module.parameters(), *module.buffers())), *extra):
                if id(t) not in seen:
                    seen.add(id(t))
                    dist.broadcast(t, src=src_rank, group=process_group)


def gather_ints(optimizer: Optimizer, values: Sequence[int], process_group: Optional[Any]) -> list[tuple[int, ...]]:
    """Every rank's ``values`` (one small all-gather of int64 on the device of the optimizer's parameters)."""
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
    return gather_ints_on(device, values, process_group)


def gather_ints_on(device: torch.device, values: Sequence[int], process_group: Optional[Any]) -> list[tuple[int, ...]]:
    """Every rank's ``values`` (one small all-gather of int64 on ``device``, on a CUDA device under NCCL)."""
    if device.type == "cpu" and dist.get_backend(process_group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world_size(process_group))]
    dist.all_gather(everyone, mine, group=process_group)
    return [tuple(int(v) for v in t.tolist()) for t in everyone]


def all_to_all_parts(x: Tensor, widths: list[int], m: int, group: Optional[Any]) -> Tensor:
    """All-to-all of ``x`` ``[m, sum(widths)]``, its columns cut into ``widths``: process j gets every process's
    j-th part; returns them as ``[world * m, widths[rank]]`` in machine order."""
    world, rank = len(widths), dist.get_rank(group)
    starts = [sum(widths[:j]) for j in range(world + 1)]
    send = torch.cat([x[:, starts[j] : starts[j + 1]].reshape(-1) for j in range(world)])
    out = torch.empty(world * m * widths[rank], dtype=x.dtype, device=x.device)
    _exchange(out, send, [m * widths[rank]] * world, [m * w for w in widths], group)
    return out.view(world * m, widths[rank])


def gather_parts(x: Tensor, widths: list[int], group: Optional[Any]) -> list[Tensor]:
    """Every process's ``x`` (process j's of ``widths[j]`` values), on every process, in rank order."""
    x = x.reshape(-1)
    out = torch.empty(sum(widths), dtype=x.dtype, device=x.device)
    _exchange(out, x.repeat(len(widths)), widths, [x.numel()] * len(widths), group)
    return list(out.split(widths))


#: Over gloo a compressed round's exchanges go in pieces of at most this many bytes from a process (its parts for
#: all its peers together), every piece in flight at once (the process group's threads carry them in order). One
#: message of megabytes each way moved at half a shaped link's rate (TCP, both directions of one connection at once),
#: pieces of 256 KiB at 90-96 % of it (docs/time_to_accuracy.md, "The link model against a shaped link"). NCCL cuts
#: its own messages: one there.
PIECE_BYTES = 256 * 1024


def _exchange(out: Tensor, send: Tensor, out_splits: list[int], in_splits: list[int], group: Optional[Any]) -> None:
    """``dist.all_to_all_single(out, send, out_splits, in_splits)``, over gloo in pieces of at most ``PIECE_BYTES``
    from a process. The pieces: each peer's part cut into n equal runs, n from the longest part and the peers, which
    every rank's splits must agree on (the callers' widths are every rank's); the same bits as one message."""
    longest = max(*out_splits, *in_splits) * send.element_size() * max(len(in_splits) - 1, 1)
    n = -(-longest // PIECE_BYTES)
    if n <= 1 or dist.get_backend(group) != "gloo":
        dist.all_to_all_single(out, send, out_splits, in_splits, group=group)
        return
    in_starts = [sum(in_splits[:j]) for j in range(len(in_splits))]
    out_starts = [sum(out_splits[:j]) for j in range(len(out_splits))]

    def runs(starts: list[int], splits: list[int], c: int) -> list[tuple[int, int]]:
        return [(s + length * c // n, s + length * (c + 1) // n) for s, length in zip(starts, splits)]

    works, landed = [], []
    for c in range(n):
        sent = runs(in_starts, in_splits, c)
        wanted = runs(out_starts, out_splits, c)
        piece = torch.cat([send[a:b] for a, b in sent])
        sizes = [b - a for a, b in wanted]
        got = torch.empty(sum(sizes), dtype=out.dtype, device=out.device)
        work = dist.all_to_all_single(got, piece, sizes, [b - a for a, b in sent], group=group, async_op=True)
        assert work is not None  # async_op=True: the work to wait on
        works.append(work)
        landed.append((got, sizes, wanted))
    for work in works:
        work.wait()
    for got, sizes, wanted in landed:
        for part, (a, b) in zip(got.split(sizes), wanted):
            out[a:b].copy_(part)


#: The averager's collectives, each opened by ``check_same_point`` (its code: the position here).
COLLECTIVES = ("a synchronisation", "gather_state_dict()")
_SETUP_SLOTS = 24  # the all-gather's length is the same whatever the collective and the setup
#: The int64 values every rank gives ``check_same_point``'s all-gather: the two counts, the setup's
#: slots and the collective's code (``lit_slowcal.link`` counts the check's bytes from it).
CHECK_VALUES = 2 + _SETUP_SLOTS + 1


def check_same_point(
    optimizer: Optimizer,
    counts: tuple[int, int],
    process_group: Optional[Any],
    advice: str,
    setup: Optional[dict[str, tuple[int, str]]] = None,
    collective: str = COLLECTIVES[0],
) -> None:
    """All ranks in the same ``collective`` (one of ``COLLECTIVES``), at the same (steps, backward passes)
    ``counts`` and, where given, with the same ``setup`` (name -> (an integer code, its readable value);
    one small all-gather of a fixed length), or one ``RuntimeError`` on every rank: for the collective,
    naming it; for a setup, naming each setting that differs with every rank's readable value (gathered
    then, on the error's path only, which every rank takes); for counts, ending with ``advice``. Where the
    all-gather itself fails (another rank never joins it: the process group's timeout), one ``RuntimeError``
    naming this rank's counts and the backend's error."""
    names = list(setup or {})
    code = COLLECTIVES.index(collective)
    values = [*counts, *(c for c, _ in (setup or {}).values())]
    assert len(names) <= _SETUP_SLOTS
    try:
        everyone = gather_ints(optimizer, [*values, *[0] * (_SETUP_SLOTS - len(names)), code], process_group)
    except RuntimeError as error:  # the backend's: a timeout, or a rank that left
        backend = " ".join(str(error).split())
        raise RuntimeError(
            f"PeriodicAverager: the ranks did not all reach {collective} (this rank: {counts[0]} steps, {counts[1]} "
            f"backward passes; the backend: {backend}); a rank whose data ended at another step (loaders of unknown "
            "length that differ between the ranks) or that skipped the collective is elsewhere: give every rank the "
            f"same number of batches, and {advice}."
        ) from error
    codes = [v[-1] for v in everyone]
    if len(set(codes)) > 1:
        what = ", ".join(f"rank {r}: {COLLECTIVES[c] if 0 <= c < len(COLLECTIVES) else c}" for r, c in enumerate(codes))
        raise RuntimeError(
            f"PeriodicAverager: the ranks are in different collectives ({what}); every rank calls each of them "
            "(gather_state_dict() too: on every rank, then rank 0 saves what it returns), and nothing was averaged or gathered."
        )
    differ = [i for i, name in enumerate(names) if len({values[2 + i] for values in everyone}) > 1]
    if differ:
        assert setup is not None
        texts = [setup[names[i]][1] for i in differ]
        readable = [texts] * len(everyone)
        if world_size(process_group) > 1:  # every rank is here: the gathered codes differ alike on all
            dist.all_gather_object(readable, texts, group=process_group)
        what = "; ".join(
            f"{names[i]} (" + ", ".join(f"rank {r}: {mine[k]}" for r, mine in enumerate(readable)) + ")"
            for k, i in enumerate(differ)
        )
        raise RuntimeError(
            f"PeriodicAverager: the ranks were set up differently: {what}; every rank must build the averager alike "
            "(the same options, machines per process, optimizer, and model and optimizer state to average), and "
            "nothing was averaged."
        )
    if len({values[:2] for values in everyone}) > 1:
        ranks = ", ".join(f"rank {r}: {v[0]} steps, {v[1]} backward passes" for r, v in enumerate(everyone))
        raise RuntimeError(
            f"PeriodicAverager: the ranks reached this synchronisation at different points ({ranks}); "
            "an optimizer step was skipped on some rank (a GradScaler that found inf/NaN, or a loop that "
            "skipped optimizer.step()) or a rank's data ended at another step (unequal numbers of batches), and "
            f"averaging now would mix different steps: {advice}."
        )


class Machines:
    """An averager's machines (mixed into ``PeriodicAverager``): P processes of ``process_group`` hosting m each."""

    process_group: Optional[Any]
    modules: list[nn.Module]
    options: AveragingOptions
    num_syncs: int
    _machines: Optional[int]

    @property
    def world_size(self) -> int:
        """Processes averaged over (1 without an initialised process group)."""
        return world_size(self.process_group)

    @property
    def rank(self) -> int:
        """This process's rank in the process group (0 without an initialised process group)."""
        return rank(self.process_group)

    @property
    def machines_per_process(self) -> int:
        """m: machines hosted by this process (1 unless the model holds ``SimulatedMachines``)."""
        if self._machines is None:
            self._machines = machines_per_process(self.modules)
        return self._machines

    @property
    def num_machines(self) -> int:
        """M = processes x m."""
        return self.world_size * self.machines_per_process

    @property
    def participants(self) -> int:
        """S: the machines that take part in each round."""
        return _server.num_participants(self.options.participation, self.num_machines)

    def participant_weights(self, round_index: Optional[int] = None) -> Optional[Tensor]:
        """The weights (1/S for the participants, 0 for the others) of the M machines in round
        ``round_index`` (the next synchronisation's by default); ``None`` when all take part."""
        r = self.num_syncs if round_index is None else round_index
        return _server.participant_weights(self.num_machines, self.participants, self.options.participation_seed, r)
