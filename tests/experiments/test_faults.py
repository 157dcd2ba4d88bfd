"""Failures end runs promptly and clearly: divergence, and a crashed process in a 2-process job."""

import subprocess
import sys
import time

import pytest
from helpers import REPO, subprocess_env

from lit_slowcal.experiments.main import main

BOUND_S = 60  # a crashed peer ends the whole job within this (measured: a few seconds)


@pytest.mark.parametrize("method", ["slowcal", "local_sgd", "minibatch_sgd", "accel_minibatch_sgd", "scaffold"])
def test_divergence_stops_the_run_at_once_with_method_lr_and_round(tmp_path, monkeypatch, capsys, method):
    from lit_slowcal.experiments.train.model import MachinesModel

    rounds = []
    step = MachinesModel.training_step
    monkeypatch.setattr(MachinesModel, "training_step", lambda self, b, i: (rounds.append(i), step(self, b, i)))
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as info:
        main(["fit", f"--config=configs/{method}.yaml", "--wandb=false", f"--run_dir={tmp_path}", "--model.lr=1e38"])
    assert info.value.code == 1
    (message,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lit_slowcal: error: ")]
    assert f"method={method}" in message and "lr=1e+38" in message
    assert "Training diverged" in message and "round 1 " in message
    assert rounds == [0]  # stopped in the first round, not after the epoch


@pytest.mark.parametrize("failing_rank", [0, 1])
@pytest.mark.slow
def test_a_crashed_process_ends_the_other_within_a_bound(tmp_path, failing_rank):
    env = subprocess_env(WANDB_MODE="disabled", FAIL=f"{failing_rank}:3")
    args = [
        f"--config={REPO / 'configs' / 'slowcal.yaml'}",
        f"--data.root={REPO / 'data'}",
        "--wandb=false",
        "--trainer.enable_progress_bar=false",
        "--num_machines=4",
        "--trainer.devices=2",
        f"--run_dir={tmp_path}",
    ]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "run_cli.py"), str(tmp_path / "out"), "fit", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert f"injected failure on rank {failing_rank} in round 3" in proc.stderr
    assert not (tmp_path / "out").exists()  # no process finished as if nothing happened
    assert elapsed < BOUND_S, f"took {elapsed:.0f} s"
    # No process is left behind.
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "out")], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""
