"""Checkpoints that are whole or absent, for Lightning's ``Trainer`` and Fabric, and read back safely."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lit_slowcal.files import atomic_path

__all__ = ["AtomicCheckpointIO", "CheckpointReadError", "read_checkpoint"]


class CheckpointReadError(ValueError):
    """A checkpoint file that cannot be read (empty, truncated, not a checkpoint); the message says which and why."""


def read_checkpoint(
    path: Union[str, os.PathLike[str]], map_location: Optional[Union[str, Callable, torch.device]] = "cpu"
) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``, with a clear one-line error for a file that is not a checkpoint.

    An empty file, a truncated one or random bytes raise ``CheckpointReadError`` naming the file and
    what is wrong with it. Loading stays restricted to plain data (``weights_only=True``): the
    message never suggests lifting that restriction, which would let the file run arbitrary code.

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        CheckpointReadError: when it cannot be read as a checkpoint.
    """
    size = os.stat(path).st_size  # FileNotFoundError as it is
    if size == 0:
        raise CheckpointReadError(f"Cannot read checkpoint {path}: the file is empty (0 bytes). {_ADVICE}")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        # torch's own message advises weights_only=False, i.e. running whatever code the file holds.
        raise CheckpointReadError(
            f"Cannot read checkpoint {path}: the file is damaged or not a PyTorch checkpoint ({size} bytes; it holds "
            f"something other than tensors and plain values, which is not loaded for safety). {_ADVICE}"
        ) from None
    except (PermissionError, IsADirectoryError):  # cannot open the file: its own message says why
        raise
    except Exception as err:  # EOFError, RuntimeError, IndexError, OSError...: what torch meets in a damaged file
        first = str(err).split(". ")[0].splitlines()[0][:120] if str(err) else type(err).__name__
        raise CheckpointReadError(
            f"Cannot read checkpoint {path}: the file is damaged or not a PyTorch checkpoint ({size} bytes; {first}). "
            f"{_ADVICE}"
        ) from None
    if not isinstance(checkpoint, dict):
        raise CheckpointReadError(
            f"Cannot read checkpoint {path}: it holds a {type(checkpoint).__name__}, not a checkpoint dict. {_ADVICE}"
        )
    return checkpoint


_ADVICE = "Use another checkpoint file, or start the run afresh without --ckpt_path."


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves survive a kill at any moment, and whose loads fail clearly.

    The checkpoint is written to a hidden temporary file next to its target, fsync-ed, and renamed
    over the target, then the folder is fsync-ed (``lit_slowcal.files.atomic_path``). A job killed
    while saving leaves the previous checkpoint intact. Local paths only; remote (fsspec) paths
    fall back to the parent's direct write and read. A local file is read with ``read_checkpoint``
    (plain data only; a damaged file gets a one-line ``CheckpointReadError``).
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        with atomic_path(path) as tmp:
            super().save_checkpoint(checkpoint, tmp, storage_options)

    def load_checkpoint(
        self,
        path: Any,
        map_location: Optional[Callable] = lambda storage, loc: storage,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        if "://" in str(path) or weights_only is False:
            return super().load_checkpoint(path, map_location, weights_only)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return read_checkpoint(path, map_location)
