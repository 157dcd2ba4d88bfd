"""A last.ckpt every few rounds and when training ends (the files themselves are written atomically
by the core's ``AtomicCheckpointIO``)."""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

__all__ = ["LastCheckpoint"]


class LastCheckpoint(ModelCheckpoint):
    """Keeps ``last.ckpt`` only: every ``every_n_train_steps`` optimizer steps and when training ends.

    A run killed at any moment resumes from the newest of these (``--ckpt_path last``); the one
    written at the end holds the trained model for ``validate``/``test``.
    """

    def __init__(self, every_n_train_steps: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(save_top_k=0, save_last=True, every_n_train_steps=every_n_train_steps, **kwargs)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if trainer.global_step != self._last_global_step_saved:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
