"""The Lightning internals behind lit_slowcal.experiments._lightning still exist and still mean what it assumes.

A Lightning release that renames or removes one fails here, naming the attribute and the version,
instead of deep inside a training run. The last tests keep every other module off Lightning's internals:
they scan the syntax tree of every module for the underscored names the installed Lightning defines.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import lightning
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lit_slowcal.experiments import _lightning

PACKAGE = Path(__file__).resolve().parents[2] / "lit_slowcal"
LIGHTNING_PY = PACKAGE / "experiments" / "_lightning.py"  # the one module that may use Lightning internals


def require(obj: object, path: str) -> object:
    """``obj.<path>`` (dotted), or a test failure naming the missing attribute and the Lightning version."""
    value = obj
    for i, name in enumerate(path.split(".")):
        if not hasattr(value, name):
            owner = ".".join([type(obj).__name__, *path.split(".")[:i]])
            pytest.fail(
                f"Lightning {lightning.__version__}: {owner} has no attribute {name!r}; "
                f"lit_slowcal/experiments/_lightning.py relies on {type(obj).__name__}.{path} and needs updating"
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

LIGHTNING = Path(lightning.__file__).resolve().parent
TOOLS = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_names(tree: ast.AST, *, members_only: bool) -> set[str]:
    """Names a module defines: every def, class and assigned name and attribute, or with ``members_only``
    only what can be reached as ``something.<name>``: class members and assigned attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not members_only:
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute):
                        names.add(t.attr)
                    elif isinstance(t, ast.Name) and not members_only:
                        names.add(t.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                names.add(node.args[1].value)
    return names


@functools.lru_cache(maxsize=1)
def lightning_internals() -> frozenset[str]:
    """The names no module but lit_slowcal/experiments/_lightning.py may use: every underscored name the installed Lightning
    defines (read from its source), and the Trainer's loop objects and their progress trackers (``fit_loop``,
    ``epoch_loop``, ``batch_progress``, ...: public names without a stability promise), found by walking them."""
    from lightning.pytorch.loops.loop import _Loop
    from lightning.pytorch.loops.progress import _BaseProgress

    names: set[str] = set()
    for path in LIGHTNING.rglob("*.py"):
        names |= {n for n in _defined_names(ast.parse(path.read_text()), members_only=False) if _private(n)}
    trainer = pl.Trainer(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    loops, owners = set(), [trainer]
    while owners:
        for name, value in vars(owners.pop()).items():
            if isinstance(value, (_Loop, _BaseProgress)) and name not in loops:
                loops.add(name)
                owners += [value] if isinstance(value, _Loop) else []
    assert {"fit_loop", "epoch_loop", "batch_progress"} <= loops, (
        f"Lightning {lightning.__version__}: the loops are {loops}"
    )
    return frozenset(names | loops)


@functools.lru_cache(maxsize=1)
def own_members() -> frozenset[str]:
    """The names lit_slowcal itself defines as class members or attributes (outside _lightning.py): ``x._version()``
    of its own is not Lightning's."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if path != LIGHTNING_PY:
            names |= _defined_names(ast.parse(path.read_text()), members_only=True)
    return frozenset(names)


def lightning_accesses(source: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every use of a Lightning internal in ``source``: an attribute access
    (``x._parser``, ``trainer.fit_loop``) or a ``getattr``-style string naming one that lit_slowcal does not
    define itself, and an import of an underscored name or module from Lightning."""
    internals, own = lightning_internals(), own_members()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in internals and node.attr not in own:
            found.append((node.lineno, f".{node.attr}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in TOOLS
            and len(node.args) > 1
        ):
            name = node.args[1]
            if isinstance(name, ast.Constant) and name.value in internals and name.value not in own:
                found.append((node.lineno, f"{node.func.id}(..., {name.value!r})"))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for module in modules:
                if module.split(".")[0] not in ("lightning", "pytorch_lightning", "lightning_fabric"):
                    continue
                names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
                private = [p for p in [*module.split("."), *names] if _private(p)]
                if private:
                    found.append((node.lineno, f"import {module}: {', '.join(private)}"))
    return sorted(found)


def test_the_scan_finds_each_kind_of_lightning_internal():
    """The old cli.py's ``self._parser(...)`` (a LightningCLI method), the loop objects, a private callback attribute,
    one named in a string, and imports of private names and modules; not lit_slowcal's own underscored members."""
    source = """
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.trainer.connectors.data_connector import _DataConnector
import lightning.fabric.utilities._hooks


class SlowcalCLI(LightningCLI):
    def before_instantiate_classes(self):
        parser = self._parser(self.subcommand)
        step = self.trainer.fit_loop.epoch_loop.total_batch_idx
        saved = self.callback._last_global_step_saved
        candidates = getattr(self.callback, "_monitor_candidates")
        return self._version(), self.run_config()
"""
    found = lightning_accesses(source)
    assert [line for line, _ in found] == [3, 4, 9, 10, 10, 11, 12], found
    assert (9, "._parser") in found and (10, ".fit_loop") in found and (10, ".epoch_loop") in found
    assert (11, "._last_global_step_saved") in found
    assert (12, "getattr(..., '_monitor_candidates')") in found
    assert "_version" in own_members() and not any("_version" in what for _, what in found)


def test_no_module_outside_lightning_py_uses_lightning_internals():
    """Every module of the package, scanned (``lightning_accesses``): the internals stay in _lightning.py."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == LIGHTNING_PY:
            continue
        lines = path.read_text().splitlines()
        for number, what in lightning_accesses(path.read_text()):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {what}: {lines[number - 1].strip()}")
    assert not offenders, "Lightning internals outside lit_slowcal/experiments/_lightning.py:\n" + "\n".join(offenders)


# --------------------------------------------------------------------- Lightning's info loggers


def lightning_has_tip() -> bool:
    """Whether the installed Lightning prints its litlogger tip at a fit (2.6 does, 2.5.0 does not)."""
    import inspect

    from lightning.pytorch.trainer.connectors.logger_connector import logger_connector

    return "litlogger" in inspect.getsource(logger_connector)


def test_lightning_says_its_info_lines_through_the_loggers_lit_slowcal_filters(tmp_path):
    """The accelerators, the litlogger tip and the end of fit come through ``LIGHTNING_INFO_LOGGERS`` (a sweep
    prints each once), and the CUDA accelerator's line through the last of them."""
    import logging

    import lightning.pytorch.accelerators.cuda as cuda

    said: list[tuple[str, str]] = []

    class Record(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            said.append((record.name, record.getMessage()))
            return False

    record = Record()
    loggers = [logging.getLogger(name) for name in _lightning.LIGHTNING_INFO_LOGGERS]
    for logger in loggers:
        logger.addFilter(record)
    try:
        fit(tiny_trainer(tmp_path, max_epochs=1), Tiny())
    finally:
        for logger in loggers:
            logger.removeFilter(record)
    rank_zero = "lightning.pytorch.utilities.rank_zero"
    for start in ("GPU available: ", "TPU available: ", "💡 Tip: ", "`Trainer.fit` stopped: `max_epochs=1` reached."):
        once = [rank_zero] if start != "💡 Tip: " or lightning_has_tip() else []  # the tip is Lightning 2.6's
        assert [name for name, text in said if text.startswith(start)] == once, (start, said, lightning.__version__)
    assert cuda._log.name == "lightning.pytorch.accelerators.cuda" == _lightning.LIGHTNING_INFO_LOGGERS[2]
