"""A round of any whole-tensor ``Code`` (``lit_slowcal.compression.Code``): encode, gather, reduce.

``CodedAverage`` keeps the anchors and the error feedback as ``CompressedAverage`` does (by a tensor's
name, saved and resumed alike; ``owner_errors`` stays empty: there is no
second stage). One round of ``anchored`` tensors, per tensor and per machine i of this process:
``c_i = value_i - anchor + e_i`` in the accumulation dtype, ``message_i = code.encode(c_i)`` and, with
error feedback, ``e_i <- c_i - code.decode(message_i)`` (a machine outside the round keeps its buffer).
Every process's messages reach every process in one all-gather of Python objects; every process then
computes ``anchor + code.reduce(the participants' messages, in machine order)``, the same bits on all
(never-negative state: at no less than 0, ``CompressedAverage._land``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lit_slowcal import _collectives
from lit_slowcal._compressed import CompressedAverage, accumulation_dtype
from lit_slowcal._selection import Tensors
from lit_slowcal._validation import check_int
from lit_slowcal.compression import Code
from lit_slowcal.link import LinkCounts

__all__ = ["CodedAverage"]


class CodedAverage(CompressedAverage):
    """Anchors, error feedback and the gathered reduce of a ``Code`` (see the module docstring)."""

    code: Code  # type: ignore[assignment]

    def __init__(self, code: Code, error_feedback: bool) -> None:
        super().__init__(code, error_feedback)  # type: ignore[arg-type]

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
        """Replace every tensor by ``anchor + reduce(messages)`` (the names in ``nonnegative``: at no less than 0,
        ``CompressedAverage._land``) and move the anchors there (see the module docstring). Returns one machine's
        message bytes, and 0 (no second stage)."""
        world, rank = _collectives.world_size(process_group), _collectives.rank(process_group)
        m, code = machines_per_process, self.code
        mine = None if participants is None else participants[rank * m : (rank + 1) * m].tolist()
        messages: list[list[Any]] = []  # [tensor][machine of this process]
        first = 0
        for k, (t, s) in zip(names, tensors):
            acc, n = accumulation_dtype(t.dtype), self.anchors[k].numel()
            changes = t.detach().reshape(m if s else 1, n).to(acc) - self.anchors[k].reshape(1, n).to(acc)
            e = self.errors.get(k)
            if e is not None:
                changes += e.reshape(-1, n)
            sent = [code.encode(change.clone()) for change in changes]
            if self.error_feedback:
                if e is None:
                    e = self.errors[k] = torch.zeros(t.shape if s else (1, *t.shape), dtype=acc, device=t.device)
                for i, message in enumerate(sent):
                    if mine is None or mine[i]:
                        e.view(-1, n)[i] = changes[i] - _values(code, "decode", code.decode(message, n, acc), n)
            messages.append(sent)
            first += _message_bytes(code, n, acc)
        everyone: list[Any] = [messages]
        if world > 1:
            everyone = [None] * world
            dist.all_gather_object(everyone, messages, group=process_group)
        keep = None if participants is None else participants.tolist()
        for i, (k, (t, s)) in enumerate(zip(names, tensors)):
            acc, a = accumulation_dtype(t.dtype), self.anchors[k]
            ordered = [message for process in everyone for message in process[i]]  # machine order, rank-major
            chosen = ordered if keep is None else [msg for msg, p in zip(ordered, keep) if p]
            mean = _values(code, "reduce", code.reduce(chosen, a.numel(), acc), a.numel()).to(a.device)
            self._land(k, t, s, mean, k in nonnegative)
        return first, 0

    def message_bytes(self, tensors: Tensors) -> tuple[int, int]:
        """One machine's message bytes for a round of ``tensors`` (``Code.message_bytes``), and 0."""
        return sum(_message_bytes(self.code, t[0].numel() if s else t.numel(), accumulation_dtype(t.dtype))
                   for t, s in tensors), 0  # fmt: skip

    @staticmethod
    def link_counts(first: int, second: Optional[int], participants: int) -> LinkCounts:
        """One round's ring counts: every participant's message to every other (a ring all-gather)."""
        return LinkCounts.of_gather(first, participants)


def _values(code: Code, what: str, values: Any, numel: int) -> Tensor:
    """``values``, what ``code.<what>`` returned for a tensor of ``numel`` values, if it is a 1-D floating tensor of
    ``numel`` values (never broadcast); else one line."""
    if not isinstance(values, Tensor) or not values.is_floating_point() or values.shape != (numel,):
        got = f"shape {tuple(values.shape)}, {values.dtype}" if isinstance(values, Tensor) else type(values).__name__
        raise ValueError(
            f"Invalid compression: {code!r}.{what} returned {got} for {numel} values (a 1-D floating tensor of {numel})"
        )
    return values


def _message_bytes(code: Code, numel: int, dtype: torch.dtype) -> int:
    """``code.message_bytes(numel, dtype)`` if it is an integer >= 0; else one line."""
    value = code.message_bytes(numel, dtype)
    check_int(f"{type(code).__name__}.message_bytes({numel}, {dtype})", value, minimum=0)
    return value
