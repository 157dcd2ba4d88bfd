"""The round engines: how a round's tensors become their average over the machines, and what that sends.

``PeriodicAverager`` keeps the schedule, the state and the checks; it hands a round's tensors to one
engine, through one small interface:

- ``average(tensors, weights, counts=None) -> Sent``: replace every tensor by its (weighted) mean over the M
  machines, blocking; return what one participant sent (``Sent``: its message's bytes, and its
  ring counts for ``lit_slowcal.link``); ``counts``, where ``rides(tensors, weights)``: the ranks' counts
  carried in the round's own message (``_communication.CountsDiffer`` where they differ, nothing averaged);
- ``sent(tensors, participants) -> Sent``: what such a round sends, without running it (``bytes_per_sync``,
  a resumed schedule's counts);
- ``settle(tensors, state)``: after the round (the outer step and ``post_sync`` applied): what every machine
  now holds becomes the next round's starting point (a coded round's anchors); ``state=False`` for a round
  that skipped the optimizer state (``state_every``): the state's anchors stay at their last common value;
- ``in_flight``: the round started and not landed (``None`` but in an overlapped engine).

``OverlappedRound`` adds what lands when: ``start(tensors, weights, step, fragment)`` takes the round's
snapshot and starts its average (``start_average``, the exact engine's collectives, not waited for);
``land(...)``, at the round's ``land_step``, waits for it and gives the averager the live
tensors and the ``lit_slowcal._in_flight.Round`` (its average, to merge). Its blocking rounds (closing
a round, a checkpoint) are its inner engine's.

``ExactRound``: bucketed all-reduces (``lit_slowcal._communication``); a participant sends the payload,
2 (S - 1) / S of it on the ring. ``CodedRound``: the round's change since its anchor travels encoded
(``lit_slowcal.compression``: a block ``Compressor`` in two stages, ``lit_slowcal._compressed``; any
whole-tensor ``Code`` gathered, ``lit_slowcal._coded``), each state counting its own bytes; a tensor
without an anchor yet goes exactly in the same round (the round's bytes and collectives are both parts'); the
optimizer's never-negative state (``protocol.Declared.nonnegative_state``) lands at no less than 0.
``OverlappedRound`` wraps the exact engine; its rounds count what the exact round sends, when they start. The outer optimizer's step is the averager's, once, after any engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Optional, Union

from torch import Tensor

from lit_slowcal import _communication, _selection, link
from lit_slowcal._coded import CodedAverage
from lit_slowcal._compressed import CompressedAverage
from lit_slowcal._in_flight import Round
from lit_slowcal._selection import Tensors
from lit_slowcal.compression import Code
from lit_slowcal.options import AveragingOptions

__all__ = ["CodedRound", "Engine", "ExactRound", "OverlappedRound", "Sent", "engine_for"]


class Sent(NamedTuple):
    """What one participant sent in one round: its message's bytes, and its counts for the ring model."""

    bytes: int
    link: link.LinkCounts


class ExactRound:
    """The exact (weighted) mean: every tensor all-reduced in buckets (``_communication.average``)."""

    in_flight: Optional[Round] = None  # blocking: never a round in flight

    def __init__(
        self, machines: int, machines_per_process: int, process_group: Optional[Any], bucket_cap_bytes: int,
        bucket_views: bool,
    ) -> None:  # fmt: skip
        self.machines = machines  # M
        self.machines_per_process = machines_per_process
        self.process_group = process_group
        self.bucket_cap_bytes = bucket_cap_bytes
        #: The flattened buckets' buffers, kept between rounds; with bucket views, the buffers the tensors live in.
        self.pool = _communication.FlatPool(bucket_views)

    def average(self, tensors: Tensors, weights: Optional[Tensor], counts: Optional[tuple[int, int]] = None) -> Sent:
        # ``_communication.average``, with what the round sends counted while its collectives are in flight.
        averaging = _communication.start_average(
            tensors, weights, machines_per_process=self.machines_per_process, process_group=self.process_group,
            bucket_cap_bytes=self.bucket_cap_bytes, flat_in_flight=2, pool=self.pool, counts=counts,
        )  # fmt: skip
        sent = self.sent(tensors, _participants(weights))
        try:
            averaging.wait()
        finally:
            self.pool.keep_used()
        return sent

    def rides(self, tensors: Tensors, weights: Optional[Tensor]) -> bool:
        """Whether a round of ``tensors`` can carry the ranks' counts in its own message (``average``'s ``counts``:
        ``_communication.rides``)."""
        return _communication.rides(tensors, weights, self.pool, self.process_group)

    def start_average(self, tensors: Tensors, weights: Optional[Tensor]) -> _communication.Averaging:
        """The average's collectives started, not waited for (``wait()`` on the handle lands it in ``tensors``)."""
        return _communication.start_average(
            tensors, weights, machines_per_process=self.machines_per_process, process_group=self.process_group,
            bucket_cap_bytes=self.bucket_cap_bytes,
        )  # fmt: skip

    def sent(self, tensors: Tensors, participants: Optional[int]) -> Sent:
        payload = link.payload_bytes(tensors)
        return Sent(payload, link.LinkCounts.of_syncs(payload, participants or self.machines))

    def settle(self, tensors: Tensors, state: bool = True) -> None:
        pass


class CodedRound:
    """A round's change encoded (``state``: a block compressor's or a whole-tensor code's anchors, error
    feedback and reduce) for the tensors with an anchor; those without one (state that appeared since, or
    no ``broadcast()``), and rounds among one machine, go through ``exact``, in the same round. ``names``
    gives each tensor its name, by which its anchor is kept (default: its place)."""

    in_flight: Optional[Round] = None  # blocking: never a round in flight

    def __init__(
        self, state: Union[CompressedAverage, CodedAverage], exact: ExactRound,
        names: Optional[Callable[[Tensors], list[str]]] = None, nonnegative: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.state = state
        self.exact = exact
        self.machines = exact.machines
        self.names = names or (lambda tensors: [str(k) for k in range(len(tensors))])
        #: The optimizer state keys landed at no less than 0 (``protocol.Declared.nonnegative_state``).
        self.nonnegative = nonnegative
        #: The last round's exact bytes and coded stages' bytes (``counted``'s arguments).
        self.last_parts: tuple[int, int, int] = (0, 0, 0)

    def rides(self, tensors: Tensors, weights: Optional[Tensor]) -> bool:
        return False  # its rounds' messages are coded

    def average(self, tensors: Tensors, weights: Optional[Tensor], counts: Optional[tuple[int, int]] = None) -> Sent:
        assert counts is None, "a coded round carries no counts"
        if self.machines == 1:
            return self.exact.average(tensors, weights)
        names = self.names(tensors)
        anchored = [a and self.smaller(pair) for a, pair in zip(self.state.anchored(tensors, names), tensors)]
        exact = [pair for pair, a in zip(tensors, anchored) if not a]
        coded = [(pair, name) for pair, name, a in zip(tensors, names, anchored) if a]
        sent = self.exact.average(exact, weights) if exact else None
        if not coded:
            assert sent is not None
            self.last_parts = (sent.bytes, 0, 0)
            return sent
        participants = None if weights is None else weights > 0
        nonnegative = {name for _, name in coded if _selection.state_key(name) in self.nonnegative}
        first, second = self.state.average(
            [pair for pair, _ in coded], [name for _, name in coded], participants,
            machines_per_process=self.exact.machines_per_process, process_group=self.exact.process_group,
            nonnegative=nonnegative,
        )  # fmt: skip
        self.last_parts = (0 if sent is None else sent.bytes, first, second)
        return self.counted(*self.last_parts, _participants(weights) or self.machines)

    def counted(self, exact: int, first: int, second: int, participants: int) -> Sent:
        """What a round sends whose exact part is ``exact`` bytes (0: none) and whose coded part's stages are
        ``first`` and ``second`` bytes (0: none): one round, each part's bytes and collectives."""
        coded = self.state.link_counts(first, second, participants)
        if not exact:
            return Sent(first, coded)
        plain = link.LinkCounts.of_syncs(exact, participants)
        return Sent(exact + first, dataclasses.replace(plain + coded, syncs=1) if first else plain)

    def sent(self, tensors: Tensors, participants: Optional[int]) -> Sent:
        """What a round sends where every tensor has an anchor (a tensor its code does not shrink, exactly)."""
        S = participants or self.machines
        coded = [pair for pair in tensors if self.smaller(pair)]
        exact = self.exact.sent([pair for pair in tensors if not self.smaller(pair)], participants)
        if not coded:
            return exact
        first, second = self.state.message_bytes(coded)
        counts = self.state.link_counts(first, second, S)
        if len(coded) == len(tensors):
            return Sent(first, counts)
        return Sent(exact.bytes + first, dataclasses.replace(exact.link + counts, syncs=1))

    def smaller(self, pair: tuple[Tensor, bool]) -> bool:
        """Whether the code's message of a tensor is smaller than the tensor (bf16 codes of a bfloat16 tensor are
        not: such a tensor is averaged exactly, counted as such)."""
        return self.state.message_bytes([pair])[0] < link.payload_bytes([pair])

    def settle(self, tensors: Tensors, state: bool = True) -> None:
        self.state.anchor(tensors, self.names(tensors), only=not state)

    def anchor_missing(self, tensors: Tensors) -> None:
        """The tensors without an anchor take their value now as one (every machine holds the same values)."""
        self.state.anchor(tensors, self.names(tensors), missing_only=True)

    @property
    def pool(self) -> _communication.FlatPool:
        """The exact rounds' buffers (``ExactRound.pool``)."""
        return self.exact.pool


class OverlappedRound:
    """Rounds that land ``delay`` (tau) steps after they start: the snapshot's exact average computed while
    training goes on (``inner.start_average``); blocking rounds, counts and anchors are ``inner``'s."""

    def __init__(self, inner: ExactRound, delay: int) -> None:
        self.inner = inner
        self.delay = delay
        self.machines = inner.machines
        #: The round started and not landed (``lit_slowcal._in_flight.Round``), or ``None``.
        self.in_flight: Optional[Round] = None

    def average(self, tensors: Tensors, weights: Optional[Tensor], counts: Optional[tuple[int, int]] = None) -> Sent:
        return self.inner.average(tensors, weights, counts)

    def rides(self, tensors: Tensors, weights: Optional[Tensor]) -> bool:
        return self.inner.rides(tensors, weights)

    def sent(self, tensors: Tensors, participants: Optional[int]) -> Sent:
        return self.inner.sent(tensors, participants)

    def settle(self, tensors: Tensors, state: bool = True) -> None:
        self.inner.settle(tensors, state)

    def start(self, tensors: Tensors, weights: Optional[Tensor], step: int, fragment: int) -> Sent:
        """Start the round of ``tensors`` (fragment ``fragment``'s) at ``step``: their snapshot, whose average
        lands at ``step + delay``. Returns what it sends (counted now)."""
        assert self.in_flight is None, "a round is in flight: land it first"
        start: Callable[[Tensors], _communication.Averaging] = lambda result: self.inner.start_average(result, weights)  # noqa: E731
        self.in_flight = Round(tensors, step + self.delay, start, fragment)
        return self.inner.sent(tensors, _participants(weights))

    def land(self, averager_tensors: Callable[[], Tensors]) -> tuple[Tensors, Round]:
        """The round in flight, landed: its live tensors (a restored round's found among ``averager_tensors()``,
        or one line, the round kept in flight) and the round, its average waited for (``result``) to merge."""
        assert self.in_flight is not None
        live = self.in_flight.bind(averager_tensors)
        landing, self.in_flight = self.in_flight, None
        landing.wait()
        return live, landing

    @property
    def pool(self) -> _communication.FlatPool:
        """The exact rounds' buffers (``ExactRound.pool``)."""
        return self.inner.pool


Engine = Union[ExactRound, CodedRound, OverlappedRound]


def _participants(weights: Optional[Tensor]) -> Optional[int]:
    """S, the machines with a weight (``None``: all)."""
    return None if weights is None else int((weights > 0).sum())


def engine_for(
    options: AveragingOptions, machines: int, machines_per_process: int, group: Optional[Any],
    names: Optional[Callable[[Tensors], list[str]]] = None, nonnegative: tuple[str, ...] = (), bucket_views: bool = False,
) -> Engine:  # fmt: skip
    """The round engine of ``options``: exact, coded by its compressor (a block ``Compressor`` or a ``Code``;
    ``names``: the averaged tensors' names, ``nonnegative``: the state keys landed at no less than 0,
    ``CodedRound``), or overlapped (``overlap_delay`` >= 1, exact: the
    options refuse compression with it); ``bucket_views``: ``options.bucket_views`` resolved (its ``None``, the
    averager's choice)."""
    exact = ExactRound(machines, machines_per_process, group, options.bucket_cap_bytes, bucket_views)
    code = options.compressor
    if options.overlap_delay:
        return OverlappedRound(exact, options.overlap_delay)
    if code is None:
        return exact
    state = (CodedAverage if isinstance(code, Code) else CompressedAverage)(code, options.lossy_feedback)
    return CodedRound(state, exact, names, nonnegative)
