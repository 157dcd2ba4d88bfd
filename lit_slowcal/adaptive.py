r"""An adaptive SLowcal: anytime averaging of an iterate stepped with per-coordinate (Adam or AdaGrad) steps.

The paper's open questions (a) and (b) (Dahan & Levy, NeurIPS 2024, Section 7): a variant that needs no
knowledge of sigma and L, with per-dimension step sizes. On one machine this is the schedule-free
AdamW update (Defazio et al. 2024, facebookresearch/schedule_free) with SLowcal's weights as an
option; across machines a synchronisation averages both sequences, x and w, as Algorithm 2 does.
The design choices (what a synchronisation averages, the step clock) and their measurements are in
docs/adaptive.md.
"""

import math
from collections.abc import Callable
from typing import Literal, Optional, cast

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

from lit_slowcal.optimizer import _averaging_weight, _buckets, _check_options, _default_to_foreach

__all__ = ["AdaptiveSlowcal", "adaptive_slowcal"]

#: The averaging weights: SLowcal's alpha_t = (t+1)^p from t = 0 (x_0 = w_0 weighted), or schedule-free's
#: alpha_0 = 0, alpha_t = t^p from t = 1 (x_1 = w_1).
WEIGHTS = ("slowcal", "schedule_free")
#: The second moment: Adam's exponential average (bias-corrected) or AdaGrad's sum.
SECOND_MOMENTS = ("adam", "adagrad")
#: The options one optimizer has for all its parameter groups (they decide what its state holds).
_OPTIMIZER_WIDE = ("beta", "weights", "second_moment")


class AdaptiveSlowcal(Optimizer):
    r"""Implements anytime averaging of an iterate stepped with Adam- or AdaGrad-normalised gradients.

    Contract: the model's parameters hold the query point :math:`y_t = \beta x_t + (1 - \beta) w_t`:
    gradients are taken there. With ``beta = 1`` (the default, SLowcal's query point) :math:`y_t = x_t`
    and the parameters are the output, as with :class:`~lit_slowcal.SlowcalSGD`; with ``beta < 1`` the
    output :math:`x_t` is ``state["x"]``: call :meth:`swap_output` to evaluate or save it (and again to
    swap back). The state holds the iterate :math:`w_t` (``state["w"]``, :math:`x_0` before the first
    step), the second moment :math:`v_t` (``state["v"]``, zeros before it), the step count :math:`t`
    (``state["step"]``, a Python int) and :math:`\alpha_{0:t}` (``state["alpha_sum"]`` plus
    ``state["alpha_sum_error"]``, a compensated float64 sum); all of it travels in ``state_dict()``.

    .. math::
       \begin{aligned}
            &\rule{110mm}{0.4pt}                                                                 \\
            &\textbf{input}      : \eta \text{ (lr)}, \: x_0 \text{ (params)}, \: f(x)
                \text{ (objective)}, \: \beta, \: \beta_2, \: \epsilon, \: p \text{ (weight\_power)},
                \: \lambda \text{ (weight decay)}                                                \\
            &\textbf{initialize} : w_0 \leftarrow x_0, \: y_0 \leftarrow x_0, \: v_0 \leftarrow 0,
                \: \alpha_t := (t+1)^p \text{ (slowcal) or } \alpha_0 := 0, \alpha_t := t^p
                \text{ (schedule\_free)}                                                         \\[-1.ex]
            &\rule{110mm}{0.4pt}                                                                 \\
            &\textbf{for} \: t=0 \: \textbf{to} \: \ldots \: \textbf{do}                         \\
            &\hspace{5mm}g_t \leftarrow \nabla f_t(y_t)                                          \\
            &\hspace{5mm}\textbf{if} \: \textit{adam}: \: v_{t+1} \leftarrow \beta_2 v_t
                + (1 - \beta_2) g_t^2, \: \hat{v}_{t+1} \leftarrow v_{t+1} / (1 - \beta_2^{t+1}) \\
            &\hspace{5mm}\textbf{else} \: (\textit{adagrad}): \: v_{t+1} \leftarrow v_t + g_t^2,
                \: \hat{v}_{t+1} \leftarrow v_{t+1}                                              \\
            &\hspace{5mm}d_t \leftarrow g_t / (\sqrt{\hat{v}_{t+1}} + \epsilon) + \lambda y_t    \\
            &\hspace{5mm}w_{t+1} \leftarrow w_t - \eta \, d_t                                    \\
            &\hspace{5mm}c_{t+1} \leftarrow \alpha_{t+1} / \alpha_{0:t+1}                        \\
            &\hspace{5mm}x_{t+1} \leftarrow (1 - c_{t+1}) \, x_t + c_{t+1} \, w_{t+1}           \\
            &\hspace{5mm}y_{t+1} \leftarrow \beta \, x_{t+1} + (1 - \beta) \, w_{t+1}           \\[-1.ex]
            &\rule{110mm}{0.4pt}                                                                 \\[-1.ex]
            &\bf{return} \: x_t                                                                  \\[-1.ex]
            &\rule{110mm}{0.4pt}                                                                 \\[-1.ex]
       \end{aligned}

    On one machine, with ``weights="schedule_free"``, ``second_moment="adam"`` and a constant ``lr``, this
    is schedule-free AdamW (``AdamWScheduleFree``) with ``betas=(beta, beta2)``, ``r = weight_power``,
    ``warmup_steps=0`` and any ``weight_lr_power`` (at a constant rate its weights' factor
    :math:`\eta^{\text{power}}` cancels in :math:`c_{t+1}`); its weight decay is this one's :math:`\lambda`
    (taken at :math:`y_t`). ``weights="slowcal"`` is SlowcalSGD's average (:math:`x_0` has weight 1, so
    :math:`c_{t+1} = 2 / (t + 3)` at p = 1 where schedule-free has :math:`2 / (t + 2)`).

    Synchronisation (the averager's protocol): every operation is elementwise, so parameters with a
    leading machine dimension (``SimulatedMachines``) run their machines independently. A
    synchronisation averages the parameters and ``averaged_state``: :math:`w`, and :math:`x` where it is
    not the parameters (``beta < 1``; ``post_sync`` then sets :math:`y = \beta \bar{x} + (1 - \beta) \bar{w}`,
    the average of the machines' :math:`y`). The second moment :math:`v` stays per machine unless
    ``average_second_moment``. The step clock :math:`t` (weights and bias correction) runs on across a
    synchronisation: every machine has taken the same steps, as in Algorithm 2.

    Parameters without a gradient are skipped and their :math:`t` does not advance.

    Args:
        params (iterable): iterable of parameters or named_parameters to optimize or iterable of
            dicts defining parameter groups.
        lr (float): learning rate :math:`\eta` (>= 0).
        beta (float, optional): :math:`\beta` in [0, 1], where the gradient is taken between x (1,
            SLowcal's query point) and w (0) (default: 1.0). One value for all groups.
        beta2 (float, optional): :math:`\beta_2` in [0, 1), the second moment's decay (Adam only)
            (default: 0.999).
        eps (float, optional): :math:`\epsilon` (> 0) added to the denominator (default: 1e-8).
        weight_power (float, optional): :math:`p` of the weights (default: 1.0).
        weights (str, optional): ``"slowcal"`` or ``"schedule_free"`` (see above) (default: "slowcal").
            One value for all groups.
        second_moment (str, optional): ``"adam"`` or ``"adagrad"`` (default: "adam"). One value for all groups.
        weight_decay (float, optional): :math:`\lambda`, added to the normalised step at :math:`y_t` as in
            schedule-free AdamW (default: 0).
        average_second_moment (bool, optional): a synchronisation averages :math:`v` too (default: False).
        foreach (bool, optional): use the multi-tensor (torch._foreach) implementation; by default
            it is used for plain tensors on CPU and CUDA (default: None).

    Example:
        >>> # xdoctest: +SKIP
        >>> optimizer = AdaptiveSlowcal(model.parameters(), lr=1e-3)
        >>> optimizer.zero_grad()
        >>> loss_fn(model(input), target).backward()
        >>> optimizer.step()
        >>> evaluate(model)  # beta = 1: the parameters are x_t, the model to report
    """

    #: Per-parameter state tensors averaged with the parameters (set by the constructor): ``w``, ``x``
    #: where ``beta < 1`` and ``v`` with ``average_second_moment``.
    averaged_state: tuple[str, ...]
    #: The second moment is never negative: a coded round lands it at ``max(anchor + mean change, 0)``.
    nonnegative_state: tuple[str, ...] = ("v",)

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        *,
        beta: float = 1.0,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_power: float = 1.0,
        weights: Literal["slowcal", "schedule_free"] = "slowcal",
        second_moment: Literal["adam", "adagrad"] = "adam",
        weight_decay: float = 0.0,
        average_second_moment: bool = False,
        foreach: bool | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "beta": beta,
            "beta2": beta2,
            "eps": eps,
            "weight_power": weight_power,
            "weights": weights,
            "second_moment": second_moment,
            "weight_decay": weight_decay,
            "foreach": foreach,
        }
        _check(defaults)
        if not isinstance(average_second_moment, bool):
            raise ValueError(f"Invalid average_second_moment: {average_second_moment!r} (True or False)")
        super().__init__(params, defaults)
        self.average_second_moment = average_second_moment
        self.averaged_state = ("w", *(("x",) if beta < 1 else ()), *(("v",) if average_second_moment else ()))
        # The optimizer protocol: with beta = 1 the parameters are x and a synchronisation needs no hook (so
        # overlapped rounds and an outer optimizer work); with beta < 1 post_sync rebuilds y from the averages.
        self.post_sync: Optional[Callable[[], None]] = self._query_point_of_averages if beta < 1 else None
        self.supports_outer_optimizer = beta == 1

    def add_param_group(self, param_group: dict) -> None:
        # Check the group's overrides before torch fills in the defaults and stores the group.
        options = {key: param_group.get(key, value) for key, value in self.defaults.items()}
        _check(options)
        for key in _OPTIMIZER_WIDE:
            if options[key] != self.defaults[key]:
                raise ValueError(
                    f"Invalid {key}: {options[key]!r} in a parameter group (one value for the whole optimizer: "
                    f"{self.defaults[key]!r}; it decides what the state holds)"
                )
        super().add_param_group(param_group)

    def _init_group(self, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdaptiveSlowcal does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = 0  # t; a Python int: exact, and load_state_dict never casts it
                state["w"] = p.clone(memory_format=torch.preserve_format)  # w_0 = x_0
                state["v"] = torch.zeros_like(p, memory_format=torch.preserve_format)  # v_0 = 0
                if group["beta"] < 1:
                    state["x"] = p.clone(memory_format=torch.preserve_format)  # x_0; the parameters hold y
                # alpha_{0:t} = alpha_sum + alpha_sum_error (a compensated sum, exact to float64)
                state["alpha_sum"] = 1.0 if group["weights"] == "slowcal" else 0.0  # alpha_0
                state["alpha_sum_error"] = 0.0
            params.append(p)
            grads.append(p.grad)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one step: update v and w, then x, then the query point y in the parameters.

        Args:
            closure (Callable, optional): A closure that reevaluates the model and returns the loss.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            self._init_group(group, params, grads)

            buckets = _buckets(self, params)
            offset = 1 if group["weights"] == "slowcal" else 0
            for (t, alpha_sum, alpha_sum_error), indices in buckets.items():
                c, alpha_sum, alpha_sum_error = _averaging_weight(
                    t, alpha_sum, alpha_sum_error, group["weight_power"], offset
                )
                bucket = [params[i] for i in indices]
                states = [self.state[p] for p in bucket]
                adaptive_slowcal(
                    bucket,
                    [grads[i] for i in indices],
                    [s["w"] for s in states],
                    [s["v"] for s in states],
                    [s["x"] for s in states] if group["beta"] < 1 else None,
                    lr=group["lr"],
                    c=c,
                    beta=group["beta"],
                    beta2=group["beta2"],
                    eps=group["eps"],
                    bias_correction=1.0 - group["beta2"] ** (t + 1) if group["second_moment"] == "adam" else None,
                    weight_decay=group["weight_decay"],
                    foreach=group["foreach"],
                )
                for s in states:
                    s["step"] = t + 1
                    s["alpha_sum"] = alpha_sum
                    s["alpha_sum_error"] = alpha_sum_error

        return loss

    def _stepped(self) -> list[tuple[Tensor, dict]]:
        return [(p, self.state[p]) for g in self.param_groups for p in g["params"] if "x" in self.state.get(p, {})]

    @torch.no_grad()
    def _query_point_of_averages(self) -> None:
        """After a synchronisation averaged x and w (``beta < 1``): the query point of the averages,
        :math:`y = \\beta \\bar{x} + (1 - \\beta) \\bar{w}`, in the parameters."""
        beta = self.defaults["beta"]
        for p, state in self._stepped():
            p.copy_(state["x"]).lerp_(state["w"], 1.0 - beta)

    @torch.no_grad()
    def swap_output(self) -> None:
        """Exchange the parameters (the query point y) and the output x in place; call again to undo.
        Nothing to do with ``beta = 1``, where the parameters are x."""
        for p, state in self._stepped():
            tmp = p.clone()
            p.copy_(state["x"])
            state["x"].copy_(tmp)


def adaptive_slowcal(
    params: list[Tensor],
    grads: list[Tensor],
    ws: list[Tensor],
    vs: list[Tensor],
    xs: list[Tensor] | None,
    *,
    lr: float,
    c: float,
    beta: float,
    beta2: float,
    eps: float,
    bias_correction: float | None,
    weight_decay: float,
    foreach: bool | None = None,
) -> None:
    r"""Functional API: one step of :class:`AdaptiveSlowcal` on tensors that share the step count.

    ``params`` hold :math:`y_t` and become :math:`y_{t+1}`; ``ws``, ``vs`` and ``xs`` hold :math:`w_t`,
    :math:`v_t` and :math:`x_t` and become their successors (``xs`` is ``None`` when ``beta = 1``: the
    parameters are x). ``c`` is :math:`c_{t+1}`; ``bias_correction`` is :math:`1 - \beta_2^{t+1}` for
    Adam's second moment, ``None`` for AdaGrad's.
    """
    if (xs is None) != (beta == 1):
        raise ValueError(
            f"Invalid xs: {'None' if xs is None else 'given'} with beta {beta} (None exactly when beta = 1)"
        )
    if foreach is None:
        foreach = _default_to_foreach(params)
    func = _multi_tensor_adaptive_slowcal if foreach else _single_tensor_adaptive_slowcal
    func(
        params, grads, ws, vs, xs, lr=lr, c=c, beta=beta, beta2=beta2, eps=eps, bias_correction=bias_correction,
        weight_decay=weight_decay,
    )  # fmt: skip


def _single_tensor_adaptive_slowcal(
    params: list[Tensor],
    grads: list[Tensor],
    ws: list[Tensor],
    vs: list[Tensor],
    xs: list[Tensor] | None,
    *,
    lr: float,
    c: float,
    beta: float,
    beta2: float,
    eps: float,
    bias_correction: float | None,
    weight_decay: float,
) -> None:
    for i, (y, grad, w, v) in enumerate(zip(params, grads, ws, vs, strict=True)):
        if bias_correction is not None:
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  # v_{t+1} = beta2 v_t + (1 - beta2) g_t^2
            denom = v.div(bias_correction).sqrt_().add_(eps)  # sqrt(v_{t+1} / (1 - beta2^{t+1})) + eps
        else:
            v.addcmul_(grad, grad)  # v_{t+1} = v_t + g_t^2
            denom = v.sqrt().add_(eps)
        d = grad.div(denom)
        if weight_decay != 0:
            d.add_(y, alpha=weight_decay)  # d_t = g_t / denom + lambda y_t
        w.add_(d, alpha=-lr)  # w_{t+1} = w_t - eta d_t
        x = y if xs is None else xs[i]
        x.lerp_(w, c)  # x_{t+1} = (1 - c_{t+1}) x_t + c_{t+1} w_{t+1}
        if xs is not None:
            y.copy_(x).lerp_(w, 1.0 - beta)  # y_{t+1} = beta x_{t+1} + (1 - beta) w_{t+1}


def _multi_tensor_adaptive_slowcal(
    params: list[Tensor],
    grads: list[Tensor],
    ws: list[Tensor],
    vs: list[Tensor],
    xs: list[Tensor] | None,
    *,
    lr: float,
    c: float,
    beta: float,
    beta2: float,
    eps: float,
    bias_correction: float | None,
    weight_decay: float,
) -> None:
    if not params:
        return
    tensors = [params, grads, ws, vs] + ([xs] if xs is not None else [])
    grouped = Optimizer._group_tensors_by_device_and_dtype(tensors)
    for found, _ in grouped.values():
        device_tensors = cast(list[list[Tensor]], found)  # every list holds tensors: none was None
        device_ys, device_grads, device_ws, device_vs = device_tensors[:4]
        if bias_correction is not None:
            torch._foreach_mul_(device_vs, beta2)
            torch._foreach_addcmul_(device_vs, device_grads, device_grads, value=1 - beta2)
            denom = list(torch._foreach_div(device_vs, bias_correction))
            torch._foreach_sqrt_(denom)
        else:
            torch._foreach_addcmul_(device_vs, device_grads, device_grads)
            denom = list(torch._foreach_sqrt(device_vs))
        torch._foreach_add_(denom, eps)
        d = list(torch._foreach_div(device_grads, denom))
        if weight_decay != 0:
            torch._foreach_add_(d, device_ys, alpha=weight_decay)
        torch._foreach_add_(device_ws, d, alpha=-lr)
        device_xs = device_ys if xs is None else device_tensors[4]
        torch._foreach_lerp_(device_xs, device_ws, c)
        if xs is not None:
            torch._foreach_copy_(device_ys, device_xs)
            torch._foreach_lerp_(device_ys, device_ws, 1.0 - beta)


def _check(options: dict) -> None:
    _check_options({**options, "gamma": None})  # lr, weight_power and weight_decay as SlowcalSGD checks them
    beta = options["beta"]
    if not (isinstance(beta, (int, float)) and 0 <= beta <= 1):
        raise ValueError(f"Invalid beta: {beta!r} (must be in [0, 1]; 1 is SLowcal's query point x)")
    beta2 = options["beta2"]
    if not (isinstance(beta2, (int, float)) and 0 <= beta2 < 1):
        raise ValueError(f"Invalid beta2: {beta2!r} (must be in [0, 1))")
    eps = options["eps"]
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"Invalid eps: {eps!r} (must be a finite number > 0)")
    if options["weights"] not in WEIGHTS:
        raise ValueError(f"Invalid weights: {options['weights']!r} (allowed: {', '.join(WEIGHTS)})")
    if options["second_moment"] not in SECOND_MOMENTS:
        raise ValueError(f"Invalid second_moment: {options['second_moment']!r} (allowed: {', '.join(SECOND_MOMENTS)})")
