"""Where a run writes (``lit_slowcal.experiments.run.run_folder``): its name, its version folder, and W&B online
or offline through the one fallback the CLI and the stacked trials share."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from in_process import RUN, command, error_line

from lit_slowcal.experiments.run.run_folder import RUN_VERSION_ENV, claim_version, run_name, run_version, start_wandb


@pytest.fixture
def no_wandb_env(monkeypatch, tmp_path):
    for key in (
        "WANDB_API_KEY",
        "WANDB_MODE",
        "WANDB_BASE_URL",
        "WANDB_INIT_TIMEOUT",
        RUN_VERSION_ENV,
        "RANK",
        "SLURM_PROCID",
    ):
        # set, then removed: monkeypatch restores the value before (or its absence) after the test, so what
        # run_version and start_wandb write to os.environ does not reach the tests that follow
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


def test_run_name_and_versions_claimed_one_each(tmp_path, no_wandb_env):
    get = {"method": "slowcal", "num_machines": 16, "local_steps": 4, "batch_size": 2, "seed_everything": 3}.get
    assert run_name(get) == "slowcal_M16_K4_b2_seed3"
    assert [claim_version(tmp_path, "r") for _ in range(3)] == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["version_0", "version_1", "version_2"]
    assert run_version(tmp_path, "r") == (3, True)  # the launcher claims the next one and passes it on
    assert run_version(tmp_path, "r") == (3, False)  # a DDP child (same environment) reuses it


@pytest.mark.parametrize("variable", ["RANK", "SLURM_PROCID"])
def test_under_an_outside_launcher_only_rank_0_claims_a_version(tmp_path, no_wandb_env, monkeypatch, variable):
    """torchrun or SLURM start every rank at once, none with the claimed version: a rank > 0 made an empty
    version folder of its own (and rank 0 then logged into the next one); now it claims nothing."""
    claim_version(tmp_path, "r")
    monkeypatch.setenv(variable, "1")
    assert run_version(tmp_path, "r") == (1, False)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["version_0"]
    monkeypatch.setenv(variable, "0")
    assert run_version(tmp_path, "r") == (1, True)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["version_0", "version_1"]


def test_without_credentials_w_and_b_logs_offline_and_says_how_to_upload(capsys, no_wandb_env):
    calls = []
    run, offline = start_wandb(lambda off: calls.append(off) or "run", "runs/x/version_0")
    assert (run, offline, calls) == ("run", True, [True])
    out = capsys.readouterr().out
    assert out == (
        "W&B: no credentials (WANDB_API_KEY or `wandb login`) found; logging offline. Upload later with "
        "`wandb sync runs/x/version_0/wandb/offline-run-*`, or pass --wandb=false to turn W&B off.\n"
    )


def test_logged_in_but_unreachable_falls_back_to_offline_for_the_runs_that_follow(capsys, monkeypatch, no_wandb_env):
    import os

    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    finished = []
    fake = types.SimpleNamespace(
        finish=lambda exit_code: finished.append(exit_code), teardown=lambda: finished.append("teardown")
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    calls = []

    def start(off):
        calls.append(off)
        if not off:
            raise ConnectionError("no route to host\nmore detail")
        return "offline run"

    assert start_wandb(start, "f") == ("offline run", True)
    assert calls == [False, True] and finished == [1, "teardown"]
    assert os.environ["WANDB_MODE"] == "offline" and os.environ["WANDB_INIT_TIMEOUT"] == "30"
    assert capsys.readouterr().out.startswith(
        "W&B: cannot reach W&B (ConnectionError: no route to host); logging offline."
    )
    calls.clear()
    assert start_wandb(start, "f", announce=False) == ("offline run", True)  # the next run does not wait again
    assert calls == [True] and capsys.readouterr().out == ""


def test_a_process_that_does_not_probe_starts_online_with_credentials(capsys, monkeypatch, no_wandb_env):
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    calls = []
    assert start_wandb(lambda off: calls.append(off) or "online run", "f", probe=False, announce=False) == (
        "online run",
        False,
    )
    assert calls == [False] and capsys.readouterr().out == ""


# ---------------------------------------------------------------------- outputs in the run folder


def test_without_a_logger_every_output_stays_in_the_run_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # the second run used to be refused: config.yaml was in the current folder
        assert command(capsys, "--trainer.logger=false", run_dir=Path("runs"))[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    for version in ("version_0", "version_1"):
        assert sorted(p.name for p in (tmp_path / "runs" / RUN / version).iterdir()) == [
            "checkpoints", "class_counts.csv", "class_distribution.png", "config.yaml"
        ]  # fmt: skip
    code, err = command(
        capsys, "--trainer.logger=false", "--ckpt_path=last", "--trainer.max_epochs=2", run_dir=Path("runs")
    )
    assert code == 0, err[-2000:]
    assert torch.load(tmp_path / "runs" / RUN / "version_2" / "checkpoints" / "last.ckpt")["global_step"] == 2 * 4 * 64


def test_a_run_dir_that_is_not_a_folder_is_one_line_naming_it(tmp_path, capsys, no_training):
    (tmp_path / "a_file").write_text("")
    for run_dir, blocking in (
        (Path("/dev/null"), "/dev/null"),
        (tmp_path / "a_file" / "runs", str(tmp_path / "a_file")),
    ):
        code, err = command(capsys, run_dir=run_dir)
        assert code == 1 and error_line(err) == (
            f"lit_slowcal: error: --run_dir {run_dir}: cannot write {run_dir / RUN / 'version_0'}: {blocking} is not a "
            "folder: pass a folder (it is created if missing) (LIT_SLOWCAL_DEBUG=1 shows the traceback)"
        )
    assert not no_training


def test_a_full_disk_mid_run_is_one_line_naming_run_dir_the_file_and_how_to_continue(tmp_path, capsys, monkeypatch):
    import errno
    import os

    from lit_slowcal.experiments.train.model import MachinesModel

    target = tmp_path / "runs" / RUN / "version_0" / "checkpoints" / ".last.ckpt.tmp"

    def disk_full(self, batch, batch_idx):  # what a write into the run folder meets on a full disk
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/tmp/elsewhere", None, str(target))  # shutil.copy's

    monkeypatch.setattr(MachinesModel, "training_step", disk_full)
    code, err = command(capsys, run_dir=tmp_path / "runs")
    line = error_line(err)
    assert code == 1 and line.startswith(
        f"lit_slowcal: error: --run_dir {tmp_path / 'runs'}: cannot write {target}: the disk is full ("
    ), line
    assert (
        "MiB free there): free space or pass another --run_dir, then continue with the same command and "
        "--ckpt_path last" in line
    )
