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

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional, Union

from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from torch import Tensor, nn
from torch.optim import Optimizer

from lit_slowcal._averagers import CHECKPOINT_KEY, AveragerSet
from lit_slowcal.averaging import broadcast_module
from lit_slowcal.compression import Compressor

__all__ = ["PeriodicAveragingFabricStrategy"]


class PeriodicAveragingFabricStrategy(AveragerSet, DDPStrategy):
    """Fabric strategy: local steps on every process, averaged every ``sync_every`` optimizer steps.

    Args:
        sync_every: K, optimizer steps between synchronisations (>= 1).
        average_state: extra optimizer state keys to average (``PeriodicAverager``).
        bucket_cap_mb: largest flattened buffer of one all-reduce.
        outer_optimizer, participation, participation_seed: the server's side of a round
            (``PeriodicAverager``).
        compression, error_feedback: how a machine's round change travels (``lit_slowcal.compression``).
        overlap_delay, fragments: overlapped rounds (``PeriodicAverager``).
        bucket_views: the averaged tensors become views of flat buffers, all-reduced where they lie
            (``PeriodicAverager``).
        **kwargs: passed to Fabric's ``DDPStrategy`` (``process_group_backend``, ``timeout``, ...).
    """

    def __init__(
        self,
        sync_every: int = 1,
        average_state: Sequence[str] = (),
        bucket_cap_mb: float = 25.0,
        outer_optimizer: Optional[Callable[[Iterable[Tensor]], Optimizer]] = None,
        participation: Optional[Union[int, float]] = None,
        participation_seed: int = 0,
        compression: Union[None, str, Compressor] = None,
        error_feedback: Optional[bool] = None,
        overlap_delay: int = 0,
        fragments: int = 1,
        bucket_views: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._init_averagers(
            sync_every, average_state, bucket_cap_mb, outer_optimizer, participation, participation_seed,
            compression, error_feedback,
            overlap_delay, fragments, bucket_views,
        )  # fmt: skip
        self.modules: list[nn.Module] = []
        self.optimizers: list[Optimizer] = []  # in set-up order
        self._restored: Optional[list[dict[str, Any]]] = None  # schedules loaded before the first step

    def setup_module(self, module: nn.Module) -> nn.Module:
        """The module itself (no DDP wrapper), with rank 0's parameters and buffers on every process."""
        broadcast_module(module, src=0)
        self.modules.append(module)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self.optimizers.append(optimizer)
        return super().setup_optimizer(optimizer)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if id(optimizer) not in self.averagers:  # before the first step: the round starts at the set-up weights
            self._create_averagers()
            if id(optimizer) not in self.averagers:  # not set up through fabric.setup
                self.averagers[id(optimizer)] = self._new_averager(self.modules, optimizer)
        output = super().optimizer_step(optimizer, **kwargs)
        self.averagers[id(optimizer)].step()
        return output

    def _create_averagers(self) -> None:
        """An averager for every optimizer set up so far, each schedule restored from a loaded state."""
        if self.optimizers:
            self._add_averagers(nn.ModuleList(self.modules), self.modules, self.optimizers, self._restored)
            self._restored = None

    def save_checkpoint(self, path: Any, state: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        # Every rank calls fabric.save: the round closes everywhere, and the file holds the average.
        self.close_rounds()
        self._create_averagers()
        schedules = self._schedules(self.optimizers)
        if schedules is not None:
            state = {**state, CHECKPOINT_KEY: schedules}
        super().save_checkpoint(path, state, *args, **kwargs)

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
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "periodic_averaging",
            cls,
            description="Local updates averaged every K steps (parameters and optimizer state)",
            override=True,
        )


PeriodicAveragingFabricStrategy.register_strategies(STRATEGY_REGISTRY)
