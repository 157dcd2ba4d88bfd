r"""SCAFFOLD (Karimireddy et al., ICML 2020) with full participation as a torch optimizer.

S. P. Karimireddy, S. Kale, M. Mohri, S. J. Reddi, S. U. Stich, A. T. Suresh, "SCAFFOLD: Stochastic
Controlled Averaging for Federated Learning", ICML 2020, Algorithm 1 with every client sampled
(S = N) and the control variates of option II. Only the local update and the control variates
live here; the average over machines is the averager's (``lit_slowcal.averaging``), through the
optimizer protocol: ``pre_sync`` computes each machine's new control variate and its change,
the averager averages the local models y and the changes, ``post_sync`` takes the server step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from lit_slowcal._elementwise import ElementwiseOptimizer
from lit_slowcal._validation import check_number

__all__ = ["Scaffold"]


class Scaffold(ElementwiseOptimizer):
    r"""SCAFFOLD's local steps and option-II control variates; the server step at each synchronisation.

    Machine i keeps its control variate :math:`c_i` (``state["c_local"]``, never averaged) and a copy
    of the server's :math:`c = \frac1M \sum_i c_i` (``state["c"]``) and of the round's start x
    (``state["x"]``). With the parameters holding the local model :math:`y_i`:

    .. math::
       \begin{aligned}
            &\textbf{local step:}\quad y_i \leftarrow y_i - \eta\,(g_i(y_i) + \lambda y_i - c_i + c)     \\
            &\textbf{round end (pre\_sync):}\quad c_i^+ = c_i - c + \tfrac{1}{K\eta}(x - y_i),
                \quad \Delta c_i = c_i^+ - c_i, \quad c_i \leftarrow c_i^+                            \\
            &\textbf{average:}\quad \bar y = \tfrac1M \textstyle\sum_i y_i,
                \quad \overline{\Delta c} = \tfrac1M \textstyle\sum_i \Delta c_i                      \\
            &\textbf{server (post\_sync):}\quad x \leftarrow x + \eta_g (\bar y - x),
                \quad c \leftarrow c + \overline{\Delta c}, \quad y_i \leftarrow x
       \end{aligned}

    K is the number of local steps the machine took since the last synchronisation (counted here);
    :math:`\eta` is ``lr`` and :math:`\eta_g` ``server_lr`` (1 by default, when x is the average of the
    local models). Each machine sends :math:`y_i` and :math:`\Delta c_i` per round, 2d floats, which is
    what the averager averages (``averaged_state = ("delta_c",)``) and counts. All of it, the control
    variates included, travels in ``state_dict()``: a resumed run continues exactly. The round's start
    x is taken from the parameters at the first step; machines that start from different points
    agree after the first synchronisation when ``server_lr`` is 1 (with another eta_g the first
    server step starts from each machine's own x_0). Every operation
    is elementwise, so parameters with a leading machine dimension (``SimulatedMachines``) keep one
    :math:`c_i` per machine.

    Args:
        params: iterable of parameters or named_parameters, or of dicts defining parameter groups.
        lr (float): the local step size :math:`\eta` (> 0).
        server_lr (float, optional): the server step size :math:`\eta_g` (> 0, default: 1).
        weight_decay (float, optional): L2 penalty :math:`\lambda` added to the gradient (default: 0).
    """

    #: The change of the control variate is averaged (and sent) with the local model y.
    averaged_state: tuple[str, ...] = ("delta_c",)
    #: Each machine's c_i changes at every synchronisation (pre_sync): a machine left out of a round
    #: would change it too, so partial participation is refused.
    supports_participation = False

    def __init__(self, params: ParamsT, lr: float, *, server_lr: float = 1.0, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "server_lr": server_lr, "weight_decay": weight_decay})

    @staticmethod
    def _check(options: dict) -> None:
        check_number("lr", options["lr"])
        check_number("server_lr", options["server_lr"])
        check_number("weight_decay", options["weight_decay"], strict=False)

    @property
    def outer_optimizer(self) -> Optional[Callable[[list[Tensor]], torch.optim.Optimizer]]:
        """The server step x <- x + eta_g (ybar - x) = x - eta_g (x - ybar): SGD at ``server_lr`` on the
        pseudo-gradient, run by the averager (``None`` at eta_g = 1: the plain average, exactly)."""
        rates = {group["server_lr"] for group in self.param_groups}
        if rates == {1.0}:
            return None
        if len(rates) > 1:
            raise ValueError(f"Invalid server_lr: {sorted(rates)} (one server_lr for all parameter groups)")
        (rate,) = rates
        return lambda params: torch.optim.SGD(params, lr=rate)

    def _init_state(self, p: Tensor, state: dict) -> None:
        state["round_steps"] = 0  # K of this round so far
        state["x"] = p.clone(memory_format=torch.preserve_format)  # the round's start
        state["c_local"] = torch.zeros_like(p, memory_format=torch.preserve_format)  # c_i
        state["c"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["delta_c"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _update(self, p: Tensor, grad: Tensor, state: dict, group: dict) -> None:
        """One local step: y <- y - lr (g + weight_decay y - c_i + c)."""
        # The same two roundings as ``grad - c_i + c``, into a buffer kept between steps.
        direction = torch.sub(grad, state["c_local"], out=self._scratch(p)).add_(state["c"])
        if group["weight_decay"] != 0:
            direction.add_(p, alpha=group["weight_decay"])
        p.add_(direction, alpha=-group["lr"])
        state["round_steps"] += 1

    @torch.no_grad()
    def pre_sync(self) -> None:
        """Each machine's new control variate c_i and its change delta_c (what the round sends with y)."""
        for p, state, group in self._stepped():
            delta = state["delta_c"]
            if state["round_steps"] == 0:
                delta.zero_()
                continue
            # delta_c = c_i^+ - c_i = (x - y_i) / (K lr) - c
            torch.sub(state["x"], p, out=delta).div_(state["round_steps"] * group["lr"]).sub_(state["c"])
            state["c_local"].add_(delta)

    @torch.no_grad()
    def post_sync(self) -> None:
        """After the server step (the average, or with eta_g != 1 the averager's outer SGD step, see
        ``outer_optimizer``): the parameters hold the new x, every machine's start of the next round;
        c takes the averaged delta_c."""
        for p, state, group in self._stepped():
            state["x"].copy_(p)
            state["c"].add_(state["delta_c"])
            state["round_steps"] = 0
