"""Exact resume: a run killed mid-training and resumed with ``--ckpt_path last`` ends bitwise where an
uninterrupted run ends (parameters, optimizer state, metrics), for SLowcal-SGD, Local-SGD,
Accelerated Minibatch-SGD (AC-SA) and SCAFFOLD (control variates included). And the checks before a resume
(``lit_slowcal.experiments.run.resume``): a run with nothing left to train fails with a line, and ``--ckpt_path last``
takes this run's newest checkpoint."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, subprocess_env
from in_process import RUN, command, error_line

from lit_slowcal.experiments.train.methods import get_method

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
@pytest.mark.slow
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
            same = (
                torch.equal(got["state"][name][key], value)
                if isinstance(value, torch.Tensor)
                else got["state"][name][key] == value
            )
            assert same, (name, key)
    assert got["metrics"] == want["metrics"]
    assert got["metrics"]["round"] == 59
    # The interrupted run's logs are kept; the continuation logs into a new version folder.
    (run_folder,) = (tmp_path / "runs").iterdir()
    assert sorted(p.name for p in run_folder.iterdir()) == ["version_0", "version_1"]
    assert (run_folder / "version_0" / "metrics.csv").stat().st_size > 0


@pytest.mark.slow
def test_ckpt_path_last_without_a_checkpoint_is_a_clear_error(tmp_path):
    proc = run(tmp_path, "none", "slowcal", "--ckpt_path=last")
    assert proc.returncode != 0
    assert "--ckpt_path last: no checkpoint of run slowcal_M4_K4_b64_seed1" in proc.stderr


# ---------------------------------------------------------------------- runs that train nothing, --ckpt_path last

NOTHING = [
    (["--ckpt_path=last"], "its run has trained 1 epoch(s) (256 steps) and trainer.max_epochs is 1, so there is "
     "nothing to train. Pass --trainer.max_epochs=2 (or more) to train on"),
    (["--ckpt_path=last", "--trainer.max_epochs=3", "--trainer.max_steps=256"], "its run has trained 256 steps and "
     "trainer.max_steps is 256, so there is nothing to train. Pass --trainer.max_steps=512 (or more)"),
    (["--trainer.max_epochs=0"], "The run trained nothing: it was at step 0 before and after fit"),
    (["--trainer.limit_train_batches=0"], "The run trained nothing: it was at step 0 before and after fit"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), NOTHING, ids=[" ".join(a) for a, _ in NOTHING])
def test_a_run_that_trains_nothing_fails_with_a_line(half_run, tmp_path, capsys, args, message):
    runs = tmp_path / "runs"
    shutil.copytree(half_run / "full", runs)
    code, err = command(capsys, *args, run_dir=runs)
    assert code == 1 and message in error_line(err)


def test_a_finished_run_of_limited_epochs_is_refused_before_anything_is_built(tmp_path, capsys, no_training):
    """Epochs of limit_train_batches=2 rounds (not R = 4): two of them finish the run, and its resume is refused
    the way a run of whole epochs is, before the checkpoint is loaded."""
    limited = ["--trainer.limit_train_batches=2", "--trainer.max_epochs=2"]
    assert command(capsys, *limited, run_dir=tmp_path / "runs")[0] == 0
    no_training.clear()
    code, err = command(capsys, *limited, "--ckpt_path=last", run_dir=tmp_path / "runs")
    assert code == 1 and not no_training
    assert (
        "its run has trained 2 epoch(s) (256 steps) and trainer.max_epochs is 2, so there is nothing to train. "
        "Pass --trainer.max_epochs=3 (or more)" in error_line(err)
    )
    assert "Restoring states" not in err


def test_ckpt_path_last_takes_the_newest_checkpoint_of_this_runs_identity(half_run, tmp_path, capsys):
    """A run of the same name with another learning rate, killed later, does not hide this run's checkpoint."""
    runs = tmp_path / "runs"
    shutil.copytree(half_run / "runs", runs)
    ours = runs / RUN / "version_0" / "checkpoints" / "last.ckpt"
    other = torch.load(ours, weights_only=True)
    other["lit_slowcal_run"]["model.lr"] = 0.03
    (runs / RUN / "version_1" / "checkpoints").mkdir(parents=True)
    torch.save(other, runs / RUN / "version_1" / "checkpoints" / "last.ckpt")  # the newest
    code, err = command(capsys, "--ckpt_path=last", run_dir=runs)
    assert code == 0, err[-3000:]
    resumed = torch.load(runs / RUN / "version_2" / "checkpoints" / "last.ckpt", weights_only=True)
    full = torch.load(half_run / "full" / RUN / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    for key, value in full["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key

    code, err = command(capsys, "--ckpt_path=last", "--model.lr=0.1", run_dir=runs)
    line = error_line(err)
    assert (
        code == 1
        and f"--ckpt_path last: none of the 3 checkpoints of run {RUN} in {runs / RUN} is of this run: " in line
    )
    assert "version_1/checkpoints/last.ckpt (model.lr 0.03 in the checkpoint, 0.1 now)" in line
    assert "version_0/checkpoints/last.ckpt (model.lr 0.01 in the checkpoint, 0.1 now)" in line


def test_a_run_stopped_by_max_steps_mid_epoch_resumes_the_rest_of_the_epoch(half_run, tmp_path, capsys):
    """Stopped by max_steps after 2 of 4 rounds with the default checkpoint_every (10 rounds): its last.ckpt is the
    round's, not the one written after the fit loop counted the epoch done, so the resume trains rounds 3 and 4
    and ends where the uninterrupted run ends (it used to train nothing: "The run trained nothing")."""
    runs = tmp_path / "runs"
    assert command(capsys, "--trainer.max_steps=128", run_dir=runs)[0] == 0
    stopped = torch.load(runs / RUN / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert (stopped["global_step"], stopped["epoch"]) == (128, 0)
    code, err = command(capsys, "--ckpt_path=last", run_dir=runs)
    assert code == 0, err[-3000:]
    resumed = torch.load(runs / RUN / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)
    full = torch.load(half_run / "full" / RUN / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == full["global_step"] == 256
    for key, value in full["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key


def test_max_steps_between_rounds_says_where_the_run_stops(tmp_path, capsys):
    code, err = command(capsys, "--trainer.max_steps=100", run_dir=tmp_path / "runs")
    assert (
        code == 0
        and "note: trainer.max_steps=100 is not a whole number of rounds (64 optimizer steps each): "
        "training stops after the round that reaches it, at step 128"
        in err
    )
    assert torch.load(tmp_path / "runs" / RUN / "version_0" / "checkpoints" / "last.ckpt")["global_step"] == 128


def test_ckpt_path_last_says_which_newer_checkpoint_it_could_not_read(half_run, tmp_path, capsys):
    """A damaged newest last.ckpt is passed over for the newest readable one, with a note naming both."""
    runs = tmp_path / "runs"
    shutil.copytree(half_run / "runs", runs)
    (runs / RUN / "version_1" / "checkpoints").mkdir(parents=True)
    (runs / RUN / "version_1" / "checkpoints" / "last.ckpt").write_bytes(b"\x00" * 100)  # the newest
    code, err = command(capsys, "--ckpt_path=last", "--trainer.max_steps=192", run_dir=runs)
    assert code == 0, err[-3000:]
    (note,) = [line for line in err.splitlines() if line.startswith("note: --ckpt_path last: ")]
    assert (
        "skipped 1 newer checkpoint(s) that cannot be read: version_1/checkpoints/last.ckpt (the file is damaged "
        "or not a PyTorch checkpoint (100 bytes" in note
    )
    assert "resuming from version_0/checkpoints/last.ckpt, the newest readable one of this run" in note
    assert "Use another checkpoint file" not in note
    resumed = torch.load(runs / RUN / "version_2" / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 192  # from version_0's step 128, one more round


def test_test_with_ckpt_path_last_evaluates_this_runs_newest_checkpoint(
    half_run, tmp_path, capsys, closes_the_process_group
):
    runs = tmp_path / "runs"
    shutil.copytree(half_run / "runs", runs)
    code, err = command(capsys, "test", "--ckpt_path=last", "--trainer.limit_test_batches=1", run_dir=runs)
    assert code == 0 and "no last checkpoint available" not in err and "untrained" not in err
    code, err = command(capsys, "test", "--ckpt_path=last", "--model.lr=0.5", run_dir=runs)
    assert code == 1 and "--ckpt_path last: none of the 1 checkpoints of run" in error_line(err)
