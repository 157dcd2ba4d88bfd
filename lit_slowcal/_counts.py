"""What one machine sends, counted in one place for every kind of round (exact, compressed, overlapped).

A round of ``tensors`` among M machines of which S take part sends, per participant, a message (the
payload in the tensors' dtypes; a coded round's codes) and the ring counts its engine gives
(``lit_slowcal._rounds.Sent``). ``Counts.add`` adds one round:
``floats`` and ``bytes`` per machine (S/M of a participant's), ``link`` for the ring model
(``lit_slowcal.link.LinkCounts``) and, for an overlapped round, ``overlapped`` (the part training
hides). With one machine in all nothing is sent. ``Counts.rebuilt`` is the same sum for a resumed
schedule's rounds, so a resume and a run that took them count alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Union

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


def counted(name: str, doc: str) -> property:
    """A property of an object holding ``counts`` (a ``Counts``) that reads and writes its ``name``."""
    return property(lambda self: getattr(self.counts, name), lambda self, v: setattr(self.counts, name, v), doc=doc)
