"""Checkpoints that are whole or absent, for Lightning's ``Trainer`` and Fabric."""

from __future__ import annotations

from typing import Any, Optional

from lightning.fabric.plugins import TorchCheckpointIO

from lit_slowcal.files import atomic_path

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves survive a kill at any moment.

    The checkpoint is written to a hidden temporary file next to its target, fsync-ed, and renamed
    over the target, then the folder is fsync-ed (``lit_slowcal.files.atomic_path``). A job killed
    while saving leaves the previous checkpoint intact. Local paths only; remote (fsspec) paths
    fall back to the parent's direct write.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        with atomic_path(path) as tmp:
            super().save_checkpoint(checkpoint, tmp, storage_options)
