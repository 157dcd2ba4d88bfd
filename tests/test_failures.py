"""Failures a user can cause, one table per class, each row a case found on a fresh clone: the command
refuses or explains in one line (``lit_slowcal: error: ...``, exit 1) before training, and loses nothing.

Runs are tiny (M = 4, K = 64, b = 64: R = 4 rounds) and run in this process through the command's own
``main``, except where processes are the point (concurrent writers, the command's stderr).
"""

import gzip
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import REPO, subprocess_env

from lit_slowcal.experiments import limits
from lit_slowcal.experiments.identity import MAY_CHANGE_ON_RESUME
from lit_slowcal.experiments.main import DEBUG_ENV, main
from lit_slowcal.experiments.model import MachinesModel

SMALL = ["--num_machines=4", "--local_steps=64", "--batch_size=64"]  # R = ceil(60000 / 16384) = 4 rounds
RUN = "slowcal_M4_K64_b64_seed1"


def command(capsys, *args: str, run_dir: Path) -> tuple[int, str]:
    """``python -m lit_slowcal fit ...`` in this process: (exit status, stderr)."""
    argv = [*args] if args and args[0] in ("fit", "test", "validate") else ["fit", *args]
    base = [f"--config={REPO / 'configs' / 'slowcal.yaml'}", f"--data.root={REPO / 'data'}", "--wandb=false",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", f"--run_dir={run_dir}"]
    capsys.readouterr()
    try:
        main([argv[0], *base, *SMALL, *argv[1:]])
        code = 0
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    return code, capsys.readouterr().err


def error_line(stderr: str) -> str:
    """The one error line; nothing else on stderr looks like an error or a traceback."""
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.startswith("lit_slowcal: error: ")]
    assert len(lines) == 1, stderr[-3000:]
    assert "weights_only=False" not in stderr  # never advice that weakens safety
    return lines[0]


@pytest.fixture()
def no_training(monkeypatch):
    """Records training steps: a refusal must come before the first."""
    steps = []
    step = MachinesModel.training_step
    monkeypatch.setattr(MachinesModel, "training_step", lambda self, b, i: (steps.append(i), step(self, b, i))[1])
    return steps


@pytest.fixture(scope="module")
def half_run(tmp_path_factory):
    """A run stopped after 2 of its 4 rounds (max_steps), its last.ckpt, and the same run uninterrupted."""
    folder = tmp_path_factory.mktemp("half")
    capsys = _Capture()
    assert command(capsys, "--trainer.max_steps=128", "--checkpoint_every=1", run_dir=folder / "runs")[0] == 0
    assert command(capsys, run_dir=folder / "full")[0] == 0
    return folder


class _Capture:
    """capsys for a module fixture: stderr is not needed there."""

    def readouterr(self):
        return type("Out", (), {"err": ""})()


# ---------------------------------------------------------------------- 1. resume of a different run

DIFFERENT_RUN = [
    # (arguments, the difference named), each from a case of the issue
    (["--ckpt_path=last", "--model.lr=0.1"], "model.lr 0.01 in the checkpoint, 0.1 now"),
    (["--ckpt_path=last", "--model.weight_power=2"], "model.weight_power 1.0 in the checkpoint, 2.0 now"),
    (["--ckpt_path=last", "--data.dirichlet_alpha=1.0"], "data.dirichlet_alpha 0.1 in the checkpoint, 1.0 now"),
    (["--ckpt_path={ckpt}", "--local_steps=8"], "local_steps 64 in the checkpoint, 8 now"),
    (["--ckpt_path={ckpt}", "--method=local_sgd"], 'method "slowcal" in the checkpoint, "local_sgd" now'),
    (["--ckpt_path={ckpt}", "--num_machines=32"], "num_machines 4 in the checkpoint, 32 now"),
    (["--ckpt_path={ckpt}", "--seed_everything=2", "--model.gamma=0.5"],
     "model.gamma null in the checkpoint, 0.5 now; seed_everything 1 in the checkpoint, 2 now"),
    (["test", "--ckpt_path={ckpt}", "--model.lr=0.1"], "Cannot test with {ckpt}: it is a different run: model.lr"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "named"), DIFFERENT_RUN, ids=[" ".join(a) for a, _ in DIFFERENT_RUN])
def test_resuming_a_different_run_is_refused_naming_each_key_with_both_values(
    half_run, tmp_path, capsys, no_training, args, named
):
    runs = tmp_path / "runs"
    shutil.copytree(half_run / "runs", runs)
    ckpt = runs / RUN / "version_0" / "checkpoints" / "last.ckpt"
    code, err = command(capsys, *(a.format(ckpt=ckpt) for a in args), run_dir=runs)
    line = error_line(err)
    assert code == 1 and named.format(ckpt=ckpt) in line
    assert "(only run_dir, eval_every, checkpoint_every, threads, wandb" in line and "trainer.{max_epochs" in line
    assert not no_training
    assert sorted(p.name for p in (runs / RUN).iterdir()) == ["version_0"]  # nothing new was written


def test_what_may_change_on_resume_changes_and_the_run_ends_as_if_uninterrupted(half_run, tmp_path, capsys):
    runs = tmp_path / "runs"
    shutil.copytree(half_run / "runs", runs)
    allowed = ["--eval_every=3", "--checkpoint_every=2", "--threads=1", "--trainer.log_every_n_steps=1"]
    assert {a[2:].split("=")[0] for a in allowed} <= set(MAY_CHANGE_ON_RESUME)
    code, err = command(capsys, "--ckpt_path=last", *allowed, run_dir=runs)
    assert code == 0, err[-3000:]
    resumed = torch.load(runs / RUN / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)
    full = torch.load(half_run / "full" / RUN / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == full["global_step"] == 4 * 64
    for key, value in full["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key
    assert resumed["lit_slowcal_run"] == full["lit_slowcal_run"]
    assert full["lit_slowcal_run"]["local_steps"] == 64 and full["lit_slowcal_run"]["model.lr"] == 0.01


def test_a_checkpoint_without_an_identity_is_compared_on_the_models_hyperparameters(half_run, tmp_path, capsys):
    old = torch.load(half_run / "runs" / RUN / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    del old["lit_slowcal_run"]  # as written before identities were stored
    torch.save(old, tmp_path / "old.ckpt")
    code, err = command(capsys, f"--ckpt_path={tmp_path / 'old.ckpt'}", "--model.lr=0.03", run_dir=tmp_path / "runs")
    assert code == 1 and "model.lr 0.01 in the checkpoint, 0.03 now" in error_line(err)


# ---------------------------------------------------------------------- 5. unreadable checkpoints


def _pickled_object(path: Path) -> None:
    path.write_bytes(pickle.dumps(Path("anything")))  # not plain data: torch's weights_only refuses it


CORRUPT = [
    ("empty", lambda p: p.write_bytes(b""), "the file is empty (0 bytes)"),
    ("random bytes", lambda p: p.write_bytes(torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0),
                                                           dtype=torch.uint8).numpy().tobytes()),
     "the file is damaged or not a PyTorch checkpoint (5000 bytes"),
    ("an object", _pickled_object, "the file is damaged or not a PyTorch checkpoint (51 bytes; it holds something "
     "other than tensors and plain values, which is not loaded for safety)"),
    ("truncated", None, "the file is damaged or not a PyTorch checkpoint (30000 bytes"),
]  # fmt: skip


@pytest.mark.parametrize("subcommand", ["fit", "test"])
@pytest.mark.parametrize(("what", "write", "message"), CORRUPT, ids=[c[0] for c in CORRUPT])
def test_an_unreadable_checkpoint_gets_one_line_without_unsafe_advice(
    half_run, tmp_path, capsys, no_training, subcommand, what, write, message
):
    path = tmp_path / "last.ckpt"
    if write is None:
        path.write_bytes((half_run / "runs" / RUN / "version_0" / "checkpoints" / "last.ckpt").read_bytes()[:30000])
    else:
        write(path)
    code, err = command(capsys, subcommand, f"--ckpt_path={path}", run_dir=tmp_path / "runs")
    line = error_line(err)
    assert code == 1 and f"Cannot read checkpoint {path}: {message}" in line, line
    assert "without --ckpt_path" in line and not no_training


def test_the_command_prints_one_line_and_the_traceback_only_when_asked(tmp_path, capsys, monkeypatch):
    from lit_slowcal.checkpoint_io import CheckpointReadError

    (tmp_path / "empty.ckpt").write_bytes(b"")
    args = ["fit", f"--config={REPO / 'configs' / 'slowcal.yaml'}", f"--data.root={REPO / 'data'}", "--wandb=false",
            f"--ckpt_path={tmp_path / 'empty.ckpt'}"]  # fmt: skip
    plain = subprocess.run(  # the real command: its whole stderr, its exit status
        [sys.executable, "-m", "lit_slowcal", *args], cwd=tmp_path, env=subprocess_env(PYTHONPATH=str(REPO)),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert plain.returncode == 1, plain.stderr[-3000:]
    assert plain.stderr.strip().splitlines()[-1] == (
        f"lit_slowcal: error: Cannot read checkpoint {tmp_path / 'empty.ckpt'}: the file is empty (0 bytes). Use "
        f"another checkpoint file, or start the run afresh without --ckpt_path. ({DEBUG_ENV}=1 shows the traceback)"
    )
    assert "Traceback" not in plain.stderr
    monkeypatch.setenv(DEBUG_ENV, "1")  # asked: the exception itself, with its traceback
    with pytest.raises(CheckpointReadError, match="the file is empty"):
        main(args)


# ---------------------------------------------------------------------- 3. resource limits

LIMITS = [
    # (arguments, available memory in bytes, message)
    (["--num_machines=16", "--local_steps=16", "--batch_size=100000"], 20 * 2**30,
     "A round does not fit in memory: 16 machines x 16 steps x 100000 samples per step x 784 features need 150.3 GiB "
     "(with the next round, fetched ahead), and 20.0 GiB are available. Use a batch_size of at most 13306 per step"),
    (["--num_machines=16", "--local_steps=16", "--batch_size=20000"], 2**40,
     "Invalid batch_size: each machine takes 20000 samples per step, more than any machine's shard of the split "
     "(16 machines, Dirichlet alpha=0.1, official) holds: 944 to 10190 samples (machine 7). Use a per-step batch of "
     "at most 10190"),
    (["--method=minibatch_sgd", "--num_machines=16", "--local_steps=16", "--batch_size=700"], 2**40,
     "each machine takes 11200 samples per step, more than any machine's shard"),
    (["--num_machines=16", "--data.split=balanced", "--batch_size=5000"], 2**40,
     "(16 machines, Dirichlet alpha=0.1, balanced) holds: 3750 to 3750 samples (machine 0)"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "available", "message"), LIMITS, ids=[" ".join(a) for a, _, _ in LIMITS])
def test_a_run_beyond_the_resources_is_refused_with_the_numbers(
    tmp_path, capsys, monkeypatch, no_training, args, available, message
):
    monkeypatch.setattr(limits, "available_memory", lambda: available)
    code, err = command(capsys, *args, run_dir=tmp_path / "runs")
    assert code == 1 and message in error_line(err)
    assert not no_training


def test_round_bytes_counts_two_rounds_of_samples_labels_and_indices():
    # 2 rounds x 4 machines x 3 steps x 5 samples x (10 float32 features + int64 label + int64 index)
    assert limits.round_bytes(4, 3, 5, 10) == 2 * 60 * (40 + 8 + 8)
    assert limits.available_memory() > 0
    limits.check_round_fits(4, 3, 5, 10, available=limits.round_bytes(4, 3, 5, 10))  # exactly fits


def test_a_batch_larger_than_some_shards_only_is_allowed():
    # The paper's split at M = 64 gives some machines 39 samples; Minibatch-SGD at K = 64 takes 64 a step.
    shards = [torch.arange(39), torch.arange(900)]
    limits.check_shards_hold_a_batch(shards, 900, "2 machines")
    with pytest.raises(ValueError, match="901 samples per step, more than any machine's shard of the split "
                       r"\(2 machines\) holds: 39 to 900 samples \(machine 1\)"):  # fmt: skip
        limits.check_shards_hold_a_batch(shards, 901, "2 machines")


# ---------------------------------------------------------------------- 4. outputs in the run folder


def test_without_a_logger_every_output_stays_in_the_run_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for _ in range(2):  # the second run used to be refused: config.yaml was in the current folder
        assert command(capsys, "--trainer.logger=false", run_dir=Path("runs"))[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    for version in ("version_0", "version_1"):
        assert sorted(p.name for p in (tmp_path / "runs" / RUN / version).iterdir()) == [
            "checkpoints", "class_counts.csv", "class_distribution.png", "config.yaml"
        ]  # fmt: skip
    code, err = command(capsys, "--trainer.logger=false", "--ckpt_path=last", "--trainer.max_epochs=2", run_dir=Path("runs"))
    assert code == 0, err[-2000:]
    assert torch.load(tmp_path / "runs" / RUN / "version_2" / "checkpoints" / "last.ckpt")["global_step"] == 2 * 4 * 64


# ---------------------------------------------------------------------- 7. runs that train nothing, final metrics

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


@pytest.mark.parametrize("eval_every", [4, 3])  # R = 4: eval_every divides R, and does not
def test_the_final_rounds_train_metrics_are_written(tmp_path, capsys, eval_every):
    assert command(capsys, f"--eval_every={eval_every}", run_dir=tmp_path)[0] == 0
    rows = (tmp_path / RUN / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    trained = [dict(zip(header, r.split(","))) for r in rows[1:]]
    trained = [r for r in trained if r["train_loss"]]
    assert [float(r["round"]) for r in trained] == [4.0]  # log_every_n_steps = 10 > R: only the final round
    assert float(trained[0]["samples_seen"]) == 4 * 4 * 64 * 64


# ---------------------------------------------------------------------- 2 and 6. concurrent processes

# Both processes start together: each says it is ready, and waits for the other.
BARRIER = textwrap.dedent(
    """
    import pathlib, sys, time
    here = pathlib.Path(sys.argv[-1])
    (here / f"ready.{sys.argv[-2]}").touch()
    while len(list(here.glob("ready.*"))) < 2:
        time.sleep(0.002)
    """
)
WRITER = textwrap.dedent(
    """
    import sys, time
    from lit_slowcal.experiments.sweep.results import ResultsFile
    path, name = sys.argv[1], sys.argv[2]
    results = ResultsFile(path)  # read before the other writer's records exist, like a sweep's start
    """
) + BARRIER + textwrap.dedent(
    """
    for i in range(40):
        results.put({"params": {"writer": name, "i": i}, "status": "failed"})
        if i % 8 == 0:  # a retried trial: its record is replaced, not duplicated
            results.put({"params": {"writer": name, "i": i}, "status": "finished"})
    """
)


def test_two_processes_writing_one_results_file_lose_and_duplicate_nothing(tmp_path):
    path = tmp_path / "X.jsonl"
    path.write_text(json.dumps({"params": {"writer": "earlier"}, "status": "finished"}) + "\n")
    path.chmod(0o640)
    env = subprocess_env(PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), name, str(tmp_path)], env=env) for name in "ab"]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    keys = [json.dumps(r["params"], sort_keys=True) for r in records]
    assert len(keys) == len(set(keys)) == 1 + 2 * 40
    assert {(r["params"].get("i"), r["status"]) for r in records if r["params"]["writer"] == "a"} == {
        (i, "finished" if i % 8 == 0 else "failed") for i in range(40)
    }
    assert path.stat().st_mode & 0o7777 == 0o640


def test_appending_a_record_keeps_the_file_itself(tmp_path):
    from lit_slowcal.experiments.sweep.results import ResultsFile

    path = tmp_path / "r.jsonl"
    ResultsFile(path).put({"params": {"a": 1}, "status": "finished"})
    path.chmod(0o604)
    link = tmp_path / "link.jsonl"
    os.link(path, link)  # a second name: appends must reach it too
    ResultsFile(path).put({"params": {"a": 2}, "status": "finished"})
    assert link.read_text() == path.read_text() and len(path.read_text().splitlines()) == 2
    assert path.stat().st_mode & 0o7777 == 0o604


def test_two_processes_preparing_mnist_on_a_fresh_copy_both_succeed(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in (REPO / "data" / "MNIST" / "raw").glob("*.gz"):
        shutil.copy(gz, raw / gz.name)
    prepare = "from pathlib import Path\nfrom lit_slowcal.experiments.mnist import prepare_mnist\n" + BARRIER + (
        "prepare_mnist(Path(sys.argv[1]))\n"
    )
    env = subprocess_env(PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen([sys.executable, "-c", prepare, str(tmp_path), name, str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True)
        for name in "ab"
    ]  # fmt: skip
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors
    names = ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", "train-images-idx3-ubyte", "train-labels-idx1-ubyte"]
    assert sorted(p.name for p in raw.iterdir() if not p.name.endswith(".gz")) == [".prepare.lock", *names]  # no temp
    for name in names:
        with gzip.open(raw / f"{name}.gz") as f:
            assert (raw / name).read_bytes() == f.read(), name


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
    assert code == 1 and f"--ckpt_path last: none of the 3 checkpoints of run {RUN} in {runs / RUN} is of this run: " in line
    assert "version_1/checkpoints/last.ckpt (model.lr 0.03 in the checkpoint, 0.1 now)" in line
    assert "version_0/checkpoints/last.ckpt (model.lr 0.01 in the checkpoint, 0.1 now)" in line


def _not_lightning(path: Path) -> None:
    torch.save({"a": torch.zeros(1)}, path)


MACHINE_OR_FILE = [
    (["--ckpt_path={tmp}/plain.ckpt"], "Cannot resume {tmp}/plain.ckpt: it is not a Lightning checkpoint (it lacks "
     "pytorch-lightning_version, state_dict, global_step; its keys: 'a')"),
    (["test", "--ckpt_path={tmp}/plain.ckpt"], "Cannot test with {tmp}/plain.ckpt: it is not a Lightning checkpoint"),
    (["--trainer.accelerator=mps"], "This machine cannot meet trainer.accelerator=mps, trainer.devices=1: `MPSAccelerator` can not run"),
    (["--trainer.devices=0"], "This machine cannot meet trainer.accelerator=cpu, trainer.devices=0: `Trainer(devices='0')` value "
     "is not a valid input using cpu accelerator. (use --trainer.devices=N, N >= 1)"),
    (["--trainer.max_steps=-5"], "Invalid trainer setting: `max_steps` must be a non-negative integer or -1 (infinite steps). "
     "You passed in -5."),
]  # fmt: skip
if not torch.cuda.is_available():  # a machine without a GPU asked for one
    MACHINE_OR_FILE.append((["--trainer.accelerator=gpu"], "This machine cannot meet trainer.accelerator=gpu, trainer.devices=1: "
                            "No supported gpu backend found! (--trainer.accelerator=cpu runs on any machine)"))  # fmt: skip


@pytest.mark.parametrize(("args", "message"), MACHINE_OR_FILE, ids=[" ".join(a) for a, _ in MACHINE_OR_FILE])
def test_a_checkpoint_of_another_kind_or_a_device_the_machine_lacks_is_one_line(tmp_path, capsys, no_training, args, message):
    _not_lightning(tmp_path / "plain.ckpt")
    code, err = command(capsys, *(a.format(tmp=tmp_path) for a in args), run_dir=tmp_path / "runs")
    assert code == 1 and message.format(tmp=tmp_path) in error_line(err) and not no_training


def test_ctrl_c_ends_fit_with_status_130_and_how_to_continue(tmp_path, capsys, monkeypatch):
    import signal

    step = MachinesModel.training_step

    def interrupted(self, batch, batch_idx):
        if batch_idx == 2:
            raise KeyboardInterrupt
        return step(self, batch, batch_idx)

    monkeypatch.setattr(MachinesModel, "training_step", interrupted)
    sigint = signal.getsignal(signal.SIGINT)  # Lightning ignores SIGINT after a Ctrl-C
    try:
        code, err = command(capsys, "--checkpoint_every=1", run_dir=tmp_path / "runs")
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert code == 130
    assert "Interrupted (Ctrl-C). Continue with the same command and --ckpt_path last" in err
    assert (tmp_path / "runs" / RUN / "version_0" / "checkpoints" / "last.ckpt").is_file()  # what it continues from


ONE_LINE = [
    (["--model.lr=nan"], 2, "model.lr: 'nan' is not a number or null"),
    (["--data.problem=Foo"], 2, "data.problem: 'Foo' is not a problem (MNIST, Synthetic, Quadratic, or a Problem's import path) or null"),
    (["--seed_everything=-1"], 2, "Invalid seed_everything: -1 (must be an integer from 0 to 4294967295"),
    (["--config={tmp}/empty.yaml"], 2, "--config {tmp}/empty.yaml: the file is empty"),
    (["--config={tmp}/binary.yaml"], 2, "--config {tmp}/binary.yaml: not a text file"),
    (["--ckpt_path="], 1, "--ckpt_path is empty: pass a checkpoint file, or last"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "status", "message"), ONE_LINE, ids=[" ".join(a) for a, _, _ in ONE_LINE])
def test_values_and_files_the_parser_meets_are_one_line_naming_them(tmp_path, capsys, no_training, args, status, message):
    (tmp_path / "empty.yaml").write_text("\n")
    (tmp_path / "binary.yaml").write_bytes(b"\x90\x00\xff" * 10)
    code, err = command(capsys, *(a.format(tmp=tmp_path) for a in args), run_dir=tmp_path / "runs")
    assert code == status and message.format(tmp=tmp_path) in error_line(err) and not no_training
    assert "Union subtypes" not in err and "numpy accepts" not in err


def test_test_without_a_checkpoint_says_it_evaluates_the_untrained_model(tmp_path, capsys, closes_the_process_group):
    code, err = command(capsys, "test", "--trainer.limit_test_batches=1", run_dir=tmp_path / "runs")
    assert code == 0 and "note: test without --ckpt_path evaluates the untrained starting model" in err


@pytest.fixture()
def closes_the_process_group():
    """`test` in this process leaves its process group open (fit closes it; the command's own process exits):
    closed afterwards, or a later test's forked sweep workers would inherit gloo's threads mid-lock and hang."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_test_with_ckpt_path_last_evaluates_this_runs_newest_checkpoint(half_run, tmp_path, capsys, closes_the_process_group):
    runs = tmp_path / "runs"
    shutil.copytree(half_run / "runs", runs)
    code, err = command(capsys, "test", "--ckpt_path=last", "--trainer.limit_test_batches=1", run_dir=runs)
    assert code == 0 and "no last checkpoint available" not in err and "untrained" not in err
    code, err = command(capsys, "test", "--ckpt_path=last", "--model.lr=0.5", run_dir=runs)
    assert code == 1 and "--ckpt_path last: none of the 1 checkpoints of run" in error_line(err)


def test_resume_takes_settings_that_do_not_change_training(half_run, tmp_path, capsys):
    runs = tmp_path / "runs"
    shutil.copytree(half_run / "runs", runs)
    same = ["--objective=false", "--diagnostics=false", f"--cache_dir={tmp_path / 'cache'}", "--data.problem=MNIST"]
    code, err = command(capsys, "--ckpt_path=last", *same, run_dir=runs)
    assert code == 0, err[-3000:]
    resumed = torch.load(runs / RUN / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)
    full = torch.load(half_run / "full" / RUN / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    for key, value in full["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key
