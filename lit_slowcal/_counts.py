"""What one machine sends, counted in one place for every kind of round (exact, compressed, overlapped).

A round of ``tensors`` among M machines of which S take part sends, per participant, a message (the
payload in the tensors' dtypes; a coded round's codes) and the ring counts its engine gives
(``lit_slowcal._rounds.Sent``). ``Counts.add`` adds one round:
``floats`` and ``bytes`` per machine (S/M of a participant's), ``link`` for the ring model
(``lit_slowcal.link.LinkCounts``) and, for an overlapped round, ``overlapped`` (the part training
hides); ``short`` counts the overlapped rounds that landed before their tau steps (closed early), by the
steps they were in flight (their communication hides behind those only). With one machine in all nothing is sent. ``Counts.rebuilt`` is the same sum for a resumed
schedule's rounds, so a resume and a run that took them count alike. ``Counted`` is
``PeriodicAverager``'s part that reads them (``bytes_per_sync``, ``floats_communicated``, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Optional, Union

from lit_slowcal import link
from lit_slowcal._rounds import Engine
from lit_slowcal._selection import Tensors, among, floats_sent
from lit_slowcal.options import AveragingOptions

__all__ = ["Counted", "Counts", "counted"]

Number = Union[int, float]


def counted(name: str, doc: str) -> property:
    """A property of an object holding ``counts`` (a ``Counts``) that reads and writes its ``name``."""
    return property(lambda self: getattr(self.counts, name), lambda self, v: setattr(self.counts, name, v), doc=doc)


class Counts:
    """One machine's floats and bytes sent, and one participant's ``LinkCounts``, over all rounds so far."""

    def __init__(self) -> None:
        self.floats: Number = 0
        self.bytes: Number = 0
        self.link = link.LinkCounts()
        self.overlapped = link.LinkCounts()
        self.short: dict[int, int] = {}  # overlapped rounds landed after s < tau steps in flight: s -> rounds

    def landed_early(self, steps: int) -> None:
        """Count an overlapped round that landed after ``steps`` (< tau) steps in flight."""
        self.short[steps] = self.short.get(steps, 0) + 1

    @staticmethod
    def per_machine(amount: Number, machines: int, participants: int) -> Number:
        """What one machine sends on average when each of S participants of M sends ``amount``; 0 with one machine."""
        if machines == 1:
            return 0
        return amount if participants == machines else amount * participants / machines

    def add(
        self,
        tensors: Tensors,
        sent: tuple[int, link.LinkCounts],
        machines: int,
        participants: int,
        *,
        rounds: int = 1,
        overlapped: bool = False,
    ) -> None:
        """Count ``rounds`` rounds of ``tensors`` in which each participant sent ``sent`` (its message's bytes
        and ring counts, a round engine's ``Sent``)."""
        if machines == 1:
            return
        self.floats += rounds * floats_sent(tensors, machines, participants)
        self.bytes += rounds * self.per_machine(sent[0], machines, participants)
        ring = sent[1].times(rounds) if rounds != 1 else sent[1]
        self.link += ring
        if overlapped:
            self.overlapped += ring

    @classmethod
    def rebuilt(
        cls,
        rounds: Iterable[tuple[Tensors, tuple[int, link.LinkCounts], int]],
        machines: int,
        participants: int,
        overlapped: bool,
    ) -> Counts:
        """The counts of ``rounds``: (tensors, what a participant sent in one such round, how many such rounds)."""
        counts = cls()
        for tensors, sent, n in rounds:
            if n:
                counts.add(tensors, sent, machines, participants, rounds=n, overlapped=overlapped)
        return counts


class Counted:
    """What an averager has sent and sends a round (mixed into ``PeriodicAverager``; its ``counts`` hold it)."""

    counts: Counts
    options: AveragingOptions
    engine: Engine
    steps: int
    num_syncs: int

    if TYPE_CHECKING:  # what the averager gives its parts

        @property
        def num_machines(self) -> int: ...

        @property
        def participants(self) -> int: ...

        @property
        def compressed(self) -> Optional[Any]: ...

        def _tensors(self, state: bool = True) -> Tensors: ...

        def _fragments(self) -> list[Tensors]: ...

        def _outer_pairs(self, tensors: Optional[Tensors] = None) -> Tensors: ...

    floats_communicated = counted("floats", "Floats one machine has sent over all rounds (S/M of a participant's).")
    bytes_communicated = counted("bytes", "The same in bytes, in the dtypes sent (a compressed round's message).")
    link_counts = counted("link", "One participant's ``LinkCounts`` over all rounds, for the ring model.")
    overlapped_counts = counted("overlapped", "The part of ``link_counts`` sent by overlapped rounds (tau >= 1).")
    short_rounds = counted(
        "short", "Of the overlapped rounds, those closed before their tau steps: steps in flight s -> rounds."
    )

    def floats_per_sync(self) -> Union[int, float]:
        """Floats one machine sends per synchronisation: one machine's averaged tensors (S/M of them with S < M
        participants; with F fragments, a round sends one fragment: 1/F of them on average; with ``state_every``
        n > 1, the mean over n rounds, one of them with the optimizer state); 0 with one machine."""
        if self.num_machines == 1:
            return 0
        return self._per_sync(lambda tensors: floats_sent(tensors, self.num_machines, self.participants))

    def bytes_per_sync(self) -> Union[int, float]:
        """Bytes one machine sends per synchronisation, as ``floats_per_sync`` in the dtypes sent (with
        ``compression``, the first stage's message: codes and per-block values); so that ``bytes_per_sync()
        x num_syncs`` is ``bytes_communicated`` after whole periods of n K steps and no closing round. On the
        ring a participant sends 2 (S - 1) / S times its payload (``link_counts``)."""
        sent = lambda tensors: self.engine.sent(tensors, self.participants).bytes  # noqa: E731
        return Counts.per_machine(self._per_sync(sent), self.num_machines, self.participants)

    def _per_sync(self, amount: Callable[[Tensors], Number]) -> Number:
        """``amount`` of a round, its mean over the n rounds of a period of ``state_every`` and the F fragments."""
        n, F = self.options.state_every, self.options.fragments
        full = amount(self._tensors())
        return (full if n == 1 else (full + (n - 1) * amount(self._tensors(state=False))) / n) / F

    def ddp_counts(self) -> link.LinkCounts:
        """The DDP reference: what DDP would have sent over the ``steps`` taken so far, one all-reduce of one
        machine's parameter gradients (the optimizer's parameters, in their dtype) among all M machines
        every step (``lit_slowcal.link.ddp_counts``; no participation, no check)."""
        return link.ddp_counts(link.payload_bytes(self._outer_pairs()), self.steps, self.num_machines)

    def _count_from_syncs(self, floats: bool = True) -> None:
        """The counts of what was sent, rebuilt as ``num_syncs`` rounds of what is averaged now (with
        fragments, round j sends fragment j mod F; with ``state_every`` n, of each fragment's rounds, the
        state travels in every n-th; with ``compression``, every round counted as compressed); ``floats``:
        ``floats_communicated`` too."""
        N, F, n = self.num_syncs, self.options.fragments, self.options.state_every
        parts = [self._tensors()] if F == 1 else self._fragments()
        light = self._tensors(state=False)
        S = self.participants
        rounds = []
        for f, tensors in enumerate(parts):
            periods = len(range(f or F, N + 1, F))  # fragment f's rounds, one a period of K steps
            rounds.append((tensors, self.engine.sent(tensors, S), periods // n))
            if n > 1:
                without = among(tensors, light)
                rounds.append((without, self.engine.sent(without, S), periods - periods // n))
        sent = Counts.rebuilt(rounds, self.num_machines, S, overlapped=self.options.overlap_delay > 0)
        if not floats:
            sent.floats = self.counts.floats
        self.counts = sent

    def stage_bytes(self) -> tuple[int, int]:
        """One participant's bytes in the two stages of a synchronisation with the optimizer state (``LinkCounts.of_stages``): the
        payload twice (the ring all-reduce's halves), or with ``compression`` its first-stage message and
        the mean's (as if every tensor had an anchor)."""
        if self.compressed is None:
            payload = link.payload_bytes(self._tensors())
            return payload, payload
        return self.compressed.message_bytes(self._tensors())
