"""What a synchronisation costs on a link: a ring all-reduce model in bytes and seconds.

A ``Link`` is a bandwidth (bytes per second) and a latency (seconds), written as ``"10Gbit/s,1ms"``.
An all-reduce of ``n`` payload bytes among ``P`` participants costs, in the ring model,

    2 (P - 1) * latency + 2 (P - 1) / P * n / bandwidth

seconds, and every participant sends ``2 (P - 1) / P * n`` bytes (``ring_bytes_sent``): a
reduce-scatter and an all-gather, each of P - 1 steps carrying n / P bytes. The model assumes a flat
ring, no overlap of communication with compute, full-duplex links, and every machine on its own link
of this speed. Machines simulated in one process (``SimulatedMachines``) are modelled as if each were
its own machine on the ring.

``LinkCounts`` sums over a run what the model needs: the synchronisations, one participating
machine's payload, what it sends on the ring, the ring's latency terms (hops), and apart from these
the small all-gathers of the averager's schedule and set-up check. ``counts.seconds(link)`` is then
the modelled communication time at any link, the sum of ``link.all_reduce_seconds`` over the
synchronisations. Every ``PeriodicAverager`` keeps one (``link_counts``), and ``ddp_counts`` gives
the same counts for what DDP would send over the same optimizer steps, so that ``compare`` can say
how many times fewer bytes and how many times less communication time a run needs than DDP.

Torch only (and only for the tensors' sizes); no communication happens here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation
from types import MappingProxyType
from typing import Any, Union

from torch import Tensor

from lit_slowcal._validation import check_int, check_number

__all__ = [
    "Link", "LinkCounts", "compare", "ddp_counts", "hidden_seconds", "payload_bytes", "ring_bytes_sent", "ring_hops",
]  # fmt: skip

#: Bandwidth units: bytes per second of one unit. Bits are decimal (1 Gbit/s = 10^9 bits/s = 1.25e8 B/s).
BANDWIDTH_UNITS: dict[str, Decimal] = {
    "bit/s": Decimal(1) / 8,
    "Kbit/s": Decimal(10) ** 3 / 8,
    "Mbit/s": Decimal(10) ** 6 / 8,
    "Gbit/s": Decimal(10) ** 9 / 8,
    "Tbit/s": Decimal(10) ** 12 / 8,
    "B/s": Decimal(1),
    "KB/s": Decimal(10) ** 3,
    "MB/s": Decimal(10) ** 6,
    "GB/s": Decimal(10) ** 9,
    "TB/s": Decimal(10) ** 12,
}
#: Latency units: seconds of one unit ("µs" with the micro sign or the Greek mu).
LATENCY_UNITS: dict[str, Decimal] = {
    "s": Decimal(1),
    "ms": Decimal(10) ** -3,
    "us": Decimal(10) ** -6,
    "µs": Decimal(10) ** -6,
    "μs": Decimal(10) ** -6,
    "ns": Decimal(10) ** -9,
}
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_TEXT = re.compile(rf"\s*({_NUMBER})\s*([A-Za-zµμ/]+)\s*,\s*({_NUMBER})\s*([A-Za-zµμ]+)\s*")
_ALLOWED = (
    'a bandwidth and a latency, e.g. "10Gbit/s,1ms": the bandwidth a number > 0 in bit/s, Kbit/s, Mbit/s, Gbit/s, '
    "Tbit/s, B/s, KB/s, MB/s, GB/s or TB/s; the latency a number >= 0 in s, ms, us, µs or ns"
)


def _scaled(number: str, unit: Decimal) -> float:
    """``number`` times ``unit``, correctly rounded to a float (inf where it overflows)."""
    try:
        return float(Decimal(number) * unit)
    except (InvalidOperation, OverflowError):  # pragma: no cover - the pattern admits plain numbers only
        return math.inf


def _shortest(value: float, units: Mapping[str, Decimal]) -> str:
    """The shortest ``<number><unit>`` among ``units`` that reads back as ``value`` exactly (the unit of
    1 with the float's repr always does), "bit" counted as long as "B" and the first unit on a tie:
    ``"100Gbit/s"``, not ``"12.5GB/s"``; ``"25GB/s"``, not ``"200Gbit/s"``."""
    out = []
    for unit, scale in units.items():
        number = repr(float(Decimal(value) / scale))
        number = number[:-2] if number.endswith(".0") else number
        if _scaled(number, scale) == value:
            out.append((len(number) + len(unit.replace("bit", "B")), f"{number}{unit}"))
    return min(out, key=lambda item: item[0])[1]


def ring_hops(participants: int) -> int:
    """The latency terms of one ring all-reduce among ``participants``: 2 (P - 1), 0 for P <= 1."""
    return 2 * (participants - 1) if participants > 1 else 0


def ring_bytes_sent(nbytes: Union[int, float], participants: int) -> float:
    """The bytes every participant sends in a ring all-reduce of ``nbytes`` payload bytes among
    ``participants``: 2 (P - 1) / P * n, 0 for P <= 1."""
    check_number("nbytes", nbytes, strict=False)
    if participants <= 1:
        return 0.0
    return 2 * (participants - 1) * nbytes / participants


def payload_bytes(tensors: Iterable[tuple[Tensor, bool]]) -> int:
    """One machine's bytes of ``tensors``, each with whether it is stacked (one slice per simulated
    machine along dimension 0): ``numel * element_size`` of one machine's slice of each, in the
    tensor's own dtype (float64: 8 bytes a value; complex64: 8)."""
    return sum((t[0].numel() if stacked else t.numel()) * t.element_size() for t, stacked in tensors)


@dataclass(frozen=True)
class Link:
    """A network link: ``bandwidth`` in bytes per second (> 0) and ``latency`` in seconds (>= 0).

    ``Link.parse("10Gbit/s,1ms")`` reads the usual notation; ``str(link)`` writes it back, and
    ``Link.parse(str(link)) == link``.
    """

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "bandwidth", float(check_number("bandwidth", self.bandwidth)))
        # + 0.0: a latency of -0.0 is 0.0 (written "0s").
        object.__setattr__(self, "latency", float(check_number("latency", self.latency, strict=False)) + 0.0)

    @classmethod
    def parse(cls, text: str) -> Link:
        """A link from ``"<bandwidth><unit>,<latency><unit>"``: ``"10Gbit/s,1ms"``, ``"100Gbit/s,10us"``,
        ``"25GB/s,2us"``. Bit units are decimal and divided by 8; anything else raises ``ValueError``
        (one line naming the text and what is allowed)."""
        match = _TEXT.fullmatch(text) if isinstance(text, str) else None
        if match is None or match[2] not in BANDWIDTH_UNITS or match[4] not in LATENCY_UNITS:
            raise ValueError(f"Invalid link: {text!r} ({_ALLOWED})")
        bandwidth = _scaled(match[1], BANDWIDTH_UNITS[match[2]])
        latency = _scaled(match[3], LATENCY_UNITS[match[4]])
        if not (0 < bandwidth < math.inf and latency < math.inf):
            raise ValueError(f"Invalid link: {text!r} ({_ALLOWED})")
        return cls(bandwidth, latency)

    def __str__(self) -> str:
        """The link as ``parse`` reads it, in the units with the shortest number (bits per second on a tie)."""
        latency_units = {u: s for u, s in LATENCY_UNITS.items() if u.isascii()}
        return f"{_shortest(self.bandwidth, BANDWIDTH_UNITS)},{_shortest(self.latency, latency_units)}"

    def all_reduce_seconds(self, nbytes: Union[int, float], participants: int) -> float:
        """The ring model's seconds for an all-reduce of ``nbytes`` payload bytes among ``participants``:
        2 (P - 1) * latency + 2 (P - 1) / P * n / bandwidth; 0 for P <= 1."""
        return ring_hops(participants) * self.latency + ring_bytes_sent(nbytes, participants) / self.bandwidth


@dataclass(frozen=True)
class LinkCounts:
    """What a run sent, summed over its synchronisations, for the ring model.

    ``syncs``: the synchronisations counted (among more than one machine); ``payload_bytes``: one
    participating machine's payload (what the average carries); ``ring_bytes``: what that machine
    sends on the ring, 2 (P - 1) / P of the payload a synchronisation; ``ring_hops``: the latency
    terms, 2 (P - 1) a synchronisation; ``check_bytes``: apart from these, what this process sent in
    the averager's schedule and set-up checks (small all-gathers, not in ``seconds``).
    """

    syncs: int = 0
    payload_bytes: int = 0
    ring_bytes: float = 0.0
    ring_hops: int = 0
    check_bytes: int = 0

    @classmethod
    def of_syncs(cls, payload_bytes: int, participants: int, syncs: int = 1) -> LinkCounts:
        """The counts of ``syncs`` synchronisations, each an all-reduce of ``payload_bytes`` among ``participants``."""
        check_int("syncs", syncs, minimum=0)
        return cls(
            syncs=syncs,
            payload_bytes=syncs * payload_bytes,
            ring_bytes=syncs * ring_bytes_sent(payload_bytes, participants),
            ring_hops=syncs * ring_hops(participants),
        )

    @classmethod
    def of_stages(cls, first: int, second: int, participants: int, syncs: int = 1) -> LinkCounts:
        """The counts of ``syncs`` two-stage synchronisations (``lit_slowcal.compression``): an all-to-all of
        ``first`` bytes a participant, then an all-gather of ``second`` bytes of results; each sends
        (P - 1) / P of its bytes and costs P - 1 latencies, as the ring all-reduce's two halves."""
        check_int("syncs", syncs, minimum=0)
        P = participants
        return cls(
            syncs=syncs,
            payload_bytes=syncs * first,
            ring_bytes=syncs * ((P - 1) * (first + second) / P if P > 1 else 0.0),
            ring_hops=syncs * ring_hops(P),
        )

    @classmethod
    def of_gather(cls, message: int, participants: int, syncs: int = 1) -> LinkCounts:
        """The counts of ``syncs`` rounds in which every participant's ``message`` bytes reach every other (a ring
        all-gather: each sends (P - 1) messages and costs P - 1 latencies; a ``Code``'s round)."""
        check_int("syncs", syncs, minimum=0)
        P = participants
        return cls(
            syncs=syncs,
            payload_bytes=syncs * message,
            ring_bytes=syncs * float((P - 1) * message if P > 1 else 0),
            ring_hops=syncs * max(P - 1, 0),
        )

    def times(self, n: int) -> LinkCounts:
        """The counts of ``n`` such runs (each field times ``n``; the check's bytes too)."""
        return LinkCounts(
            n * self.syncs, n * self.payload_bytes, n * self.ring_bytes, n * self.ring_hops, n * self.check_bytes
        )

    def __add__(self, other: LinkCounts) -> LinkCounts:
        if not isinstance(other, LinkCounts):
            return NotImplemented
        return LinkCounts(
            self.syncs + other.syncs,
            self.payload_bytes + other.payload_bytes,
            self.ring_bytes + other.ring_bytes,
            self.ring_hops + other.ring_hops,
            self.check_bytes + other.check_bytes,
        )

    def seconds(self, link: Link) -> float:
        """The modelled communication seconds at ``link``: latency * ring_hops + ring_bytes / bandwidth,
        the sum of ``link.all_reduce_seconds`` over the synchronisations (the checks left out)."""
        return link.latency * self.ring_hops + self.ring_bytes / link.bandwidth

    def state_dict(self) -> dict[str, Union[int, float]]:
        """The counts as plain data (``torch.load(weights_only=True)`` reads them)."""
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> LinkCounts:
        """The counts ``state_dict()`` returned (a key missing counts 0)."""
        return cls(
            syncs=int(state.get("syncs", 0)),
            payload_bytes=int(state.get("payload_bytes", 0)),
            ring_bytes=float(state.get("ring_bytes", 0.0)),
            ring_hops=int(state.get("ring_hops", 0)),
            check_bytes=int(state.get("check_bytes", 0)),
        )


def hidden_seconds(
    overlapped: LinkCounts, link: Link, delay_seconds: float, short: Mapping[float, int] = MappingProxyType({})
) -> float:
    """The communication seconds at ``link`` that training hides in the overlapped rounds counted by
    ``overlapped`` (``PeriodicAverager.overlapped_counts``): each round's, up to ``delay_seconds`` (tau steps
    of compute) a round, the rounds taken as equal (a round's seconds: their mean). ``short``: of these, the
    rounds closed before their tau steps, by the seconds of compute they were in flight (s steps' of
    ``PeriodicAverager.short_rounds``): each hides up to those only."""
    if overlapped.syncs == 0:
        return 0.0
    one = overlapped.seconds(link) / overlapped.syncs
    closed = sum(short.values())
    if closed > overlapped.syncs:
        raise ValueError(f"Invalid short: {closed} rounds (must be <= the {overlapped.syncs} overlapped rounds)")
    early = sum(n * min(one, seconds) for seconds, n in short.items())
    return (overlapped.syncs - closed) * min(one, delay_seconds) + early


def ddp_counts(parameter_bytes: int, steps: int, machines: int) -> LinkCounts:
    """What DDP would send over ``steps`` optimizer steps on ``machines`` machines: at every step one
    all-reduce of one machine's parameter gradients (``parameter_bytes``, the parameters' bytes in
    their dtype) among all of them. DDP has no partial participation; one machine sends nothing."""
    check_int("steps", steps, minimum=0)
    if machines <= 1:
        return LinkCounts()
    return LinkCounts.of_syncs(parameter_bytes, machines, steps)


def _ratio(reference: float, ours: float) -> float:
    if ours == 0:
        return math.nan if reference == 0 else math.inf
    return reference / ours


def compare(ours: LinkCounts, ddp: LinkCounts, link: Link) -> tuple[float, float]:
    """``(bytes_ratio, seconds_ratio)``: how many times fewer bytes one participating machine sends on
    the ring than under DDP, and how many times less communication time at ``link`` (> 1: fewer, less;
    ``inf`` where ours is 0, ``nan`` where both are)."""
    return _ratio(ddp.ring_bytes, ours.ring_bytes), _ratio(ddp.seconds(link), ours.seconds(link))
