"""Periodic averaging of parameters and optimizer state: Local-SGD and SLowcal-SGD on DDP ranks.

``PeriodicAveragingStrategy`` is a ``DDPStrategy`` without the gradient all-reduce. Each process
(and each simulated machine inside it, see ``SimulatedMachines``) steps its optimizer on its own
data; every ``sync_every`` optimizer steps the parameter server's aggregation of Algorithm 2 runs:
parameters, floating buffers and the optimizer's iterate state (``SlowcalSGD``'s w) are replaced by
their average over all M = world_size x m machines, in one all-reduce per synchronisation.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.overrides.distributed import _sync_module_states
import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.fabric.strategies import _StrategyRegistry
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lit_slowcal.checkpoint import AtomicCheckpointIO
from lit_slowcal.simulated import SimulatedMachines

__all__ = ["PeriodicAveragingStrategy"]

log = logging.getLogger(__name__)


class PeriodicAveragingStrategy(DDPStrategy):
    """Local updates on every machine, averaged over all machines every ``sync_every`` steps.

    With ``torch.optim.SGD`` this is Local-SGD; with ``SlowcalSGD`` it is SLowcal-SGD (Algorithm 2),
    averaging both the query point x (the parameters) and the iterate w (optimizer state); with
    ``sync_every=1`` and SGD it is Minibatch-SGD (averaging parameters after one SGD step from a
    common point equals one step on the averaged gradient).

    What is averaged at a synchronisation:

    * every parameter of the optimizer's param groups, and every floating-point buffer of the model;
    * the optimizer's per-parameter state tensors named by ``optimizer.averaged_state``
      (``("w",)`` for ``SlowcalSGD``) plus those named in ``average_state`` (e.g.
      ``["momentum_buffer"]`` for SGD with momentum, on request).

    Parameters of ``SimulatedMachines`` modules are averaged over their leading (machine) dimension
    and then over the processes, so M = world_size x m machines take part with equal weight.
    All tensors of one device and dtype are flattened into one buffer: one collective per
    synchronisation, none at all with a single process.

    Args:
        sync_every: K, the number of optimizer steps between synchronisations (>= 1).
        average_state: extra optimizer state keys to average besides ``optimizer.averaged_state``.
        **kwargs: passed to ``DDPStrategy`` (``process_group_backend``, ``timeout``, ``start_method``, ...).

    Example:
        >>> trainer = Trainer(strategy=PeriodicAveragingStrategy(sync_every=16), devices=2)  # doctest: +SKIP
        >>> trainer = Trainer(strategy="periodic_averaging", devices=2)  # K = 1 unless set  # doctest: +SKIP
    """

    strategy_name = "periodic_averaging"

    def __init__(self, sync_every: int = 1, average_state: Sequence[str] = (), **kwargs: Any) -> None:
        if kwargs.get("model_averaging_period") is not None or kwargs.get("ddp_comm_state") is not None:
            raise ValueError(
                "PeriodicAveragingStrategy does its own averaging; do not pass model_averaging_period or ddp_comm_state"
            )
        # Checkpoints are written to a temporary name and renamed: a kill never leaves half a file.
        kwargs["checkpoint_io"] = kwargs.get("checkpoint_io") or AtomicCheckpointIO()
        super().__init__(**kwargs)
        self.sync_every = sync_every
        self.average_state = tuple(average_state)
        self.num_syncs = 0
        self.floats_communicated = 0
        self._steps: dict[int, int] = {}

    @property
    def sync_every(self) -> int:
        return self._sync_every

    @sync_every.setter
    def sync_every(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Invalid sync_every: {value!r} (must be an integer >= 1)")
        self._sync_every = value

    @property
    def machines_per_rank(self) -> int:
        """m: machines hosted by this process (1 unless the model holds ``SimulatedMachines``)."""
        sims = [mod.num_machines for mod in self._modules_to_average() if isinstance(mod, SimulatedMachines)]
        if len(set(sims)) > 1:
            raise ValueError(f"All SimulatedMachines of a model must host the same number of machines, got {sims}")
        return sims[0] if sims else 1

    @property
    def num_machines(self) -> int:
        """M = world_size x m."""
        return self.world_size * self.machines_per_rank

    @override
    def configure_ddp(self) -> None:
        # No DistributedDataParallel wrapper: gradients stay local. Start every rank from rank 0's
        # weights (x_0 = w_0 identical on all machines); simulated machines are identical copies already.
        log.debug(f"{self.__class__.__name__}: broadcasting initial weights, no gradient synchronisation")
        if self.world_size > 1:
            _sync_module_states(self.lightning_module)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[pl.LightningModule, nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if id(inner) not in self._steps:
            self._resume_counters(inner)
        steps = self._steps[id(inner)] + 1
        self._steps[id(inner)] = steps
        if steps % self.sync_every == 0:
            self.synchronize(inner)
        return output

    def _resume_counters(self, optimizer: Optimizer) -> None:
        """Start counting from the trainer's step count, so a run resumed from a checkpoint keeps
        its sync schedule (and its sync and float counts)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        done = trainer.global_step if trainer is not None and len(self._steps) == 0 else 0
        self._steps[id(optimizer)] = done
        if done:
            self.num_syncs = done // self.sync_every
            tensors, stacked = self._tensors_to_average(optimizer)
            per_sync = sum(t[0].numel() if s else t.numel() for t, s in zip(tensors, stacked))
            self.floats_communicated = self.num_syncs * per_sync

    def synchronize(self, optimizer: Optimizer) -> None:
        """Replace parameters, floating buffers and iterate state by their average over all M machines."""
        tensors, stacked = self._tensors_to_average(optimizer)
        local = [t.mean(0) if s else t for t, s in zip(tensors, stacked)]
        self.floats_communicated += sum(t.numel() for t in local)
        averaged = self._all_reduce_mean(local)
        with torch.no_grad():
            for t, s, avg in zip(tensors, stacked, averaged):
                if s:
                    t.copy_(avg.unsqueeze(0).expand_as(t))
                elif avg is not t:
                    t.copy_(avg)
        self.num_syncs += 1

    def _modules_to_average(self) -> Iterable[nn.Module]:
        return self.lightning_module.modules() if self.lightning_module is not None else ()

    def _tensors_to_average(self, optimizer: Optimizer) -> tuple[list[Tensor], list[bool]]:
        """The floating tensors to average, and whether each has a leading machine dimension.

        A tensor is stacked when it belongs to a ``SimulatedMachines`` module, or is the optimizer
        state of such a parameter (elementwise state has the parameter's shape).
        """
        stacked_ids: set[int] = set()
        for module in self._modules_to_average():
            if isinstance(module, SimulatedMachines):
                stacked_ids.update(id(t) for t in (*module.parameters(), *module.buffers()))
        keys = tuple(getattr(optimizer, "averaged_state", ())) + self.average_state
        seen: set[int] = set()
        tensors: list[Tensor] = []
        stacked: list[bool] = []

        def add(t: Tensor, owner: Tensor) -> None:
            if id(t) not in seen and t.is_floating_point():
                seen.add(id(t))
                tensors.append(t)
                stacked.append(id(owner) in stacked_ids)

        for group in optimizer.param_groups:
            for p in group["params"]:
                add(p, p)
                state = optimizer.state.get(p, {})
                for key in keys:
                    if isinstance(state.get(key), Tensor):
                        add(state[key], p)
        for b in self.lightning_module.buffers():
            add(b, b)
        return tensors, stacked

    def _all_reduce_mean(self, tensors: list[Tensor]) -> list[Tensor]:
        if self.world_size == 1 or not dist.is_available() or not dist.is_initialized():
            return tensors
        buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, t in enumerate(tensors):
            buckets.setdefault((t.device, t.dtype), []).append(i)
        flats, works = [], []
        for idx in buckets.values():
            flat = torch.cat([tensors[i].reshape(-1) for i in idx])
            flats.append((idx, flat))
            works.append(dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True))
        for w in works:
            w.wait()
        out: list[Tensor] = list(tensors)
        for idx, flat in flats:
            flat.div_(self.world_size)
            offset = 0
            for i in idx:
                n = tensors[i].numel()
                out[i] = flat[offset : offset + n].view_as(tensors[i])
                offset += n
        return out

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in (("periodic_averaging", "popen"), ("periodic_averaging_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"Local updates averaged every K steps (parameters and optimizer state), '{start_method}'",
                start_method=start_method,
            )


PeriodicAveragingStrategy.register_strategies(StrategyRegistry)
