"""The exact average of a model's tensors over the machines: buckets, all-reduce, division.

The tensors to average are grouped by device and dtype and flattened into buckets of at most a cap
of bytes; each bucket is one all-reduce (a small model: one collective per device and dtype per
synchronisation). At most two flattened buckets are in flight, so a synchronisation needs at most
two buckets of extra memory, not a second copy of the model (a blocking one flattens into two
buffers that its averager keeps: ``FlatPool``; with ``bucket_views`` the tensors live in one flat
buffer per kind, reduced where it lies: ``FlatPool.home``). A tensor larger than a bucket is reduced
in place; with two processes, so is every tensor of at least ``IN_PLACE_BYTES`` that lies contiguous
(see ``average``: the same bits as in a bucket, without its copies). With one process nothing is
communicated.

Which tensors, each with whether it is stacked: ``lit_slowcal._selection``; the process group:
``lit_slowcal._collectives``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lit_slowcal._collectives import world_size
from lit_slowcal._selection import Tensors

__all__ = ["Averaging", "CountsDiffer", "FlatPool", "average", "buckets", "rides", "start_average"]


def average(
    tensors: Tensors,
    weights: Optional[Tensor] = None,
    *,
    machines_per_process: int,
    process_group: Optional[Any],
    bucket_cap_bytes: int,
    pool: Optional[FlatPool] = None,
) -> None:
    """Replace every tensor by its average over the machines: the mean, or with ``weights`` (one per
    machine of all M, summing to 1) the weighted sum.

    The buckets are ``buckets``'s. With two processes, whose sum of two floats is the same whatever
    the order or the place of a value in a buffer, a tensor that can be reduced in place (not stacked,
    contiguous) of at least ``IN_PLACE_BYTES`` is reduced alone, in place, and only the others are
    flattened (``buckets(..., alone_bytes=...)``): the same bits without the flatten copy and the copy
    back. With more processes the ring's order of summation depends on the place of a value in the
    buffer, so the buckets stay as they are. At most two flattened buckets are in flight; with a
    ``pool`` they are flattened into its two persistent buffers (``FlatPool``) instead of new memory;
    with its ``bucket_views`` (and ``weights`` or not), each kind whose tensors all can be reduced in place
    lives in one buffer instead, reduced where it lies (``_home``), and only the other kinds are flattened.
    """
    start_average(
        tensors, weights, machines_per_process=machines_per_process, process_group=process_group,
        bucket_cap_bytes=bucket_cap_bytes, flat_in_flight=2, pool=pool,
    ).wait()  # fmt: skip
    if pool is not None:
        pool.keep_used()


class FlatPool:
    """Two persistent flat buffers per (device, dtype) for the flattened buckets of blocking averages.

    A bucket flattened into new memory pays for that memory's first touch at every synchronisation
    (the allocator hands large blocks back to the system and gets them again): for a bucket of a
    few MB that costs more than the copy. The buffers grow to the largest bucket of their kind and
    stay; an average whose flattened buckets are at most two in flight (``average``) uses them in
    turn, so a buffer is written again only after its all-reduce was waited for (a model of one
    bucket of a kind holds one buffer of it). Kinds an average did not use are dropped after it (a
    model moved to another device frees its old buffers).

    With ``bucket_views`` the pool also keeps, per kind, the buffer its tensors live in (``home``): the
    tensors are views of it, so it costs no memory beyond the model's.
    """

    def __init__(self, bucket_views: bool = False) -> None:
        #: Whether the tensors of a kind become views of one flat buffer of it where they all can (``home``).
        self.bucket_views = bucket_views
        # Per kind: the buffer its tensors live in (``home``), that buffer with the room behind it for the counts
        # a round carries (``rides``), and the tensors' addresses and sizes there.
        self.homes: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor, list[int], list[int]]] = {}
        self.homed: set[tuple[torch.device, torch.dtype]] = set()  # the kinds this average homed
        self.buffers: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        self.turn: dict[tuple[torch.device, torch.dtype], int] = {}  # the kinds this average used, and whose turn
        # Per (kind, buffer): the buffer and the shapes it was last laid out as, with its views of them.
        self.layouts: dict[tuple[tuple[torch.device, torch.dtype], int], tuple[Tensor, tuple, list[Tensor]]] = {}

    def take(self, numel: int, like: Tensor) -> Tensor:
        """A contiguous flat tensor of ``numel`` elements of ``like``'s device and dtype: the next of its kind's two buffers."""
        kind = (like.device, like.dtype)
        slots = self.buffers.setdefault(kind, [])
        turn = self.turn.get(kind, 0)
        self.turn[kind] = 1 - turn
        if turn == len(slots):
            slots.append(torch.empty(numel, device=like.device, dtype=like.dtype))
        elif slots[turn].numel() < numel:
            slots[turn] = torch.empty(numel, device=like.device, dtype=like.dtype)
        return slots[turn][:numel]

    def laid_out(self, tensors: Sequence[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """``take`` for ``tensors`` one after another, with the buffer's views shaped as each. The views are
        kept with their buffer for as long as the shapes stay: building them costs more than copying
        small tensors."""
        kind = (tensors[0].device, tensors[0].dtype)
        turn = self.turn.get(kind, 0)  # the buffer that take() gives
        sizes = [t.numel() for t in tensors]
        flat = self.take(sum(sizes), tensors[0])
        shapes = tuple(t.shape for t in tensors)
        slot = self.buffers[kind][turn]
        kept = self.layouts.get((kind, turn))
        if kept is None or kept[0] is not slot or kept[1] != shapes:
            views = [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]
            kept = self.layouts[kind, turn] = (slot, shapes, views)
        return flat, kept[2]

    @torch.no_grad()
    def home(self, tensors: Sequence[Tensor]) -> Tensor:
        """A flat buffer of ``tensors``' kind (device and dtype; each contiguous) that holds them one after
        another, each tensor a view of its part (``bucket_views``). Built, with the tensors' values copied
        in and each tensor rebound to its view (``t.data = view``: the same tensor objects), the first
        time and whenever a tensor no longer lies at its place (a loaded optimizer state, a model moved);
        else the same buffer, with nothing copied."""
        kind = (tensors[0].device, tensors[0].dtype)
        self.homed.add(kind)  # used: kept by keep_used()
        kept = self.homes.get(kind)
        sizes = [t.numel() for t in tensors]
        if kept is not None and [t.data_ptr() for t in tensors] == kept[2] and sizes == kept[3]:
            return kept[0]
        # Room behind the tensors for the counts a round carries in its message (``rides``): a few values.
        spare = RIDE_VALUES if kind[1] in RIDE_DTYPES else 0
        whole = torch.empty(sum(sizes) + spare, device=kind[0], dtype=kind[1])
        flat = whole[: sum(sizes)]
        views = [part.view(t.shape) for part, t in zip(flat.split(sizes), tensors)]
        torch._foreach_copy_(views, list(tensors))
        for t, view in zip(tensors, views):
            t.data = view
        self.homes[kind] = (flat, whole, [t.data_ptr() for t in tensors], sizes)
        return flat

    def spare(self, flat: Tensor) -> Tensor:
        """``flat``, a kind's ``home`` buffer, with the room behind it for the counts a round carries."""
        return self.homes[flat.device, flat.dtype][1]

    def keep_used(self) -> None:
        """After an average: drop the buffers of the kinds it did not use; the next starts again with each kind's first."""
        for kind in set(self.homes) - self.homed:
            del self.homes[kind]
        self.homed = set()
        for kind in set(self.buffers) - set(self.turn):
            del self.buffers[kind]
        for key in [key for key in self.layouts if key[0] not in self.turn]:
            del self.layouts[key]
        self.turn = {}


class CountsDiffer(Exception):
    """The counts an average carried in its message (``start_average``'s ``counts``) differ between the two
    processes; the tensors are as they were before it (nothing averaged)."""


class Averaging:
    """An average started by ``start_average``; ``wait()`` writes it into the tensors it was started on."""

    def __init__(self, divide: int) -> None:
        # (bucket, its flat copy or None, work, the copy's views shaped as the bucket's tensors or None)
        self.pending: list[tuple[Tensors, Optional[Tensor], Any, Optional[list[Tensor]]]] = []
        self.divide = divide
        #: With counts carried (``start_average``): their averaged parts, this process's parts, the buffer the
        #: tensors live in and its values before the round.
        self.carried: Optional[tuple[Tensor, Tensor, Tensor, Tensor]] = None

    def wait(self) -> None:
        """Wait for every bucket's all-reduce and write the averages back (at once with one process); with counts
        carried that differ between the processes, put the tensors back and raise ``CountsDiffer``."""
        pending, self.pending = self.pending, []
        for item in pending:
            _finish(*item, self.divide)
        if self.carried is not None:
            averaged, mine, flat, before = self.carried
            self.carried = None
            if not torch.equal(averaged, mine):  # (a + b) / 2 == a exactly, for these integers, only where b == a
                flat.copy_(before)
                raise CountsDiffer


#: With two processes a blocking round can carry counts (``start_average``'s ``counts``, two of them) in its own
#: message, behind the tensors in their bucket-views buffer: each in four 16-bit parts, exact in these dtypes
#: (their sum and its half too), so the processes compare them without a collective of their own (``rides``).
RIDE_VALUES = 8
RIDE_DTYPES = (torch.float32, torch.float64)
#: The most bytes of tensors a round that carries counts holds: it keeps a copy of them, to put them back
#: where the counts differ.
RIDE_BYTES = 4 * 2**20


def rides(tensors: Tensors, weights: Optional[Tensor], pool: Optional[FlatPool], process_group: Optional[Any]) -> bool:
    """Whether an average of ``tensors`` can carry counts in its message (``start_average``'s ``counts``): two
    processes, no ``weights``, bucket views, every tensor of one kind of ``RIDE_DTYPES`` reduced where it lies (not
    stacked, contiguous), ``RIDE_BYTES`` at most."""
    if weights is not None or pool is None or not pool.bucket_views or not tensors or world_size(process_group) != 2:
        return False
    first = tensors[0][0]
    kind = (first.device, first.dtype)
    return (
        first.dtype in RIDE_DTYPES
        and all(_in_place([pair]) and (pair[0].device, pair[0].dtype) == kind for pair in tensors)
        and sum(t.numel() for t, _ in tensors) * first.element_size() <= RIDE_BYTES
    )


def _count_parts(counts: Sequence[int], like: Tensor) -> Tensor:
    """``counts`` (each below 2^64) in 16-bit parts, lowest first, as ``like``'s dtype on its device."""
    parts = [(c >> (16 * k)) & 0xFFFF for c in counts for k in range(RIDE_VALUES // len(counts))]
    return torch.tensor(parts, dtype=like.dtype, device=like.device)


def start_average(
    tensors: Tensors,
    weights: Optional[Tensor] = None,
    *,
    machines_per_process: int,
    process_group: Optional[Any],
    bucket_cap_bytes: int,
    flat_in_flight: Optional[int] = None,
    pool: Optional[FlatPool] = None,
    counts: Optional[Sequence[int]] = None,
) -> Averaging:
    """Start ``average``'s all-reduces, every one asynchronous, and return without waiting for them
    (with one process the average is computed at once). ``tensors`` must not be read or written
    until ``wait()``. ``flat_in_flight``: wait for the oldest flattened bucket before starting one
    more than that many (``None``: start them all); ``pool``: flatten into its buffers (needs
    ``flat_in_flight`` at most 2). ``counts`` (two non-negative integers, where ``rides``): carried behind the
    tensors in the one all-reduce of their buffer; ``wait()`` raises ``CountsDiffer``, the tensors put back,
    where the other process's differ."""
    assert pool is None or (flat_in_flight is not None and flat_in_flight <= 2)
    assert counts is None or pool is not None  # and ``rides``: the caller's to check (``ScheduleCheck._carried``)
    world = world_size(process_group)
    local = None
    if weights is not None:
        m = machines_per_process
        rank = dist.get_rank(process_group) if world > 1 else 0
        local = weights[rank * m : (rank + 1) * m]

    if world == 1:
        for t, s in tensors:
            if s:
                t.copy_((t.mean(0, keepdim=True) if local is None else _combine(t, s, local).unsqueeze(0)).expand_as(t))
        return Averaging(1)
    # A tensor that the buckets of any number of processes reduce alone in place is weighted by a Python
    # number, the others by a tensor of their dtype (for bfloat16 and float16 the two differ): kept so.
    scalar = {id(b[0][0]) for b in buckets(tensors, bucket_cap_bytes) if _in_place(b)} if local is not None else set()
    alone = IN_PLACE_BYTES if world == 2 else None
    out = Averaging(world if local is None else 1)  # the weights already sum to 1 over all machines
    pending = out.pending

    def reduce_in_place(t: Tensor) -> None:  # no copy at all, and no memory held while in flight
        for piece in _pieces(t) if alone else (t,):
            if alone and _exchanged(piece):
                work: Any = _Exchange(piece, process_group)
            else:
                work = dist.all_reduce(piece, group=process_group, async_op=True)
            pending.append(([(piece, False)], None, work, None))

    def weigh(t: Tensor) -> None:  # with participation: this machine's weight, as a tensor reduced alone gets it
        if local is not None:
            t.mul_(local[0].item() if id(t) in scalar else local[0].to(device=t.device, dtype=t.dtype))

    if counts is not None:  # every tensor in one buffer, the counts behind them: one message
        assert pool is not None
        flat = pool.home([t for t, _ in tensors])
        whole = pool.spare(flat)
        mine = _count_parts(counts, whole)
        whole[flat.numel() :].copy_(mine)
        out.carried = (whole[flat.numel() :], mine, flat, flat.clone())
        reduce_in_place(whole)
        return out
    if pool is not None and pool.bucket_views:
        tensors = _home(
            tensors, pool, bucket_cap_bytes if alone is None else None, reduce_in_place, weigh, local is not None
        )
    for bucket in buckets(tensors, bucket_cap_bytes, alone_bytes=alone):
        if _in_place(bucket):
            weigh(bucket[0][0])
            reduce_in_place(bucket[0][0])
            continue
        while flat_in_flight is not None and sum(item[1] is not None for item in pending) == flat_in_flight:
            _finish(*pending.pop(0), out.divide)
        views = None
        if pool is not None and local is None and not any(s for _, s in bucket):  # the tensors as they are
            plain = [t for t, _ in bucket]
            flat, views = pool.laid_out(plain)
            torch._foreach_copy_(views, plain)
        else:
            parts = [_combine(t, s, local, id(t) in scalar).reshape(-1) for t, s in bucket]
            numel = sum(t.numel() for t in parts)
            flat = torch.cat(parts) if pool is None else torch.cat(parts, out=pool.take(numel, parts[0]))
        pending.append((bucket, flat, dist.all_reduce(flat, group=process_group, async_op=True), views))
    return out


#: With two processes, a tensor of at least this many bytes that can be reduced in place is reduced
#: alone (``average``): the copy into a bucket and the copy back that this saves cost more than the
#: latency of one more collective (docs/performance.md).
IN_PLACE_BYTES = 2**19
#: With two processes, a tensor reduced in place travels in pieces of at most this many bytes, so that
#: each piece's division runs while the next pieces are on the wire (``None``: whole; docs/performance.md).
IN_PLACE_CHUNK_BYTES: Optional[int] = 4 * 2**20


#: With two processes, a tensor on the CPU reduced in place of at most this many bytes is exchanged instead of
#: all-reduced: each process sends its values to the other and adds the other's to its own (``_Exchange``). One
#: message each way where gloo's all-reduce takes more steps; a + b on one process and b + a on the other are the
#: same bits, and the same as the all-reduce's sum. Above it the all-reduce is faster (docs/performance.md).
EXCHANGE_BYTES = 2**20


def _exchanged(t: Tensor) -> bool:
    """Whether two processes average ``t`` (reduced in place) by an exchange (``EXCHANGE_BYTES``)."""
    return t.device.type == "cpu" and t.numel() * t.element_size() <= EXCHANGE_BYTES


class _Exchange:
    """``t``'s sum over two processes by exchange: its values sent to the other process and the other's received
    (both started at once); ``wait()`` adds them in."""

    def __init__(self, t: Tensor, process_group: Optional[Any]) -> None:
        self.t, self.other = t, torch.empty_like(t)
        group: Any = dist.group.WORLD if process_group is None else process_group
        peer = dist.get_global_rank(group, 1 - dist.get_rank(group))  # torch >= 2.4: no group_dst yet
        self.works: list[Any] = [dist.isend(t, peer, group=group), dist.irecv(self.other, peer, group=group)]

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.t.add_(self.other)


def _pieces(t: Tensor) -> Sequence[Tensor]:
    """``t`` (contiguous) in views of at most ``IN_PLACE_CHUNK_BYTES``: what two processes reduce in place one by one."""
    pieces = math.ceil(t.numel() * t.element_size() / IN_PLACE_CHUNK_BYTES) if IN_PLACE_CHUNK_BYTES else 1
    return t.view(-1).tensor_split(pieces) if pieces > 1 else (t,)


def _home(
    tensors: Tensors,
    pool: FlatPool,
    cap_bytes: Optional[int],
    reduce: Callable[[Tensor], None],
    weigh: Callable[[Tensor], None],
    weighted: bool,
) -> Tensors:
    """``bucket_views``: the tensors of each kind (device and dtype) that all can be reduced in place live
    in one flat buffer (``FlatPool.home``), reduced where it lies with ``reduce``: whole, or with
    ``cap_bytes`` (more than two processes) in the ranges of the buckets that ``buckets`` gives them, so
    the ring sums every value in the order it would in a flattened bucket. Returns the other tensors."""
    rest: Tensors = []
    for items in _by_kind(tensors):
        if not all(_in_place([pair]) for pair in items):  # a stacked or non-contiguous tensor: flattened, as it is
            rest += items
            continue
        flat = pool.home([t for t, _ in items])
        for t, _ in (
            items if weighted else ()
        ):  # with participation, each tensor weighted where it lies (the same products)
            weigh(t)
        if cap_bytes is None:
            reduce(flat)
            continue
        offset = 0
        for bucket in buckets(items, cap_bytes):
            numel = sum(t.numel() for t, _ in bucket)
            reduce(flat[offset : offset + numel])
            offset += numel
    return rest


def _by_kind(tensors: Tensors) -> list[Tensors]:
    """``tensors`` grouped by (device, dtype), each group in order, the groups in order of first appearance."""
    by_kind: dict[tuple[torch.device, torch.dtype], Tensors] = {}
    for t, s in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append((t, s))
    return list(by_kind.values())


def _in_place(bucket: Tensors) -> bool:
    """Whether ``bucket`` is one tensor all-reduced where it lies (not stacked, contiguous)."""
    return len(bucket) == 1 and not bucket[0][1] and bucket[0][0].is_contiguous()


def _combine(t: Tensor, s: bool, local: Optional[Tensor], scalar: bool = False) -> Tensor:
    """This process's share of ``t``: the machines' mean (or, with ``local``, this process's machines'
    weights, the weighted sum) over its machine dimension when stacked ``s``."""
    if local is None:
        return t.mean(0) if s else t
    if scalar and not s:
        return t * local[0].item()
    w = local.to(device=t.device, dtype=t.dtype)
    return torch.tensordot(w, t, dims=1) if s else t * w[0]


#: A flattened bucket whose tensors average fewer bytes than this is divided in one pass over the
#: buffer and copied back in one call (``torch._foreach_copy_``): for many small tensors the calls
#: cost more than the second pass over their bytes. Either way, the same quotients.
SMALL_TENSOR_BYTES = 64 * 2**10


def _finish(bucket: Tensors, flat: Optional[Tensor], work: Any, views: Optional[list[Tensor]], world: int) -> None:
    """Wait for a bucket's all-reduce, then divide by ``world`` in place or, for a flattened bucket, on
    the way back into its tensors (one pass, the same quotients as dividing the buffer first; for
    small tensors the buffer is divided first, ``SMALL_TENSOR_BYTES``, and copied back through
    ``views``, its views shaped as the tensors, where the pool gave them)."""
    work.wait()
    if flat is None:
        if world != 1:
            bucket[0][0].div_(world)
        return
    if flat.numel() * flat.element_size() < SMALL_TENSOR_BYTES * len(bucket) and not any(s for _, s in bucket):
        if world != 1:
            flat.div_(world)
        if views is None:
            views = [part.view(t.shape) for part, (t, _) in zip(flat.split([t.numel() for t, _ in bucket]), bucket)]
        torch._foreach_copy_([t for t, _ in bucket], views)
        return
    offset = 0
    for t, s in bucket:
        n = t[0].numel() if s else t.numel()
        avg = flat[offset : offset + n].view(t.shape[1:] if s else t.shape)
        avg = avg.unsqueeze(0).expand_as(t) if s else avg
        if world != 1:
            torch.div(avg, world, out=t)
        else:
            t.copy_(avg)
        offset += n


def buckets(tensors: Tensors, cap_bytes: int, alone_bytes: Optional[int] = None) -> list[Tensors]:
    """Tensors grouped by (device, dtype), in order, cut where a bucket would exceed ``cap_bytes``; with
    ``alone_bytes``, a tensor of at least that many bytes that can be reduced in place (``_in_place``)
    is a bucket of its own, and the others of its kind are packed without it."""
    out: list[Tensors] = []
    for items in _by_kind(tensors):
        current: Tensors = []
        size = 0
        for t, s in items:
            nbytes = (t[0].numel() if s else t.numel()) * t.element_size()
            if alone_bytes is not None and nbytes >= alone_bytes and _in_place([(t, s)]):
                out.append([(t, s)])
                continue
            if current and size + nbytes > cap_bytes:
                out.append(current)
                current, size = [], 0
            current.append((t, s))
            size += nbytes
        if current:
            out.append(current)
    return out
