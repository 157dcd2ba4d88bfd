"""Checkpointing: files that are either whole or absent, and a last.ckpt every few rounds."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

__all__ = ["AtomicCheckpointIO", "LastCheckpoint"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves survive a kill at any moment.

    The checkpoint is written to a hidden temporary file next to its target, flushed to disk, and
    renamed over the target (``os.replace`` is atomic on POSIX and Windows). A job killed while
    saving leaves the previous checkpoint intact and at most a stray ``.*.tmp`` file. Local paths
    only; remote (fsspec) paths fall back to the parent's direct write.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        target = Path(path)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)


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
