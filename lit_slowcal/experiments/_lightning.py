"""Every Lightning internal that lit_slowcal relies on, behind one small function each.

Lightning gives no stability promise for underscored names or for its loop objects
(``trainer.fit_loop...``); they have changed between minor releases. Keeping all of them here means
one file to read when Lightning is upgraded, and ``tests/experiments/test_lightning.py`` checks each
one against the installed Lightning, so a rename fails there, by name, instead of deep inside a run.
No other module of the package may use them: that test scans the syntax tree of every module for an
attribute, a ``getattr`` string or an import naming an underscored name the installed Lightning
defines (or a Trainer's loop), other than lit_slowcal's own.

Each function says why the internal is needed and which public alternative was considered.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = [
    "LIGHTNING_INFO_LOGGERS",
    "KeepCommandLineModelArgs",
    "batches_done_in_epoch",
    "batches_started",
    "last_saved_step",
    "save_last_checkpoint",
]


#: The loggers Lightning says its info lines through, by module name: ``rank_zero_info`` (the accelerators
#: available, the litlogger tip, "`Trainer.fit` stopped") and the CUDA accelerator ("LOCAL_RANK: 0 -
#: CUDA_VISIBLE_DEVICES"). Internal: the module paths are not an API. A sweep filters them to print each line
#: once (``lit_slowcal.experiments.print_once``); Lightning offers no switch for these lines but the loggers' level,
#: which would silence them in a run alone too. The seed's line ("Seed set to 1") is left out: it names the
#: trial's seed.
LIGHTNING_INFO_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning.pytorch.accelerators.cuda",
)


def batches_started(trainer: pl.Trainer) -> int:
    """Training batches started so far over all epochs, the current one included.

    Internal: ``trainer.fit_loop.epoch_loop.total_batch_idx``. The public counter,
    ``trainer.global_step``, counts optimizer steps, and a LightningModule with manual optimization
    may take several per batch (or a strategy may count them its own way); ``batch_idx`` restarts
    every epoch. Counting batches in the module itself was considered: it would duplicate
    Lightning's own progress tracking and need saving in checkpoints to survive a resume, which
    the loop's counter already does.
    """
    return trainer.fit_loop.epoch_loop.total_batch_idx + 1


def batches_done_in_epoch(trainer: pl.Trainer) -> int:
    """Training batches of the current epoch whose training step has finished.

    Internal: ``trainer.fit_loop.epoch_loop.batch_progress.current.processed``. It is what a data
    source saves in a checkpoint to resume its stream mid-epoch. Counting in the data source the
    items it has yielded was considered: that count runs one ahead whenever Lightning fetches a
    batch early (it does for a source without ``len``), and a resumed run would then skip a batch;
    the public ``batch_idx`` is only given to hooks, not to ``LightningDataModule.state_dict``.
    """
    return trainer.fit_loop.epoch_loop.batch_progress.current.processed


def last_saved_step(callback: ModelCheckpoint) -> int:
    """``trainer.global_step`` at which ``callback`` last wrote a checkpoint (0 before any).

    Internal: ``ModelCheckpoint._last_global_step_saved``. The public ``last_model_path`` says
    which file, not at which step; reading the step back out of the file would mean loading it.
    """
    return callback._last_global_step_saved


def save_last_checkpoint(callback: ModelCheckpoint, trainer: pl.Trainer) -> None:
    """Have ``callback`` write its ``last`` checkpoint now, exactly as it does on its own schedule.

    Internals: ``ModelCheckpoint._monitor_candidates`` and ``ModelCheckpoint._save_last_checkpoint``.
    The public ``trainer.save_checkpoint(path)`` was considered: it writes the file but leaves the
    callback's state (``last_model_path``, the last saved step, versioned ``last-v1`` names,
    removal of the previous file, logger notification) behind, and that state goes into every
    later checkpoint and decides what ``--ckpt_path last`` resumes from.
    """
    candidates: dict[str, Any] = callback._monitor_candidates(trainer)
    callback._save_last_checkpoint(trainer, candidates)


class KeepCommandLineModelArgs:
    """A ``LightningCLI`` mixin: the model's arguments are the command line's, never the checkpoint's.

    Internal: ``LightningCLI._parse_ckpt_path``, overridden to do nothing. Lightning (2.5+) calls it
    right after parsing: when ``ckpt_path`` names a file, it loads it and silently replaces the
    model's arguments by the checkpoint's hyperparameters, so ``--ckpt_path X --model.lr=0.1``
    trains with the checkpoint's rate while the logged config says 0.1, and an unreadable file fails
    there with torch's raw error. lit_slowcal compares the whole configuration with the run stored
    in the checkpoint instead and refuses a difference (``lit_slowcal.experiments.run.identity``). No
    public switch turns the override off.
    """

    def _parse_ckpt_path(self) -> None:
        return None
