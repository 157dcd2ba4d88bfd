"""What the Trainer strategies share: one averager per optimizer and the round boundaries of ``fit``.

``TrainerRounds`` is mixed into ``PeriodicAveragingStrategy`` (over ``DDPStrategy``) and
``ShardedAveragingStrategy`` (over ``ModelParallelStrategy``), before the Lightning strategy in the
bases, so that its hooks run and then hand on to Lightning's. It holds the library's contract for
the Trainer (docs/library.md): the model Lightning evaluates, saves and returns is one averaged
model, the same on every machine. Before every validation during ``fit``, before every checkpoint
(``lightning_module_state_dict``) and at the end of ``fit`` it closes the round
(``PeriodicAverager.close_round``); ``optimizer_step`` counts every step of every optimizer;
``setup`` builds and drops them (a combination the optimizer or model refuses is one line before the
sanity check), ``on_train_start`` builds the averagers, restores their schedules from the checkpoint being resumed
and checks that every rank built them alike; the first batch of every epoch checks that every rank
reads as many batches this epoch (one small all-gather an epoch: Lightning runs a collective of its own
every step, so ranks whose epochs end at other steps would hang); where some rank cannot know its count, every
batch checks instead that the ranks' data ends at the same batch. Where a checkpoint keeps the averagers' states is the
strategy's: ``_put_schedules`` and ``_take_schedules``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lit_slowcal._averagers import CHECKPOINT_KEY, AveragerSet
from lit_slowcal._collectives import gather_ints_on
from lit_slowcal.averaging import PeriodicAverager
from lit_slowcal.options import AveragingOptions

__all__ = ["TrainerRounds"]


class TrainerRounds(AveragerSet):
    """The round boundaries of a Trainer strategy (mixed in before the Lightning strategy)."""

    skip_advice = (
        "call optimizer.step() in every iteration on every rank (a GradScaler's skip under Lightning's "
        "precision plugins is counted alike; a step the LightningModule leaves out is not)"
    )

    def _init_rounds(self, options: AveragingOptions) -> None:
        """The averagers' options and the rounds' state."""
        self._init_averagers(options)
        self._direct = False  # optimizer.step() called without Lightning's dispatch (PeriodicAveragingStrategy)
        self._sync_pre_hooks: OrderedDict[int, Callable[[PeriodicAverager], None]] = OrderedDict()
        self._restored: Optional[list[dict[str, Any]]] = None  # the schedules of the checkpoint being resumed
        self._epoch_checked = -1  # the last epoch whose length the ranks compared
        self._ends_compared = False  # the ranks compare at every batch whether their data ended (lengths unknown)

    def _new_averager(
        self, modules: Any, optimizer: Optimizer, buffers: Optional[list[Tensor]] = None
    ) -> PeriodicAverager:
        averager = super()._new_averager(modules, optimizer, buffers)
        averager.register_sync_pre_hook(self._run_sync_pre_hooks)
        return averager

    def _torch_optimizers(self) -> list[Optimizer]:
        return [o.optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]  # type: ignore[attr-defined]

    def _create_averagers(self) -> None:
        """A fresh averager per optimizer for this fit, in Trainer order, each schedule restored from the
        checkpoint being resumed."""
        self._drop_averagers()
        optimizers = self._torch_optimizers()
        restored, self._restored = self._restored, None
        module = self.lightning_module  # type: ignore[attr-defined]
        self._add_averagers(module, module, optimizers, restored)
        global_step = module.trainer.global_step
        if restored is None and len(optimizers) == 1 and global_step > 0:
            # A checkpoint written before the schedules were saved: K-step rounds, one optimizer.
            self.averagers[id(optimizers[0])].resume(global_step)

    def register_sync_pre_hook(self, hook: Callable[[PeriodicAverager], None]) -> RemovableHandle:
        """``hook(averager)`` at the start of every synchronisation of every optimizer's averager,
        those created later included (see ``PeriodicAverager.register_sync_pre_hook``)."""
        handle = RemovableHandle(self._sync_pre_hooks)
        self._sync_pre_hooks[handle.id] = hook
        return handle

    def _run_sync_pre_hooks(self, averager: PeriodicAverager) -> None:
        for hook in tuple(self._sync_pre_hooks.values()):
            hook(averager)

    def _fitting(self) -> bool:
        module = self.lightning_module  # type: ignore[attr-defined]
        try:
            trainer = module.trainer if module is not None else None
        except RuntimeError:  # not attached to a Trainer
            return False
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING

    def _direct_steps(self) -> bool:
        """Whether ``optimizer_step`` may call the optimizer's step directly (see ``PeriodicAveragingStrategy``)."""
        return False

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # type: ignore[misc]
        if trainer.state.fn == TrainerFn.FITTING:
            # The rules that need the optimizer or the model (``AveragingOptions.check_with``, ``check_tensors``)
            # refuse here, before the sanity check and any step: averagers built and dropped (fit builds its own).
            module = self.lightning_module  # type: ignore[attr-defined]
            self._add_averagers(module, module, self._torch_optimizers())
            self._drop_averagers()

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        self._direct = self._direct_steps()
        self._epoch_checked = -1
        self._create_averagers()
        # Every rank built alike, checked now: Lightning runs a collective of its own every step (its
        # SIGTERM broadcast), so ranks whose first synchronisations fall on other steps would hang.
        for averager in self.averagers.values():
            averager.check_setup()
            averager.anchor()  # every machine holds the set-up broadcast's (or the checkpoint's) values: compressed from the first round

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        epoch = self.lightning_module.trainer.current_epoch  # type: ignore[attr-defined]
        if epoch != self._epoch_checked:  # the first batch of an epoch (of a resumed one too)
            self._epoch_checked = epoch
            self._check_epoch_length()
        if self._ends_compared:
            self._check_data_ends(batch_idx)
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]

    def _check_epoch_length(self) -> None:
        """Every rank reads as many batches this epoch (``trainer.num_training_batches``), or one ``RuntimeError``
        on every rank naming each rank's count: one all-gather of every process, before the epoch's first step.
        Where a rank cannot know its count (a loader without ``__len__``), the ranks compare instead, at every
        step of the epoch, whether their data has ended (``_check_data_ends``)."""
        self._ends_compared = False
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        batches = self.lightning_module.trainer.num_training_batches  # type: ignore[attr-defined]
        known = -1 if math.isinf(batches) else int(batches)
        everyone = [n for (n,) in gather_ints_on(self.root_device, [known], None)]  # type: ignore[attr-defined]
        if -1 in everyone:
            self._ends_compared = True
            return
        if len(set(everyone)) == 1:
            return
        counts = ", ".join(f"rank {r}: {n}" for r, n in enumerate(everyone))
        raise RuntimeError(
            f"{type(self).__name__}: the ranks read unequal numbers of training batches this epoch "
            f"(trainer.num_training_batches: {counts}); give every rank the same number each epoch (equal "
            "shards, drop_last=True, or limit_train_batches), or the ranks' rounds and Lightning's own "
            "collectives would pair different steps; nothing of this epoch was trained."
        )

    def _check_data_ends(self, batch_idx: int) -> None:
        """Every rank's data goes on past this batch, or ends with it on every rank; else one ``RuntimeError`` on
        every rank naming each rank's count, before this batch is trained: one all-gather of two int64 values a
        rank, every step of an epoch whose length some rank cannot know. Lightning's prefetch knows at each batch
        whether it is the last (``trainer.is_last_batch``); a rank whose data ended would otherwise leave
        the others in a collective it never joins."""
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        last = bool(trainer.is_last_batch)
        everyone = gather_ints_on(self.root_device, [batch_idx + 1, int(last)], None)  # type: ignore[attr-defined]
        ended = {bool(e) for _, e in everyone}
        if len(ended) == 1:
            return
        counts = ", ".join(f"rank {r}: {n}" if e else f"rank {r}: more than {n}" for r, (n, e) in enumerate(everyone))
        raise RuntimeError(
            f"{type(self).__name__}: the ranks' training data ended at different batches this epoch (a loader "
            f"without __len__; batches: {counts}); give every rank the same number each epoch (equal shards, "
            f"drop_last=True, or limit_train_batches), or the ranks' rounds and Lightning's own collectives would "
            f"pair different steps; the run stops before batch {batch_idx + 1} on every rank, the model not averaged."
        )

    def on_train_end(self) -> None:
        # fit returns one model: the machines' average, the same on every rank.
        self.close_rounds()
        for averager in self.averagers.values():
            averager.remove_hooks()  # kept for their counts, which the strategy reports after fit
        self._direct = False
        super().on_train_end()  # type: ignore[misc]

    def on_validation_start(self) -> None:
        # Validation during fit evaluates the averaged model, the same on every rank.
        self.close_rounds()
        super().on_validation_start()  # type: ignore[misc]

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # Every checkpoint holds the averaged model (Lightning calls this on every rank).
        self.close_rounds()
        return super().lightning_module_state_dict()  # type: ignore[misc]

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self._put_schedules(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]
        if self._fitting():
            self._restored = self._take_schedules(checkpoint, checkpoint_path)
        return checkpoint

    def _put_schedules(self, checkpoint: dict[str, Any]) -> None:
        """Put the averagers' states into ``checkpoint`` (called on every rank): every process's, gathered
        on rank 0 (``AveragerSet._schedules``)."""
        schedules = self._schedules(self._torch_optimizers())
        if schedules is not None:
            checkpoint[CHECKPOINT_KEY] = schedules

    def _take_schedules(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> Optional[list[dict[str, Any]]]:
        """The averagers' states of the checkpoint being resumed (``None``: none saved)."""
        return checkpoint.get(CHECKPOINT_KEY)

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[pl.LightningModule, nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        averager = self.averagers.get(id(inner))
        if averager is None:  # an optimizer stepped outside Lightning's fit (its round starts here)
            averager = self.averagers[id(inner)] = self._new_averager(self.lightning_module, inner)  # type: ignore[attr-defined]
        if self._direct:
            output = optimizer.step(closure=closure, **kwargs)
        else:
            output = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        averager.step()
        return output

    def synchronize(self, optimizer: Optimizer) -> None:
        """Average now (outside the schedule), for ``optimizer``'s parameters and state."""
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if id(inner) not in self.averagers:
            self.averagers[id(inner)] = self._new_averager(self.lightning_module, inner)  # type: ignore[attr-defined]
        self.averagers[id(inner)].sync()
