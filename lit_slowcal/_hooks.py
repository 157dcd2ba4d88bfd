"""The hooks an averager sets on a training loop: one call per ``optimizer.step()``, and a count of backward passes.

Both attach to the optimizer and its parameters alone, so they work the same in a plain torch
loop, under Fabric and under the ``Trainer``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

__all__ = ["after_every_step", "on_every_backward"]


def after_every_step(optimizer: Optimizer, fn: Callable[[], Any]) -> list[RemovableHandle]:
    """Call ``fn()`` after every ``optimizer.step()``; returns the handles that remove the hooks.

    An optimizer subclass whose ``step`` calls ``super().step()`` runs torch's step hooks at both
    levels; a pre-hook/post-hook pair counts nesting so that one ``optimizer.step()`` is one call.
    """
    depth = [0]

    def pre(*_: Any) -> None:
        depth[0] += 1

    def post(*_: Any) -> None:
        depth[0] -= 1
        if depth[0] == 0:
            fn()

    return [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]


def on_every_backward(optimizer: Optimizer, fn: Callable[[Tensor], Any]) -> Optional[RemovableHandle]:
    """Call ``fn(grad)`` once per backward pass through the model: a gradient hook on the optimizer's
    first parameter that requires a gradient (``None`` when there is none)."""
    first = next((p for g in optimizer.param_groups for p in g["params"] if p.requires_grad), None)
    return None if first is None else first.register_post_accumulate_grad_hook(fn)
