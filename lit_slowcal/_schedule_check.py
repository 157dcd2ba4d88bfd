"""The checks that every rank agrees: its set-up before the first average, its point of the schedule after.

With several processes a blocking round compares, in one small all-gather (``check_setup``), what every rank
built (``setup_fingerprint``, the first time) and, with ``check_schedule``, its counts of steps and backward
passes. The counts are compared in rounds 0, n, 2n, ... of n = ``check_every``, in every round that closes
one (``close_round()``), and in the first after a resume, a load or a new K; the rounds between send their
average alone, and a collective of theirs that another rank never joined becomes one line (``_unreached``).
With two processes a periodic check rides in its round's own all-reduce where the tensors allow it (``_carried``):
no collective of its own; counts that differ put the tensors back and run the all-gather, which names them.
``ScheduleCheck`` is ``PeriodicAverager``'s part that holds when, and does it (docs/library.md, "A mismatch
is caught").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from torch import Tensor
from torch.optim import Optimizer

from lit_slowcal import _collectives, _communication, _selection, _server, link
from lit_slowcal._counts import Counts
from lit_slowcal._selection import Tensors
from lit_slowcal._validation import check_int
from lit_slowcal.options import AveragingOptions

if TYPE_CHECKING:
    from lit_slowcal._rounds import Engine
    from lit_slowcal.protocol import Declared

__all__ = ["CHECK_EVERY", "ScheduleCheck"]

#: With ``check_schedule``, a blocking round compares the ranks' counts in rounds 0, n, 2n, ... of this n
#: (``PeriodicAverager.check_every``), and in every round that closes one, follows a resume, a load or a new K;
#: the rounds between send their average alone (docs/library.md, "A mismatch is caught").
CHECK_EVERY = 16


class ScheduleCheck:
    """When and how the ranks compare their set-up and counts (mixed into ``PeriodicAverager``; see the module
    docstring)."""

    options: AveragingOptions
    optimizer: Optimizer
    process_group: Optional[Any]
    outer: Optional[Optimizer]
    counts: Counts
    steps: int
    backward_passes: int
    num_syncs: int
    skip_advice: str

    if TYPE_CHECKING:  # what the averager gives its parts

        @property
        def world_size(self) -> int: ...

        @property
        def machines_per_process(self) -> int: ...

        @property
        def participants(self) -> int: ...

        def _tensors(self, state: bool = True) -> Tensors: ...

        def _averaged_keys(self) -> tuple[str, ...]: ...

        def _declared(self) -> Declared: ...

        def participant_weights(self) -> Optional[Tensor]: ...

        engine: Engine

    def _init_checks(self) -> None:
        """No check made yet; the counts compared every ``CHECK_EVERY`` rounds."""
        self._setup_checked = False  # the ranks compared their set-up (before the first average)
        #: n: with ``check_schedule``, the blocking rounds that compare the ranks' counts: those whose index
        #: (``num_syncs``) n divides, a round closing one, the first after a resume, a load or a new K. Part of
        #: the set-up every rank must agree on; 1: every round.
        self._check_every = CHECK_EVERY
        self._check_next = False  # the next blocking round compares the counts (a boundary: resume, load, new K)
        self._counts_checked = False  # this round compared the ranks' counts

    @property
    def check_every(self) -> int:
        """n: with ``check_schedule``, the blocking rounds that compare the ranks' counts are those whose index
        (``num_syncs``) n divides, every ``close_round()`` and the first after a resume, a load or a new K (16,
        ``CHECK_EVERY``; 1: every round). Set it alike on every rank, before the first synchronisation: it is
        part of the set-up the ranks compare."""
        return self._check_every

    @check_every.setter
    def check_every(self, value: int) -> None:
        self._check_every = check_int("check_every", value)

    def _check_at_boundary(self) -> None:
        """A resume, a load or a new K: the next blocking round compares the ranks' counts."""
        self._check_next = True

    def _check_due(self, closing: bool) -> bool:
        """Whether ``sync()``'s round compares the ranks' counts (``closing``: ``close_round()``'s, which always does)."""
        return closing or self._check_next or self.num_syncs % self._check_every == 0

    def _carried(self, closing: bool, state: bool) -> Optional[tuple[int, int]]:
        """The counts that a round the check is due in carries in its own average's message, instead of a
        collective of their own (``None``: it compares them in the check's all-gather, as ``_check_round``): with
        ``check_schedule``, two processes, the set-up compared, a periodic round of ``check_every`` > 1 (not one
        that closes a round or follows a resume, a load or a new K, nor every round of ``check_every = 1``: those
        compare which collective each rank is in too), an optimizer without ``pre_sync``, and an exact round whose
        tensors all live in one buffer (``_communication.rides``)."""
        if not (self.options.check_schedule and self._setup_checked and not closing and not self._check_next):
            return None
        if self._check_every == 1:
            return None
        if self.world_size != 2 or self._declared().pre_sync is not None:
            return None
        if not self.engine.rides(self._tensors(state), self.participant_weights()):
            return None
        return (self.steps, self.backward_passes)

    def _counts_differ(self) -> None:
        """A round whose carried counts differed (nothing averaged): the check's all-gather, which names every
        rank's counts in its error (both ranks take this path: their sums differ alike)."""
        self.check_setup(counts=True)
        raise RuntimeError(  # the all-gather found them alike: the message was not what was sent
            "PeriodicAverager: the counts carried in this synchronisation's message differed between the ranks but "
            "not in the check's all-gather; nothing was averaged."
        )

    def _counts_carried(self, tensors: Tensors) -> None:
        """A round that carried the counts: they were alike; their values' bytes, which each process sends once
        on the ring of two, counted with the checks' (``link_counts.check_bytes``)."""
        self._counts_checked = True
        size = tensors[0][0].element_size()
        self.counts.link += link.LinkCounts(check_bytes=_communication.RIDE_VALUES * size)

    def _check_round(self, check: bool) -> None:
        """A round's check before its average: with several processes, the ranks' set-up the first time and,
        where ``check`` (with ``check_schedule``), their counts; one error on all where they differ."""
        counts = self.options.check_schedule and check
        self._counts_checked = False
        if self.world_size > 1 and (counts or not self._setup_checked):
            # Every rank at the same step (and, the first time, set up alike), or one error on all.
            self.check_setup(counts=self.options.check_schedule)
            self._counts_checked = self.options.check_schedule
            self._check_next = False

    def _unreached(self, error: RuntimeError) -> Optional[RuntimeError]:
        """The one line of a round that did not compare the ranks' counts, whose collective failed (``error``, the
        backend's: another rank never joined it, the process group's timeout); ``None`` where the round compared
        them, with one process, or where ``error`` is the averager's own (it is raised as it is)."""
        if self._counts_checked or self.world_size == 1 or str(error).startswith("PeriodicAverager"):
            return None
        backend = " ".join(str(error).split())
        return RuntimeError(
            f"PeriodicAverager: the ranks did not all reach the average of this synchronisation (this rank: "
            f"{self.steps} steps, {self.backward_passes} backward passes, round {self.num_syncs}, one that does not "
            f"compare the ranks' counts: they are compared every {self.check_every} rounds, in close_round() and in "
            f"gather_state_dict(); the backend: {backend}); a rank that called close_round() or gather_state_dict() "
            "alone, or whose data ended at another step, is elsewhere: every rank calls them alike, give every rank "
            f"the same number of batches, and {self.skip_advice}."
        )

    def setup_fingerprint(self) -> dict[str, tuple[int, str]]:
        """What every rank must agree on before anything is averaged: every option (``AveragingOptions.agreement``)
        and what the model and optimizer make of them, each as (an integer code, its readable value)."""
        return {
            **self.options.agreement(),
            "machines per process": (self.machines_per_process, str(self.machines_per_process)),
            "check_every": (self.check_every, str(self.check_every)),
            "participation (S)": (self.participants, str(self.participants)),
            **_server.fingerprint(self.outer),
            **_selection.fingerprint(self._tensors(), self._averaged_keys(), self.optimizer),
        }

    def check_setup(self, counts: bool = False) -> None:
        """With several processes, check in one small all-gather (a collective: every rank calls it) that every
        rank built the averager alike (``setup_fingerprint``) and, with ``counts``, is at the same step; else one
        ``RuntimeError`` on every rank naming what differs with every rank's value. ``sync()`` does it before
        the first average, the strategies before the first step; its bytes: ``link_counts.check_bytes``."""
        if self.world_size == 1:
            return
        setup = None if self._setup_checked else self.setup_fingerprint()
        point = (self.steps, self.backward_passes) if counts else (0, 0)
        _collectives.check_same_point(self.optimizer, point, self.process_group, self.skip_advice, setup)
        self._setup_checked = True
        # What this process sends in the check's ring all-gather: its int64 values to each other process.
        sent = (self.world_size - 1) * _collectives.CHECK_VALUES * 8
        self.counts.link += link.LinkCounts(check_bytes=sent)
