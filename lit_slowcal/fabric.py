"""Fabric with periodic averaging: ``Fabric(strategy="periodic_averaging")``.

Fabric's ``DDPStrategy`` without the ``DistributedDataParallel`` wrapper: ``fabric.setup(model,
optimizer)`` gives every process rank 0's weights and leaves gradients local, and every
``optimizer.step()`` goes through a ``PeriodicAverager`` that averages the machines every
``sync_every`` steps. Nothing else of the training loop changes::

    fabric = Fabric(accelerator="cpu", devices=2, strategy=PeriodicAveragingFabricStrategy(sync_every=16))
    fabric.launch()
    model, optimizer = fabric.setup(model, SlowcalSGD(model.parameters(), lr=0.01))
    for x, y in loader:
        optimizer.zero_grad()
        fabric.backward(loss_fn(model(x), y))
        optimizer.step()  # averaged over all processes after every 16th step
    fabric.strategy.close_rounds()  # the end of training (and before evaluating mid-round)

Round boundaries as with the Trainer (docs/library.md): ``fabric.save`` closes the round first
(every rank saves the averaged model) and saves every optimizer's schedule with it, which
``fabric.load`` restores; before evaluating or returning the model mid-round, call
``fabric.strategy.close_rounds()``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lit_slowcal._averagers import CHECKPOINT_KEY, AveragerSet
from lit_slowcal._option_access import refuse_unknown
from lit_slowcal.averaging import broadcast_module
from lit_slowcal.options import AveragingOptions, option_keywords

__all__ = ["PeriodicAveragingFabricStrategy"]


class PeriodicAveragingFabricStrategy(AveragerSet, DDPStrategy):
    """Fabric strategy: local steps on every process, averaged every ``sync_every`` optimizer steps.

    Args:
        sync_every: K, optimizer steps between synchronisations (>= 1; ``None``: ``options``'s, 1 by default).
        options: every synchronisation option (``lit_slowcal.options.AveragingOptions``), or each by name
            (``compression="int8"``); a bad value or combination is refused here, in one line.
        **kwargs: the options by name; the rest passed to Fabric's ``DDPStrategy`` (``process_group_backend``,
            ``timeout``, ...).
    """

    @option_keywords
    def __init__(
        self, sync_every: Optional[int] = None, *, options: Optional[AveragingOptions] = None, **kwargs: Any
    ) -> None:
        averaging = AveragingOptions.build(options, sync_every, **AveragingOptions.take(kwargs))
        refuse_unknown(type(self).__name__, kwargs, DDPStrategy.__init__, DistributedDataParallel.__init__)
        super().__init__(**kwargs)
        self._init_averagers(averaging)
        self.modules: list[nn.Module] = []
        self.optimizers: list[Optimizer] = []  # in set-up order
        self._restored: Optional[list[dict[str, Any]]] = None  # schedules loaded before the first step

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """The module itself (no DDP wrapper), with rank 0's parameters and buffers on every process."""
        broadcast_module(module, src=0)
        self.modules.append(module)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self.optimizers.append(optimizer)
        return super().setup_optimizer(optimizer)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if id(optimizer) not in self.averagers:  # before the first step: the round starts at the set-up weights
            self._create_averagers(anchor=True)
            if id(optimizer) not in self.averagers:  # not set up through fabric.setup
                self.averagers[id(optimizer)] = self._new_averager(self.modules, optimizer)
                self.averagers[id(optimizer)].check_setup()
        output = super().optimizer_step(optimizer, **kwargs)
        self.averagers[id(optimizer)].step()
        return output

    def _create_averagers(self, anchor: bool = False) -> None:
        """An averager for every optimizer set up so far, each schedule restored from a loaded state; ``anchor``:
        before the first step, where every machine holds the set-up broadcast's values (``PeriodicAverager.anchor``)."""
        if self.optimizers:
            added = self._add_averagers(nn.ModuleList(self.modules), self.modules, self.optimizers, self._restored)
            self._restored = None
            for averager in added:  # every rank built alike, before the first step (a collective: all ranks are here)
                averager.check_setup()
                if anchor:
                    averager.anchor()

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        # Every rank calls fabric.save: the round closes everywhere, and the file holds the average.
        self.close_rounds()
        self._create_averagers()
        schedules = self._schedules(self.optimizers)
        if schedules is not None:
            state = {**state, CHECKPOINT_KEY: schedules}
        super().save_checkpoint(path, state, *args, **kwargs)

    @override
    def load_checkpoint(
        self, path: Any, state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state, *args, **kwargs)
        schedules = remainder.pop(CHECKPOINT_KEY, None) if isinstance(remainder, dict) else None
        if schedules is not None:
            self._drop_averagers()
            self._restored = schedules
            self._create_averagers()
        return remainder

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "periodic_averaging",
            cls,
            description="Local updates averaged every K steps (parameters and optimizer state)",
            override=True,
        )


PeriodicAveragingFabricStrategy.register_strategies(STRATEGY_REGISTRY)
