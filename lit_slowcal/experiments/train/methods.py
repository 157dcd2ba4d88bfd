r"""The methods, one entry each (the paper's Table 1, DiLoCo and the adaptive SLowcal): ``--method slowcal|local_sgd|...``.

Everything the app knows about a method is its entry here: the optimizer built from the model's
hyperparameters, the round's shape (sync period, steps per round, per-step batch), what a machine
uploads per round, the paper-config learning rate, and its name and colour in the report. Nothing
else in the app tests a method's name: a new method is one new entry of ``METHODS``.

=====================  ===========  ===============  ==============  =================================
method                 steps/round  per-step batch   uploads/round   optimizer
=====================  ===========  ===============  ==============  =================================
slowcal                K            b                2d (x, w)       ``SlowcalSGD``
local_sgd              K            b                d (x)           ``torch.optim.SGD``
minibatch_sgd          1            K * b            d (x)           ``torch.optim.SGD``
accel_minibatch_sgd    1            K * b            d (x)           ``AcceleratedSGD`` (AC-SA)
scaffold               K            b                2d (y, dc)      ``Scaffold`` (option II)
diloco                 K            b                d (x)           ``torch.optim.AdamW``; the server's
                                                                     outer SGD with Nesterov momentum
adaptive_slowcal       K            b                2d (x, w)       ``AdaptiveSlowcal``: SLowcal's
                                                     (3d: beta < 1,  averages, Adam-normalised steps
                                                     or v averaged)  (docs/adaptive.md)
=====================  ===========  ===============  ==============  =================================

A round is one synchronisation: the sync period equals the steps per round, and every method
draws K * b samples per machine per round. The minibatch methods send their new parameters (d
floats), which carries the same information as the averaged gradient they stand for.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lit_slowcal._validation import check_int, check_number
from lit_slowcal.accelerated import AcceleratedSGD
from lit_slowcal.adaptive import AdaptiveSlowcal
from lit_slowcal.optimizer import SlowcalSGD
from lit_slowcal.scaffold import Scaffold

__all__ = [
    "METHODS",
    "Method",
    "OUTER_STEPS",
    "TABLE1_METHODS",
    "get_method",
    "max_weight_power",
    "method_names",
    "server_step",
]


@dataclass(frozen=True)
class Method:
    """One method of the comparison.

    Attributes:
        name: the ``--method`` value.
        label, color: the method's name and matplotlib colour in the report.
        local: K local steps of b samples per round (a local method), or one step on K * b samples
            (a minibatch method).
        uploads: d-sized vectors one machine sends per round.
        paper_lr: the learning rate of the paper-config runs (``model.lr`` unset): the paper's for
            its three methods, the choice of ``sweeps/lr.yaml`` for the others.
        optimizer: ``(parameters, hparams, steps=None) -> Optimizer``, ``hparams`` being the model's
            hyperparameters (``lr``, ``weight_decay`` and the method's own options) and ``steps`` the
            optimizer steps of the whole run, N, where the caller knows it (AC-SA's horizon-aware step
            needs it; the model reads it from the trainer, a stacked group from its rounds).
        options: the model hyperparameters the method reads besides ``lr`` and ``weight_decay``.
        table1: whether the method is one of the paper's Table 1 (the grids of the reproduction).
    """

    name: str
    label: str
    color: str
    local: bool
    uploads: int
    paper_lr: float
    optimizer: Callable[..., Optimizer]
    options: tuple[str, ...] = ()
    table1: bool = True  # one of the paper's Table 1 methods (its grids: sweeps/table1*.yaml, lr.yaml)

    def probe(self, hparams: Any, steps: Optional[int] = 1) -> Optimizer:
        """The method's optimizer on one probe parameter: what it declares and refuses, before any model trains."""
        return self.optimizer([torch.zeros(1, requires_grad=True)], hparams, steps=steps)

    def sync_period(self, local_steps: int) -> int:
        """Optimizer steps between synchronisations."""
        return self.steps_per_round(local_steps)

    def steps_per_round(self, local_steps: int) -> int:
        """Optimizer steps per round: K for a local method, 1 for a minibatch method."""
        check_int("local_steps", local_steps)
        return local_steps if self.local else 1

    def per_step_batch(self, local_steps: int, batch_size: int) -> int:
        """Samples per machine per step: b for a local method, K * b for a minibatch method."""
        check_int("local_steps", local_steps)
        check_int("batch_size", batch_size)
        return batch_size if self.local else local_steps * batch_size

    def floats_per_round(self, dim: int) -> int:
        """Floats one machine sends per round for a model of ``dim`` parameters."""
        return self.uploads * dim


#: The server steps a method may take at each synchronisation (``model.outer``), on the pseudo-gradient
#: x_s - x_bar (``PeriodicAverager``'s ``outer_optimizer``): none (the plain average), SGD with momentum
#: (FedAvgM), SGD with Nesterov momentum (DiLoCo), Adam (FedAdam).
OUTER_STEPS = ("none", "sgd", "nesterov", "adam")


def server_step(h: Any, default: Optional[tuple[str, float]] = None) -> Optional[Callable[[list[Tensor]], Optimizer]]:
    """The outer optimizer factory of ``model.outer`` / ``model.outer_lr`` / ``model.outer_momentum``
    (``default``: the method's own (kind, lr) when ``model.outer`` is unset); ``None`` for the plain average."""
    kind, lr = getattr(h, "outer", None), getattr(h, "outer_lr", None)
    if kind is None:
        kind, default_lr = default if default is not None else ("none", 1.0)
        lr = default_lr if lr is None else lr
    if kind not in OUTER_STEPS:
        raise ValueError(f"Invalid outer: {kind!r} (allowed: {', '.join(OUTER_STEPS)})")
    if kind == "none":
        if lr is not None and getattr(h, "outer", None) == "none":
            raise ValueError(f"Invalid outer_lr: {lr!r} (model.outer is none: there is no server step to take it)")
        return None
    lr = 1.0 if lr is None else lr
    check_number("outer_lr", lr)
    momentum = getattr(h, "outer_momentum", 0.9)
    check_number("outer_momentum", momentum, strict=False, maximum=1.0)
    if kind == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=kind == "nesterov")


def _serve(optimizer: Optimizer, h: Any, default: Optional[tuple[str, float]] = None) -> Optimizer:
    """``optimizer`` with the run's server step declared (the averager's optimizer protocol)."""
    factory = server_step(h, default)
    if factory is not None:
        optimizer.outer_optimizer = factory  # type: ignore[attr-defined]
    return optimizer


def _sgd(params: Iterable[Tensor], h: Any, steps: Optional[int] = None) -> Optimizer:
    return _serve(torch.optim.SGD(params, lr=h.lr, weight_decay=h.weight_decay), h)


def max_weight_power(steps: int, lr: float = 0.0, scale_lr_by_weight: bool = False) -> float:
    """The largest SLowcal ``weight_power`` p whose arithmetic stays finite over ``steps`` optimizer steps.

    The optimizer sums alpha_t = (t + 1)^p in float64 up to n = steps + 1: at most n^p (1 + n / (p + 1)),
    which must stay below float64's largest number (1.8e308); with ``scale_lr_by_weight`` it steps w by
    lr (t + 1)^p, at most lr steps^p, which torch must hold as a float32 multiplier (3.4e38). Tight, as
    measured: at the bound a run's sums and weights are finite, 0.05% above its step raises OverflowError (or
    torch's "value cannot be converted to type float without overflow"). E.g. 85.75 for 3,760 steps (the
    default run), 646 for 2, 1024 (the optimizer's own bound) for 1; scaled at lr 0.01: 11.33 for 3,760.
    """
    n = steps + 1
    low, high = 0.0, 1024.0  # SlowcalSGD refuses p >= 1024 itself: 2^p, its first weight, overflows
    for _ in range(100):  # bisection on p ln n + ln(1 + n / (p + 1)) <= ln(max float64), increasing in p
        mid = (low + high) / 2
        low, high = (mid, high) if mid * math.log(n) + math.log1p(n / (mid + 1)) <= _LN_MAX_FLOAT64 else (low, mid)
    if scale_lr_by_weight and lr > 0 and steps > 1:
        low = min(low, (_LN_MAX_FLOAT32 - math.log(lr)) / math.log(steps))
    return low


_LN_MAX_FLOAT64 = math.log(sys.float_info.max)
_LN_MAX_FLOAT32 = math.log(torch.finfo(torch.float32).max)  # the machines' parameters are float32


def _check_weight_power(h: Any, steps: int) -> None:
    """Refuse a ``weight_power`` beyond ``max_weight_power`` for a run of ``steps`` optimizer steps."""
    scaled = bool(getattr(h, "scale_lr_by_weight", False))
    bound = max_weight_power(steps, h.lr, scaled)
    if h.weight_power > bound:
        at = f" at lr {h.lr:g} with scale_lr_by_weight (lr (t+1)^p must fit float32)" if scaled else ""
        raise ValueError(
            f"Invalid weight_power: {h.weight_power!r} (must be from 0 to {math.floor(bound * 100) / 100:g} for this "
            f"run's {steps} optimizer steps{at}: beyond it the weights alpha_t = (t+1)^p and their sum overflow)"
        )


def _slowcal(params: Iterable[Tensor], h: Any, steps: Optional[int] = None) -> Optimizer:
    if (
        steps is not None and steps > 1 and math.isfinite(h.weight_power) and 0 <= h.weight_power < 1024
    ):  # else: SlowcalSGD's line
        _check_weight_power(h, steps)
    return _serve(SlowcalSGD(
        params, lr=h.lr, weight_power=h.weight_power, scale_lr_by_weight=h.scale_lr_by_weight, gamma=h.gamma,
        weight_decay=h.weight_decay,
    ), h)  # fmt: skip


def _diloco(params: Iterable[Tensor], h: Any, steps: Optional[int] = None) -> Optimizer:
    # DiLoCo: inner AdamW on every machine, outer SGD with Nesterov momentum (lr 0.7, momentum 0.9).
    return _serve(torch.optim.AdamW(params, lr=h.lr, weight_decay=h.weight_decay), h, default=("nesterov", 0.7))


def _adaptive(params: Iterable[Tensor], h: Any, steps: Optional[int] = None) -> Optimizer:
    beta = getattr(h, "beta", 1.0)
    if beta != 1:  # its post_sync sets the parameters (y) from the averaged x and w: a server step on y would be lost
        _no_server_step(h, "adaptive_slowcal", "with model.beta < 1 the parameters are rebuilt from x and w")
    if (
        steps is not None and steps > 1 and math.isfinite(h.weight_power) and 0 <= h.weight_power < 1024
    ):  # else: the optimizer's line
        _check_weight_power(h, steps)
    return _serve(AdaptiveSlowcal(
        params, lr=h.lr, beta=beta, beta2=getattr(h, "beta2", 0.999), weight_power=h.weight_power,
        second_moment=getattr(h, "second_moment", "adam"),
        average_second_moment=getattr(h, "average_second_moment", False), weight_decay=h.weight_decay,
    ), h)  # fmt: skip


def _no_server_step(h: Any, method: str, instead: str) -> None:
    if getattr(h, "outer", None) not in (None, "none"):
        raise ValueError(f"Invalid outer: {h.outer!r} with method {method} ({instead})")


def _accelerated(params: Iterable[Tensor], h: Any, steps: Optional[int] = None) -> Optimizer:
    _no_server_step(h, "accel_minibatch_sgd", "AC-SA's synchronisation is its own step; model.outer=none")
    # horizon_aware: lr is Lan's constant c and gamma = min{max_lr, c (N+1)^-3/2}, N the run's steps.
    horizon = None
    if getattr(h, "horizon_aware", False):
        if steps is None:
            raise ValueError("model.horizon_aware needs the run's number of steps N, which only a fit knows")
        horizon = steps
    max_lr = getattr(h, "max_lr", None)
    if max_lr is not None and horizon is None:
        raise ValueError(
            f"Invalid max_lr: {max_lr!r} (it caps the horizon-aware step; set horizon_aware=true or leave it unset)"
        )
    return AcceleratedSGD(params, lr=h.lr, weight_decay=h.weight_decay, horizon=horizon, max_lr=max_lr)


def _scaffold(params: Iterable[Tensor], h: Any, steps: Optional[int] = None) -> Optimizer:
    _no_server_step(h, "scaffold", "SCAFFOLD's server step is SGD at model.server_lr")
    return Scaffold(params, lr=h.lr, server_lr=h.server_lr, weight_decay=h.weight_decay)


#: The registry, in the report's order. paper_lr: the paper's grid search for its three methods
#: (Section 6); sweeps/lr.yaml (M = 16, K = 16, seed 1) for the other two, see docs/reproduction.md.
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("slowcal", "SLowcal-SGD", "tab:red", local=True, uploads=2, paper_lr=0.01, optimizer=_slowcal,
               options=("weight_power", "scale_lr_by_weight", "gamma")),
        Method("local_sgd", "Local-SGD", "tab:blue", local=True, uploads=1, paper_lr=0.01, optimizer=_sgd),
        Method("minibatch_sgd", "Minibatch-SGD", "tab:green", local=False, uploads=1, paper_lr=0.1, optimizer=_sgd),
        Method("accel_minibatch_sgd", "Accelerated Minibatch-SGD", "tab:purple", local=False, uploads=1,
               paper_lr=0.01, optimizer=_accelerated, options=("horizon_aware", "max_lr")),
        Method("scaffold", "SCAFFOLD", "tab:orange", local=True, uploads=2, paper_lr=0.01, optimizer=_scaffold,
               options=("server_lr",)),
        # paper_lr: AdamW's default rate (DiLoCo is not in the paper; not tuned here).
        Method("diloco", "DiLoCo", "tab:brown", local=True, uploads=1, paper_lr=0.001, optimizer=_diloco,
               options=("outer", "outer_lr", "outer_momentum"), table1=False),
        # paper_lr: AdamW's default rate, as DiLoCo's (not tuned here; docs/adaptive.md tunes it).
        Method("adaptive_slowcal", "Adaptive SLowcal", "tab:pink", local=True, uploads=2, paper_lr=0.001,
               optimizer=_adaptive,
               options=("weight_power", "beta", "beta2", "second_moment", "average_second_moment"), table1=False),
    )
}  # fmt: skip


#: The paper's Table 1 methods, in the registry's order.
TABLE1_METHODS: tuple[str, ...] = tuple(name for name, m in METHODS.items() if m.table1)


def method_names() -> tuple[str, ...]:
    return tuple(METHODS)


def get_method(name: Any, field: str = "method") -> Method:
    """The entry of ``name``; else one line naming the field, the value and the allowed names."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise ValueError(f"Invalid {field}: {name!r} (allowed: {', '.join(METHODS)})") from None
