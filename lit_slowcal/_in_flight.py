"""A round in flight: the snapshot of a round's tensors when it started, its average being computed while
training goes on, and the merge when it lands (``lit_slowcal._rounds.OverlappedRound`` holds one).

It lands as live <- avg + (live - snapshot): the round's average plus the local progress since the snapshot.

A checkpoint taken while a round is in flight holds it (``PeriodicAverager.state_dict()["in_flight"]``)::

    {"world_size": P, "machines_per_process": m, "overlap_delay": tau, "fragments": F,
     "ranks": {rank: {"land_step": s, "fragment": f, "snapshot": [...], "result": [...]}}}

``snapshot`` and ``result`` are lists by the tensor's place in the averager's tensors (``None``
outside the round's fragment), as the compressed state's are: the process's snapshot (every
machine's) and the average (one machine's shape where stacked). ``saved_round`` checks that an
averager can continue it; ``Round.from_state_dict`` restores it without communicating it again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor

from lit_slowcal._communication import Averaging
from lit_slowcal._selection import Tensors

__all__ = ["Round", "saved_round"]


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
