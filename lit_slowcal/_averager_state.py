"""The averager's saved state: what ``PeriodicAverager.state_dict()`` holds and how a resume takes it back.

The state is a dict of plain values: the schedule (``steps``, ``num_syncs``, ``last_sync_step``) and
the counts of what was sent (``floats_communicated``, ``bytes_communicated``, ``link_counts``); with
overlapped rounds also ``settled_step`` (the last synchronisation of the whole model) and
``overlapped_counts``, and ``short_rounds`` where an overlapped round was closed before its tau steps.
``"configuration"`` records what the state's meaning depends on (``configuration``: the compression, its
error feedback, the optimizer's class and options but its learning rate); a state is loaded only into an
averager of the same (one line naming what differs, both values). Four keys are there only where there is
something to keep:

- ``"outer"``: with an outer optimizer, the round's start and its state (``lit_slowcal._server``);
- ``"per_machine"``: optimizer state a synchronisation leaves per machine (``lit_slowcal._machine_state``);
- ``"compression"``: with ``compression``, the anchors and error feedback (``lit_slowcal._compressed``);
- ``"in_flight"``: an overlapped round in flight, its snapshot and average (``lit_slowcal._in_flight``).

The last three are kept per process, ``{"world_size": P, "ranks": {rank: ...}}``: ``state_dict`` holds
this process's rank, ``gather_state_dict`` every rank's (gathered on one rank, their tensors on the
CPU), and ``load_state_dict`` gives each process its own back, or refuses in one line what it cannot take.

The averager calls what is here and keeps its own private state (the round in flight, the step of
the last synchronisation of the whole model, the hook that puts per-machine state back after an
optimizer load): it passes in what these functions read and sets what they return.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional, Protocol, Union

from torch import Tensor
from torch.optim import Optimizer

from lit_slowcal import _collectives, _machine_state, _server, link
from lit_slowcal._anchors import check_saved
from lit_slowcal._compressed import CompressedAverage
from lit_slowcal._in_flight import Round, saved_round
from lit_slowcal._selection import Tensors
from lit_slowcal.options import AveragingOptions

__all__ = [
    "COMPRESSION_KEY", "CONFIGURATION_KEY", "IN_FLIGHT_KEY", "Averager", "Loaded", "configuration", "gather_state_dict",
    "load_state_dict", "state_dict",
]  # fmt: skip

#: The key of ``PeriodicAverager.state_dict()`` that holds the compressed synchronisation's state.
COMPRESSION_KEY = "compression"
#: The key of ``PeriodicAverager.state_dict()`` that holds an overlapped round in flight.
IN_FLIGHT_KEY = "in_flight"
#: The key of ``PeriodicAverager.state_dict()`` that records the configuration it was saved under.
CONFIGURATION_KEY = "configuration"
#: Optimizer options that change no saved state's meaning (a learning rate may change on resume).
_FREE_OPTIONS = frozenset({"lr", "foreach", "fused", "capturable", "differentiable"})
#: The keys of a state, each with the types its value may have; the first three are required.
_KEYS: dict[str, tuple[type, ...]] = {
    "steps": (int,), "num_syncs": (int,), "floats_communicated": (int, float), "last_sync_step": (int,),
    "settled_step": (int,), "bytes_communicated": (int, float), "link_counts": (dict,), "overlapped_counts": (dict,),
    "outer": (dict,), _machine_state.KEY: (dict,), COMPRESSION_KEY: (dict,), IN_FLIGHT_KEY: (dict,),
    CONFIGURATION_KEY: (dict,),
}  # fmt: skip


class Averager(Protocol):
    """What the functions here read and set of a ``PeriodicAverager`` (imported here, it would be a cycle)."""

    steps: int
    num_syncs: int
    last_sync_step: int
    floats_communicated: Union[int, float]
    bytes_communicated: Union[int, float]
    link_counts: link.LinkCounts
    overlapped_counts: link.LinkCounts
    short_rounds: dict[int, int]
    skip_advice: str

    @property
    def optimizer(self) -> Optimizer: ...
    @property
    def options(self) -> AveragingOptions: ...
    @property
    def outer(self) -> Optional[Optimizer]: ...
    @property
    def global_params(self) -> list[Tensor]: ...
    @property
    def compressed(self) -> Optional[CompressedAverage]: ...
    @property
    def process_group(self) -> Optional[Any]: ...
    @property
    def world_size(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def machines_per_process(self) -> int: ...
    @property
    def sync_every(self) -> int: ...
    def state_dict(self) -> dict[str, Any]: ...


def state_dict(
    averager: Averager,
    averaged_keys: Sequence[str],
    settled_step: Optional[int],
    in_flight: Optional[Round],
    tensors: Callable[[], Tensors],
) -> dict[str, Any]:
    """``averager.state_dict()``: ``settled_step`` is ``None`` without overlapped rounds; ``in_flight``, the
    round in flight, is kept by its tensors' places in ``tensors()`` (the averager's tensors)."""
    state: dict[str, Any] = {
        "steps": averager.steps,
        "num_syncs": averager.num_syncs,
        "last_sync_step": averager.last_sync_step,
        "floats_communicated": averager.floats_communicated,
        "bytes_communicated": averager.bytes_communicated,
        "link_counts": averager.link_counts.state_dict(),
        CONFIGURATION_KEY: configuration(averager),
    }
    if settled_step is not None:
        state["settled_step"] = settled_step
        state["overlapped_counts"] = averager.overlapped_counts.state_dict()
        if averager.short_rounds:
            state["short_rounds"] = dict(averager.short_rounds)
    if averager.outer is not None:
        state["outer"] = _server.state_dict(averager.outer, averager.global_params)
    own = _machine_state.local_state(averager.optimizer, averaged_keys)
    if own:  # absent where the optimizer keeps no tensor per machine (SGD without momentum, SlowcalSGD)
        state[_machine_state.KEY] = {"world_size": averager.world_size, "ranks": {averager.rank: own}}
    if averager.compressed is not None:  # the anchors and this process's error feedback, per averaged tensor
        coded = averager.compressed.state_dict()
        state[COMPRESSION_KEY] = {"world_size": averager.world_size, "ranks": {averager.rank: coded}}
    if in_flight is not None:  # this process's machines' snapshot and the average, by tensor place
        state[IN_FLIGHT_KEY] = {
            "world_size": averager.world_size,
            "machines_per_process": averager.machines_per_process,
            "overlap_delay": averager.options.overlap_delay,
            "fragments": averager.options.fragments,
            "ranks": {averager.rank: in_flight.state_dict(tensors())},
        }
    return state


def gather_state_dict(averager: Averager, dst: int) -> Optional[dict[str, Any]]:
    """``averager.gather_state_dict(dst)``: ``state_dict()`` with every rank's per-process parts, on rank
    ``dst`` (``None`` on the others). A collective."""
    state = averager.state_dict()
    if averager.world_size == 1:
        return state
    rank, group = averager.rank, averager.process_group
    # Every rank here, or one line on every rank (not a mismatched gather with another collective).
    _collectives.check_same_point(
        averager.optimizer, (0, 0), group, averager.skip_advice, collective="gather_state_dict()"
    )
    mine = state.pop(_machine_state.KEY, {"ranks": {}})["ranks"].get(rank, {})
    own = {i: {k: v.cpu() for k, v in per.items()} for i, per in mine.items()}
    coded = _cpu(state.pop(COMPRESSION_KEY, {"ranks": {}})["ranks"].get(rank))
    flight = state.pop(IN_FLIGHT_KEY, None)
    round_ = None if flight is None else _cpu(flight.pop("ranks")[rank])
    ranks = _collectives.gather_objects((rank, own, coded, round_), dst, group)  # on every rank, even with none
    if ranks is None:
        return None
    world_size = averager.world_size
    if any(per for _, per, _, _ in ranks):
        state[_machine_state.KEY] = {"world_size": world_size, "ranks": {r: per for r, per, _, _ in ranks}}
    if coded is not None:
        state[COMPRESSION_KEY] = {"world_size": world_size, "ranks": {r: c for r, _, c, _ in ranks}}
    if flight is not None:
        state[IN_FLIGHT_KEY] = {**flight, "ranks": {r: f for r, _, _, f in ranks}}
    return state


class Loaded(NamedTuple):
    """What ``load_state_dict`` restored that the averager keeps itself."""

    #: The step of the last synchronisation of the whole model.
    settled_step: int
    #: The round in flight, its average already computed (``None``: none).
    in_flight: Optional[Round]
    #: Puts this process's per-machine state back into an optimizer (``None``: none saved).
    reload: Optional[Callable[[Optimizer], None]]


def load_state_dict(
    averager: Averager, state: dict[str, Any], averaged_keys: Sequence[str], recount: Callable[[], None]
) -> Loaded:
    """``averager.load_state_dict(state)``, but for what the averager keeps itself (returned). ``recount``
    rebuilds the counts of bytes sent for a state saved before they existed.

    Everything is checked before anything is set: a state refused (one ``ValueError`` line) changes nothing.
    """
    _check_keys(state)
    if "outer" in state and averager.outer is None:
        raise ValueError(
            "Cannot load the averager's state: it holds an outer optimizer's state (the round's start and its "
            "moments) and this averager has no outer_optimizer; build it with the same outer_optimizer"
        )
    saved = state.get(_machine_state.KEY)
    own = None if saved is None else _machine_state.select(saved, averager.rank, averager.world_size)
    coded = _saved_compression(averager, state)
    _check_configuration(averager, state)
    flight = state.get(IN_FLIGHT_KEY)
    if flight is not None:
        m, options = averager.machines_per_process, averager.options
        flight = saved_round(flight, averager.rank, averager.world_size, m, options.overlap_delay, options.fragments)
    averager.steps = int(state["steps"])
    averager.num_syncs = int(state["num_syncs"])
    # States saved before the key existed come from schedules that synchronised every K only.
    averager.last_sync_step = int(state.get("last_sync_step", averager.steps - averager.steps % averager.sync_every))
    settled_step = int(state.get("settled_step", averager.last_sync_step))
    averager.overlapped_counts = link.LinkCounts.from_state_dict(state.get("overlapped_counts", {}))
    averager.short_rounds = {int(s): int(n) for s, n in state.get("short_rounds", {}).items()}
    floats = state["floats_communicated"]
    averager.floats_communicated = floats if isinstance(floats, float) else int(floats)
    if "link_counts" in state:
        sent = state.get("bytes_communicated", 0)
        averager.bytes_communicated = sent if isinstance(sent, float) else int(sent)
        averager.link_counts = link.LinkCounts.from_state_dict(state["link_counts"])
    else:  # saved before the byte counts existed: num_syncs synchronisations of what is averaged now
        recount()
    if averager.outer is not None and "outer" in state:
        _server.load_state(averager.outer, averager.global_params, state["outer"])
    if averager.compressed is not None:
        averager.compressed.load_state_dict(coded)
    in_flight = None if flight is None else Round.from_state_dict(flight)
    if own is None:
        return Loaded(settled_step, in_flight, None)
    _machine_state.load(averager.optimizer, own, averaged_keys)
    # The optimizer's own load_state_dict, if it comes after (the other order), gives this rank
    # rank 0's per-machine state: the averager puts this rank's back after it, until the next step.
    return Loaded(settled_step, in_flight, lambda o: _machine_state.load(o, own, averaged_keys))


def _saved_compression(averager: Averager, state: dict[str, Any]) -> dict[str, list[Optional[Tensor]]]:
    """This process's anchors and error feedback in ``state`` (none: the next synchronisation is exact), or
    one line where they cannot be taken."""
    saved = state.get(COMPRESSION_KEY)
    if saved is not None and averager.compressed is None:
        raise ValueError(
            "Cannot load the averager's state: it holds a compressed run's anchors and error feedback and this "
            "averager has compression=None; build it with the same compression"
        )
    if saved is None or averager.compressed is None:
        return {}
    if int(saved["world_size"]) != averager.world_size:
        raise ValueError(
            f"Cannot resume the compressed synchronisation's error feedback of {saved['world_size']} processes on "
            f"{averager.world_size}: it is kept per process; resume on {saved['world_size']} processes"
        )
    coded = saved["ranks"].get(averager.rank)
    if not isinstance(coded, dict):
        raise ValueError(
            f"Cannot load the averager's state: 'compression' holds no state of rank {averager.rank} (its ranks: "
            f"{sorted(saved['ranks'])}); save it with gather_state_dict() on every rank"
        )
    check_saved(coded)
    return coded


def configuration(averager: Averager) -> dict[str, Any]:
    """What a saved state's meaning depends on, as text: the compression (its code and settings), whether it keeps
    error feedback, the optimizer's class and each of its options (``defaults``, but those of ``_FREE_OPTIONS``)."""
    optimizer = averager.optimizer
    options = {k: repr(v) for k, v in sorted(optimizer.defaults.items()) if k not in _FREE_OPTIONS}
    return {
        "compression": repr(averager.options.compressor),
        "error_feedback": repr(averager.options.lossy_feedback),
        "optimizer": type(optimizer).__qualname__,
        "optimizer options": options,
    }


def _check_configuration(averager: Averager, state: dict[str, Any]) -> None:
    """One line where ``state`` was saved under another configuration (a state without the record is taken)."""
    saved = state.get(CONFIGURATION_KEY)
    if saved is None:
        return
    mine = configuration(averager)
    pairs = [(key, saved[key], mine[key]) for key in mine if key in saved and key != "optimizer options"]
    if isinstance(saved.get("optimizer options"), dict) and saved.get("optimizer") == mine["optimizer"]:
        theirs = saved["optimizer options"]  # each option apart: the line names the ones that differ
        pairs += [(f"optimizer option {k}", theirs[k], v) for k, v in mine["optimizer options"].items() if k in theirs]
    differ = [(key, old, new) for key, old, new in pairs if str(old) != str(new)]
    if differ:
        what = "; ".join(f"{key} {old} (this averager's: {new})" for key, old, new in differ)
        raise ValueError(
            f"Cannot load the averager's state: it was saved with {what}; build the averager and its optimizer "
            "as they were when it was saved"
        )


def _check_keys(state: Any) -> None:
    """One line naming the first key of ``state`` that is missing or of the wrong type."""
    if not isinstance(state, dict):
        raise ValueError(
            f"Cannot load the averager's state: a {type(state).__name__} (PeriodicAverager.state_dict()'s dict)"
        )
    for i, (key, kinds) in enumerate(_KEYS.items()):
        if key not in state:
            if i < 3:
                raise ValueError(f"Cannot load the averager's state: the key {key!r} is missing (every state holds it)")
            continue
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, kinds):
            allowed = " or ".join(kind.__name__ for kind in kinds)
            raise ValueError(
                f"Cannot load the averager's state: {key!r} is {value!r} of type {type(value).__name__} (expected {allowed})"
            )
    for key in (_machine_state.KEY, COMPRESSION_KEY, IN_FLIGHT_KEY):
        part = state.get(key)
        if part is not None and not (isinstance(part.get("world_size"), int) and isinstance(part.get("ranks"), dict)):
            raise ValueError(
                f"Cannot load the averager's state: {key!r} lacks an int 'world_size' or a dict 'ranks' "
                "(as PeriodicAverager.state_dict() writes it)"
            )


def _cpu(state: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """``state`` with every tensor of its lists on the CPU (what ``gather_state_dict`` sends)."""
    if state is None:
        return None
    return {
        k: [v.cpu() if isinstance(v, Tensor) else v for v in vs] if isinstance(vs, list) else vs
        for k, vs in state.items()
    }
