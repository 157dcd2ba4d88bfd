"""The shared frame of the core's elementwise optimizers (``AcceleratedSGD``, ``Scaffold``).

Validation of the options (at construction and for added groups), the closure, the per-parameter
loop over parameters with a gradient, lazy state, and the walk over the parameters that have
state for the synchronisation hooks. A subclass gives ``_check``, ``_init_state`` and ``_update``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

__all__ = ["ElementwiseOptimizer"]


class ElementwiseOptimizer(Optimizer):
    """An optimizer that updates each parameter on its own from its gradient, group and state."""

    def __init__(self, params: ParamsT, defaults: dict) -> None:
        self._check(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        # Check the group's overrides before torch fills in the defaults and stores the group.
        self._check({key: param_group.get(key, value) for key, value in self.defaults.items()})
        super().add_param_group(param_group)

    @staticmethod
    def _check(options: dict) -> None:
        """Raise ``ValueError`` (one line naming the option) for a bad option value."""

    def _init_state(self, p: Tensor, state: dict) -> None:
        """Fill the state of ``p`` before its first update."""
        raise NotImplementedError

    def _update(self, p: Tensor, grad: Tensor, state: dict, group: dict) -> None:
        """One update of ``p`` from its gradient (under ``torch.no_grad``)."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step of every parameter that has a gradient (``closure``: reevaluates the model, returns the loss)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                self._update(p, p.grad, state, group)
        return loss

    def _scratch(self, p: Tensor) -> Tensor:
        """A buffer of ``p``'s shape kept between steps for an intermediate result (allocating a tensor of
        stacked machines afresh every step costs more than the arithmetic on it). Not state: not checkpointed."""
        buffers = self.__dict__.setdefault("_scratch_buffers", {})
        key = (p.shape, p.dtype, p.device)
        if key not in buffers:
            buffers[key] = torch.empty_like(p, memory_format=torch.contiguous_format)
        return buffers[key]

    def _stepped(self) -> Iterator[tuple[Tensor, dict, dict]]:
        """(parameter, its state, its group) for every parameter stepped at least once."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if state:
                    yield p, state, group
