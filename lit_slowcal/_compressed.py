"""The compressed average of ``PeriodicAverager`` (the semantics are ``lit_slowcal.compression``'s).

``CompressedAverage`` keeps, per averaged tensor by its name (``lit_slowcal._anchors.Anchored``), the
anchor (the value every machine held after the last synchronisation, one machine's shape) and the
error-feedback buffers: ``errors`` per machine of this process (the tensor's own shape, stacked or not),
``owner_errors`` for the blocks of the chunk this process reduces (one machine's shape, zero elsewhere).
Process j reduces the j-th of ``P`` nearly equal contiguous runs of each tensor's own blocks (``_Layout``),
whatever else the round codes: a block's second-stage error feedback stays where its next round reads it
when the coded tensors change between rounds (state anchored a round after the parameters, ``state_every``).
``average`` runs one synchronisation of the tensors that are ``anchored``; the caller averages the others
exactly in the same round, and then calls ``anchor``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Optional

import torch
from torch import Tensor

from lit_slowcal import _collectives
from lit_slowcal._anchors import Anchored
from lit_slowcal._selection import Tensors
from lit_slowcal.compression import Compressor
from lit_slowcal.link import LinkCounts

__all__ = ["CompressedAverage", "accumulation_dtype"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype changes are summed in: float64 for float64 tensors, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class _Layout:
    """Where the values of a group of tensors (one device, one accumulation dtype) lie in its padded
    buffer of ``NB`` blocks (``NB * block_size`` values, each tensor starting at a block), and which
    blocks each process reduces.

    ``sizes``: one machine's values of each tensor; ``starts``: where each starts in the padded buffer;
    ``N``: the real values in all. Each tensor's own blocks are cut into ``P`` nearly equal contiguous
    runs, run j of every tensor reduced by process j, whatever else the round averages: chunk j is the
    round's tensors' j-th runs, one after another. The communication's buffer holds the blocks in that
    chunk-major order (``order[i]``: the padded buffer's block at position i; ``None``: the same order,
    as with one process): ``block_starts[j]``: chunk j's first position (``P + 1`` entries);
    ``segments[j]``: the ranges ``(lo, hi)`` of real values of chunk j in that order; ``pieces[j]``: per
    tensor with a run in chunk j, ``(tensor, lo, hi, at)``: its values ``lo:hi`` lie from ``at`` on.
    """

    sizes: list[int]
    starts: list[int]
    N: int
    NB: int
    block_starts: list[int]
    segments: list[list[tuple[int, int]]]
    pieces: list[list[tuple[int, int, int, int]]]
    order: Optional[Tensor]
    inverse: Optional[Tensor]

    @classmethod
    def of(cls, sizes: list[int], block_size: int, chunks: int) -> _Layout:
        blocks = [-(-n // block_size) for n in sizes]
        firsts = list(accumulate(blocks, initial=0))[:-1]
        NB = sum(blocks)
        order: list[int] = []
        block_starts, pieces = [0], []
        for j in range(chunks):
            chunk = []
            for i, (n, nb, first) in enumerate(zip(sizes, blocks, firsts)):
                r0, r1 = nb * j // chunks, nb * (j + 1) // chunks
                if r0 < r1:
                    chunk.append((i, r0 * block_size, min(r1 * block_size, n), len(order) * block_size))
                    order.extend(range(first + r0, first + r1))
            pieces.append(chunk)
            block_starts.append(len(order))
        segments = [[(at, at + hi - lo) for _, lo, hi, at in chunk] for chunk in pieces]
        starts = [first * block_size for first in firsts]
        if order == list(range(NB)):
            return cls(sizes, starts, sum(sizes), NB, block_starts, segments, pieces, None, None)
        permutation = torch.tensor(order, dtype=torch.long)
        inverse = torch.empty_like(permutation)
        inverse[permutation] = torch.arange(NB)
        return cls(sizes, starts, sum(sizes), NB, block_starts, segments, pieces, permutation, inverse)

    def widths(self) -> list[int]:
        """The real values of each chunk."""
        return [sum(hi - lo for lo, hi in segments) for segments in self.segments]

    def block_widths(self) -> list[int]:
        """The blocks of each chunk."""
        return [b - a for a, b in zip(self.block_starts, self.block_starts[1:])]

    def to_chunks(self, x: Tensor, dim: int) -> Tensor:
        """``x``'s blocks (along ``dim``, in the padded buffer's order) in chunk-major order."""
        return x if self.order is None else x.index_select(dim, self.order.to(x.device))

    def from_chunks(self, x: Tensor, dim: int) -> Tensor:
        """``x``'s blocks (along ``dim``, in chunk-major order) back in the padded buffer's order."""
        return x if self.inverse is None else x.index_select(dim, self.inverse.to(x.device))

    def real(self, x: Tensor, chunk: int, offset: int = 0) -> Tensor:
        """The real values of chunk ``chunk`` of ``x`` (``[..., padded]`` in chunk-major order, starting at
        ``offset``), in order."""
        parts = [x[..., lo - offset : hi - offset] for lo, hi in self.segments[chunk]]
        return torch.cat(parts, dim=-1) if parts else x[..., :0]

    def place(self, values: Tensor, out: Tensor, chunk: int, offset: int = 0) -> None:
        """Write ``values`` (``[..., real values of chunk]``) into their places in ``out`` (padded in chunk-major
        order, from ``offset``)."""
        i = 0
        for lo, hi in self.segments[chunk]:
            out[..., lo - offset : hi - offset] = values[..., i : i + hi - lo]
            i += hi - lo


@dataclass(frozen=True)
class _Group:
    """One group's round: its tensors (name, tensor, stacked) on ``device``, averaged in ``acc``, the layouts of their
    values and codes, this process's ``m`` machines and its ``rank`` of ``world`` in the process ``group``."""

    items: list[tuple[str, Tensor, bool]]
    layout: _Layout
    coded: _Layout
    acc: torch.dtype
    device: torch.device
    m: int
    world: int
    rank: int
    group: Optional[Any]

    @property
    def chunk(self) -> tuple[int, int]:
        """The blocks this process reduces, ``b0:b1`` (chunk-major order)."""
        return self.layout.block_starts[self.rank], self.layout.block_starts[self.rank + 1]


class CompressedAverage(Anchored):
    """Anchors, error feedback and the two-stage reduce of one averager (see the module docstring)."""

    def __init__(self, code: Compressor, error_feedback: bool) -> None:
        super().__init__(error_feedback)
        self.code = code
        self._layouts: dict[tuple[Any, ...], tuple[_Layout, _Layout]] = {}

    # -- one synchronisation ----------------------------------------------------------------------

    def average(
        self,
        tensors: Tensors,
        names: list[str],
        participants: Optional[Tensor],
        *,
        machines_per_process: int,
        process_group: Optional[Any],
        nonnegative: Collection[str] = (),
    ) -> tuple[int, int]:
        """Replace every tensor (each ``anchored``, ``names`` theirs) by ``anchor + reduce(changes)`` and move the
        anchors there (``nonnegative``: the names landed at no less than 0, ``_land``). ``participants``: a bool
        per machine of all M (``None``: all). Returns the bytes one machine's message has in the first stage and
        the mean's in the second (codes and per-block values, no padding)."""
        world, rank = _collectives.world_size(process_group), _collectives.rank(process_group)
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, Tensor, bool]]] = {}
        for k, (t, s) in zip(names, tensors):
            groups.setdefault((t.device, accumulation_dtype(t.dtype)), []).append((k, t, s))
        first = second = 0
        for (device, acc), items in groups.items():
            layout, coded = self._layout([(t, s) for _, t, s in items], world)
            g = _Group(items, layout, coded, acc, device, machines_per_process, world, rank, process_group)
            a, b = self._average_group(g, participants, nonnegative)
            first, second = first + a, second + b
        return first, second

    def message_bytes(self, tensors: Tensors) -> tuple[int, int]:
        """One machine's bytes in the two stages of a synchronisation of ``tensors`` (codes and per-block
        values, no padding), without running it."""
        first = second = 0
        B = self.code.block_size
        for t, s in tensors:
            acc = accumulation_dtype(t.dtype)
            n = t[0].numel() if s else t.numel()
            nb = -(-n // B)
            codes, per_block = self.code.encode(torch.zeros(1, 1, B, dtype=acc))
            coded = self._message_bytes(codes, per_block, self._code_sizes([n])[0], nb)
            first += coded
            second += coded if self.code.second_stage else n * torch.empty(0, dtype=acc).element_size()
        return first, second

    @staticmethod
    def link_counts(first: int, second: Optional[int], participants: int) -> LinkCounts:
        """One round's ring counts: an all-to-all of ``first`` bytes, then an all-gather of ``second``."""
        return LinkCounts.of_stages(first, first if second is None else second, participants)

    def _layout(self, items: Tensors, world: int) -> tuple[_Layout, _Layout]:
        """The layouts of a group's values and of their codes (``Compressor.code_width`` codes a block: the same
        blocks, chunks and tensors)."""
        sizes = [t[0].numel() if s else t.numel() for t, s in items]
        key = (tuple(sizes), world, self.code.block_size)
        if key not in self._layouts:
            B = self.code.block_size
            codes = _Layout.of(self._code_sizes(sizes), self.code.code_width(B), world)
            self._layouts[key] = (_Layout.of(sizes, B, world), codes)
        return self._layouts[key]

    def _code_sizes(self, sizes: list[int]) -> list[int]:
        """The codes of tensors of ``sizes`` values: a code block per block, a tensor's last block's shorter."""
        B, width = self.code.block_size, self.code.code_width
        return [(n - 1) // B * width(B) + width(n - (n - 1) // B * B) for n in sizes]

    def _message_bytes(self, codes: Tensor, per_block: Optional[Tensor], n: int, nb: int) -> int:
        return n * codes.element_size() + (nb * per_block.element_size() if per_block is not None else 0)

    def _average_group(
        self, g: _Group, participants: Optional[Tensor], nonnegative: Collection[str]
    ) -> tuple[int, int]:
        """One group's round, steps 1 to 5 below. Returns the bytes one machine's message has in each stage."""
        layout, NB, B = g.layout, g.layout.NB, self.code.block_size
        # 1. Every machine's change (with its error feedback) in the padded buffer [m, NB * B], zeros between tensors.
        codes, per_block, decoded = self._code_changes(g, participants)
        first = self._message_bytes(codes, per_block, g.coded.N, NB)

        # 2-3. Process `rank` gets every machine's codes of its chunk, decodes them and takes the mean. From here on
        # the blocks lie in chunk-major order (``_Layout``; with one process, as they are).
        received, codes, per_block = self._exchange(g, codes, per_block, decoded)
        mean = _mean(received, participants)

        # 4. The mean, encoded again by its chunk's owner (with its error feedback), to every process.
        if self.code.second_stage:
            result, second = self._second_stage(g, mean, codes, per_block)
        else:
            result, second = self._gather_mean(g, mean)
        result = layout.from_chunks(result.view(NB, B), 0).reshape(NB * B)

        # 5. Every machine ends the round at anchor + the decoded mean; the anchors move there.
        for (k, t, s), st, n in zip(g.items, layout.starts, layout.sizes):
            self._land(k, t, s, result[st : st + n], k in nonnegative)
        return first, second

    def _code_changes(self, g: _Group, participants: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor], Tensor]:
        """Step 1: every machine's change since its anchor, with its error feedback, coded; with error feedback, what
        the codes lost becomes each machine's buffer (with participation, this process's participants' only).
        Returns the codes, the per-block values and what they decode to (``[m, NB * B]``)."""
        m, acc, NB, B = g.m, g.acc, g.layout.NB, self.code.block_size
        changes = torch.zeros(m, NB * B, dtype=acc, device=g.device)
        for (k, t, s), st, n in zip(g.items, g.layout.starts, g.layout.sizes):
            value = t.detach().reshape(m if s else 1, n)
            delta = changes[:, st : st + n]
            delta.copy_(value.to(acc) - self.anchors[k].reshape(1, n).to(acc))
            e = self.errors.get(k)
            if e is not None:
                delta.add_(e.reshape(m, n))
        codes, per_block = self.code.encode(changes.view(m, NB, B))
        decoded = self.code.decode(codes, per_block, acc).view(m, NB * B)
        if self.error_feedback:
            mine = None if participants is None else participants[g.rank * m : (g.rank + 1) * m]
            for (k, t, s), st, n in zip(g.items, g.layout.starts, g.layout.sizes):
                lost = changes[:, st : st + n] - decoded[:, st : st + n]
                e = self.errors.get(k)
                if e is None:
                    e = self.errors[k] = torch.zeros(t.shape if s else (1, *t.shape), dtype=acc, device=g.device)
                if mine is None:
                    e.view(m, n).copy_(lost)
                else:
                    e.view(m, n)[mine] = lost[mine]
        return codes, per_block, decoded

    def _exchange(
        self, g: _Group, codes: Tensor, per_block: Optional[Tensor], decoded: Tensor
    ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """Steps 2-3: every machine's values of chunk ``rank``, decoded from the codes an all-to-all brought
        (``[world * m, its values]``; with one process, ``decoded``), and the codes and per-block values as sent."""
        if g.world == 1:
            return decoded, codes, per_block
        layout, coded, m, world, acc = g.layout, g.coded, g.m, g.world, g.acc
        B, NB, C = self.code.block_size, layout.NB, self.code.code_width(self.code.block_size)
        b0, b1 = g.chunk
        codes = layout.to_chunks(codes.view(m, NB, C), 1)
        per_block = None if per_block is None else layout.to_chunks(per_block, 1)
        sent = torch.cat([coded.real(codes.view(m, NB * C), j) for j in range(world)], dim=1)
        got = _collectives.all_to_all_parts(sent, coded.widths(), m, g.group)
        # The padding (never sent) as the codes of zeros, as a process's own padded blocks have them: it decodes
        # to 0 and leaves the second stage's scales alone.
        zero = self.code.encode(torch.zeros(1, 1, B, dtype=acc, device=g.device))[0].reshape(-1)
        chunk_codes = zero.repeat(world * m, b1 - b0)
        coded.place(got, chunk_codes, g.rank, b0 * C)
        got_blocks = None
        if per_block is not None:
            got_blocks = _collectives.all_to_all_parts(per_block, layout.block_widths(), m, g.group)
        received = torch.zeros(world * m, 0, dtype=acc, device=g.device)  # no block here: fewer than processes
        if b1 > b0:
            received = self.code.decode(chunk_codes.view(world * m, b1 - b0, C), got_blocks, acc).view(world * m, -1)
        return received, codes, per_block

    def _second_stage(self, g: _Group, mean: Tensor, codes: Tensor, per_block: Optional[Tensor]) -> tuple[Tensor, int]:
        """Step 4 with a second stage: chunk ``rank``'s ``mean`` (with the owner's error feedback) coded again, every
        process's codes gathered and decoded (``codes``, ``per_block``: the first stage's, as ``_exchange`` left
        them). Returns the mean of every block, chunk-major, and the bytes of this process's message."""
        layout, coded, code, acc = g.layout, g.coded, self.code, g.acc
        B, NB, C = code.block_size, layout.NB, code.code_width(code.block_size)
        b0, b1 = g.chunk
        owner = self._owner_chunk(g) if self.error_feedback else None
        if owner is not None:
            mean.add_(owner)
        if b1 > b0:
            codes2, per_block2 = code.encode(mean.view(b1 - b0, B))
            result = code.decode(codes2, per_block2, acc).view(-1)
        else:  # no block here: nothing to encode (the first stage's codes, none of them, to gather)
            codes2, per_block2, result = codes[0, :0], None if per_block is None else per_block[0, :0], mean
        if owner is not None:
            self._keep_owner_chunk(g, mean - result)
        second = self._message_bytes(codes2, per_block2, coded.N, NB)
        if g.world > 1:
            all_codes = code.encode(torch.zeros(1, 1, B, dtype=acc, device=g.device))[0].reshape(1, C).repeat(1, NB)
            mine_real = coded.real(codes2.view(1, -1), g.rank, b0 * C)
            gathered = _collectives.gather_parts(mine_real, coded.widths(), g.group)
            for j, part in enumerate(gathered):
                coded.place(part.view(1, -1), all_codes, j)
            blocks2 = None
            if per_block2 is not None:
                blocks2 = torch.cat(_collectives.gather_parts(per_block2, layout.block_widths(), g.group)).view(1, NB)
            result = code.decode(all_codes.view(1, NB, C), blocks2, acc).view(NB * B)
        return result, second

    def _gather_mean(self, g: _Group, mean: Tensor) -> tuple[Tensor, int]:
        """Step 4 without a second stage: every process's chunk of the mean gathered as it is. Returns the mean of
        every block, chunk-major, and the bytes of this process's message."""
        layout, B = g.layout, self.code.block_size
        second = layout.N * torch.empty(0, dtype=g.acc).element_size()
        if g.world > 1:
            full = torch.zeros(1, layout.NB * B, dtype=g.acc, device=g.device)
            mine_real = layout.real(mean.view(1, -1), g.rank, g.chunk[0] * B)
            for j, part in enumerate(_collectives.gather_parts(mine_real, layout.widths(), g.group)):
                layout.place(part.view(1, -1), full, j)
            mean = full.view(layout.NB * B)
        return mean, second

    def _land(self, name: str, t: Tensor, stacked: bool, mean: Tensor, nonnegative: bool) -> None:
        """Every machine of ``t`` (``name``'s) ends the round at ``anchor + mean`` (the same bits on all), at
        ``max(anchor + mean, 0)`` where ``nonnegative``: with error feedback, what was not applied,
        ``min(anchor + mean, 0)``, joins every machine's buffer (the next round's mean carries it). The anchor
        moves there."""
        a = self.anchors[name]
        new = a.to(accumulation_dtype(a.dtype)).reshape(-1) + mean
        if nonnegative:
            if self.error_feedback:  # every machine's buffer exists: the round has just written it
                self.errors[name].view(-1, mean.numel()).add_(new.clamp(max=0))
            new = new.clamp(min=0)
        value = new.to(t.dtype).view(a.shape)
        a.copy_(value)
        t.detach().copy_(value.unsqueeze(0).expand_as(t) if stacked else value)

    def _owner_chunk(self, g: _Group) -> Tensor:
        """The second stage's error feedback on chunk ``rank`` (this process's, padded, in chunk-major order)."""
        (b0, b1), B = g.chunk, self.code.block_size
        out = torch.zeros((b1 - b0) * B, dtype=g.acc, device=g.device)
        for i, lo, hi, at in g.layout.pieces[g.rank]:
            e = self.owner_errors.get(g.items[i][0])
            if e is not None:
                out[at - b0 * B : at - b0 * B + hi - lo] = e.reshape(-1)[lo:hi]
        return out

    def _keep_owner_chunk(self, g: _Group, lost: Tensor) -> None:
        """``lost`` (chunk ``rank``'s, as ``_owner_chunk``'s) into each tensor's buffer, on that tensor's run."""
        at0 = g.chunk[0] * self.code.block_size
        for i, lo, hi, at in g.layout.pieces[g.rank]:
            k, t, s = g.items[i]
            e = self.owner_errors.get(k)
            if e is None:
                e = self.owner_errors[k] = torch.zeros(
                    t.shape[1:] if s else t.shape, dtype=lost.dtype, device=lost.device
                )
            e.reshape(-1)[lo:hi] = lost[at - at0 : at - at0 + hi - lo]


def _mean(values: Tensor, participants: Optional[Tensor]) -> Tensor:
    """The participants' rows of ``values`` (all: ``None``) summed in machine order, divided by their number."""
    rows = (
        list(range(values.shape[0])) if participants is None else [i for i, p in enumerate(participants.tolist()) if p]
    )
    total = values[rows[0]].clone()
    for i in rows[1:]:
        total.add_(values[i])
    return total.div_(len(rows))
