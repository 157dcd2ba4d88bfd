"""What one machine sends, counted in one place for every kind of round (exact, compressed, overlapped).

A round of ``tensors`` among M machines of which S take part sends, per participant, a message of
``first`` bytes (the payload in the tensors' dtypes; a compressed round's codes and per-block values)
and, for a compressed round, ``second`` bytes in its second stage. ``Counts.add`` adds one round:
``floats`` and ``bytes`` per machine (S/M of a participant's), ``link`` for the ring model
(``lit_slowcal.link.LinkCounts``) and, for an overlapped round, ``overlapped`` (the part training
hides). With one machine in all nothing is sent. ``Counts.rebuilt`` is the same sum for a resumed
schedule's rounds, so a resume and a run that took them count alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional, Union

from lit_slowcal import link
from lit_slowcal._selection import Tensors, floats_sent

__all__ = ["Counts", "counted"]

Number = Union[int, float]


class Counts:
    """One machine's floats and bytes sent, and one participant's ``LinkCounts``, over all rounds so far."""

    def __init__(self) -> None:
        self.floats: Number = 0
        self.bytes: Number = 0
        self.link = link.LinkCounts()
        self.overlapped = link.LinkCounts()

    @staticmethod
    def per_machine(amount: Number, machines: int, participants: int) -> Number:
        """What one machine sends on average when each of S participants of M sends ``amount``; 0 with one machine."""
        if machines == 1:
            return 0
        return amount if participants == machines else amount * participants / machines

    @staticmethod
    def of_rounds(
        first: int, second: Optional[int], machines: int, participants: int, rounds: int = 1
    ) -> link.LinkCounts:
        """``rounds`` rounds' ring counts: ``first`` bytes a participant (a compressed round: ``first`` in its first
        stage, ``second`` in its second); none with one machine."""
        if machines == 1:
            return link.LinkCounts()
        if second is None:
            return link.LinkCounts.of_syncs(first, participants, rounds)
        return link.LinkCounts.of_stages(first, second, participants, rounds)

    def add(
        self,
        tensors: Tensors,
        first: int,
        second: Optional[int],
        machines: int,
        participants: int,
        *,
        rounds: int = 1,
        overlapped: bool = False,
    ) -> None:
        """Count ``rounds`` rounds of ``tensors`` whose participants each sent ``first`` (and ``second``) bytes."""
        if machines == 1:
            return
        self.floats += rounds * floats_sent(tensors, machines, participants)
        self.bytes += rounds * self.per_machine(first, machines, participants)
        sent = self.of_rounds(first, second, machines, participants, rounds)
        self.link += sent
        if overlapped:
            self.overlapped += sent

    @classmethod
    def rebuilt(
        cls,
        rounds: Iterable[tuple[Tensors, tuple[int, Optional[int]], int]],
        machines: int,
        participants: int,
        overlapped: bool,
    ) -> Counts:
        """The counts of ``rounds``: (tensors, their (first, second) bytes, how many such rounds)."""
        counts = cls()
        for tensors, (first, second), n in rounds:
            if n:
                counts.add(tensors, first, second, machines, participants, rounds=n, overlapped=overlapped)
        return counts


def counted(name: str, doc: str) -> property:
    """A property of an object holding ``counts`` (a ``Counts``) that reads and writes its ``name``."""
    return property(lambda self: getattr(self.counts, name), lambda self, v: setattr(self.counts, name, v), doc=doc)
