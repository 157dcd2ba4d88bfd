"""The optimizer protocol: what an optimizer may declare about a synchronisation, in one place.

``PeriodicAverager`` treats every optimizer alike; what a synchronisation does with one is declared
by the optimizer, never special-cased in the averager. Every member is optional: ``torch.optim.SGD``
declares nothing and gets plain Local-SGD. ``SyncOptimizer`` is the protocol as a type (for readers
and type checkers; an optimizer need not inherit from it), and ``declared(optimizer)`` is the one
place that reads it, each member with its default and checked, so that a wrong declaration is one
line at construction rather than a failure at the first synchronisation. A hook that does nothing
for an optimizer's settings is ``None`` on that instance (``AdaptiveSlowcal(beta=1).post_sync``), so
that the averager allows what a hook would forbid (overlapped rounds).

===========================  ===========================================================================
member                       meaning
===========================  ===========================================================================
``averaged_state``           per-parameter state keys averaged together with the parameters
                             (``SlowcalSGD``: ``("w",)``); the other tensors of the state stay per
                             machine, and every machine's is kept in checkpoints
``pre_sync()``               called on every machine just before the average (``Scaffold``: compute
                             what the round sends; ``AcceleratedSGD``: put its new x in the parameters)
``post_sync()``              called just after it (fold averaged values into per-machine state)
``outer_optimizer``          ``params -> Optimizer``: a server step of the optimizer's own, used when the
                             averager is given none (``Scaffold`` with ``server_lr != 1``)
``supports_participation``   ``False`` where machines outside a round would leave per-machine state
                             stale (``Scaffold``): partial participation is refused
``supports_outer_optimizer`` ``False`` where ``post_sync`` rewrites the parameters from averaged state
                             (``AdaptiveSlowcal`` with ``beta < 1``): an outer optimizer is refused
``swap_output()``            exchange the parameters with the method's output where the two differ
                             (``AcceleratedSGD``: x^md and x^ag); called around evaluation
===========================  ===========================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["NONNEGATIVE", "Declared", "SyncOptimizer", "declared"]

OuterFactory = Callable[[list[Tensor]], Optimizer]

#: The never-negative state keys of torch's optimizers (and their subclasses), for those that declare none.
NONNEGATIVE: dict[type[Optimizer], tuple[str, ...]] = {
    torch.optim.Adam: ("exp_avg_sq", "max_exp_avg_sq"),
    torch.optim.AdamW: ("exp_avg_sq", "max_exp_avg_sq"),
    torch.optim.NAdam: ("exp_avg_sq",),
    torch.optim.RAdam: ("exp_avg_sq",),
    torch.optim.SparseAdam: ("exp_avg_sq",),
    torch.optim.Adamax: ("exp_inf",),
    torch.optim.Adagrad: ("sum",),
    torch.optim.RMSprop: ("square_avg",),
    torch.optim.Adadelta: ("square_avg", "acc_delta"),
    torch.optim.Rprop: ("step_size",),
}


class SyncOptimizer(Protocol):
    """An optimizer with every member of the protocol (each optional in practice; see ``declared``)."""

    averaged_state: tuple[str, ...]
    nonnegative_state: tuple[str, ...]
    supports_participation: bool
    supports_outer_optimizer: bool

    @property
    def outer_optimizer(self) -> Optional[OuterFactory]: ...

    def pre_sync(self) -> None: ...

    def post_sync(self) -> None: ...

    def swap_output(self) -> None: ...


@dataclass(frozen=True)
class Declared:
    """What an optimizer declares, each member present with its default (``declared``)."""

    averaged_state: tuple[str, ...] = ()
    nonnegative_state: tuple[str, ...] = ()
    pre_sync: Optional[Callable[[], None]] = None
    post_sync: Optional[Callable[[], None]] = None
    outer_optimizer: Optional[OuterFactory] = None
    supports_participation: bool = True
    supports_outer_optimizer: bool = True
    swap_output: Optional[Callable[[], None]] = None


def _callable(optimizer: Any, name: str) -> Optional[Callable[..., Any]]:
    value = getattr(optimizer, name, None)
    if value is not None and not callable(value):
        raise TypeError(f"Invalid {type(optimizer).__name__}.{name}: {value!r} (a method, or absent)")
    return value


def _names(name: str, member: str, keys: Any) -> tuple[str, ...]:
    """``keys``, what ``<name>.<member>`` declares, if it is a collection of state key names; else one line."""
    if isinstance(keys, str) or not isinstance(keys, Iterable) or not all(isinstance(k, str) for k in keys):
        raise TypeError(f"Invalid {name}.{member}: {keys!r} (a tuple of state key names)")
    return tuple(keys)


def declared(optimizer: Any) -> Declared:
    """The protocol members ``optimizer`` declares, with the defaults for the others; ``TypeError`` (one
    line) for a member of the wrong kind."""
    name = type(optimizer).__name__
    known = next((keys for kind, keys in NONNEGATIVE.items() if isinstance(optimizer, kind)), ())
    keys = _names(name, "averaged_state", getattr(optimizer, "averaged_state", ()))
    nonnegative = _names(name, "nonnegative_state", getattr(optimizer, "nonnegative_state", known))
    supports = {key: getattr(optimizer, key, True) for key in ("supports_participation", "supports_outer_optimizer")}
    for key, value in supports.items():
        if not isinstance(value, bool):
            raise TypeError(f"Invalid {name}.{key}: {value!r} (True or False)")
    return Declared(
        averaged_state=keys,
        nonnegative_state=nonnegative,
        pre_sync=_callable(optimizer, "pre_sync"),
        post_sync=_callable(optimizer, "post_sync"),
        outer_optimizer=_callable(optimizer, "outer_optimizer"),
        **supports,
        swap_output=_callable(optimizer, "swap_output"),
    )
