r"""SLowcal-SGD's per-machine update (Anytime SGD) as a torch optimizer.

Dahan & Levy, "SLowcal-SGD: Slow Query Points Improve Local-SGD for Stochastic Convex Optimization",
NeurIPS 2024, Algorithm 2 and Section "Anytime GD". Only the local update lives here; averaging
across machines belongs to the strategy, which averages the parameters (x) and the state named in
:attr:`SlowcalSGD.averaged_state` (w).
"""

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

__all__ = ["SlowcalSGD", "slowcal_sgd"]

# Devices whose tensors take the multi-tensor path by default. torch enables foreach only on
# accelerators, but it pays on CPU too: there the _foreach_* ops run the per-tensor kernels in a
# C++ loop, which saves the Python loop: faster on many small tensors, a tie on large ones
# (benchmarks/bench_optimizer.py). On CUDA one launch serves many tensors.
_FOREACH_DEVICE_TYPES = ("cpu", "cuda", "xpu")


class SlowcalSGD(Optimizer):
    r"""Implements SLowcal-SGD's local update (Anytime SGD with weights alpha_t = (t+1)^p).

    Contract: the model's parameters hold the query point :math:`x_t`: gradients are taken there,
    and the trained model is :math:`x_T`, the paper's output, so evaluate and save the model as
    it is (there is no swap before evaluation). The optimizer state holds the iterate :math:`w_t`
    (``state["w"]``, equal to :math:`x_0` before the first step) and the step count :math:`t`
    (``state["step"]``, a Python int), with :math:`\alpha_{0:t}` in ``state["alpha_sum"]`` plus
    ``state["alpha_sum_error"]``; all of it travels in ``state_dict()``. On one machine :math:`x_t`
    is exactly the :math:`\alpha`-weighted average of :math:`w_0, \dots, w_t`.

    .. math::
       \begin{aligned}
            &\rule{110mm}{0.4pt}                                                                 \\
            &\textbf{input}      : \eta \text{ (lr)}, \: x_0 \text{ (params)}, \: f(x)
                \text{ (objective)}, \: p \text{ (weight\_power)}, \: \lambda \text{ (weight decay)},
                \: \gamma \text{ (gamma)}                                                        \\
            &\textbf{initialize} : w_0 \leftarrow x_0, \: \alpha_t := (t+1)^p,
                \: \alpha_{0:t} := \textstyle\sum_{\tau=0}^{t} \alpha_\tau                       \\[-1.ex]
            &\rule{110mm}{0.4pt}                                                                 \\
            &\textbf{for} \: t=0 \: \textbf{to} \: \ldots \: \textbf{do}                         \\
            &\hspace{5mm}g_t \leftarrow \nabla f_t(x_t) + \lambda x_t                            \\
            &\hspace{5mm}\textbf{if} \: \textit{scale\_lr\_by\_weight}                           \\
            &\hspace{10mm}\eta_t \leftarrow \eta \, \alpha_t                                     \\
            &\hspace{5mm}\textbf{else}                                                           \\
            &\hspace{10mm}\eta_t \leftarrow \eta                                                 \\
            &\hspace{5mm}w_{t+1} \leftarrow w_t - \eta_t g_t                                     \\
            &\hspace{5mm}\textbf{if} \: \gamma \: \textbf{is None}                               \\
            &\hspace{10mm}c_{t+1} \leftarrow \alpha_{t+1} / \alpha_{0:t+1}                       \\
            &\hspace{5mm}\textbf{else}                                                           \\
            &\hspace{10mm}c_{t+1} \leftarrow \gamma                                              \\
            &\hspace{5mm}x_{t+1} \leftarrow (1 - c_{t+1}) \, x_t + c_{t+1} \, w_{t+1}           \\[-1.ex]
            &\rule{110mm}{0.4pt}                                                                 \\[-1.ex]
            &\bf{return} \: x_t                                                                  \\[-1.ex]
            &\rule{110mm}{0.4pt}                                                                 \\[-1.ex]
       \end{aligned}

    Two learning-rate modes. ``scale_lr_by_weight=True`` is Algorithm 2 exactly:
    :math:`w_{t+1} = w_t - \eta \alpha_t g_t`, so ``lr`` is the paper's :math:`\eta` and the
    effective step grows like :math:`t^p`. The default ``False`` follows the authors' code, used for
    the paper's experiments: :math:`w_{t+1} = w_t - \eta g_t`, with the weights acting only in the
    average. ``gamma`` replaces the weights in the average by a fixed interpolation
    :math:`x_{t+1} = \gamma w_{t+1} + (1 - \gamma) x_t`.

    Parameters without a gradient are skipped and their :math:`t` does not advance. The running
    sum :math:`\alpha_{0:t}` is kept per parameter in float64 with compensated summation, so
    :math:`c_{t+1}` stays exact to float64 precision at any :math:`t` and :math:`p \ge 0`.

    Args:
        params (iterable): iterable of parameters or named_parameters to optimize or iterable of
            dicts defining parameter groups.
        lr (float): learning rate :math:`\eta` (>= 0).
        weight_power (float, optional): :math:`p` in :math:`\alpha_t = (t+1)^p`; 1 gives the
            paper's linear weights, 0 uniform weights (default: 1.0).
        scale_lr_by_weight (bool, optional): step :math:`w` by :math:`\eta \alpha_t` as in
            Algorithm 2 instead of :math:`\eta` as in the authors' code (default: False).
        gamma (float, optional): if set, a fixed interpolation weight in (0, 1] for the
            average instead of :math:`\alpha_{t+1} / \alpha_{0:t+1}` (default: None).
        weight_decay (float, optional): L2 penalty :math:`\lambda`, added to the gradient at
            :math:`x_t` as in :class:`torch.optim.SGD` (default: 0).
        foreach (bool, optional): use the multi-tensor (torch._foreach) implementation; by default
            it is used for plain tensors on CPU and CUDA, where it is the faster one (default: None).

    Example:
        >>> # xdoctest: +SKIP
        >>> optimizer = SlowcalSGD(model.parameters(), lr=0.01, weight_power=1.0)
        >>> optimizer.zero_grad()
        >>> loss_fn(model(input), target).backward()
        >>> optimizer.step()
        >>> evaluate(model)  # the parameters are x_t, the model to report
    """

    #: Per-parameter state tensors that, with the parameters (x), make up the iterate: a
    #: synchronisation step averages these across machines too (Algorithm 2, aggregation).
    averaged_state: tuple[str, ...] = ("w",)

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        *,
        weight_power: float = 1.0,
        scale_lr_by_weight: bool = False,
        gamma: float | None = None,
        weight_decay: float = 0.0,
        foreach: bool | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_power": weight_power,
            "scale_lr_by_weight": scale_lr_by_weight,
            "gamma": gamma,
            "weight_decay": weight_decay,
            "foreach": foreach,
        }
        _check_options(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        # Check the group's overrides before torch fills in the defaults and stores the group.
        _check_options({key: param_group.get(key, value) for key, value in self.defaults.items()})
        super().add_param_group(param_group)

    def _init_group(self, group: dict, params: list[Tensor], grads: list[Tensor]) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("SlowcalSGD does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = 0  # t; a Python int: exact, and load_state_dict never casts it
                state["w"] = p.clone(memory_format=torch.preserve_format)  # w_0 = x_0
                # alpha_{0:t} = alpha_sum + alpha_sum_error (a compensated sum, exact to float64)
                state["alpha_sum"] = 1.0  # alpha_{0:0} = alpha_0 = 1^p
                state["alpha_sum_error"] = 0.0
            params.append(p)
            grads.append(p.grad)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one step: update w, then move the parameters x towards it.

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
            power = group["weight_power"]
            for (t, alpha_sum, alpha_sum_error), indices in buckets.items():
                c, alpha_sum, alpha_sum_error = _averaging_weight(t, alpha_sum, alpha_sum_error, power)
                eta = group["lr"] * (t + 1.0) ** power if group["scale_lr_by_weight"] else group["lr"]
                largest = min(torch.finfo(params[i].dtype).max for i in indices)
                if not eta <= largest:  # torch would fail converting it, or step to inf
                    raise OverflowError(
                        f"SlowcalSGD: the step size lr (t+1)^p = {eta:.3g} at step t = {t} (scale_lr_by_weight, "
                        f"weight_power p = {power}) exceeds the parameters' largest value {largest:.3g}; use a smaller "
                        "weight_power or lr"
                    )
                if group["gamma"] is not None:
                    c = group["gamma"]
                bucket = [params[i] for i in indices]
                slowcal_sgd(
                    bucket,
                    [grads[i] for i in indices],
                    [self.state[p]["w"] for p in bucket],
                    eta=eta,
                    c=c,
                    weight_decay=group["weight_decay"],
                    foreach=group["foreach"],
                )
                for p in bucket:
                    state = self.state[p]
                    state["step"] = t + 1
                    state["alpha_sum"] = alpha_sum
                    state["alpha_sum_error"] = alpha_sum_error

        return loss


def slowcal_sgd(
    params: list[Tensor],
    grads: list[Tensor],
    ws: list[Tensor],
    *,
    eta: float,
    c: float,
    weight_decay: float,
    foreach: bool | None = None,
) -> None:
    r"""Functional API: one SLowcal-SGD step on tensors that share the step sizes.

    ``params`` hold :math:`x_t` and become :math:`x_{t+1}`, ``ws`` hold :math:`w_t` and become
    :math:`w_{t+1}`; ``eta`` is :math:`\eta_t` and ``c`` is :math:`c_{t+1}`. See
    :class:`SlowcalSGD` for the algorithm.
    """
    if foreach is None:
        foreach = _default_to_foreach(params)
    func = _multi_tensor_slowcal_sgd if foreach else _single_tensor_slowcal_sgd
    func(params, grads, ws, eta=eta, c=c, weight_decay=weight_decay)


def _single_tensor_slowcal_sgd(
    params: list[Tensor],
    grads: list[Tensor],
    ws: list[Tensor],
    *,
    eta: float,
    c: float,
    weight_decay: float,
) -> None:
    for x, grad, w in zip(params, grads, ws, strict=True):
        if weight_decay != 0:
            grad = grad.add(x, alpha=weight_decay)  # g_t = grad + lambda x_t
        w.add_(grad, alpha=-eta)  # w_{t+1} = w_t - eta_t g_t
        x.lerp_(w, c)  # x_{t+1} = (1 - c_{t+1}) x_t + c_{t+1} w_{t+1}


def _multi_tensor_slowcal_sgd(
    params: list[Tensor],
    grads: list[Tensor],
    ws: list[Tensor],
    *,
    eta: float,
    c: float,
    weight_decay: float,
) -> None:
    if not params:
        return
    grouped = Optimizer._group_tensors_by_device_and_dtype([params, grads, ws])
    for (device_params, device_grads, device_ws), _ in grouped.values():
        if weight_decay != 0:
            device_grads = torch._foreach_add(device_grads, device_params, alpha=weight_decay)
        torch._foreach_add_(device_ws, device_grads, alpha=-eta)
        torch._foreach_lerp_(device_params, device_ws, c)


def _buckets(optimizer: Optimizer, params: list[Tensor]) -> dict[tuple[int, float, float], list[int]]:
    """The indices of ``params`` by their state's step count and running sum: parameters that skipped steps
    (no gradient) have a smaller t, hence other step sizes and another c_{t+1}."""
    buckets: dict[tuple[int, float, float], list[int]] = {}
    for i, p in enumerate(params):
        state = optimizer.state[p]
        buckets.setdefault((state["step"], state["alpha_sum"], state["alpha_sum_error"]), []).append(i)
    return buckets


def _default_to_foreach(params: list[Tensor]) -> bool:
    return all(type(p) in (Tensor, torch.nn.Parameter) and p.device.type in _FOREACH_DEVICE_TYPES for p in params)


def _averaging_weight(
    step: int, alpha_sum: float, alpha_sum_error: float, weight_power: float, offset: int = 1
) -> tuple[float, float, float]:
    r"""Return :math:`c_{t+1} = \alpha_{t+1} / \alpha_{0:t+1}` and the running sum :math:`\alpha_{0:t+1}`.

    ``step`` is :math:`t` and ``alpha_sum + alpha_sum_error`` is :math:`\alpha_{0:t}`, with
    :math:`\alpha_t = (t+1)^p` (``offset`` 1; ``offset`` 0: :math:`\alpha_t = t^p` from t = 1, the
    schedule-free weights, the caller starting the sum at 0). A plain float running sum drifts (1e-12 relative after 10^6 steps
    with p = 2); Neumaier's compensated sum keeps the rounding error of every addition in
    ``alpha_sum_error`` so the total stays exact to float64 precision at any t. All in float64.
    """
    try:
        alpha_next = float(step + 1 + offset) ** weight_power  # alpha_{t+1} = (t + 1 + offset)^p
    except OverflowError:
        alpha_next = math.inf
    total = alpha_sum + alpha_next
    if not math.isfinite(total):  # the weights of a long run at a large p: c would be 0 or NaN without a word
        raise OverflowError(
            f"SlowcalSGD: the averaging weight alpha_t = (t+1)^p or its running sum overflows float64 at step "
            f"t = {step + 1} with weight_power p = {weight_power}; a run of T steps needs (T+1)^p and its sum below "
            f"1.8e308 (p * ln(T+1) under about 709): use a smaller weight_power"
        )
    if alpha_sum >= alpha_next:
        alpha_sum_error += (alpha_sum - total) + alpha_next
    else:
        alpha_sum_error += (alpha_next - total) + alpha_sum
    return alpha_next / (total + alpha_sum_error), total, alpha_sum_error


#: weight_power must stay below this: alpha_1 = 2^p is float64's largest power of two below it.
_MAX_WEIGHT_POWER = 1024


def _check_options(options: dict) -> None:
    lr = options["lr"]
    if isinstance(lr, bool) or not isinstance(lr, (int, float, torch.Tensor)) or not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"Invalid lr: {lr!r} (must be a finite number >= 0)")
    weight_power = options["weight_power"]
    if not (math.isfinite(weight_power) and 0 <= weight_power < _MAX_WEIGHT_POWER):
        # alpha_1 = 2^p, the weight of the first step's average, overflows float64 from p = 1024.
        raise ValueError(
            f"Invalid weight_power: {weight_power} (must be finite, >= 0 and < {_MAX_WEIGHT_POWER}: the first "
            f"step's weight 2^p overflows float64 beyond; a run of T steps needs (T+1)^p and its sum finite too)"
        )
    gamma = options["gamma"]
    if gamma is not None and not 0 < gamma <= 1:
        raise ValueError(f"Invalid gamma: {gamma} (must be in (0, 1] or None)")
    weight_decay = options["weight_decay"]
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"Invalid weight_decay: {weight_decay} (must be finite and >= 0)")
