"""A user's own ``LightningCLI`` with ``trainer.strategy: periodic_averaging`` in a config: the command line may name
the strategy again (``--trainer.strategy=periodic_averaging``) and override one init arg, keeping the config's others
(``lit_slowcal._registration``: jsonargparse parses a bare name as the Trainer's string and dropped them)."""

from pathlib import Path

import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

import lit_slowcal  # noqa: F401 (registers the strategy's names)

CONFIG = """
trainer:
  accelerator: cpu
  logger: false
  strategy:
    class_path: periodic_averaging
    init_args:
      sync_every: 20
      participation: 0.5
      outer_optimizer:
        class_path: torch.optim.SGD
        init_args: {lr: 0.7, momentum: 0.9, nesterov: true}
"""


def _strategy(tmp_path: Path, *args: str):
    (tmp_path / "config.yaml").write_text(CONFIG)
    cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=[f"--config={tmp_path / 'config.yaml'}", *args])
    return cli.trainer.strategy


@pytest.mark.parametrize("args", [
    [],
    ["--trainer.strategy.sync_every=30"],
    ["--trainer.strategy=periodic_averaging", "--trainer.strategy.sync_every=30"],
    ["--trainer.strategy", "periodic_averaging", "--trainer.strategy.sync_every=30"],
    ["--trainer.strategy=lit_slowcal.strategy.periodic_averaging", "--trainer.strategy.sync_every=30"],
    ["--trainer.strategy=periodic_averaging"],
])  # fmt: skip
def test_naming_the_configs_strategy_again_keeps_its_other_init_args(tmp_path, args):
    strategy = _strategy(tmp_path, *args)
    assert strategy.sync_every == (30 if any("sync_every" in a for a in args) else 20)
    assert strategy.options.participation == 0.5
    outer = strategy.options.outer_optimizer([torch.zeros(1, requires_grad=True)])
    assert type(outer) is torch.optim.SGD
    assert {k: outer.defaults[k] for k in ("lr", "momentum", "nesterov")} == {
        "lr": 0.7,
        "momentum": 0.9,
        "nesterov": True,
    }


def test_another_strategy_on_the_command_line_replaces_the_configs(tmp_path):
    strategy = _strategy(tmp_path, "--trainer.strategy=periodic_averaging_spawn", "--trainer.strategy.sync_every=7")
    assert type(strategy).__name__ == "periodic_averaging_spawn" and strategy.sync_every == 7
    assert strategy.options.outer_optimizer is None and strategy.options.participation is None
