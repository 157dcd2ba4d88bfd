"""Torch threads of the main job (``--threads``): the policy, its refusals, and a run that applies it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, subprocess_env

from lit_slowcal.experiments.run import threads as th
from lit_slowcal.experiments.run.threads import AUTO_MAX_THREADS, AUTO_MIN_WORK, WorkSize, choose_threads

DEFAULT_JOB = WorkSize(machines=16, samples=1, features=784)  # M = 16, K = 16, b = 1: one process


@pytest.fixture
def restore_threads(monkeypatch):
    """Torch's threads, the thread variables and the module's record as they were, after the test."""
    saved = torch.get_num_threads()
    for name in th.THREAD_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    for attr in ("exported", "before", "printed"):
        monkeypatch.setattr(th._State, attr, None)
    yield
    torch.set_num_threads(saved)


# ---- the policy as a pure function ------------------------------------------------------------


def test_auto_takes_one_thread_for_small_steps():
    choice = choose_threads("auto", DEFAULT_JOB, cpus=2)
    assert choice.threads == 1
    assert choice.reason == "auto: 16 machines x 1 sample x 784 features per step; --threads N to choose"
    # Every configuration of the paper: at most 64 machines x 64 samples (Minibatch-SGD, K = 64, b = 1).
    assert choose_threads("auto", WorkSize(64, 64, 784), cpus=64).threads == 1
    assert choose_threads("auto", WorkSize(1, AUTO_MIN_WORK - 1, 1), cpus=64).threads == 1


@pytest.mark.parametrize(
    ("cpus", "processes", "expected"),
    [(2, 1, 2), (1, 1, 1), (16, 1, AUTO_MAX_THREADS), (8, 2, 4), (8, 4, 2), (2, 4, 1)],
)
def test_auto_takes_the_cpus_of_its_process_for_large_steps(cpus, processes, expected):
    at_threshold = WorkSize(1, AUTO_MIN_WORK, 1)
    assert choose_threads("auto", at_threshold, cpus=cpus, processes=processes).threads == expected
    big = WorkSize(256, 1024, 784, per_process=True)
    choice = choose_threads("auto", big, cpus=cpus, processes=processes)
    assert choice.threads == expected
    assert "256 machines per process x 1024 samples x 784 features per step" in choice.reason


@pytest.mark.parametrize("name", ["OMP_NUM_THREADS", "MKL_NUM_THREADS"])
def test_auto_keeps_torchs_setting_when_the_environment_sets_threads(name):
    for work in (DEFAULT_JOB, WorkSize(1, AUTO_MIN_WORK, 1)):
        choice = choose_threads("auto", work, cpus=8, environ={name: "3"})
        assert choice.threads is None and f"{name}=3 set" in choice.reason


def test_an_explicit_count_wins_over_everything():
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    assert choose_threads(3, DEFAULT_JOB, cpus=2, environ=env) == th.ThreadChoice(3, "--threads 3")
    assert choose_threads("1", WorkSize(1, AUTO_MIN_WORK, 1), cpus=16).threads == 1


def test_zero_is_torchs_default():
    for env in ({}, {"OMP_NUM_THREADS": "1"}):
        choice = choose_threads(0, DEFAULT_JOB, cpus=2, environ=env)
        assert choice.threads is None and "torch's default" in choice.reason


def test_evaluation_batches_are_described_without_machines():
    work = WorkSize(1, 10_000, 784, what="evaluation batch")
    assert choose_threads("auto", work, cpus=2).reason.startswith(
        "auto: 10000 samples x 784 features per evaluation batch"
    )


# ---- refusals ---------------------------------------------------------------------------------

ALLOWED = (
    f"(must be auto, 0 for torch's default, or an integer from 1 to {4 * os.cpu_count()} (4 x this machine's CPUs))"
)


@pytest.mark.parametrize("value", [-1, "-1", "x", "1.5", 1.5, "", True, None, "two", 4 * os.cpu_count() + 1, "100000"])
def test_bad_values_are_refused_naming_the_field_and_what_is_allowed(value):
    with pytest.raises(ValueError) as info:
        th.parse_threads(value)
    assert str(info.value) == f"Invalid threads: {value!r} {ALLOWED}"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("auto", "auto"), ("AUTO", "auto"), ("0", 0), (0, 0), ("4", 4), (2, 2), (4 * os.cpu_count(), 4 * os.cpu_count())],
)
def test_good_values_parse(value, expected):
    assert th.parse_threads(value) == expected


@pytest.mark.parametrize("args", [["--threads=-1"], ["--threads=x"], ["--threads", "1.5"], ["--threads=100000"]])
def test_the_cli_refuses_bad_values_before_anything_is_built(tmp_path, monkeypatch, capsys, restore_threads, args):
    from lit_slowcal.experiments.main import main

    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config=configs/slowcal.yaml", "--wandb=false", f"--run_dir={tmp_path}", *args])
    assert info.value.code != 0
    value = args[-1].split("=")[-1]
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert errors == [
        f"lit_slowcal: error: argument --threads: Invalid threads: {value!r} {ALLOWED} "
        "(`python -m lit_slowcal fit --help` lists the options)"
    ]
    assert not (tmp_path / "slowcal_M16_K16_b1_seed1").exists()


@pytest.mark.parametrize("threads", [99999, 4 * os.cpu_count() + 1])
def test_the_sweep_refuses_more_threads_than_the_machine_can_run_before_anything_starts(tmp_path, capsys, threads):
    from lit_slowcal.experiments.sweep import main as sweep_main

    code = sweep_main(
        [str(tmp_path / "missing.yaml"), "--workers=1", f"--threads={threads}"]
    )  # refused before the file
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        f"lit_slowcal sweep: error: Invalid --threads: {threads} (must be 0 for torch's default or an integer from 1 to "
        f"{4 * os.cpu_count()} (4 x this machine's CPUs))"
    )


def test_a_bad_value_in_a_config_file_is_refused(tmp_path, monkeypatch, capsys, restore_threads):
    from lit_slowcal.experiments.main import main

    config = tmp_path / "threads.yaml"
    config.write_text("threads: -2\n")
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit):
        main(["fit", "--config=configs/slowcal.yaml", f"--config={config}", "--wandb=false", f"--run_dir={tmp_path}"])
    assert f"Invalid threads: -2 {ALLOWED}" in capsys.readouterr().err


# ---- applying it in a process -------------------------------------------------------------------

BIG = WorkSize(1, AUTO_MIN_WORK, 1)


def test_configure_sets_torch_and_exports_omp_num_threads_and_prints_once(capsys, restore_threads):
    assert th.configure_threads("auto", DEFAULT_JOB) == 1
    assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
    assert th.configure_threads("auto", DEFAULT_JOB) == 1
    out = capsys.readouterr().out
    assert out == "threads: 1 (auto: 16 machines x 1 sample x 784 features per step; --threads N to choose)\n"
    th.configure_threads("auto", DEFAULT_JOB, verbose=False)
    assert capsys.readouterr().out == ""


def test_a_later_run_in_the_same_process_chooses_afresh(capsys, restore_threads):
    before = torch.get_num_threads()
    th.configure_threads("auto", DEFAULT_JOB)
    # OMP_NUM_THREADS=1 is this module's own export, not the user's: a large step gets more threads.
    expected = max(1, min(AUTO_MAX_THREADS, th.usable_cpus()))
    assert th.configure_threads("auto", BIG) == expected == torch.get_num_threads()
    assert os.environ["OMP_NUM_THREADS"] == str(expected)
    # 0: torch's default, i.e. what there was before this module changed anything.
    th.configure_threads(0, DEFAULT_JOB)
    assert torch.get_num_threads() == before and "OMP_NUM_THREADS" not in os.environ
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("threads: 1 (auto:")
    if expected != 1:
        assert lines[1].startswith(f"threads: {expected} (auto: 1 machine x {AUTO_MIN_WORK} samples")


def test_the_users_environment_is_kept(monkeypatch, capsys, restore_threads):
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert th.configure_threads("auto", BIG) == 1 == torch.get_num_threads()
    assert os.environ["OMP_NUM_THREADS"] == "1"
    assert capsys.readouterr().out == "threads: 1 (auto: OMP_NUM_THREADS=1 set; --threads N to choose)\n"
    # An explicit count wins, and is exported for Lightning's launcher and DDP children.
    assert th.configure_threads(2, DEFAULT_JOB) == 2 == torch.get_num_threads()
    assert os.environ["OMP_NUM_THREADS"] == "2"


def test_mkl_num_threads_alone_is_exported_as_omp_num_threads(monkeypatch, restore_threads):
    # Lightning's launcher reads only OMP_NUM_THREADS; without it, it would reset what MKL_NUM_THREADS gave.
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    torch.set_num_threads(1)
    assert th.configure_threads("auto", BIG, verbose=False) == 1
    assert os.environ["OMP_NUM_THREADS"] == "1"


def test_validate_and_test_size_the_evaluation_batch(monkeypatch, capsys, restore_threads):
    from lit_slowcal.experiments.run.cli import SlowcalCLI

    class Stop(Exception):
        pass

    def stop(self, **kwargs):
        raise Stop

    # Torch's threads are set from the run's shape, before the trainer is built.
    monkeypatch.setattr(SlowcalCLI, "_build_trainer", stop)
    monkeypatch.chdir(REPO)
    with pytest.raises(Stop):
        SlowcalCLI(args=["test", "--config=configs/slowcal.yaml", "--wandb=false", "--data.eval_batch_size=500"])
    assert capsys.readouterr().out.startswith(
        "threads: 1 (auto: 500 samples x 784 features per evaluation batch; --threads N to choose)"
    )
    with pytest.raises(Stop):
        SlowcalCLI(
            args=["fit", "--config=configs/slowcal.yaml", "--trainer.devices=2", "--num_machines=8", "--threads=3"]
        )
    assert capsys.readouterr().out.startswith("threads: 3 (--threads 3)")
    assert torch.get_num_threads() == 3


# ---- end to end --------------------------------------------------------------------------------

# Added to the job with --trainer.callbacks+=: torch's threads in every round and whether W&B is loaded.
PROBE = r"""
import os, sys, torch
import lightning.pytorch as pl

class Probe(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        line = (f"probe: rank {trainer.global_rank} threads {torch.get_num_threads()} "
                f"omp {os.environ.get('OMP_NUM_THREADS')} wandb {'wandb' in sys.modules}\n")
        os.write(1, line.encode())  # one write: the ranks share the pipe
"""

PROBE_LINE = r"probe: rank \d+ threads \d+ omp \S+ wandb (?:True|False)"


def run_job(tmp_path: Path, *args: str) -> str:
    (tmp_path / "probe_callback.py").write_text(PROBE)
    env = subprocess_env(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    for name in th.THREAD_ENV_VARS:  # torch's and Lightning's defaults, as for a user who set nothing
        env.pop(name, None)
    cmd = [
        sys.executable, "-m", "lit_slowcal", "fit", "--config=configs/slowcal.yaml", "--wandb=false",
        f"--run_dir={tmp_path / 'runs'}", "--trainer.limit_train_batches=2", "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false", "--trainer.callbacks+=probe_callback.Probe", *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
def test_the_main_job_trains_with_the_thread_count_it_prints(tmp_path):
    out = run_job(tmp_path)
    lines = re.findall(r"^threads: .*$", out, re.M)
    assert lines == ["threads: 1 (auto: 16 machines x 1 sample x 784 features per step; --threads N to choose)"]
    probes = re.findall(PROBE_LINE, out)
    assert probes == ["probe: rank 0 threads 1 omp 1 wandb False"] * 2  # and W&B is never imported


@pytest.mark.slow
def test_ddp_processes_keep_the_chosen_count(tmp_path):
    # Lightning's launcher would give each of 2 processes CPUs / 2 threads; the exported count wins.
    out = run_job(tmp_path, "--trainer.devices=2", "--threads=2")
    assert re.findall(r"^threads: .*$", out, re.M) == ["threads: 2 (--threads 2)"]  # rank 0 only
    probes = sorted(re.findall(PROBE_LINE, out))
    assert (
        probes == ["probe: rank 0 threads 2 omp 2 wandb False"] * 2 + ["probe: rank 1 threads 2 omp 2 wandb False"] * 2
    )
