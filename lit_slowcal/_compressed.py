"""The compressed average of ``PeriodicAverager`` (the semantics are ``lit_slowcal.compression``'s).

``CompressedAverage`` keeps, per averaged tensor, the anchor (the value every machine held after the
last synchronisation, one machine's shape) and the error-feedback buffers: ``error`` per machine of
this process (the tensor's own shape, stacked or not), ``owner_error`` for the blocks of the chunks
this process reduces (one machine's shape, zero elsewhere). ``average`` runs one synchronisation of
the tensors that have an anchor; the caller averages the others exactly and then calls ``anchor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lit_slowcal._communication import Tensors
from lit_slowcal.compression import Compressor

__all__ = ["CompressedAverage", "accumulation_dtype"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype changes are summed in: float64 for float64 tensors, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class _Layout:
    """Where the values of a group of tensors (one device, one accumulation dtype) lie.

    ``sizes``: one machine's values of each tensor; ``offsets``: where each starts in the group's flat
    vector of ``N`` values; ``blocks``: ``NB`` blocks in all; ``pos``: each value's place in the
    zero-padded ``[NB, block_size]`` layout; ``block_starts[j]``/``value_starts[j]``: chunk j's first
    block and value (``P + 1`` entries each).
    """

    sizes: list[int]
    offsets: list[int]
    N: int
    NB: int
    pos: Tensor
    block_starts: list[int]
    value_starts: list[int]

    @classmethod
    def of(cls, sizes: list[int], block_size: int, chunks: int, device: torch.device) -> _Layout:
        offsets, counts, pos = [], [], []
        value, block = 0, 0
        for n in sizes:
            nb = -(-n // block_size)
            offsets.append(value)
            pos.append(block * block_size + torch.arange(n, device=device))
            counts.append(nb)
            value += n
            block += nb
        NB = block
        block_starts = [NB * j // chunks for j in range(chunks + 1)]
        # The value a block starts at: its tensor's offset plus its place in the tensor.
        first_value = torch.tensor(
            [off + b * block_size for off, nb in zip(offsets, counts) for b in range(nb)] + [value], dtype=torch.long
        )
        value_starts = [int(first_value[b]) for b in block_starts]
        flat_pos = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.long, device=device)
        return cls(sizes, offsets, value, NB, flat_pos, block_starts, value_starts)


class CompressedAverage:
    """Anchors, error feedback and the two-stage reduce of one averager (see the module docstring)."""

    def __init__(self, code: Compressor, error_feedback: bool) -> None:
        self.code = code
        self.error_feedback = error_feedback
        self.anchors: dict[int, Tensor] = {}  # id(tensor) -> its anchor
        self.errors: dict[int, Tensor] = {}  # id(tensor) -> this process's machines' error feedback
        self.owner_errors: dict[int, Tensor] = {}  # id(tensor) -> the second stage's, on the blocks owned here
        self._layouts: dict[tuple[Any, ...], _Layout] = {}

    # -- state ------------------------------------------------------------------------------------

    def has_anchor(self, t: Tensor) -> bool:
        return id(t) in self.anchors

    def anchor(self, tensors: Tensors) -> None:
        """Every tensor's current value (machine 0's slice for a stacked one) is its anchor."""
        for t, s in tensors:
            value = (t[0] if s else t).detach()
            a = self.anchors.get(id(t))
            if a is None or a.shape != value.shape or a.dtype != value.dtype:
                self.anchors[id(t)] = value.clone()
            else:
                a.copy_(value)

    def state_dict(self, tensors: Tensors) -> dict[str, list[Optional[Tensor]]]:
        """The anchors and buffers, one entry per tensor of ``tensors`` (``None`` where it has none)."""
        return {
            name: [store.get(id(t)) for t, _ in tensors]
            for name, store in (("anchors", self.anchors), ("errors", self.errors), ("owner_errors", self.owner_errors))
        }

    def load_state_dict(self, state: dict[str, list[Optional[Tensor]]], tensors: Tensors) -> None:
        for name, store in (("anchors", self.anchors), ("errors", self.errors), ("owner_errors", self.owner_errors)):
            saved = state.get(name, [None] * len(tensors))
            if len(saved) != len(tensors):
                raise ValueError(
                    f"Cannot load the averager's compression state: it holds {name} for {len(saved)} tensors and "
                    f"this averager averages {len(tensors)}; build it on the same model and optimizer"
                )
            store.clear()
            for (t, _), value in zip(tensors, saved):
                if value is not None:
                    store[id(t)] = value.detach().clone().to(t.device)

    # -- one synchronisation ----------------------------------------------------------------------

    def average(
        self,
        tensors: Tensors,
        participants: Optional[Tensor],
        *,
        machines_per_process: int,
        process_group: Optional[Any],
    ) -> tuple[int, int]:
        """Replace every tensor (each with an anchor) by ``anchor + reduce(changes)`` and move the anchors
        there. ``participants``: a bool per machine of all M (``None``: all). Returns the bytes one
        machine's message has in the first stage and the mean's in the second (codes and per-block
        values, no padding)."""
        world = dist.get_world_size(process_group) if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank(process_group) if world > 1 else 0
        groups: dict[tuple[torch.device, torch.dtype], Tensors] = {}
        for t, s in tensors:
            groups.setdefault((t.device, accumulation_dtype(t.dtype)), []).append((t, s))
        first = second = 0
        for (device, acc), items in groups.items():
            layout = self._layout(items, world, device)
            a, b = self._average_group(
                items, layout, acc, participants, machines_per_process, world, rank, process_group
            )
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
            coded = self._message_bytes(codes, per_block, n, nb)
            first += coded
            second += coded if self.code.second_stage else n * torch.empty(0, dtype=acc).element_size()
        return first, second

    def _layout(self, items: Tensors, world: int, device: torch.device) -> _Layout:
        sizes = [t[0].numel() if s else t.numel() for t, s in items]
        key = (tuple(sizes), world, device, self.code.block_size)
        if key not in self._layouts:
            self._layouts[key] = _Layout.of(sizes, self.code.block_size, world, device)
        return self._layouts[key]

    def _message_bytes(self, codes: Tensor, per_block: Optional[Tensor], n: int, nb: int) -> int:
        return n * codes.element_size() + (nb * per_block.element_size() if per_block is not None else 0)

    def _average_group(
        self,
        items: Tensors,
        layout: _Layout,
        acc: torch.dtype,
        participants: Optional[Tensor],
        m: int,
        world: int,
        rank: int,
        group: Optional[Any],
    ) -> tuple[int, int]:
        B, N, NB, code = self.code.block_size, layout.N, layout.NB, self.code
        device = layout.pos.device
        # 1. Every machine's change (with its error feedback), [m, N] in the accumulation dtype.
        changes = torch.empty(m, N, dtype=acc, device=device)
        for (t, s), off, n in zip(items, layout.offsets, layout.sizes):
            value = t.detach().reshape(m, n) if s else t.detach().reshape(1, n)
            delta = changes[:, off : off + n]
            torch.sub(value.to(acc), self.anchors[id(t)].reshape(1, n).to(acc), out=delta)
            e = self.errors.get(id(t))
            if e is not None:
                delta.add_(e.reshape(m, n))
        padded = torch.zeros(m, NB * B, dtype=acc, device=device)
        padded[:, layout.pos] = changes
        codes, per_block = code.encode(padded.view(m, NB, B))
        decoded = code.decode(codes, per_block, acc).reshape(m, NB * B)[:, layout.pos]
        mine = torch.ones(m, dtype=torch.bool) if participants is None else participants[rank * m : (rank + 1) * m]
        if self.error_feedback:
            lost = changes - decoded
            for (t, s), off, n in zip(items, layout.offsets, layout.sizes):
                e = self.errors.get(id(t))
                if e is None:
                    e = self.errors[id(t)] = torch.zeros(t.shape if s else (1, *t.shape), dtype=acc, device=device)
                e.view(m, n)[mine] = lost[mine, off : off + n]
        first = self._message_bytes(codes, per_block, N, NB)

        # 2-3. Process `rank` gets every machine's codes of its chunk, decodes them and takes the mean.
        b0, b1 = layout.block_starts[rank], layout.block_starts[rank + 1]
        v0, v1 = layout.value_starts[rank], layout.value_starts[rank + 1]
        local_pos = layout.pos[v0:v1] - b0 * B
        if world == 1:
            received = decoded
        else:
            codes_real = codes.reshape(m, NB * B)[:, layout.pos]
            got = _exchange(codes_real, layout.value_starts, m, world, group)
            got_block = None if per_block is None else _exchange(per_block, layout.block_starts, m, world, group)
            received = _decode(code, got, got_block, local_pos, b1 - b0, B, acc)
        everyone = torch.ones(world * m, dtype=torch.bool) if participants is None else participants
        mean = _mean(received, everyone)

        # 4. The mean, encoded again by its chunk's owner (with its error feedback), to every process.
        if code.second_stage:
            owner = self._owner_errors(items, layout, acc, rank, B)
            if owner is not None:
                mean.add_(owner[v0:v1])
            pad = torch.zeros(b1 - b0, B, dtype=acc, device=device)
            pad.view(-1)[local_pos] = mean
            codes2, per_block2 = code.encode(pad)
            result = code.decode(codes2, per_block2, acc).reshape(-1)[local_pos]
            if owner is not None:
                self._keep_owner_errors(items, layout, mean - result, v0, v1)
            second = self._message_bytes(codes2, per_block2, N, NB)
            if world > 1:
                codes_all = _gather(codes2.reshape(-1)[local_pos], layout.value_starts, world, group)
                block_all = None if per_block2 is None else _gather(per_block2, layout.block_starts, world, group)
                result = _decode(code, codes_all.unsqueeze(0), block_all, layout.pos, NB, B, acc).squeeze(0)
        else:
            second = N * torch.empty(0, dtype=acc).element_size()
            result = mean if world == 1 else _gather(mean, layout.value_starts, world, group)

        # 5. Every machine ends the round at anchor + the decoded mean; the anchors move there.
        for (t, s), off, n in zip(items, layout.offsets, layout.sizes):
            a = self.anchors[id(t)]
            new = (a.to(acc).reshape(-1) + result[off : off + n]).to(t.dtype).view(a.shape)
            a.copy_(new)
            t.detach().copy_(new.unsqueeze(0).expand_as(t) if s else new)
        return first, second

    def _owner_errors(self, items: Tensors, layout: _Layout, acc: torch.dtype, rank: int, B: int) -> Optional[Tensor]:
        """The second stage's error feedback of the group, flat ``[N]`` (zero outside this process's chunk)."""
        if not self.error_feedback:
            return None
        flat = torch.zeros(layout.N, dtype=acc, device=layout.pos.device)
        for (t, s), off, n in zip(items, layout.offsets, layout.sizes):
            e = self.owner_errors.get(id(t))
            if e is not None:
                flat[off : off + n] = e.reshape(-1)
        return flat

    def _keep_owner_errors(self, items: Tensors, layout: _Layout, lost: Tensor, v0: int, v1: int) -> None:
        flat = torch.zeros(layout.N, dtype=lost.dtype, device=lost.device)
        flat[v0:v1] = lost
        for (t, s), off, n in zip(items, layout.offsets, layout.sizes):
            if off + n <= v0 or off >= v1:
                continue
            shape = t.shape[1:] if s else t.shape
            self.owner_errors[id(t)] = flat[off : off + n].reshape(shape).clone()


def _mean(values: Tensor, participants: Tensor) -> Tensor:
    """The participants' rows of ``values`` summed in machine order, divided by their number."""
    rows = [i for i, p in enumerate(participants.tolist()) if p]
    total = values[rows[0]].clone()
    for i in rows[1:]:
        total.add_(values[i])
    return total.div_(len(rows))


def _decode(
    code: Compressor, codes: Tensor, per_block: Optional[Tensor], pos: Tensor, blocks: int, B: int, acc: torch.dtype
) -> Tensor:
    """``codes`` ``[rows, n]`` of the values at ``pos`` of ``blocks`` padded blocks, decoded to ``[rows, n]``."""
    rows = codes.shape[0]
    padded = torch.zeros(rows, blocks * B, dtype=codes.dtype, device=codes.device)
    padded[:, pos] = codes
    scales = None if per_block is None else per_block.reshape(rows, blocks)
    return code.decode(padded.view(rows, blocks, B), scales, acc).reshape(rows, blocks * B)[:, pos]


def _exchange(x: Tensor, starts: list[int], m: int, world: int, group: Optional[Any]) -> Tensor:
    """All-to-all of ``x`` ``[m, n]``: process j gets every process's columns ``starts[j]:starts[j+1]``;
    returns them as ``[world * m, n_j]`` in machine order."""
    x = x.reshape(m, -1)
    send = torch.cat([x[:, starts[j] : starts[j + 1]].reshape(-1) for j in range(world)])
    rank = dist.get_rank(group)
    width = starts[rank + 1] - starts[rank]
    out = torch.empty(world * m * width, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(
        out, send, [m * width] * world, [m * (starts[j + 1] - starts[j]) for j in range(world)], group=group
    )
    return out.view(world * m, width)


def _gather(x: Tensor, starts: list[int], world: int, group: Optional[Any]) -> Tensor:
    """Every process's chunk ``x`` (process j's covers ``starts[j]:starts[j+1]``), concatenated, on every process."""
    x = x.reshape(-1)
    out = torch.empty(starts[-1], dtype=x.dtype, device=x.device)
    sizes = [starts[j + 1] - starts[j] for j in range(world)]
    dist.all_to_all_single(out, x.repeat(world), sizes, [x.numel()] * world, group=group)
    return out
