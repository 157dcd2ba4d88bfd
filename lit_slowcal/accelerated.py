r"""Accelerated Minibatch-SGD: the AC-SA method of Lan (2012) as a torch optimizer.

G. Lan, "An optimal method for stochastic composite optimization", Math. Program. 133 (2012),
Section 3 (the AC-SA algorithm) with the step sizes of its Corollary 1 (Euclidean setting, no
composite term); also Ghadimi & Lan, SIAM J. Optim. 22 (2012), Section 3. In the paper's Table 1
this is "Accelerated Minibatch-SGD" (Dekel et al. 2012; Lan 2012): the parameter server runs AC-SA
on the minibatch gradient averaged over the M machines, one step per round on K * b samples per
machine.

Every update is linear in the gradient, so when all machines start a step from the same state,
averaging the machines' new state equals one AC-SA step on the averaged gradient. The optimizer
speaks the averager's protocol (``lit_slowcal.averaging``): it communicates one vector per machine
and round (the new x, d floats, as Minibatch-SGD sends its new parameters) and rebuilds the rest
of its state from the average in ``post_sync``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from lit_slowcal._elementwise import ElementwiseOptimizer
from lit_slowcal._validation import check_int, check_number

__all__ = ["AcceleratedSGD"]


class AcceleratedSGD(ElementwiseOptimizer):
    r"""AC-SA (Lan 2012) with the step sizes of its Corollary 1: gradients at the middle point.

    With :math:`s = 1, 2, \dots` the step count and :math:`x_1 = x^{ag}_1 = x_0` (the initial
    parameters), step :math:`s` is

    .. math::
       \begin{aligned}
            &\beta_s = \tfrac{s+1}{2}, \qquad \gamma_s = \tfrac{s+1}{2}\,\gamma                  \\
            &x^{md}_s = \beta_s^{-1} x_s + (1 - \beta_s^{-1})\, x^{ag}_s                         \\
            &g_s = \nabla f(x^{md}_s) + \lambda x^{md}_s                                          \\
            &x_{s+1} = x_s - \gamma_s g_s                                                         \\
            &x^{ag}_{s+1} = \beta_s^{-1} x_{s+1} + (1 - \beta_s^{-1})\, x^{ag}_s
       \end{aligned}

    Corollary 1 takes :math:`\gamma = \min\{1/(2L),\ \sqrt{6}\,D / (\sigma (N+1)^{3/2})\}` for a
    horizon of N steps (L the smoothness constant, sigma the gradient noise, D the distance to a
    minimiser). Two ways to set :math:`\gamma`:

    * ``horizon=None`` (default): ``lr`` is :math:`\gamma`, a tuned constant like every other
      method's learning rate, whatever the horizon;
    * ``horizon=N`` (Lan's horizon-aware step): ``lr`` is the constant c and
      :math:`\gamma = \min\{\gamma_{max},\ c\,(N+1)^{-3/2}\}`, :math:`\gamma_{max}` = ``max_lr``
      (Lan's 1/(2L); none by default). One tuned c then serves runs of any length, as the
      corollary's :math:`\sqrt{6} D / \sigma` does.

    The condition of Lan's Theorem 2, :math:`L\gamma_s \le \beta_s / 2`, holds at every s when
    :math:`\gamma \le 1/(2L)`: the growing step is matched by the growing averaging weight.

    Contract: the parameters hold the query point :math:`x^{md}_s` (gradients are taken there); the
    state holds :math:`x_s` (``state["x"]``), :math:`x^{ag}_s` (``state["x_ag"]``, the method's
    output) and the steps taken (``state["step"]``, a Python int); all of it travels in
    ``state_dict()``. To evaluate or export the output :math:`x^{ag}`, call :meth:`swap_output`
    (and again to swap back), or read ``state["x_ag"]``.

    Synchronisation (the averager's protocol): a synchronisation must follow every step (sync
    period 1, the minibatch method); ``pre_sync`` puts each machine's :math:`x_{s+1}` in the
    parameters, the averager averages them (d floats per machine), and ``post_sync`` rebuilds
    :math:`x^{ag}_{s+1}` and :math:`x^{md}_{s+1}` from the average, which equals one AC-SA step on the
    machines' averaged gradient. Every operation is elementwise, so parameters with a leading
    machine dimension (``SimulatedMachines``) run their machines independently.

    Args:
        params: iterable of parameters or named_parameters, or of dicts defining parameter groups.
        lr (float): :math:`\gamma` (> 0); with ``horizon``, the constant c of :math:`c\,(N+1)^{-3/2}`.
        weight_decay (float, optional): L2 penalty :math:`\lambda` added to the gradient (default: 0).
        horizon (int, optional): N, the steps the run will take (>= 1): Lan's horizon-aware step
            (default: None, ``lr`` is :math:`\gamma`).
        max_lr (float, optional): :math:`\gamma_{max}` (> 0), the cap of the horizon-aware step
            (default: None, no cap); only with ``horizon``.

    Example:
        >>> optimizer = AcceleratedSGD(model.parameters(), lr=1000.0, horizon=235)  # gamma = 1000 / 236**1.5
    """

    #: Nothing besides the parameters is averaged: pre_sync places x in them (d floats a machine).
    averaged_state: tuple[str, ...] = ()

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        *,
        weight_decay: float = 0.0,
        horizon: Optional[int] = None,
        max_lr: Optional[float] = None,
    ) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "horizon": horizon, "max_lr": max_lr})

    @staticmethod
    def _check(options: dict) -> None:
        check_number("lr", options["lr"])
        check_number("weight_decay", options["weight_decay"], strict=False)
        if options["horizon"] is not None:
            check_int("horizon", options["horizon"])
        if options["max_lr"] is not None:
            check_number("max_lr", options["max_lr"])
            if options["horizon"] is None:
                raise ValueError(
                    f"Invalid max_lr: {options['max_lr']!r} without horizon (it caps the horizon-aware step "
                    "min{max_lr, lr (N+1)^-3/2}; give horizon=N, or leave max_lr unset)"
                )

    @staticmethod
    def step_size(group: dict[str, Any]) -> float:
        r""":math:`\gamma` of a parameter group: ``lr``, or :math:`\min\{\gamma_{max}, c\,(N+1)^{-3/2}\}` with a horizon."""
        horizon = group.get("horizon")  # absent from the groups of a state saved before the option existed
        if horizon is None:
            return group["lr"]
        gamma = group["lr"] / (horizon + 1) ** 1.5
        max_lr = group.get("max_lr")
        return gamma if max_lr is None else min(max_lr, gamma)

    def _init_state(self, p: Tensor, state: dict) -> None:
        state["step"] = 0  # steps taken; the next is s = step + 1
        state["round_steps"] = 0  # steps since the last synchronisation
        state["x"] = p.clone(memory_format=torch.preserve_format)  # x_1 = x_0
        state["x_ag"] = p.clone(memory_format=torch.preserve_format)  # x^ag_1 = x_0

    def _update(self, p: Tensor, grad: Tensor, state: dict, group: dict) -> None:
        """One AC-SA step from the gradient at the parameters (the middle point)."""
        s = state["step"] + 1
        if group["weight_decay"] != 0:
            grad = grad.add(p, alpha=group["weight_decay"])
        x, x_ag = state["x"], state["x_ag"]
        x.add_(grad, alpha=-self.step_size(group) * (s + 1) / 2)  # x_{s+1} = x_s - gamma_s g_s
        x_ag.lerp_(x, 2.0 / (s + 1))  # x^ag_{s+1} = beta_s^-1 x_{s+1} + (1 - beta_s^-1) x^ag_s
        p.copy_(x_ag).lerp_(x, 2.0 / (s + 2))  # x^md_{s+1}
        state["step"] = s
        state["round_steps"] += 1

    @torch.no_grad()
    def pre_sync(self) -> None:
        """Put each machine's x_{s+1} in the parameters: the vector the round sends."""
        for p, state, _ in self._stepped():
            if state["round_steps"] > 1:
                raise ValueError(
                    f"AcceleratedSGD took {state['round_steps']} steps between synchronisations; it is the "
                    "minibatch method and needs one after every step (sync_every=1)"
                )
            if state["round_steps"] == 1:
                p.copy_(state["x"])

    @torch.no_grad()
    def post_sync(self) -> None:
        """Rebuild x, x^ag and the next middle point from the averaged x_{s+1}."""
        for p, state, _ in self._stepped():
            if state["round_steps"] == 0:
                continue
            s = state["step"]
            x, x_ag = state["x"], state["x_ag"]
            # x^ag_{s+1} was computed from this machine's x_{s+1}; the average moves it by beta_s^-1 (xbar - x).
            x_ag.add_(torch.sub(p, x, out=self._scratch(p)), alpha=2.0 / (s + 1))
            x.copy_(p)
            p.copy_(x_ag).lerp_(x, 2.0 / (s + 2))
            state["round_steps"] = 0

    @torch.no_grad()
    def swap_output(self) -> None:
        """Exchange the parameters (the query point x^md) and the output x^ag in place; call again to undo."""
        for p, state, _ in self._stepped():
            tmp = p.clone()
            p.copy_(state["x_ag"])
            state["x_ag"].copy_(tmp)
