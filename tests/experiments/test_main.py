"""Failures a user can cause, one table per class, each row a case found on a fresh clone: the command
(``lit_slowcal.experiments.main``) refuses or explains in one line (``lit_slowcal: error: ...``, exit 1)
before training, and loses nothing. The classes a module owns are tested with it: a resume of a different
run (test_identity.py), nothing left to train and ``--ckpt_path last`` (test_resume.py), resource limits
(test_limits.py), outputs in the run folder (test_run_folder.py), the final round's metrics
(test_rounds.py), concurrent processes (sweep/test_results.py, test_data.py).

Runs are tiny (M = 4, K = 64, b = 64: R = 4 rounds) and run in this process through the command's own
``main`` (tests/in_process.py), except where the command's stderr is the point.
"""

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, subprocess_env
from in_process import RUN, command, error_line

from lit_slowcal.experiments.main import DEBUG_ENV, main
from lit_slowcal.experiments.train.model import MachinesModel

# ---------------------------------------------------------------------- unreadable checkpoints


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


@pytest.mark.slow
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
def test_a_checkpoint_of_another_kind_or_a_device_the_machine_lacks_is_one_line(
    tmp_path, capsys, no_training, args, message
):
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


def test_sigterm_ends_fit_with_status_143_and_how_to_continue(tmp_path, capsys, monkeypatch):
    """A real SIGTERM to this process in round 2: Lightning finishes the round and raises its SIGTERMException
    (a SystemExit of status 0), which the command turns into 143, as a scheduler expects of a terminated job."""
    import os
    import signal

    rounds = []
    step = MachinesModel.training_step

    def terminated(self, batch, batch_idx):
        rounds.append(batch_idx)
        if batch_idx == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # Lightning's handler, installed for the fit, records it
        return step(self, batch, batch_idx)

    monkeypatch.setattr(MachinesModel, "training_step", terminated)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        code, err = command(capsys, "--checkpoint_every=1", run_dir=tmp_path / "runs")
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert code == 143, err[-2000:]
    assert "Stopped by SIGTERM. Continue with the same command and --ckpt_path last." in err
    assert rounds == [0, 1]  # stopped after the round it came in, not at the end of the run
    checkpoint = torch.load(tmp_path / "runs" / RUN / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 2 * 64  # two rounds of K = 64 steps: what it continues from


ONE_LINE = [
    (["--model.lr=nan"], 2, "model.lr: 'nan' is not a number or null"),
    (["--data.problem=Foo"], 2, "data.problem: 'Foo' is not a problem (MNIST, Synthetic, Quadratic, StdlibChars, or a Problem's import path) or null"),
    (["--seed_everything=-1"], 2, "Invalid seed_everything: -1 (must be an integer from 0 to 4294967295"),
    (["--config={tmp}/empty.yaml"], 2, "--config {tmp}/empty.yaml: the file is empty"),
    (["--config={tmp}/binary.yaml"], 2, "--config {tmp}/binary.yaml: not a text file"),
    (["--ckpt_path="], 1, "--ckpt_path is empty: pass a checkpoint file, or last"),
    (["--ckpt_path={tmp}"], 1, "--ckpt_path {tmp}: it is a folder, not a checkpoint file: pass a file, e.g. a run's "
     "<run_dir>/<run name>/version_<n>/checkpoints/last.ckpt, or last for this run's newest"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "status", "message"), ONE_LINE, ids=[" ".join(a) for a, _, _ in ONE_LINE])
def test_values_and_files_the_parser_meets_are_one_line_naming_them(
    tmp_path, capsys, no_training, args, status, message
):
    (tmp_path / "empty.yaml").write_text("\n")
    (tmp_path / "binary.yaml").write_bytes(b"\x90\x00\xff" * 10)
    code, err = command(capsys, *(a.format(tmp=tmp_path) for a in args), run_dir=tmp_path / "runs")
    assert code == status and message.format(tmp=tmp_path) in error_line(err) and not no_training
    assert "Union subtypes" not in err and "numpy accepts" not in err


def test_test_without_a_checkpoint_says_it_evaluates_the_untrained_model(tmp_path, capsys, closes_the_process_group):
    code, err = command(capsys, "test", "--trainer.limit_test_batches=1", run_dir=tmp_path / "runs")
    assert code == 0 and "note: test without --ckpt_path evaluates the untrained starting model" in err


def test_the_command_ends_the_process_group_its_run_made(tmp_path, capsys, monkeypatch):
    """Lightning leaves the group it makes to the script; one alive at the interpreter's exit occasionally
    aborts the process after the run (gloo: "terminate called without an active exception"). A group the
    caller made before the command is the caller's, and stays."""
    import lit_slowcal.experiments.run.cli as cli

    def run_that_makes_a_group(args):
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        assert torch.distributed.is_initialized()

    monkeypatch.setattr(cli, "run", run_that_makes_a_group)
    main(["fit"])
    assert not torch.distributed.is_initialized()
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store2'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(cli, "run", lambda args: None)
        main(["fit"])
        assert torch.distributed.is_initialized()
    finally:
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------- the command's start and exit


def test_the_command_freezes_its_imports_and_collects_what_comes_after():
    """``python -m lit_slowcal`` imports the command's modules with the garbage collector off, then freezes what
    they made (``gc.freeze``: collections and the interpreter's exit skip it, 0.6 s and about 1 s) and turns the
    collector on: objects made afterwards are collected as usual."""
    probe = (
        "import atexit, gc, runpy, sys\n"
        "sys.argv = ['lit_slowcal', 'report', '--help']\n"
        "def after():\n"
        "    class Cycle: pass\n"
        "    a, b = Cycle(), Cycle(); a.b, b.a = b, a; del a, b\n"
        "    print('frozen', gc.get_freeze_count(), 'enabled', gc.isenabled(), 'collected', gc.collect() >= 2)\n"
        "atexit.register(after)\n"
        "runpy.run_module('lit_slowcal', run_name='__main__')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    words = done.stdout.strip().splitlines()[-1].split()
    assert words[0] == "frozen" and int(words[1]) > 100_000  # torch and Lightning: hundreds of thousands of objects
    assert words[2:] == ["enabled", "True", "collected", "True"]
