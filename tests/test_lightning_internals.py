"""The Lightning internals behind lit_slowcal._lightning still exist and still mean what it assumes.

A Lightning release that renames or removes one fails here, naming the attribute and the version,
instead of deep inside a training run. The last test keeps every other module off these names.
"""

from __future__ import annotations

import re
from pathlib import Path

import lightning
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lit_slowcal import _lightning

PACKAGE = Path(__file__).resolve().parents[1] / "lit_slowcal"
INTERNALS = (
    "_parse_ckpt_path",
    "_trainer",
    "_save_last_checkpoint",
    "_last_global_step_saved",
    "_monitor_candidates",
    "fit_loop",
    "epoch_loop",
    "batch_progress",
    "total_batch_idx",
)


def require(obj: object, path: str) -> object:
    """``obj.<path>`` (dotted), or a test failure naming the missing attribute and the Lightning version."""
    value = obj
    for i, name in enumerate(path.split(".")):
        if not hasattr(value, name):
            owner = ".".join([type(obj).__name__, *path.split(".")[:i]])
            pytest.fail(
                f"Lightning {lightning.__version__}: {owner} has no attribute {name!r}; "
                f"lit_slowcal/_lightning.py relies on {type(obj).__name__}.{path} and needs updating"
            )
        value = getattr(value, name)
    return value


class Tiny(pl.LightningModule):
    """One linear layer; records what the loop counters say after every training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.seen: list[tuple[int, int, int]] = []

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        t = self.trainer
        self.seen.append(
            (
                batch_idx,
                _lightning.batches_started(t),
                _lightning.batches_done_in_epoch(t),
            )
        )

    def validation_step(self, batch, batch_idx):
        self.log("val", self.layer(batch).sum())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def tiny_trainer(tmp_path, **kwargs) -> pl.Trainer:
    kwargs = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": tmp_path,
        **kwargs,
    }
    return pl.Trainer(**kwargs)


def fit(trainer: pl.Trainer, model: pl.LightningModule, batches: int = 3) -> None:
    data = torch.ones(batches, 2)
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=1), val_dataloaders=DataLoader(data[:1]))


# ------------------------------------------------------------------------- the loop counters


def test_fit_loop_has_total_batch_idx(tmp_path):
    require(tiny_trainer(tmp_path), "fit_loop.epoch_loop.total_batch_idx")


def test_fit_loop_has_batch_progress_current_processed(tmp_path):
    require(tiny_trainer(tmp_path), "fit_loop.epoch_loop.batch_progress.current.processed")


def test_counters_mean_what_lit_slowcal_assumes(tmp_path):
    """Over two epochs of three batches, validating every two: after batch i of epoch e, the batches
    started over all epochs are 3e + i + 1, those done in the epoch i + 1."""
    model = Tiny()
    fit(tiny_trainer(tmp_path, val_check_interval=2), model)
    expected = [(i, 3 * e + i + 1, i + 1) for e in range(2) for i in range(3)]
    assert model.seen == expected, f"Lightning {lightning.__version__}"


# ------------------------------------------------------------------ ModelCheckpoint internals


def test_lightning_cli_parses_ckpt_path_in_the_method_the_mixin_overrides():
    """LightningCLI.__init__ calls _parse_ckpt_path (what KeepCommandLineModelArgs turns off).

    Lightning 2.5 has no such step: its CLI never reads a checkpoint's hyperparameters (nothing in
    its module reads ``hyper_parameters``), so the mixin's method is never called there and there
    is nothing to turn off.
    """
    import inspect

    import lightning.pytorch.cli as cli_module
    from lightning.pytorch.cli import LightningCLI

    if not hasattr(LightningCLI, "_parse_ckpt_path"):
        assert "hyper_parameters" not in inspect.getsource(cli_module)
        return
    assert callable(require(LightningCLI, "_parse_ckpt_path"))
    assert "self._parse_ckpt_path()" in inspect.getsource(LightningCLI.__init__)


def test_model_checkpoint_has_last_global_step_saved(tmp_path):
    assert require(ModelCheckpoint(dirpath=tmp_path), "_last_global_step_saved") == 0


def test_model_checkpoint_has_monitor_candidates(tmp_path):
    assert callable(require(ModelCheckpoint(dirpath=tmp_path), "_monitor_candidates"))


def test_model_checkpoint_has_save_last_checkpoint(tmp_path):
    assert callable(require(ModelCheckpoint(dirpath=tmp_path), "_save_last_checkpoint"))


def test_save_last_checkpoint_writes_last_and_records_the_step(tmp_path):
    """Saving every 2 steps over 3 leaves last.ckpt at step 2; the helpers bring it to step 3."""
    callback = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=0, save_last=True, every_n_train_steps=2)
    trainer = tiny_trainer(tmp_path, max_epochs=1, enable_checkpointing=True, callbacks=[callback])
    fit(trainer, Tiny())
    assert trainer.global_step == 3
    if _lightning.last_saved_step(callback) != 3:  # ModelCheckpoint does not save again at train end
        assert _lightning.last_saved_step(callback) == 2
        _lightning.save_last_checkpoint(callback, trainer)
    assert _lightning.last_saved_step(callback) == 3
    assert callback.last_model_path == str(tmp_path / "ckpt" / "last.ckpt")
    assert torch.load(callback.last_model_path, weights_only=False)["global_step"] == 3
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["last.ckpt"]


# ------------------------------------------------------- public behaviour used instead of _trainer


def test_unattached_module_trainer_raises_runtime_error():
    """lit_slowcal reads ``module.trainer`` and treats RuntimeError as "not attached" (no ``_trainer``)."""
    with pytest.raises(RuntimeError, match="not attached"):
        Tiny().trainer


# --------------------------------------------------------------------------------- the rule


def test_no_module_outside_lightning_py_uses_lightning_internals():
    """Attribute access (``x.fit_loop``) or a string naming one (``getattr(x, "fit_loop")``)."""
    names = "|".join(INTERNALS)
    pattern = re.compile(rf"\.\s*(?:{names})\b|[\"'](?:{names})[\"']")
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "_lightning.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not offenders, "Lightning internals outside lit_slowcal/_lightning.py:\n" + "\n".join(offenders)
