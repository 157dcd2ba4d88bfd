"""Overlapped rounds: a round's average computed while training goes on, and the model cut in fragments.

``PeriodicAverager(..., overlap_delay=tau, fragments=F)`` (docs/communication.md, "Overlapped
rounds"). The averaged tensors are cut into F fragments (``partition``), each a contiguous run of
the averager's units (a parameter with its averaged optimizer state, or a buffer). Fragment f
starts its round at the steps where ``steps % K == f * K / F``: a ``Round`` takes a snapshot of
the fragment's tensors and starts the snapshot's average; training goes on on the live tensors.
tau steps later the round lands: live <- avg + (live - snapshot). With tau < K / F a round lands
before the next one starts, so at most one is in flight.

The averager keeps the round in flight (a ``Round``) and calls what is here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lit_slowcal._communication import Averaging, Tensors
from lit_slowcal._validation import check_int

__all__ = ["Round", "check_options", "partition"]


def check_options(
    sync_every: int, overlap_delay: Any = 0, fragments: Any = 1, setting_k: bool = False
) -> tuple[int, int]:
    """(tau, F), checked against K: tau >= 0, F >= 1, F divides K and tau < K / F (a round lands before
    the next starts); else one ``ValueError`` naming the field, ``sync_every`` where K is being set (``setting_k``)."""
    tau = check_int("overlap_delay", overlap_delay, minimum=0)
    parts = check_int("fragments", fragments)
    if setting_k and (sync_every % parts or tau >= sync_every // parts):
        raise ValueError(
            f"Invalid sync_every: {sync_every} (must be a multiple of fragments = {parts} and >= "
            f"(overlap_delay + 1) x fragments = {(tau + 1) * parts})"
        )
    if sync_every % parts:
        raise ValueError(f"Invalid fragments: {parts} (must divide sync_every = {sync_every})")
    if tau >= sync_every // parts:
        raise ValueError(
            f"Invalid overlap_delay: {tau} (must be < sync_every // fragments = {sync_every // parts}: "
            "a round lands before the next one starts)"
        )
    return tau, parts


def partition(sizes: Sequence[int], parts: int) -> list[int]:
    """The first index of each of ``parts`` contiguous, non-empty groups of ``sizes`` (at least ``parts``
    of them) whose largest sum is the smallest possible; of the partitions that reach it, the one that
    fills every group in turn as far as it may."""
    if len(sizes) < parts:
        raise ValueError(f"Invalid fragments: {parts} (must be <= {len(sizes)}, the parameters and buffers averaged)")

    def starts(cap: int, exact: bool) -> list[int]:
        out, total = [0], 0
        for i, size in enumerate(sizes):
            # Cut where the group would pass the cap, or (exact) where each group left needs one of the items left.
            if i and (total + size > cap or (exact and len(sizes) - i == parts - len(out))):
                out.append(i)
                total = 0
            total += size
        return out

    low, high = max(sizes, default=0), sum(sizes)
    while low < high:  # the smallest cap that the greedy cut meets with at most `parts` groups
        mid = (low + high) // 2
        low, high = (low, mid) if len(starts(mid, False)) <= parts else (mid + 1, high)
    return starts(low, True)


class Round:
    """A round in flight: the live tensors, their snapshot when it started, and the snapshot's average
    (``result``, being computed; read it after ``wait()``)."""

    def __init__(self, tensors: Tensors, land_step: int, start: Callable[[Tensors], Averaging]) -> None:
        self.tensors = tensors
        self.land_step = land_step  # steps at which it lands
        self.snapshot = [t.clone() for t, _ in tensors]
        self.result: Tensors = [(t.clone(), s) for t, (_, s) in zip(self.snapshot, tensors)]
        self.averaging = start(self.result)

    def wait(self) -> None:
        """Wait for the average: ``result`` holds it."""
        self.averaging.wait()

    def merge(self) -> None:
        """live <- avg + (live - snapshot): the round's average plus the local progress since the snapshot."""
        live = [t for t, _ in self.tensors]
        torch._foreach_sub_(live, self.snapshot)
        torch._foreach_add_(live, [t for t, _ in self.result])
