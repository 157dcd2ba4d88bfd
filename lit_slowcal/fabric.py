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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from torch import nn

from lit_slowcal._validation import check_int
from lit_slowcal.averaging import PeriodicAverager, broadcast_module

__all__ = ["PeriodicAveragingFabricStrategy"]


class PeriodicAveragingFabricStrategy(DDPStrategy):
    """Fabric strategy: local steps on every process, averaged every ``sync_every`` optimizer steps.

    Args:
        sync_every: K, optimizer steps between synchronisations (>= 1).
        average_state: extra optimizer state keys to average (``PeriodicAverager``).
        bucket_cap_mb: largest flattened buffer of one all-reduce.
        **kwargs: passed to Fabric's ``DDPStrategy`` (``process_group_backend``, ``timeout``, ...).
    """

    def __init__(
        self, sync_every: int = 1, average_state: Sequence[str] = (), bucket_cap_mb: float = 25.0, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.sync_every = check_int("sync_every", sync_every)
        self.average_state = tuple(average_state)
        self.bucket_cap_mb = bucket_cap_mb
        self.modules: list[nn.Module] = []
        self.averagers: dict[int, PeriodicAverager] = {}  # id(optimizer) -> its averager

    def setup_module(self, module: nn.Module) -> nn.Module:
        """The module itself (no DDP wrapper), with rank 0's parameters and buffers on every process."""
        broadcast_module(module, src=0)
        self.modules.append(module)
        return module

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        averager = self.averagers.get(id(optimizer))
        if averager is None:
            averager = self.averagers[id(optimizer)] = PeriodicAverager(
                self.modules, optimizer, self.sync_every, average_state=self.average_state,
                bucket_cap_mb=self.bucket_cap_mb,
            )  # fmt: skip
        averager.step()
        return output

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "periodic_averaging",
            cls,
            description="Local updates averaged every K steps (parameters and optimizer state)",
            override=True,
        )


PeriodicAveragingFabricStrategy.register_strategies(STRATEGY_REGISTRY)
