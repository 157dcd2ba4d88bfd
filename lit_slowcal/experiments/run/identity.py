"""A run's identity: what defines it is stored in its checkpoints, and a resume must match it.

Everything in the run's configuration defines the run (method, M, K, b, the seed, the data split,
the model and optimizer hyperparameters, the trainer's strategy, devices and precision, ...), except
the settings in ``MAY_CHANGE_ON_RESUME``: how long to train, how often to evaluate, log and
checkpoint, where logs go, threads, the links the communication time is modelled at. The CLI stores
the identity in every checkpoint it writes (``RunIdentity``, under ``"lit_slowcal_run"``) and, before it builds anything, compares it with the
configuration of a command that loads a checkpoint (``fit --ckpt_path``, ``validate``, ``test``):
any other difference is refused, naming each key with both values (``check_same_run``).

Checkpoints written before identities were stored carry only the model's hyperparameters (which
Lightning saves: method, M, lr, ...); those are compared (a setting left null, e.g. ``model.lr`` for
the paper's rate, is not), and K, b, the seed and the split cannot be checked.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

__all__ = [
    "ADDED_AT_DEFAULT", "CHECKPOINT_KEY", "MAY_CHANGE_ON_RESUME", "RESULT_SETTINGS", "SEED_KEYS", "SHAPE_KEYS", "RunIdentity", "allowed_on_resume",
    "check_same_run", "may_change_on_resume", "run_identity", "trial_identity",
]  # fmt: skip

#: Where the identity is stored in a checkpoint.
CHECKPOINT_KEY = "lit_slowcal_run"

#: The configuration keys (patterns, as ``fnmatch``) that may differ from the checkpoint's run.
MAY_CHANGE_ON_RESUME: tuple[str, ...] = (
    "config",
    "ckpt_path",
    "weights_only",
    "run_dir",
    "eval_every",
    "checkpoint_every",
    "threads",
    "wandb",
    "wandb_project",
    "cache_dir",
    "objective",
    "diagnostics",
    "step_every",
    "optimum_tol",
    "link",
    "step_seconds",
    "data.root",
    "data.eval_batch_size",
    "trainer.max_epochs",
    "trainer.max_steps",
    "trainer.max_time",
    "trainer.min_epochs",
    "trainer.min_steps",
    "trainer.logger",
    "trainer.callbacks",
    "trainer.default_root_dir",
    "trainer.enable_*",
    "trainer.log_every_n_steps",
    "trainer.check_val_every_n_epoch",
    "trainer.num_sanity_val_steps",
    "trainer.limit_val_batches",
    "trainer.limit_test_batches",
    "trainer.limit_predict_batches",
    "trainer.profiler",
    "trainer.detect_anomaly",
    "trainer.model_registry",
)


#: Settings that may change on resume but that a finished run's results depend on (how long it trained,
#: how much of the test set its evaluations read): part of a sweep trial's identity (``trial_identity``).
RESULT_SETTINGS: tuple[str, ...] = (
    "objective",
    "diagnostics",
    "step_every",
    "optimum_tol",
    "trainer.max_epochs",
    "trainer.max_steps",
    "trainer.max_time",
    "trainer.min_epochs",
    "trainer.min_steps",
    "trainer.limit_val_batches",
    "trainer.limit_test_batches",
)
#: The keys that hold a run's seed (the data's and the model's are linked from ``seed_everything``).
SEED_KEYS: tuple[str, ...] = ("seed_everything", "data.seed", "model.seed")


def may_change_on_resume(key: str) -> bool:
    """Whether the configuration key ``key`` (``model.lr``) may differ from the checkpoint's run on resume."""
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in MAY_CHANGE_ON_RESUME)


def run_identity(config: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of a run's configuration that define it, flattened (``model.lr``), as plain JSON values.

    ``config`` is the subcommand's configuration as plain data (settings linked from others, such as
    ``model.method``, left out: they follow from the keys they are linked from; so are the run's shape's
    ``data.steps_per_round`` and ``data.batch_size``, ``SHAPE_KEYS``).
    """
    flat = _flat(config)
    return {k: v for k, v in flat.items() if not may_change_on_resume(k)}


def trial_identity(config: Mapping[str, Any]) -> dict[str, Any]:
    """What defines a sweep trial's results: ``run_identity`` and the ``RESULT_SETTINGS`` (how long it trains).

    Two trials of one identity give the same results, whatever command line or config file said it;
    a sweep reuses a trial's record only for a trial of the same identity.
    """
    flat = _flat(config)
    return {k: v for k, v in flat.items() if not may_change_on_resume(k) or k in RESULT_SETTINGS}


def _flat(config: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and key in ("model", "data", "trainer"):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    flat = {k: json.loads(json.dumps(v, default=str)) for k, v in sorted(flat.items())}
    problem = flat.get("data.problem")
    if isinstance(problem, dict) and str(problem.get("class_path")).startswith(_PROBLEMS_MODULE):
        name = problem["class_path"][len(_PROBLEMS_MODULE) :]
        flat["data.problem"] = {**problem, "class_path": _PROBLEMS_MODULE_STORED + name}
    for key in SHAPE_KEYS:
        flat.pop(key, None)
    for key, default in ADDED_AT_DEFAULT.items():
        if key in flat and flat[key] == default:
            flat.pop(key)
    if flat.get("data.problem") in _DEFAULT_PROBLEM:  # the default problem named: the same run as left unset
        flat["data.problem"] = None
    return flat


#: The data module's keys that the run's shape owns (``RunShape``, from method, K and b; unset, or given by a
#: config file of an earlier version and then checked against the shape): left out of every identity, as they
#: were when they were computed while parsing, so that the digests stay the same.
SHAPE_KEYS = ("data.steps_per_round", "data.batch_size")

#: Settings added after identities were first stored, left out of an identity at their default (the run they
#: describe is the one from before the setting existed), so that the digests of results files and checkpoints
#: written before stay the same; any other value is part of it.
ADDED_AT_DEFAULT: dict[str, Any] = {
    "compression": None, "error_feedback": None, "overlap_delay": 0, "fragments": 1, "state_every": 1, "average_state": None,
    "model.beta": 1.0, "model.beta2": 0.999, "model.second_moment": "adam", "model.average_second_moment": False,
}  # fmt: skip

# A problem's class path in an identity: as it was when the stored identities were written (results files,
# checkpoints), before the problems moved to ``lit_slowcal.experiments.data.problems``; the digests stay the same.
_PROBLEMS_MODULE = "lit_slowcal.experiments.data.problems."
_PROBLEMS_MODULE_STORED = "lit_slowcal.experiments.problems."

# ``data.problem`` given as the default problem (MNIST, no arguments), as the config dump writes it.
_DEFAULT_PROBLEM = (
    {"class_path": "lit_slowcal.experiments.problems.MNIST"},
    {"class_path": "lit_slowcal.experiments.problems.MNIST", "init_args": {}},
)


def _differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    # Keys present on one side only (an option added or removed since) are not compared, but for those
    # ADDED_AT_DEFAULT, absent at their default. Values are shown as JSON: null, true, "zeros", as in a config file.
    saved, now = ({**ADDED_AT_DEFAULT, **side} for side in (saved, now))
    return [
        f"{key} {json.dumps(saved[key])} in the checkpoint, {json.dumps(now[key])} now"
        for key in sorted(saved.keys() & now.keys())
        if not may_change_on_resume(key)
        and json.dumps(saved[key], sort_keys=True) != json.dumps(now[key], sort_keys=True)
    ]


def check_same_run(path: Any, checkpoint: Mapping[str, Any], identity: Mapping[str, Any], verb: str = "resume") -> None:
    """Raise ``ValueError`` naming every key on which ``identity`` differs from ``checkpoint``'s run.

    A checkpoint without a stored identity is compared on the model's hyperparameters only.
    """
    saved = checkpoint.get(CHECKPOINT_KEY)
    if saved is None:  # an older checkpoint: the model's hyperparameters, as the model resolved them
        hparams = checkpoint.get("hyper_parameters") or {}
        saved = {k: hparams[k] for k in ("method", "num_machines") if k in hparams}
        saved.update({f"model.{k}": v for k, v in hparams.items()})
        identity = {k: v for k, v in identity.items() if v is not None}  # null: the model's default, resolved
    differences = _differences(saved, identity)
    if differences:
        raise ValueError(
            f"Cannot {verb} {path}: it is a different run: {'; '.join(differences)} (only {allowed_on_resume()} may change "
            f"on resume; start a new run without --ckpt_path to change the others)"
        )


def allowed_on_resume() -> str:
    """``MAY_CHANGE_ON_RESUME`` in short: ``run_dir, ..., data.{root, eval_batch_size}, trainer.{max_epochs, ...}``."""
    groups: dict[str, list[str]] = {}
    for pattern in MAY_CHANGE_ON_RESUME[3:]:  # not config, ckpt_path, weights_only: they name the files
        section, _, key = pattern.rpartition(".")
        groups.setdefault(section, []).append(key)
    return ", ".join(
        ", ".join(keys) if not section else f"{section}.{{{', '.join(keys)}}}" for section, keys in groups.items()
    )


class RunIdentity(Callback):
    """Stores the run's identity in every checkpoint the trainer writes."""

    def __init__(self, identity: Mapping[str, Any]) -> None:
        self.identity = dict(identity)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[CHECKPOINT_KEY] = dict(self.identity)
