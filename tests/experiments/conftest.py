"""Fixtures of the tests that run the command in this process (``in_process.command``)."""

import pytest
import torch
from in_process import command

from lit_slowcal.experiments.train.model import MachinesModel


@pytest.fixture()
def no_training(monkeypatch):
    """Records training steps: a refusal must come before the first."""
    steps = []
    step = MachinesModel.training_step
    monkeypatch.setattr(MachinesModel, "training_step", lambda self, b, i: (steps.append(i), step(self, b, i))[1])
    return steps


@pytest.fixture(scope="session")
def half_run(tmp_path_factory):
    """A run stopped after 2 of its 4 rounds (max_steps), its last.ckpt, and the same run uninterrupted."""
    folder = tmp_path_factory.mktemp("half")
    capsys = _Capture()
    assert command(capsys, "--trainer.max_steps=128", "--checkpoint_every=1", run_dir=folder / "runs")[0] == 0
    assert command(capsys, run_dir=folder / "full")[0] == 0
    return folder


class _Capture:
    """capsys for a session fixture: stderr is not needed there."""

    def readouterr(self):
        return type("Out", (), {"err": ""})()


@pytest.fixture()
def closes_the_process_group():
    """`test` in this process leaves its process group open (fit closes it; the command's own process exits):
    closed afterwards, or a later test's forked sweep workers would inherit gloo's threads mid-lock and hang."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
