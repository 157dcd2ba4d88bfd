"""Exact resume: a run killed mid-training and resumed with ``--ckpt_path last`` ends bitwise where an
uninterrupted run ends (parameters, optimizer state, metrics), for SLowcal-SGD, Local-SGD,
Accelerated Minibatch-SGD (AC-SA) and SCAFFOLD (control variates included)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, subprocess_env

from lit_slowcal.experiments.methods import get_method

K = 4


def run(tmp_path: Path, out: str, method: str, *extra: str, kill: str = "") -> subprocess.CompletedProcess:
    env = subprocess_env(WANDB_MODE="disabled", **({"KILL": kill} if kill else {}))
    args = [
        f"--config={REPO / 'configs' / (method + '.yaml')}",
        f"--data.root={REPO / 'data'}",
        "--wandb=false",
        "--trainer.enable_progress_bar=false",
        "--num_machines=4",
        f"--local_steps={K}",
        "--batch_size=64",  # R = 59 rounds
        "--eval_every=5",
        "--checkpoint_every=1",
        f"--run_dir={tmp_path / 'runs'}",
    ]
    cmd = [sys.executable, str(REPO / "tests" / "run_cli.py"), str(tmp_path / out), "fit", *args, *extra]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    results = {}
    for method in ("slowcal", "local_sgd", "accel_minibatch_sgd", "scaffold"):
        tmp = tmp_path_factory.mktemp(method)
        proc = run(tmp, "full", method)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[method] = torch.load(tmp / "full" / "rank0.pt")
    return results


@pytest.mark.parametrize(
    ("method", "signal", "step", "where"),
    [
        ("slowcal", "SIGKILL", 23 * K + 1, "at a round boundary: right after round 23 and its checkpoint"),
        ("slowcal", "SIGTERM", 30 * K + 3, "mid round 31: stops gracefully after it, resumes from round 31"),
        ("local_sgd", "SIGKILL", 41 * K + 2, "between rounds: mid round 42, resumes from round 41"),
        ("local_sgd", "SIGTERM", 12 * K + 1, "first step of round 13: stops after it, resumes from round 13"),
        ("scaffold", "SIGKILL", 37 * K + 3, "mid round 38, resumes from round 37 (c_i, c, x and the round's K)"),
        ("accel_minibatch_sgd", "SIGKILL", 29, "one step a round: killed in round 29, resumes from round 28"),
    ],
)
def test_killed_run_resumes_bitwise(tmp_path, uninterrupted, method, signal, step, where):
    killed = run(tmp_path, "killed", method, kill=f"{signal}:{step}")
    assert killed.returncode == (143 if signal == "SIGTERM" else -9), where
    assert not (tmp_path / "killed").exists()  # it really died before finishing
    ckpts = list((tmp_path / "runs").glob("*/version_0/checkpoints/last.ckpt"))
    assert len(ckpts) == 1
    steps_per_round = get_method(method).steps_per_round(K)
    rounds_saved = (step - 1) // steps_per_round + (signal == "SIGTERM")  # SIGTERM: Lightning finishes the round
    assert torch.load(ckpts[0], weights_only=False)["global_step"] == rounds_saved * steps_per_round

    resumed = run(tmp_path, "resumed", method, "--ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Restored all states" in resumed.stdout + resumed.stderr
    got, want = torch.load(tmp_path / "resumed" / "rank0.pt"), uninterrupted[method]
    for name in want["params"]:
        assert torch.equal(got["params"][name], want["params"][name]), name
    assert got["w"].keys() == want["w"].keys()
    for name in want["w"]:
        assert torch.equal(got["w"][name], want["w"][name]), name
    for name, state in want["state"].items():
        assert got["state"][name].keys() == state.keys()
        for key, value in state.items():
            same = torch.equal(got["state"][name][key], value) if isinstance(value, torch.Tensor) else got["state"][name][key] == value
            assert same, (name, key)
    assert got["metrics"] == want["metrics"]
    assert got["metrics"]["round"] == 59
    # The interrupted run's logs are kept; the continuation logs into a new version folder.
    (run_folder,) = (tmp_path / "runs").iterdir()
    assert sorted(p.name for p in run_folder.iterdir()) == ["version_0", "version_1"]
    assert (run_folder / "version_0" / "metrics.csv").stat().st_size > 0


def test_ckpt_path_last_without_a_checkpoint_is_a_clear_error(tmp_path):
    proc = run(tmp_path, "none", "slowcal", "--ckpt_path=last")
    assert proc.returncode != 0
    assert "--ckpt_path last: no checkpoint of run slowcal_M4_K4_b64_seed1" in proc.stderr
