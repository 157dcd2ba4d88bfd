"""The main job end to end: ``python -m lit_slowcal fit --config configs/<method>.yaml`` on a small budget."""

import csv
import gzip
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import REPO, subprocess_env

D = 784 * 10 + 10  # logistic regression parameters


def clean_env(tmp_path: Path) -> dict[str, str]:
    """No W&B credentials (HOME without .netrc), no rendezvous variables from other tests."""
    env = subprocess_env()
    env["HOME"] = str(tmp_path / "home")
    env["NETRC"] = str(tmp_path / "home" / ".netrc")
    (tmp_path / "home").mkdir(exist_ok=True)
    return env


def lit_slowcal(tmp_path: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lit_slowcal", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(tmp_path), capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def read_metrics(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(
    ("method", "floats_per_machine_per_round"),
    [("slowcal", 2 * D), ("local_sgd", D), ("minibatch_sgd", D), ("accel_minibatch_sgd", D), ("scaffold", 2 * D)],
)
@pytest.mark.slow
def test_main_job_end_to_end_writes_metrics_and_summary(tmp_path, method, floats_per_machine_per_round):
    M, K, b, rounds = 8, 4, 2, 12
    run_dir = tmp_path / "runs"
    proc = lit_slowcal(
        tmp_path,
        "fit",
        f"--config=configs/{method}.yaml",
        f"--num_machines={M}",
        f"--local_steps={K}",
        f"--batch_size={b}",
        "--eval_every=5",
        f"--trainer.limit_train_batches={rounds}",
        f"--run_dir={run_dir}",
        "--trainer.enable_progress_bar=false",
    )
    out = proc.stdout + proc.stderr
    # W&B without an account: offline, with the line telling how to upload later; never a prompt.
    assert "logging offline" in out and "wandb sync" in out
    assert f"method {method}" in out and f"M={M}  K={K}  b={b}" in out
    assert f"rounds {rounds}/{math.ceil(60000 / (M * K * b))}" in out

    (version,) = (run_dir / f"{method}_M{M}_K{K}_b{b}_seed1").iterdir()
    assert (version / "class_distribution.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((version / "class_counts.csv").read_text().splitlines()) == 1 + M * 10
    assert (version / "config.yaml").exists()
    assert list((version / "wandb").glob("offline-run-*"))
    rows = read_metrics(version / "metrics.csv")

    train = [r for r in rows if r["train_loss"]]
    assert [float(r["round"]) for r in train] == [10, 12]  # every log_every_n_steps = 10 rounds, and the last
    for r in train:
        n = int(float(r["round"]))
        assert float(r["samples_seen"]) == n * M * K * b
        assert float(r["floats_communicated"]) == n * M * floats_per_machine_per_round
        assert math.isfinite(float(r["train_loss"]))
    # Evaluated every 5 rounds and after the last one, on the 10,000 test images.
    evals = [r for r in rows if r["test_acc"]]
    assert [float(r["round"]) for r in evals] == [5, 10, 12]
    assert float(evals[-1]["test_acc"]) > 0.6
    assert float(evals[-1]["test_loss"]) < float(evals[0]["test_loss"]) or float(evals[-1]["test_acc"]) > 0.8
    summary_acc = float(out.split("final test accuracy")[1].split()[0])
    assert summary_acc == pytest.approx(float(evals[-1]["test_acc"]), abs=1e-4)


@pytest.mark.slow
def test_print_config_shows_the_four_settings_once(tmp_path):
    proc = lit_slowcal(tmp_path, "fit", "--config=configs/minibatch_sgd.yaml", "--local_steps=8", "--print_config")
    config = yaml.safe_load(proc.stdout)
    assert (config["method"], config["num_machines"], config["local_steps"], config["batch_size"]) == (
        "minibatch_sgd",
        16,
        8,
        1,
    )
    # Derived values are the run's shape's, not computed while parsing: the data module's are unset.
    assert config["data"]["batch_size"] is None and config["data"]["steps_per_round"] is None
    assert "num_machines" not in config["model"] and "method" not in config["model"]
    assert config["model"]["lr"] == 0.1


@pytest.mark.parametrize(("given", "parsed"), [("1", 1), ("4", 4), ("1.0", 1.0), ("0.25", 0.25)])
def test_participation_keeps_a_count_a_count_and_a_fraction_a_fraction(tmp_path, given, parsed):
    """``--participation=1`` is one machine a round, ``1.0`` all of them: the count must not come back a float."""
    proc = lit_slowcal(tmp_path, "fit", "--config=configs/slowcal.yaml", f"--participation={given}", "--print_config")
    value = yaml.safe_load(proc.stdout)["participation"]
    assert (type(value), value) == (type(parsed), parsed)


def corrupt_root(tmp_path: Path, how: str) -> Path:
    """A copy of the shipped MNIST with one decompressed file broken."""
    raw = tmp_path / "mnist" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for gz in (REPO / "data" / "MNIST" / "raw").glob("*.gz"):
        shutil.copy(gz, raw / gz.name)
    target = raw / "train-labels-idx1-ubyte"
    with gzip.open(raw / "train-labels-idx1-ubyte.gz") as f:
        data = f.read()
    target.write_bytes(data[:100] if how == "size" else b"\x00\x00\x08\x03" + data[4:])
    return tmp_path / "mnist"


BAD_INPUT = [
    # (arguments, texts the message must contain): field, value and what is allowed
    (["--method=fedavg"], ["method", "fedavg", "slowcal, local_sgd, minibatch_sgd, accel_minibatch_sgd, scaffold"]),
    (["--method=scaffold", "--model.server_lr=0"], ["model.server_lr: 0", "> 0"]),
    (["--method=accel_minibatch_sgd", "--model.weight_decay=-1"], ["model.weight_decay: -1", ">= 0"]),
    (["--local_steps=0"], ["local_steps: 0", ">= 1"]),
    (["--num_machines=-4"], ["num_machines: -4", ">= 1"]),
    (["--batch_size=0"], ["batch_size: 0", ">= 1"]),
    (["--eval_every=0"], ["eval_every: 0", ">= 1"]),
    (["--checkpoint_every=-1"], ["checkpoint_every: -1", ">= 0"]),
    (["--model.lr=-0.1"], ["model.lr: -0.1", "> 0"]),
    (["--model.lr=0"], ["model.lr: 0", "> 0"]),
    (["--data.dirichlet_alpha=0"], ["dirichlet_alpha: 0", "> 0", "null"]),
    (["--data.dirichlet_alpha=-1"], ["dirichlet_alpha: -1", "> 0"]),
    (["--data.split=plain"], ["Invalid data.split: 'plain' (allowed: official, balanced, dirichlet)"]),
    (["--model.weight_power=-1"], ["weight_power: -1"]),
    (["--model.gamma=1.5"], ["gamma: 1.5", "(0, 1]"]),
    (
        ["--model.weight_power=1e6"],
        [
            "Invalid model.weight_power: 1000000.0 (must be finite, >= 0 and < 1024: the first "
            "step's weight 2^p overflows float64 beyond"
        ],
    ),
    (
        ["--model.weight_power=86"],
        [
            "Invalid model.weight_power: 86.0 (must be from 0 to 85.75 for this run's 3760 "
            "optimizer steps: beyond it the weights alpha_t = (t+1)^p and their sum overflow)"
        ],
    ),
    (
        ["--model.weight_power=400", "--model.scale_lr_by_weight=true"],
        [
            "Invalid model.weight_power: 400.0 (must be from 0 to 11.33 for this run's 3760 optimizer steps at lr 0.01 with "
            "scale_lr_by_weight (lr (t+1)^p must fit float32)"
        ],
    ),
    (
        [
            "--model.weight_power=17",
            "--model.scale_lr_by_weight=true",
            "--trainer.limit_train_batches=10",
            "--trainer.max_epochs=2",
        ],
        ["Invalid model.weight_power: 17.0 (must be from 0 to 16.17 for this run's 320 "],
    ),
    (["--num_machines=3", "--trainer.devices=2"], ["num_machines = 3", "not divisible", "processes (2"]),
    (
        ["--trainer.strategy=periodic_averaging", "--trainer.strategy.sync_every=8"],
        ["Invalid trainer.strategy.sync_every: 8", "16 for slowcal with local_steps=16", "leave it unset"],
    ),
    (["--data.derived=1"], ["unrecognized arguments: --data.derived=1"]),
    (
        ["--data.steps_per_round=3"],
        ["Invalid data.steps_per_round: 3 (the run's shape has 16, from method, local_steps and batch_size"],
    ),
    (
        ["--trainer.gradient_clip_val=1.0"],
        [
            "Invalid trainer setting: Automatic gradient clipping is not supported for "
            "manual optimization. Remove `Trainer(gradient_clip_val=1.0)` (every method "
            "steps its own optimizer, K steps per round)."
        ],
    ),
    (
        ["--trainer.accumulate_grad_batches=2"],
        ["Invalid trainer setting: Automatic gradient accumulation is not supported for manual optimization. Remove"],
    ),
    (["--run_dir="], ["Invalid run_dir: '' (must be a folder; . for the current one)"]),
    (["--data.root={empty}"], ["missing from", "MNIST/raw", "train-images-idx3-ubyte.gz", "data.root"]),
    (["--data.root={size}"], ["Corrupt MNIST file", "train-labels-idx1-ubyte", "100 bytes, expected 60008"]),
    (["--data.root={magic}"], ["Corrupt MNIST file", "train-labels-idx1-ubyte", "magic number 2051, expected 2049"]),
    (["--threads=-1"], ["Invalid threads: '-1'", "auto", "0 for torch's default", "from 1 to"]),
    (["--threads=x"], ["Invalid threads: 'x'", "auto", "0 for torch's default", "from 1 to"]),
    (["--threads=100000"], ["Invalid threads: '100000'", "auto", "0 for torch's default", "from 1 to"]),
]


@pytest.mark.parametrize(("args", "expected"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_refused_before_training_with_the_field_named(tmp_path, monkeypatch, capsys, args, expected):
    from torchvision.datasets import MNIST

    from lit_slowcal.experiments.main import main
    from lit_slowcal.experiments.train.model import MachinesModel

    def no_download(self):
        raise OSError("no network in this test")

    monkeypatch.setattr(MNIST, "download", no_download)
    trained = []
    monkeypatch.setattr(MachinesModel, "training_step", lambda *a: trained.append(1))
    (tmp_path / "empty").mkdir()
    roots = {
        "empty": tmp_path / "empty",
        "size": corrupt_root(tmp_path / "s", "size"),
        "magic": corrupt_root(tmp_path / "m", "magic"),
    }
    args = [a.format(**roots) for a in args]
    monkeypatch.chdir(REPO)
    with pytest.raises((SystemExit, ValueError, FileNotFoundError)) as info:
        main(["fit", "--config=configs/slowcal.yaml", "--wandb=false", f"--run_dir={tmp_path / 'runs'}", *args])
    captured = capsys.readouterr()
    if isinstance(info.value, SystemExit):
        assert info.value.code != 0
        # One line: the check's own message, without jsonargparse's usage or the link's name.
        lines = [line for line in captured.err.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("lit_slowcal: error: ")]
        assert len(errors) == 1 and not any(line.startswith(("usage:", "error:")) for line in lines), captured.err[
            -2000:
        ]
        assert "compute_fn" not in errors[0]
    message = f"{info.value}\n{captured.err}\n{captured.out}"
    for text in expected:
        assert text in message, message[-2000:]
    assert not trained  # refused before any training step


@pytest.mark.slow
def test_logged_in_without_network_falls_back_to_offline(tmp_path):
    """A W&B key but no reachable server: the run goes on, logged offline, and says so."""
    env = clean_env(tmp_path)
    env["WANDB_API_KEY"] = "0" * 40
    env["WANDB_BASE_URL"] = "http://127.0.0.1:9"  # nothing listens on the discard port
    env["WANDB_INIT_TIMEOUT"] = "5"
    run_dir = tmp_path / "runs"
    cmd = [
        sys.executable,
        "-m",
        "lit_slowcal",
        "fit",
        "--config=configs/slowcal.yaml",
        "--trainer.limit_train_batches=2",
        "--trainer.enable_progress_bar=false",
        f"--run_dir={run_dir}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "cannot reach W&B" in out and "logging offline" in out
    (version,) = (run_dir / "slowcal_M16_K16_b1_seed1").iterdir()
    assert list((version / "wandb").glob("offline-run-*"))
    assert "final test accuracy" in out
