"""Overlapped rounds' schedule: a round's average computed while training goes on, and the model cut in fragments.

``PeriodicAverager(..., overlap_delay=tau, fragments=F)`` (docs/communication.md, "Overlapped
rounds"). The averaged tensors are cut into F fragments (``partition``), each a contiguous run of
the averager's units (a parameter with its averaged optimizer state, or a buffer). Fragment f
starts its round at the steps where ``steps % K == f * K / F``; with tau = 0 the round blocks, else
the round engine (``lit_slowcal._rounds.OverlappedRound``) takes a snapshot of the fragment's
tensors and starts the snapshot's average, training goes on on the live tensors, and tau steps
later the round lands: live <- avg + (live - snapshot). With tau < K / F a round lands before the
next one starts, so at most one is in flight.

``OverlappedSchedule`` is ``PeriodicAverager``'s part that decides when: it starts a fragment's round
every K / F steps, lands the engine's round in flight at its step (the outer optimizer's step on the
snapshot's average, the merge, ``optimizer.post_sync()``), and counts a round when it starts (and, when
``close_round()`` lands it before its tau steps, the steps it was in flight: ``short_rounds``). A
round's participants are drawn when it starts; each fragment's round is one of ``num_syncs``,
``last_sync_step`` its start. ``close_round()`` lands a round in flight, then synchronises the whole
model. An optimizer that declares ``pre_sync`` or ``post_sync`` is refused with tau >= 1 or F > 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lit_slowcal import link
from lit_slowcal._counts import Counts
from lit_slowcal._rounds import Engine, OverlappedRound
from lit_slowcal._selection import Tensors, averaged_units
from lit_slowcal.options import AveragingOptions

__all__ = ["OverlappedSchedule", "partition"]


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


class OverlappedSchedule:
    """The overlapped and fragmented rounds of an averager (mixed into ``PeriodicAverager``; see the module
    docstring)."""

    options: AveragingOptions
    engine: Engine
    counts: Counts
    modules: list[nn.Module]
    optimizer: Optimizer
    buffers: Optional[list[Tensor]]
    steps: int
    num_syncs: int
    last_sync_step: int

    if TYPE_CHECKING:  # what the averager gives its parts

        @property
        def sync_every(self) -> int: ...

        @property
        def num_machines(self) -> int: ...

        @property
        def participants(self) -> int: ...

        def participant_weights(self, round_index: Optional[int] = None) -> Optional[Tensor]: ...

        def _tensors(self, state: bool = True) -> Tensors: ...

        def _averaged_keys(self) -> tuple[str, ...]: ...

        def _begin_round(self, fragment: Optional[int], state: bool = True) -> Tensors: ...

        def _blocking_round(self, tensors: Tensors, state: bool = True) -> None: ...

        def _end_round(self, count: bool = True) -> None: ...

        def _outer_step(self, live: Tensors, averaged: Tensors) -> None: ...

    @property
    def _overlapped(self) -> bool:
        """Whether rounds overlap training or take turns by fragment (tau >= 1 or F > 1)."""
        return self.options.overlap_delay > 0 or self.options.fragments > 1

    def _overlapped_step(self) -> bool:
        """``step()``'s schedule with overlapped rounds: land the round in flight at its step, start a
        fragment's round every K / F steps. Returns whether one started."""
        flight = self.engine.in_flight
        if flight is not None and self.steps >= flight.land_step:
            self._land()
        period = self.sync_every // self.options.fragments
        if self.steps % period:
            return False
        self._start_round((self.steps // period) % self.options.fragments)
        return True

    def _refuse_in_flight(self, what: str) -> None:
        """One ``RuntimeError`` line while a round is in flight (``what`` cannot run then)."""
        if self.engine.in_flight is not None:
            raise RuntimeError(
                f"PeriodicAverager.{what}: a round is in flight (it lands at step {self.engine.in_flight.land_step}); "
                "call close_round() first"
            )

    def _start_round(self, fragment: int) -> None:
        """Fragment ``fragment``'s scheduled round: blocking with tau = 0, else started to land tau steps later."""
        if self.engine.in_flight is not None:  # K made smaller mid-run: the last round lands before the next starts
            self._land()
        state = self.options.state_round(self.steps)  # the optimizer state in this round (``state_every``)
        tensors = self._begin_round(fragment if self.options.fragments > 1 else None, state)
        if not isinstance(self.engine, OverlappedRound):  # tau = 0
            self._blocking_round(tensors, state=state)
            return
        with torch.no_grad():
            sent = self.engine.start(tensors, self.participant_weights(), self.steps, fragment)
        self.counts.add(tensors, sent, self.num_machines, self.participants, overlapped=True)
        self.num_syncs += 1
        self.last_sync_step = self.steps

    def _land(self) -> None:
        """The round in flight lands: its average (waited for), the outer optimizer's step on it, the merge
        live <- avg + (live - snapshot), ``optimizer.post_sync()``."""
        assert isinstance(self.engine, OverlappedRound)
        assert self.engine.in_flight is not None
        taken = self.steps - (self.engine.in_flight.land_step - self.engine.delay)  # the steps it was in flight
        live, landing = self.engine.land(self._tensors)  # a restored round finds its live tensors (or one line)
        if taken < self.engine.delay:  # closed early: its communication hides behind these steps' compute only
            self.counts.landed_early(max(taken, 0))
        with torch.no_grad():
            self._outer_step(live, landing.result)
            landing.merge()
        self._end_round(count=False)

    def _units(self) -> list[Tensors]:
        """``_tensors()`` in units: a parameter with its averaged state, or a buffer (``_selection.averaged_units``)."""
        return averaged_units(self.modules, self.optimizer, self._averaged_keys(), self.buffers)

    def _fragments(self) -> list[Tensors]:
        """The F fragments of ``_tensors()``: runs of units balanced by the bytes of the units' parameters
        and buffers, which do not change as optimizer state appears (``_overlap.partition``)."""
        units = self._units()
        starts = partition([link.payload_bytes(unit[:1]) for unit in units], self.options.fragments)
        ends = [*starts[1:], len(units)]
        return [[pair for unit in units[a:b] for pair in unit] for a, b in zip(starts, ends)]
