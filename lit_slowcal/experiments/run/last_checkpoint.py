"""A last.ckpt every few rounds and when training ends (the files themselves are written atomically
by the core's ``AtomicCheckpointIO``)."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lit_slowcal.experiments._lightning import last_saved_step, save_last_checkpoint

__all__ = ["LastCheckpoint"]


class LastCheckpoint(ModelCheckpoint):
    """Keeps ``last.ckpt`` only: every ``every_n_train_steps`` optimizer steps and when training ends.

    A run killed at any moment resumes from the newest of these (``--ckpt_path last``); the one
    written at the end holds the trained model for ``validate``/``test``.
    """

    def __init__(self, every_n_train_steps: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(save_top_k=0, save_last=True, every_n_train_steps=every_n_train_steps, **kwargs)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Lightning 2.6 warns at every save under manual optimization that the checkpoint holds the
        # state after the optimizer step. That is the state wanted here: a round's checkpoint holds
        # the model, optimizer and data position after the round, which is what an exact resume needs.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if 0 <= trainer.max_steps <= trainer.global_step and trainer.global_step != last_saved_step(self):
                # The round that reaches max_steps ends training, often mid-epoch: written now, as the round's
                # own checkpoint. Written at on_train_end instead, it would record the epoch as completed (the
                # fit loop counts it done when max_steps stops it), and the resume would skip its other rounds.
                save_last_checkpoint(self, trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning 2.6's ModelCheckpoint.on_train_end writes last.ckpt only when none was written
        # during the run (earlier versions not at all); a run whose last steps came after the last
        # every_n_train_steps save needs one more, or validate/test would load a stale model.
        super().on_train_end(trainer, pl_module)
        if trainer.global_step != last_saved_step(self):
            save_last_checkpoint(self, trainer)
