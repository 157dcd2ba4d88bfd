"""The hooks an averager sets on a training loop: one call per ``optimizer.step()``, and a count of backward passes.

Both attach to the optimizer and its parameters alone, so they work the same in a plain torch
loop, under Fabric and under the ``Trainer``. ``LoopHooks`` is ``PeriodicAverager``'s part that
attaches it (``attach``, ``detach``, a context manager), counts backward passes and runs the sync
pre-hooks' registry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import Self

__all__ = ["LoopHooks", "after_every_step", "on_every_backward"]


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


class LoopHooks:
    """Attaching an averager to a loop: ``step()`` after every ``optimizer.step()``, the backward passes
    counted, the optimizer's reload hook, the sync pre-hooks (mixed into ``PeriodicAverager``)."""

    optimizer: Optimizer
    backward_passes: int
    _hooks: list[RemovableHandle]
    _backward_hook: Optional[RemovableHandle]
    _reload_hook: Optional[RemovableHandle]
    _sync_pre_hooks: OrderedDict[int, Callable[[Any], None]]

    if TYPE_CHECKING:  # what the averager gives its parts

        def step(self) -> bool: ...

    def attach(self) -> Self:
        """Call ``step()`` after every ``optimizer.step()`` (optimizer step hooks). Returns self.

        An optimizer subclass whose ``step`` calls ``super().step()`` runs torch's step hooks at both
        levels; a pre-hook/post-hook pair counts nesting so that one ``optimizer.step()`` is one step.
        """
        if not self._hooks:
            self._hooks = after_every_step(self.optimizer, self.step)
        return self

    def detach(self) -> None:
        """Stop counting ``optimizer.step()`` calls (undo ``attach``)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def remove_hooks(self) -> None:
        """Detach, and remove the gradient hook that counts backward passes (the averager is done)."""
        self.detach()
        self._drop_reload_hook()
        if self._backward_hook is not None:
            self._backward_hook.remove()
            self._backward_hook = None

    def __enter__(self) -> Self:
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def register_sync_pre_hook(self, hook: Callable[[Any], None]) -> RemovableHandle:
        """Call ``hook(self)`` at the start of every ``sync()`` (and overlapped round), before ``optimizer.pre_sync()``.

        The machines then hold their parameters after the round's last local step. Returns a handle
        whose ``remove()`` unregisters the hook.
        """
        handle = RemovableHandle(self._sync_pre_hooks)
        self._sync_pre_hooks[handle.id] = hook
        return handle

    def _drop_reload_hook(self) -> None:
        if self._reload_hook is not None:
            self._reload_hook.remove()
            self._reload_hook = None

    def _count_backward(self, _: Tensor) -> None:
        self.backward_passes += 1
