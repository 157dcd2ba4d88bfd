"""``AveragingOptions``: every option of a periodic averaging, its default, its check and its combinations.

One frozen value holds how machines are synchronised; ``PeriodicAverager``, the Trainer strategies and
the Fabric strategy take it (their keyword arguments of the same names build it, in ``build``). It
refuses a bad value or a combination that cannot work when it is made, in one line naming the
option(s), the value(s) and what is allowed; the rules that need the optimizer or the model
(``check_with``) run where the averager is built. What every rank must agree on is derived from its
fields (``agreement``), so a new option is compared across ranks by being declared here.

Which combinations work (docs/communication.md, "Which options combine", gives the table):

- ``overlap_delay`` tau and ``fragments`` F with ``sync_every`` K: F divides K, tau < K / F.
- ``compression`` with ``overlap_delay`` >= 1 or ``fragments`` > 1: refused (a compressed round is a
  blocking round of the whole model).
- ``error_feedback`` needs ``compression``.
- ``bucket_views`` with ``fragments`` > 1 or ``overlap_delay`` >= 1: refused (those rounds send a fragment
  or a snapshot, never the model's buffer where it lies); with ``participation`` it works, and with
  ``compression`` it serves the rounds that go exactly (the first, a tensor without an anchor).
- ``state_every`` n > 1 with ``bucket_views``: refused (a round that skips the state would all-reduce part of
  the buffer the tensors live in); with ``compression``, ``participation``, overlap and fragments it works.
- ``participation``, ``outer_optimizer``, ``check_schedule``, ``bucket_cap_mb`` combine with everything.
- With the optimizer: ``pre_sync``/``post_sync`` declared with ``overlap_delay`` >= 1 or ``fragments`` > 1;
  ``participation`` with an optimizer that does not support it; ``state_every`` > 1 with
  ``pre_sync``/``post_sync`` declared; ``outer_optimizer`` with one whose
  ``post_sync`` rewrites the parameters (``supports_outer_optimizer = False``): refused.
- With the model: an FSDP2-sharded model with ``fragments`` > 1, ``bucket_views`` or
  ``SimulatedMachines``; ``compression`` with simulated machines and averaged tensors outside them: refused.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

from torch import Tensor
from torch.optim import Optimizer

from lit_slowcal._validation import check_int, check_number, is_int
from lit_slowcal.compression import Compressor, compressor
from lit_slowcal.protocol import declared

__all__ = ["OPTION_NAMES", "AveragingOptions", "check_overlap", "check_participation", "option_keywords"]

OuterFactory = Callable[[Iterable[Tensor]], Optimizer]
#: S or a fraction of M, int first. Spelled flat: typing caches ``Optional[Union[int, float]]`` by its inner Union,
#: which equals ``Union[float, int]``, so whichever order a process made first would come back (importing Lightning
#: makes the float-first one), and a parser trying float first reads "2" as 2.0 and "1" as all machines.
Participation = Union[int, float, None]


@dataclass(frozen=True)
class AveragingOptions:
    """How machines are synchronised; checked when made (see the module docstring for the combinations).

    Args:
        sync_every: K, optimizer steps between synchronisations (>= 1).
        average_state: extra per-parameter optimizer state keys to average (``("momentum_buffer",)``: SGD's).
        bucket_cap_mb: the largest flattened buffer of one collective, in megabytes (> 0).
        check_schedule: with several processes, compare the ranks' step and backward counts before the
            average of the blocking rounds that check (the first, every ``PeriodicAverager.check_every``-th, every
            ``close_round()``, the first after a resume, a load or a new K; overlapped rounds: every round) and
            raise on a difference (one small all-gather a round that checks).
        outer_optimizer: ``params -> Optimizer``, the server's optimizer on the pseudo-gradient x_s - x_bar
            (DiLoCo, FedAvgM, FedAdam); ``None``: the optimizer's own if it declares one, else the plain average.
        participation: machines taking part in each round: an int S >= 1 or a fraction of M in (0, 1];
            ``None``: all of them.
        participation_seed: the seed of the per-round sample of participants (0 <= seed < 2**63).
        compression: how a machine's round change travels (``lit_slowcal.compression``): ``None`` (exact),
            ``"bf16"``, ``"int8"`` or a ``Compressor``.
        error_feedback: with ``compression``, keep what each message lost and add it to the next round's
            change; ``None``: on for a lossy compressor.
        overlap_delay: tau, optimizer steps a round's average takes to land while training goes on (0: blocking).
        fragments: F, the parts of the model that take turns, one round every K / F steps.
        bucket_views: the averaged tensors of each device and dtype become views of one flat buffer that a
            blocking exact synchronisation all-reduces where it lies (docs/communication.md, "Bucket views");
            ``None`` (the default): on where no optimizer state is averaged (the buffer then holds what the model
            holds: saving it writes nothing more) and the rounds are blocking and exact (no ``compression``,
            ``overlap_delay``, ``fragments`` > 1, ``state_every`` > 1 or FSDP2 shards); else off.
        state_every: n, the optimizer state a round averages (the declared ``averaged_state`` and
            ``average_state``) goes in every n-th scheduled round only, those of the periods ceil(steps / K)
            that n divides; parameters and buffers in every round, everything in a closing round
            (docs/communication.md, "The optimizer state on its own period").

    Example::

        options = AveragingOptions(sync_every=16, compression="int8")
        averager = PeriodicAverager(model, optimizer, options=options)
        later = dataclasses.replace(options, sync_every=32)  # checked again
    """

    sync_every: int = 1
    average_state: Sequence[str] = ()
    bucket_cap_mb: float = 25.0
    check_schedule: bool = True
    outer_optimizer: Optional[OuterFactory] = None
    participation: Participation = None
    participation_seed: int = 0
    compression: Union[None, str, Compressor] = field(default=None, compare=False)  # compared as its compressor
    error_feedback: Optional[bool] = None
    overlap_delay: int = 0
    fragments: int = 1
    bucket_views: Optional[bool] = None
    state_every: int = 1
    #: The compressor ``compression`` names (``None``: the exact average); derived, not an option.
    compressor: Optional[Compressor] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_int("sync_every", self.sync_every)
        keys = self.average_state
        if isinstance(keys, str) or not isinstance(keys, Iterable):
            raise ValueError(f"Invalid average_state: {keys!r} (a sequence of state key names)")
        keys = tuple(keys)  # an iterator is read once
        if not all(isinstance(k, str) for k in keys):
            raise ValueError(f"Invalid average_state: {keys!r} (a sequence of state key names)")
        object.__setattr__(self, "average_state", keys)
        check_number("bucket_cap_mb", self.bucket_cap_mb)
        for name in ("check_schedule", "bucket_views"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "bucket_views" and value is None):
                more = ", or None: on where it changes nothing a program saves" if name == "bucket_views" else ""
                raise ValueError(f"Invalid {name}: {value!r} (True or False){more}")
        if self.outer_optimizer is not None and not callable(self.outer_optimizer):
            raise TypeError(
                f"Invalid outer_optimizer: {self.outer_optimizer!r} (a callable params -> torch.optim.Optimizer)"
            )
        check_participation(self.participation)
        seed = check_int("participation_seed", self.participation_seed, minimum=0)
        if seed >= 2**63:
            raise ValueError(f"Invalid participation_seed: {seed} (must be an integer >= 0 and < 2**63)")
        object.__setattr__(self, "compressor", compressor(self.compression))
        if self.error_feedback is not None and not isinstance(self.error_feedback, bool):
            raise ValueError(
                f"Invalid error_feedback: {self.error_feedback!r} (True, False, or None: on for a lossy compressor)"
            )
        check_overlap(self.sync_every, self.overlap_delay, self.fragments)
        check_int("state_every", self.state_every)
        integers = ("sync_every", "overlap_delay", "fragments", "participation_seed", "state_every")
        for name in integers:  # numpy's integers as int
            object.__setattr__(self, name, int(getattr(self, name)))
        self._check_pairs()

    def _check_pairs(self) -> None:
        """The combinations of options that cannot work, each one line naming both."""
        tau, parts, code = self.overlap_delay, self.fragments, self.compressor
        if self.error_feedback is not None and code is None:
            raise ValueError(
                f"Invalid error_feedback: {self.error_feedback!r} with compression=None (it applies to compressed "
                "rounds; give compression or leave error_feedback None)"
            )
        if code is not None and (tau or parts > 1):
            raise ValueError(
                f"Invalid compression: {code.name!r} with overlap_delay={tau}, fragments={parts} "
                "(compressed rounds are blocking rounds of the whole model; use one or the other)"
            )
        if self.bucket_views and (parts > 1 or tau):
            other = f"fragments={parts}" if parts > 1 else f"overlap_delay={tau}"
            raise ValueError(
                f"Invalid bucket_views: True with {other} (those rounds send a fragment or a snapshot, never the "
                "model's buffer where it lies; use bucket_views=False)"
            )
        if self.bucket_views and self.state_every > 1:
            raise ValueError(
                f"Invalid bucket_views: True with state_every={self.state_every} (a round that skips the optimizer "
                "state would all-reduce part of the buffer the tensors live in; use bucket_views=False)"
            )

    @property
    def bucket_cap_bytes(self) -> int:
        """``bucket_cap_mb`` in bytes (at least 1)."""
        return max(1, int(self.bucket_cap_mb * 2**20))

    def with_sync_every(self, value: int) -> AveragingOptions:
        """These options with K = ``value`` (set mid-run), one line naming ``sync_every`` where tau or F forbid it."""
        check_int("sync_every", value)
        check_overlap(value, self.overlap_delay, self.fragments, setting_k=True)
        return dataclasses.replace(self, sync_every=value)

    def state_round(self, steps: int) -> bool:
        """Whether the scheduled round after ``steps`` steps averages the optimizer state: its period p =
        ceil(steps / K) (the round after step p K, or a fragment's within those K steps) is a multiple of n."""
        return -(-steps // self.sync_every) % self.state_every == 0

    @property
    def lossy_feedback(self) -> bool:
        """Whether compressed rounds keep error feedback (``error_feedback``, by default the code's ``lossy``)."""
        return self.compressor is not None and (
            self.compressor.lossy if self.error_feedback is None else self.error_feedback
        )

    # -- building it ----------------------------------------------------------------------------

    @classmethod
    def build(
        cls, options: Optional[AveragingOptions] = None, sync_every: Optional[int] = None, **settings: Any
    ) -> AveragingOptions:
        """``options`` (default: the defaults) with ``sync_every`` (unless ``None``) and ``settings`` (option names)
        replacing its fields; one line for a name that is not an option. The one place the keyword spelling
        becomes the value."""
        unknown = sorted(set(settings) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(f"Invalid averaging option: {unknown[0]!r} (one of {', '.join(OPTION_NAMES)})")
        if sync_every is not None:
            settings["sync_every"] = sync_every
        if options is None:
            return cls(**settings)
        if not isinstance(options, AveragingOptions):
            raise TypeError(f"Invalid options: {options!r} (an AveragingOptions)")
        return dataclasses.replace(options, **settings) if settings else options

    @staticmethod
    def take(kwargs: dict[str, Any]) -> dict[str, Any]:
        """Remove the option names from ``kwargs`` (a strategy's keyword arguments) and return them."""
        return {name: kwargs.pop(name) for name in OPTION_NAMES if name in kwargs}

    # -- what needs the optimizer or the model ------------------------------------------------

    def check_with(
        self, optimizer: Optimizer, *, sharded: bool = False, machines_per_process: int = 1
    ) -> Optional[Callable[..., Optimizer]]:
        """The combinations with ``optimizer`` (its declared protocol) and the model (``sharded``: FSDP2
        shards; ``machines_per_process``: simulated machines), one line each; returns the outer factory
        (``outer_optimizer``, else the optimizer's own)."""
        protocol, name = declared(optimizer), type(optimizer).__name__
        hooks = protocol.pre_sync is not None or protocol.post_sync is not None
        if hooks and self.fragments > 1:
            raise ValueError(
                f"Invalid fragments: {self.fragments} ({name}'s pre_sync/post_sync act on the whole model at once; "
                "use fragments=1)"
            )
        if hooks and self.overlap_delay:
            raise ValueError(
                f"Invalid overlap_delay: {self.overlap_delay} ({name}'s post_sync takes the round's average in the "
                "step its pre_sync starts it; use overlap_delay=0)"
            )
        if hooks and self.state_every > 1:
            raise ValueError(
                f"Invalid state_every: {self.state_every} ({name}'s pre_sync/post_sync rebuild its state from every "
                "round's averages; use state_every=1)"
            )
        if self.participation is not None and not protocol.supports_participation:
            raise ValueError(
                f"Invalid participation: {self.participation!r} ({name} keeps per-machine state that machines "
                "outside a round would update; use participation=None)"
            )
        if self.outer_optimizer is not None and not protocol.supports_outer_optimizer:
            raise ValueError(
                f"Invalid outer_optimizer: {describe(self.outer_optimizer)} with {name} (its post_sync rewrites the "
                "parameters from the averaged state, which would discard the outer step; use outer_optimizer=None)"
            )
        if sharded:
            self.check_sharded(machines_per_process)
        return self.outer_optimizer if self.outer_optimizer is not None else protocol.outer_optimizer

    def check_sharded(self, machines_per_process: int = 1) -> None:
        """The combinations with an FSDP2-sharded model: one machine per process, F = 1, no bucket views."""
        what = (
            f"fragments={self.fragments}" if self.fragments > 1 else "bucket_views=True" if self.bucket_views else
            f"{machines_per_process} SimulatedMachines per process" if machines_per_process > 1 else None
        )  # fmt: skip
        if what is not None:
            raise ValueError(
                f"Invalid options for an FSDP2-sharded model: {what} (fragments cut by local bytes would differ by "
                "shard, and FSDP2 owns its shards' memory; supported: one machine per process, fragments=1, "
                "bucket_views=False; docs/sharded.md)"
            )

    def check_tensors(self, tensors: Sequence[tuple[Tensor, bool]], machines_per_process: int) -> None:
        """``compression`` needs real tensors (a complex one's imaginary part would be dropped) and, with simulated
        machines, every averaged tensor to hold one slice per machine."""
        complex_ = next((t for t, _ in tensors if t.is_complex()), None)
        if self.compressor is not None and complex_ is not None:
            raise ValueError(
                f"Invalid compression: {self.compressor.name!r} with a complex averaged tensor (of shape "
                f"{tuple(complex_.shape)}, {complex_.dtype}); the codes are real: use compression=None for this model"
            )
        loose = [t for t, s in tensors if not s] if machines_per_process > 1 else []
        if self.compressor is not None and loose:
            raise ValueError(
                f"Invalid compression: {self.compressor.name!r} with {machines_per_process} simulated machines per "
                f"process and {len(loose)} averaged tensors outside SimulatedMachines (of shape "
                f"{tuple(loose[0].shape)}); compression needs every averaged tensor to hold one slice per machine"
            )

    # -- what every rank must agree on ----------------------------------------------------------

    def agreement(self) -> dict[str, tuple[int, str]]:
        """Every option as (an integer code, its readable value): what the ranks compare before the
        first average. Codes are equal exactly when the readable values are."""
        out = {}
        for f in fields(self):
            if not f.init:
                continue
            text = describe(self.compressor if f.name == "compression" else getattr(self, f.name))
            value = getattr(self, f.name)
            code = int(value) if is_int(value) or isinstance(value, bool) else zlib.crc32(text.encode())
            out[f.name] = (code if -(2**62) < code < 2**62 else zlib.crc32(text.encode()), text)
        return out


#: Every option's name, in the order of ``AveragingOptions``'s fields.
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(AveragingOptions) if f.init)


def describe(value: Any) -> str:
    """A text for ``value`` that is the same on every process for the same setting (no addresses):
    a function or class by its qualified name, a ``functools.partial`` with its arguments."""
    if isinstance(value, functools.partial):
        args = [describe(a) for a in value.args] + [f"{k}={describe(v)}" for k, v in value.keywords.items()]
        return f"partial({describe(value.func)}, {', '.join(args)})"
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in value.items()) + "}"
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else text


def check_participation(value: Any, num_machines: Optional[int] = None) -> Optional[Union[int, float]]:
    """``value`` if it is ``None``, an int >= 1 (and <= ``num_machines`` when given), or a fraction in (0, 1]."""
    if value is None:
        return None
    if isinstance(value, float):
        if not (0.0 < value <= 1.0):
            raise ValueError(f"Invalid participation: {value!r} (a number of machines >= 1, or a fraction in (0, 1])")
        return value
    check_int("participation", value)
    if num_machines is not None and value > num_machines:
        raise ValueError(f"Invalid participation: {value} (must be <= M = {num_machines}, the machines in all)")
    return value


def check_overlap(
    sync_every: int, overlap_delay: Any = 0, fragments: Any = 1, setting_k: bool = False
) -> tuple[int, int]:
    """(tau, F), checked against K: tau >= 0, F >= 1, F divides K and tau < K / F (a round lands before
    the next starts); else one ``ValueError`` naming the field, ``sync_every`` where K is being set (``setting_k``)."""
    tau = check_int("overlap_delay", overlap_delay, minimum=0)
    parts = check_int("fragments", fragments)
    if setting_k and (sync_every % parts or tau >= sync_every // parts):
        raise ValueError(
            f"Invalid sync_every: {sync_every} (must be a multiple of fragments = {parts} and >= "
            f"(overlap_delay + 1) x fragments = {(tau + 1) * parts})"
        )
    if sync_every % parts:
        raise ValueError(f"Invalid fragments: {parts} (must divide sync_every = {sync_every})")
    if tau >= sync_every // parts:
        raise ValueError(
            f"Invalid overlap_delay: {tau} (must be < sync_every // fragments = {sync_every // parts}: "
            "a round lands before the next one starts)"
        )
    return tau, parts


def option_keywords(init: Callable[..., None]) -> Callable[..., None]:
    """Give a strategy's ``__init__(self, sync_every=1, ..., options=None, **kwargs)`` a signature that also
    lists every other option by name, keyword-only, with its type and default (``AveragingOptions``'s
    fields: declared there once), for ``inspect``, ``help`` and LightningCLI. The ``__init__`` takes them
    out of ``kwargs`` with ``AveragingOptions.take``."""
    hints = typing.get_type_hints(AveragingOptions)
    params = list(inspect.signature(init).parameters.values())
    named = {p.name for p in params}
    keywords = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
        for f in fields(AveragingOptions)
        if f.init and f.name not in named
    ]
    if "options" not in named:
        keywords.append(inspect.Parameter("options", inspect.Parameter.KEYWORD_ONLY, default=None,
                                          annotation=Optional[AveragingOptions]))  # fmt: skip
    at = next((i for i, p in enumerate(params) if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD)), len(params))
    init.__signature__ = inspect.Signature([*params[:at], *keywords, *params[at:]])  # type: ignore[attr-defined]
    return init
