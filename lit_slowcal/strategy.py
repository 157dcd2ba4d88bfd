"""Lightning's ``Trainer`` with periodic averaging: ``Trainer(strategy="periodic_averaging")``.

``PeriodicAveragingStrategy`` is a ``DDPStrategy`` without the gradient all-reduce: each process
(and each simulated machine inside it, see ``SimulatedMachines``) steps its optimizer on its own
data, and a ``PeriodicAverager`` per optimizer averages the machines every ``sync_every`` optimizer
steps. The strategy only wires the averager in: all averaging logic lives in
``lit_slowcal.averaging``, shared with plain torch loops and Fabric.

Round boundaries (the library's contract, docs/library.md): the model Lightning evaluates, saves
and returns is one averaged model, the same on every machine. Before every validation during
``fit``, before every checkpoint and at the end of ``fit``, the strategy closes the round
(``PeriodicAverager.close_round``: a synchronisation when a step was taken since the last one);
the schedule goes on unchanged. Checkpoints hold every optimizer's schedule, so a resumed run
(on any number of processes) continues it exactly.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lit_slowcal._option_access import refuse_unknown
from lit_slowcal._trainer_rounds import TrainerRounds
from lit_slowcal.averaging import broadcast_module, machines_per_process
from lit_slowcal.checkpoint_io import AtomicCheckpointIO
from lit_slowcal.options import AveragingOptions, option_keywords

__all__ = ["PeriodicAveragingStrategy"]

log = logging.getLogger(__name__)

# The hooks Lightning calls around every backward and optimizer step (see _direct_steps).
_STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")


class PeriodicAveragingStrategy(TrainerRounds, DDPStrategy):
    """Local updates on every machine, averaged over all machines every ``sync_every`` steps.

    With ``torch.optim.SGD`` this is Local-SGD; with ``SlowcalSGD`` it is SLowcal-SGD (Algorithm 2),
    averaging both the query point x (the parameters) and the iterate w (optimizer state); with
    ``sync_every=1`` and SGD it is Minibatch-SGD (averaging parameters after one SGD step from a
    common point equals one step on the averaged gradient).

    What is averaged, and how it is communicated, is ``PeriodicAverager``'s: parameters, floating
    buffers and the optimizer state the optimizer declares (``averaged_state``), plus the keys in
    ``average_state``; ``SimulatedMachines`` are averaged over their machine dimension and the
    processes, so M = world_size x m machines take part with equal weight. Rank 0's weights are
    broadcast at setup, so all machines start from the same point.

    A fit in one process (``devices=1``, one node) sets up no ``torch.distributed`` process group:
    there is nobody to communicate with, the averager averages the simulated machines in place, and
    Lightning's barrier, broadcast and reduce are the identity without one. (``validate`` and
    ``test`` still set one up, as ``DDPStrategy`` syncs the module states through it there.)

    Under manual optimization with full precision, when neither the module nor any callback
    implements ``on_before_backward``, ``on_after_backward`` or ``on_before_optimizer_step`` and no
    profiler is set, ``manual_backward(loss)`` is ``loss.backward()`` and ``optimizer.step()`` is the
    torch optimizer's step: the strategy then calls them directly instead of dispatching the hooks
    that nobody implements (a tenth of a millisecond per step, as much as the step of a small model).

    Args:
        sync_every: K, the number of optimizer steps between synchronisations (>= 1; ``None``: ``options``'s,
            1 by default). It can also be set after construction (``trainer.strategy.sync_every = 16``).
        options: every synchronisation option (``lit_slowcal.options.AveragingOptions``); each option may
            also be given by name (``compression="int8"``, ``outer_optimizer=...``), replacing its field.
            A bad value or combination is refused here, in one line.
        **kwargs: the options by name; the rest passed to ``DDPStrategy`` (``process_group_backend``,
            ``timeout``, ``start_method``, ...).

    Example:
        >>> trainer = Trainer(strategy=PeriodicAveragingStrategy(sync_every=16), devices=2)  # doctest: +SKIP
        >>> trainer = Trainer(strategy="periodic_averaging", devices=2)  # K = 1 unless set  # doctest: +SKIP
    """

    strategy_name = "periodic_averaging"

    @option_keywords
    def __init__(
        self, sync_every: Optional[int] = None, *, options: Optional[AveragingOptions] = None, **kwargs: Any
    ) -> None:
        if kwargs.get("model_averaging_period") is not None or kwargs.get("ddp_comm_state") is not None:
            raise ValueError(
                "PeriodicAveragingStrategy does its own averaging; do not pass model_averaging_period or ddp_comm_state"
            )
        settings = AveragingOptions.take(kwargs)
        averaging = AveragingOptions.build(options, sync_every, **settings)  # one line, before anything
        refuse_unknown(type(self).__name__, kwargs, DDPStrategy.__init__, DistributedDataParallel.__init__)
        # Checkpoints are written to a temporary name and renamed: a kill never leaves half a file.
        kwargs["checkpoint_io"] = kwargs.get("checkpoint_io") or AtomicCheckpointIO()
        super().__init__(**kwargs)
        self._init_rounds(averaging)

    @property
    def machines_per_rank(self) -> int:
        """m: machines hosted by this process (1 unless the model holds ``SimulatedMachines``)."""
        return machines_per_process(self.lightning_module) if self.lightning_module is not None else 1

    @property
    def num_machines(self) -> int:
        """M = world_size x m."""
        return self.world_size * self.machines_per_rank

    @override
    def setup_distributed(self) -> None:
        # One process fitting: no process group (its set-up, and the gloo collectives that
        # torchmetrics and Lightning then run on every evaluation, cost time for nothing). What
        # DDPStrategy.setup_distributed does besides is kept: re-seeding and the world ranks.
        if self.num_nodes * self.num_processes == 1 and self._fitting():
            log.debug(f"{type(self).__name__}: one process, no process group")
            reset_seed()
            self.set_world_ranks()
            return
        # A one-process validate/test still gets a group (DDPStrategy syncs the module states through
        # it); it is destroyed at teardown, so that no group outlives the call in the user's process.
        self._own_group = self.num_nodes * self.num_processes == 1 and not (
            dist.is_available() and dist.is_initialized()
        )
        super().setup_distributed()

    @override
    def teardown(self) -> None:
        super().teardown()
        if getattr(self, "_own_group", False) and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self._own_group = False

    @override
    def configure_ddp(self) -> None:
        # No DistributedDataParallel wrapper: gradients stay local. Start every rank from rank 0's
        # weights (x_0 = w_0 identical on all machines); simulated machines are identical copies already.
        log.debug(f"{type(self).__name__}: broadcasting initial weights, no gradient synchronisation")
        if self.world_size > 1:
            broadcast_module(self.lightning_module, src=0)

    def _direct_steps(self) -> bool:
        """Whether Lightning's backward and optimizer step would do nothing but ``loss.backward()``
        and ``optimizer.step(closure)``: full precision (``Precision`` itself), manual optimization
        (no gradient clipping by Lightning), no profiler, the module not wrapped, and no hook of a
        backward or a step implemented by the module (``backward`` included) or a callback, nor a
        ``pre_backward``/``post_backward`` of a subclass."""
        module = self.lightning_module
        if module is None or module.automatic_optimization or self.model is not module:
            return False
        trainer = module.trainer
        if type(self.precision_plugin) is not Precision or not isinstance(trainer.profiler, PassThroughProfiler):
            return False
        if any(is_overridden(name, self, PeriodicAveragingStrategy) for name in ("pre_backward", "post_backward")):
            return False
        if any(is_overridden(hook, module, pl.LightningModule) for hook in (*_STEP_HOOKS, "backward")):
            return False
        return not any(is_overridden(hook, cb, Callback) for cb in trainer.callbacks for hook in _STEP_HOOKS)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        if not self._direct:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        closure_loss.backward(*args, **kwargs)
        return closure_loss.detach()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("periodic_averaging", "popen"), ("periodic_averaging_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"Local updates averaged every K steps (parameters and optimizer state), '{start_method}'",
                start_method=start_method,
                override=True,
            )


PeriodicAveragingStrategy.register_strategies(StrategyRegistry)


class periodic_averaging(PeriodicAveragingStrategy):  # noqa: N801 (the registered name, on purpose)
    """``PeriodicAveragingStrategy`` under its registered name, so that LightningCLI sets K by name.

    jsonargparse resolves ``--trainer.strategy=periodic_averaging --trainer.strategy.sync_every=8``
    (and ``class_path: periodic_averaging`` in YAML) to a class of that name; the name alone, with no
    argument after it, stays the registry's string (K = 1 unless set).
    """


class periodic_averaging_spawn(PeriodicAveragingStrategy):  # noqa: N801
    """``PeriodicAveragingStrategy`` starting its processes with ``spawn``, under its registered name."""

    @option_keywords
    def __init__(self, sync_every: Optional[int] = None, **kwargs: Any) -> None:
        kwargs.setdefault("start_method", "spawn")
        super().__init__(sync_every, **kwargs)
