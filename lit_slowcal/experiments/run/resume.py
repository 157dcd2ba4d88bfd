"""Checks of a command that loads a checkpoint (``fit --ckpt_path``, ``validate``, ``test``), made before
training: the file is a Lightning checkpoint of this very run (``lit_slowcal.experiments.run.identity``),
a resumed fit has something left to train, and ``--ckpt_path last`` finds this run's newest one.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from lit_slowcal._validation import is_int
from lit_slowcal.checkpoint_io import CheckpointReadError, read_checkpoint
from lit_slowcal.experiments.run.identity import allowed_on_resume, check_same_run
from lit_slowcal.experiments.train.shape import RunShape

__all__ = ["check_checkpoint", "check_trains_more", "last_checkpoint"]

# The advice that ends a CheckpointReadError's message (left out of a note: the resume goes on).
_READ_ADVICE = "Use another checkpoint file"


def _rank_zero_note(line: str) -> None:
    """``line`` on stderr, from the launching process only (DDP children parse the command again)."""
    if all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK")):
        print(line, file=sys.stderr, flush=True)


def check_checkpoint(path: str, identity: Mapping[str, Any], subcommand: str) -> int:
    """The step ``path``'s run stopped at; refuses a file that is not a Lightning checkpoint or is of
    another run. A path that is not a local file (remote, ``best``, missing) is Lightning's to resolve: 0."""
    if "://" not in path and Path(path).is_dir():
        raise ValueError(
            f"--ckpt_path {path}: it is a folder, not a checkpoint file: pass a file, e.g. a run's "
            "<run_dir>/<run name>/version_<n>/checkpoints/last.ckpt, or last for this run's newest"
        )
    if "://" in path or not Path(path).is_file():
        return 0
    checkpoint = read_checkpoint(path)
    verb = "resume" if subcommand == "fit" else f"{subcommand} with"
    missing = [k for k in ("pytorch-lightning_version", "state_dict", "global_step") if k not in checkpoint]
    if missing:
        raise ValueError(
            f"Cannot {verb} {path}: it is not a Lightning checkpoint (it lacks {', '.join(missing)}; its keys: "
            f"{', '.join(repr(k) for k in list(checkpoint)[:5]) or 'none'}). Pass a last.ckpt written by `lit_slowcal fit`."
        )
    check_same_run(path, checkpoint, identity, verb)
    return int(checkpoint.get("global_step", 0))


def check_trains_more(path: str, step: int, shape: RunShape, max_epochs: Any, max_steps: Any) -> None:
    """Refuse to resume at ``step`` a run whose ``max_epochs`` or ``max_steps`` are already reached.

    An epoch is the rounds Lightning trains of it: all R, or fewer under ``trainer.limit_train_batches``
    (which cannot change on resume)."""
    steps_per_epoch = shape.trained_rounds * shape.steps_per_round
    if steps_per_epoch == 0:  # limit_train_batches=0 trains nothing: the fit says so
        return
    epochs_done = step // steps_per_epoch
    if is_int(max_epochs) and 0 <= max_epochs <= epochs_done:
        stop = f"{epochs_done} epoch(s) ({step} steps) and trainer.max_epochs is {max_epochs}"
        more = f"--trainer.max_epochs={epochs_done + 1}"
    elif is_int(max_steps) and 0 <= max_steps <= step:
        stop, more = (
            f"{step} steps and trainer.max_steps is {max_steps}",
            f"--trainer.max_steps={step + steps_per_epoch}",
        )
    else:
        return
    raise ValueError(
        f"Cannot resume {path}: its run has trained {stop}, so there is nothing to train. Pass {more} (or more) "
        f"to train on, or use `test --ckpt_path {path}` to evaluate it."
    )


def last_checkpoint(run_dir: str, name: str, identity: Mapping[str, Any]) -> Path:
    """The newest ``last.ckpt`` of run ``name`` under ``run_dir`` whose stored identity is ``identity``.

    ``--ckpt_path last`` continues from it; the continuation logs into a new version folder, so the
    interrupted run's logs stay as they were. Runs of the same name with other settings (another
    learning rate) share the name's folder: their checkpoints are passed over, and when none is this
    run's, the error names each one considered and why it is not.
    """
    folder = Path(run_dir) / name
    found = sorted(folder.glob("version_*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
    if not found:
        raise FileNotFoundError(
            f"--ckpt_path last: no checkpoint of run {name} in {folder}/version_*/checkpoints/ "
            f"(checkpoints are written every `checkpoint_every` rounds). Pass a checkpoint file instead."
        )
    reasons, unreadable = [], []
    for path in found:
        why: Optional[str] = None
        try:
            check_same_run(path, read_checkpoint(path), identity)
        except CheckpointReadError as err:  # damaged: it may have been this run's newest
            why = str(err).split(f"{path}: ", 1)[-1].split(f" {_READ_ADVICE}", 1)[0]
            unreadable.append(f"{path.relative_to(folder)} ({why})")
        except ValueError as err:  # another run of this name
            why = str(err).split(": it is a different run: ", 1)[-1].split(" (only ", 1)[0]
        if why is None:
            if unreadable:  # a resume from an older checkpoint than the newest file: never silently
                _rank_zero_note(
                    f"note: --ckpt_path last: skipped {len(unreadable)} newer checkpoint(s) that cannot be read: "
                    f"{'; '.join(unreadable)}; resuming from {path.relative_to(folder)}, the newest readable one of "
                    "this run (move the damaged file away to silence this, or pass a checkpoint file)"
                )
            return path
        reasons.append(f"{path.relative_to(folder)} ({why})")
    raise ValueError(
        f"--ckpt_path last: none of the {len(found)} checkpoints of run {name} in {folder} is of this "
        f"run: {'; '.join(reasons)} (only {allowed_on_resume()} may change on resume; pass the settings of the run "
        "to continue, a checkpoint file, or start a new run without --ckpt_path)"
    )
