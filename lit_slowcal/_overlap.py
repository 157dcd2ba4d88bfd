"""Overlapped rounds: a round's average computed while training goes on, and the model cut in fragments.

``PeriodicAverager(..., overlap_delay=tau, fragments=F)`` (docs/communication.md, "Overlapped
rounds"). The averaged tensors are cut into F fragments (``partition``), each a contiguous run of
the averager's units (a parameter with its averaged optimizer state, or a buffer). Fragment f
starts its round at the steps where ``steps % K == f * K / F``: a ``Round`` takes a snapshot of
the fragment's tensors and starts the snapshot's average; training goes on on the live tensors.
tau steps later the round lands: live <- avg + (live - snapshot). With tau < K / F a round lands
before the next one starts, so at most one is in flight.

``OverlappedSchedule`` is ``PeriodicAverager``'s part that runs them: it keeps the round in flight (a
``Round``), starts a fragment's round every K / F steps (blocking with tau = 0; else a snapshot whose
average the round engine starts, ``engine.start``), lands it tau steps later (the outer optimizer's
step on the snapshot's average, the merge, ``optimizer.post_sync()``), and counts it when it starts.
A round's participants are drawn when it starts; each fragment's round is one of ``num_syncs``,
``last_sync_step`` its start. ``close_round()`` lands a round in flight, then synchronises the whole
model. An optimizer that declares ``pre_sync`` or ``post_sync`` is refused with tau >= 1 or F > 1.

A checkpoint taken while a round is in flight holds it (``PeriodicAverager.state_dict()["in_flight"]``)::

    {"world_size": P, "machines_per_process": m, "overlap_delay": tau, "fragments": F,
     "ranks": {rank: {"land_step": s, "fragment": f, "snapshot": [...], "result": [...]}}}

``snapshot`` and ``result`` are lists by the tensor's place in the averager's tensors (``None``
outside the round's fragment), as the compressed state's are: the process's snapshot (every
machine's) and the average (one machine's shape where stacked). ``saved_round`` checks that an
averager can continue it; ``Round.from_state_dict`` restores it without communicating it again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lit_slowcal import link
from lit_slowcal._communication import Averaging
from lit_slowcal._counts import Counts
from lit_slowcal._rounds import Engine
from lit_slowcal._selection import Tensors, averaged_units
from lit_slowcal.options import AveragingOptions

__all__ = ["OverlappedSchedule", "Round", "partition", "saved_round"]


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
    """A round in flight: fragment ``fragment``'s live tensors, their snapshot when it started, and the
    snapshot's average (``result``, being computed; read it after ``wait()``).

    A round restored from a checkpoint (``from_state_dict``) holds its snapshot and its average, and the
    places of its tensors among the averager's; it finds the live tensors there when it lands (``bind``),
    so the optimizer's state may be loaded before or after the averager's."""

    def __init__(
        self, tensors: Tensors, land_step: int, start: Callable[[Tensors], Averaging], fragment: int = 0
    ) -> None:
        self.tensors: Optional[Tensors] = tensors
        self.land_step = land_step  # steps at which it lands
        self.fragment = fragment
        self.places: Optional[list[int]] = None  # a restored round's tensors' places, until bound
        self.snapshot = [t.clone() for t, _ in tensors]
        self.result: Tensors = [(t.clone(), s) for t, (_, s) in zip(self.snapshot, tensors)]
        self.averaging: Optional[Averaging] = start(self.result)

    def wait(self) -> None:
        """Wait for the average: ``result`` holds it."""
        if self.averaging is not None:
            self.averaging.wait()
            self.averaging = None

    def merge(self) -> None:
        """live <- avg + (live - snapshot): the round's average plus the local progress since the snapshot."""
        assert self.tensors is not None
        live = [t for t, _ in self.tensors]
        torch._foreach_sub_(live, self.snapshot)
        torch._foreach_add_(live, [t for t, _ in self.result])

    # -- in a checkpoint -------------------------------------------------------------------------

    def state_dict(self, averaged: Tensors) -> dict[str, Any]:
        """The round as plain data, by its tensors' places in ``averaged`` (the averager's tensors), after
        waiting for its average: ``land_step``, ``fragment``, and per place (``None`` outside the fragment)
        this process's ``snapshot`` (every machine's) and ``result`` (the average: one machine's shape where
        stacked, every machine's being the same)."""
        self.wait()
        places = self._places(averaged)
        snapshot: list[Optional[Tensor]] = [None] * len(averaged)
        result: list[Optional[Tensor]] = [None] * len(averaged)
        for k, before, (avg, s) in zip(places, self.snapshot, self.result):
            snapshot[k] = before  # not written again: the round's own, as an optimizer's state_dict gives its own
            result[k] = avg[0].clone() if s else avg  # a copy, not a view (torch.save would store all of avg)
        return {"land_step": self.land_step, "fragment": self.fragment, "snapshot": snapshot, "result": result}

    def _places(self, averaged: Tensors) -> list[int]:
        if self.places is not None:
            return self.places
        assert self.tensors is not None
        where = {id(t): k for k, (t, _) in enumerate(averaged)}
        if any(id(t) not in where for t, _ in self.tensors):
            raise RuntimeError(
                "PeriodicAverager.state_dict(): the round in flight averages tensors that are no longer the "
                "averager's (the optimizer's state was replaced mid-round); call close_round() before loading state"
            )
        return [where[id(t)] for t, _ in self.tensors]

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Round:
        """The round ``state_dict()`` saved, its average already computed (nothing is communicated again);
        bound to the live tensors by ``bind``."""
        out = cls.__new__(cls)
        out.tensors, out.averaging = None, None
        out.land_step, out.fragment = int(state["land_step"]), int(state["fragment"])
        kept = [(k, v, state["result"][k]) for k, v in enumerate(state["snapshot"]) if v is not None]
        out.places = [k for k, _, _ in kept]
        out.snapshot = [v.detach().clone() for _, v, _ in kept]
        out.result = [(avg.detach().clone(), False) for _, _, avg in kept]  # stacking known once bound
        return out

    def bind(self, averager_tensors: Callable[[], Tensors]) -> Tensors:
        """The round's live tensors. A restored round's are those at its places in ``averager_tensors()`` (the
        averager's tensors now), each of the snapshot's shape and dtype, or one line; its snapshot and
        average are moved to their devices."""
        if self.places is None:
            assert self.tensors is not None
            return self.tensors
        averaged = averager_tensors()
        if self.places and max(self.places) >= len(averaged):
            raise ValueError(
                f"Cannot land the restored round in flight: it averages tensor {max(self.places)} and the averager "
                f"has {len(averaged)}; load the optimizer's state before the round lands"
            )
        tensors = [averaged[k] for k in self.places]
        for k, (t, s), before, (avg, _) in zip(self.places, tensors, self.snapshot, self.result):
            one = t.shape[1:] if s else t.shape
            if before.shape != t.shape or before.dtype != t.dtype or avg.shape != one or avg.dtype != t.dtype:
                raise ValueError(
                    f"Cannot land the restored round in flight: averaged tensor {k} has shape {tuple(t.shape)} and "
                    f"dtype {t.dtype}, its snapshot {tuple(before.shape)} and {before.dtype}; resume the same model"
                )
        self.snapshot = [before.to(t.device) for before, (t, _) in zip(self.snapshot, tensors)]
        self.result = [
            ((avg.to(t.device).unsqueeze(0).expand_as(t).clone() if s else avg.to(t.device)), s)
            for (avg, _), (t, s) in zip(self.result, tensors)
        ]
        self.tensors, self.places = tensors, None
        return tensors


def saved_round(
    saved: dict[str, Any], rank: int, world_size: int, machines: int, delay: int, parts: int
) -> dict[str, Any]:
    """This process's round in flight in ``saved`` (``PeriodicAverager.state_dict()["in_flight"]``), or one
    line where this averager cannot continue it: other tau or F, another number of processes or of
    machines per process, or a state without this rank's round."""
    land = next(iter(saved["ranks"].values()))["land_step"]
    what = f"Cannot resume the round in flight (it lands at step {land})"
    if (int(saved["overlap_delay"]), int(saved["fragments"])) != (delay, parts):
        raise ValueError(
            f"{what}: it was started with overlap_delay={saved['overlap_delay']}, fragments={saved['fragments']} "
            f"and this averager has overlap_delay={delay}, fragments={parts}; build it with the same, or save "
            "after close_round()"
        )
    if (int(saved["world_size"]), int(saved["machines_per_process"])) != (world_size, machines):
        raise ValueError(
            f"{what}: it was saved on {saved['world_size']} process(es) of {saved['machines_per_process']} machines "
            f"each and this averager runs on {world_size} of {machines}; each machine's snapshot is its own: resume "
            "on the same machines, or save after close_round()"
        )
    ranks = {int(r): state for r, state in saved["ranks"].items()}
    if rank not in ranks:
        raise ValueError(
            f"{what}: the state holds rank(s) {sorted(ranks)} and this is rank {rank}; save it with "
            "gather_state_dict() on every rank, or every rank's state_dict() in a file of its own"
        )
    return ranks[rank]


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
    _in_flight: Optional[Round]

    if TYPE_CHECKING:  # what the averager gives its parts

        @property
        def sync_every(self) -> int: ...

        @property
        def num_machines(self) -> int: ...

        @property
        def participants(self) -> int: ...

        def participant_weights(self, round_index: Optional[int] = None) -> Optional[Tensor]: ...

        def _tensors(self) -> Tensors: ...

        def _averaged_keys(self) -> tuple[str, ...]: ...

        def _begin_round(self, fragment: Optional[int]) -> Tensors: ...

        def _blocking_round(self, tensors: Tensors) -> None: ...

        def _end_round(self, count: bool = True) -> None: ...

        def _outer_step(self, live: Tensors, averaged: Tensors) -> None: ...

    @property
    def _overlapped(self) -> bool:
        """Whether rounds overlap training or take turns by fragment (tau >= 1 or F > 1)."""
        return self.options.overlap_delay > 0 or self.options.fragments > 1

    def _overlapped_step(self) -> bool:
        """``step()``'s schedule with overlapped rounds: land the round in flight at its step, start a
        fragment's round every K / F steps. Returns whether one started."""
        if self._in_flight is not None and self.steps >= self._in_flight.land_step:
            self._land()
        period = self.sync_every // self.options.fragments
        if self.steps % period:
            return False
        self._start_round((self.steps // period) % self.options.fragments)
        return True

    def _refuse_in_flight(self, what: str) -> None:
        """One ``RuntimeError`` line while a round is in flight (``what`` cannot run then)."""
        if self._in_flight is not None:
            raise RuntimeError(
                f"PeriodicAverager.{what}: a round is in flight (it lands at step {self._in_flight.land_step}); "
                "call close_round() first"
            )

    def _start_round(self, fragment: int) -> None:
        """Fragment ``fragment``'s scheduled round: blocking with tau = 0, else started to land tau steps later."""
        if self._in_flight is not None:  # K made smaller mid-run: the last round lands before the next starts
            self._land()
        tensors = self._begin_round(fragment if self.options.fragments > 1 else None)
        if self.options.overlap_delay == 0:
            self._blocking_round(tensors)
            return
        weights = self.participant_weights()
        with torch.no_grad():
            land = self.steps + self.options.overlap_delay
            start = lambda result: self.engine.start(result, weights)  # noqa: E731
            self._in_flight = Round(tensors, land, start, fragment)
        sent = self.engine.sent(tensors, self.participants)
        self.counts.add(tensors, sent, self.num_machines, self.participants, overlapped=True)
        self.num_syncs += 1
        self.last_sync_step = self.steps

    def _land(self) -> None:
        """The round in flight lands: wait for its average, the outer optimizer's step on it, the merge
        live <- avg + (live - snapshot), ``optimizer.post_sync()``."""
        landing = self._in_flight
        assert landing is not None
        live = landing.bind(self._tensors)  # a restored round finds its live tensors (one line if it cannot)
        self._in_flight = None
        landing.wait()
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
