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
    fabric.strategy.close_round()  # the end of training (and before evaluating mid-round)

Round boundaries as with the Trainer (docs/library.md): ``fabric.save`` closes the round first
(every rank saves the averaged model) and saves every optimizer's schedule with it, which
``fabric.load`` restores; before evaluating or returning the model mid-round, call
``fabric.strategy.close_round()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional, Union

from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from torch import Tensor, nn
from torch.optim import Optimizer

from lit_slowcal._validation import check_int
from lit_slowcal.averaging import PeriodicAverager, broadcast_module, buffer_owners

# The key of the saved state holding the averagers' schedules, one per optimizer in set-up order.
CHECKPOINT_KEY = "periodic_averaging"
_SKIP_ADVICE = "call optimizer.step() in every iteration on every rank (fabric's GradScaler skips are counted alike)"

__all__ = ["PeriodicAveragingFabricStrategy"]


class PeriodicAveragingFabricStrategy(DDPStrategy):
    """Fabric strategy: local steps on every process, averaged every ``sync_every`` optimizer steps.

    Args:
        sync_every: K, optimizer steps between synchronisations (>= 1).
        average_state: extra optimizer state keys to average (``PeriodicAverager``).
        bucket_cap_mb: largest flattened buffer of one all-reduce.
        outer_optimizer, participation, participation_seed: the server's side of a round
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
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.averagers: dict[int, PeriodicAverager] = {}  # id(optimizer) -> its averager
        self.sync_every = sync_every
        self.average_state = tuple(average_state)
        self.bucket_cap_mb = bucket_cap_mb
        # The server's side of a round (PeriodicAverager): an outer optimizer, partial participation.
        self.server_options = {"outer_optimizer": outer_optimizer, "participation": participation, "participation_seed": participation_seed}
        self.modules: list[nn.Module] = []
        self.optimizers: list[Optimizer] = []  # in set-up order
        self._restored: Optional[list[dict[str, int]]] = None  # schedules loaded before the first step

    @property
    def sync_every(self) -> int:
        return self._sync_every

    @sync_every.setter
    def sync_every(self, value: int) -> None:
        self._sync_every = check_int("sync_every", value)
        for averager in self.averagers.values():
            averager.sync_every = value

    @property
    def num_syncs(self) -> int:
        """Synchronisations so far (of the first optimizer)."""
        return next(iter(self.averagers.values())).num_syncs if self.averagers else 0

    @property
    def floats_communicated(self) -> int:
        """Floats one machine has sent so far (all optimizers' averagers)."""
        return sum(a.floats_communicated for a in self.averagers.values())

    def close_round(self) -> bool:
        """Synchronise every optimizer's machines now if a step was taken since their last synchronisation
        (``PeriodicAverager.close_round``); call it before evaluating or returning the model mid-round."""
        return any([averager.close_round() for averager in self.averagers.values()])

    def setup_module(self, module: nn.Module) -> nn.Module:
        """The module itself (no DDP wrapper), with rank 0's parameters and buffers on every process."""
        broadcast_module(module, src=0)
        self.modules.append(module)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self.optimizers.append(optimizer)
        return super().setup_optimizer(optimizer)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        averager = self.averagers.get(id(optimizer))
        if averager is None:  # before the first step: the round starts at the set-up weights
            self._create_averagers()
            averager = self.averagers.get(id(optimizer)) or self._averager(optimizer, None)
            self.averagers[id(optimizer)] = averager
        output = super().optimizer_step(optimizer, **kwargs)
        averager.step()
        return output

    def _averager(self, optimizer: Optimizer, buffers: Optional[list[Tensor]]) -> PeriodicAverager:
        averager = PeriodicAverager(
            self.modules, optimizer, self.sync_every, average_state=self.average_state,
            bucket_cap_mb=self.bucket_cap_mb, buffers=buffers, **self.server_options,
        )  # fmt: skip
        averager.skip_advice = _SKIP_ADVICE
        return averager

    def _create_averagers(self) -> None:
        """An averager for every optimizer set up so far (each buffer given to one of them), each
        schedule restored from a loaded state."""
        optimizers = [o for o in self.optimizers if id(o) not in self.averagers]
        if not optimizers:
            return
        owners = buffer_owners(nn.ModuleList(self.modules), self.optimizers) if len(self.optimizers) > 1 else None
        for i, optimizer in enumerate(self.optimizers):
            if id(optimizer) in self.averagers:
                continue
            averager = self.averagers[id(optimizer)] = self._averager(optimizer, owners[i] if owners else None)
            if self._restored is not None and i < len(self._restored):
                averager.load_state_dict(self._restored[i])
        self._restored = None

    def save_checkpoint(self, path: Any, state: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        # Every rank calls fabric.save: the round closes everywhere, and the file holds the average.
        self.close_round()
        self._create_averagers()
        if self.averagers:
            state = {**state, CHECKPOINT_KEY: [self.averagers[id(o)].state_dict() for o in self.optimizers if id(o) in self.averagers]}
        super().save_checkpoint(path, state, *args, **kwargs)

    def load_checkpoint(
        self, path: Any, state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state, *args, **kwargs)
        schedules = remainder.pop(CHECKPOINT_KEY, None) if isinstance(remainder, dict) else None
        if schedules is not None:
            for averager in self.averagers.values():
                averager.remove_hooks()
            self.averagers = {}
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
