"""``python -m lit_slowcal sweep``: W&B sweep files expanded, checked against the CLI and run here."""

import csv
import glob
import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import subprocess_env

from lit_slowcal.experiments import sweep as sw
from lit_slowcal.experiments.sweep.contract import MEASURED
from lit_slowcal.experiments.train.methods import METHODS, TABLE1_METHODS

REPO = Path(__file__).resolve().parents[3]
SWEEP_FILES = sorted((REPO / "sweeps").glob("*.yaml"))
COMMAND = ["${env}", "python", "-m", "lit_slowcal", "fit", "--config", "configs/paper.yaml", "${args}"]


def config(parameters, method="grid", **extra):
    return {"method": method, "parameters": parameters, "command": COMMAND, **extra}


def clean_env(tmp_path: Path) -> dict[str, str]:
    """No W&B credentials (HOME without .netrc), no W&B or rendezvous variables from elsewhere."""
    env = subprocess_env()
    (tmp_path / "home").mkdir(exist_ok=True)
    env.update(HOME=str(tmp_path / "home"), NETRC=str(tmp_path / "home" / ".netrc"))
    return env


@pytest.fixture(scope="module")
def command_line():
    return sw.CommandLine()


# ---------------------------------------------------------------------------------------- expansion


def test_grid_is_the_product_of_values_in_wandb_order():
    params = {
        "model.lr": {"values": [0.01, 0.1]},
        "method": {"values": ["slowcal", "local_sgd"]},
        "num_machines": {"value": 4},
    }
    sweep = sw.parse_sweep(config(params))
    assert sweep.param_names == ["method", "model.lr", "num_machines"]  # W&B sorts the names
    assert [p.distribution for p in sweep.params] == ["categorical", "categorical", "constant"]
    assert sw.expand_trials(sweep) == [
        {"method": "slowcal", "model.lr": 0.01, "num_machines": 4},
        {"method": "slowcal", "model.lr": 0.1, "num_machines": 4},
        {"method": "local_sgd", "model.lr": 0.01, "num_machines": 4},
        {"method": "local_sgd", "model.lr": 0.1, "num_machines": 4},
    ]
    assert sw.expand_trials(sweep, count=3) == sw.expand_trials(sweep)[:3]
    assert len(sw.expand_trials(sw.parse_sweep(config(sweep_params(), run_cap=2)))) == 2


def sweep_params():
    return {"local_steps": {"values": [1, 2, 3]}}


def test_grid_over_int_range_and_q_uniform_as_wandb_enumerates_them():
    sweep = sw.parse_sweep(
        config(
            {
                "local_steps": {"min": 2, "max": 4},
                "model.lr": {"distribution": "q_uniform", "min": 0.0, "max": 1.0, "q": 0.25},
            }
        )
    )
    assert [p.distribution for p in sweep.params] == ["int_uniform", "q_uniform"]  # int min/max -> int_uniform
    trials = sw.expand_trials(sweep)
    assert [t["local_steps"] for t in trials[::4]] == [2, 3, 4]  # min..max inclusive
    assert [t["model.lr"] for t in trials[:4]] == [0.0, 0.25, 0.5, 0.75]  # numpy.arange: max excluded
    assert len(trials) == 12


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"min": 0.001, "max": 0.3}, "distribution 'uniform' cannot be searched by method: grid"),
        ({"distribution": "log_uniform_values", "min": 0.001, "max": 0.3}, "'log_uniform_values' cannot be searched"),
        ({"values": [1, 2], "probabilities": [0.5, 0.5]}, "'categorical_w_probabilities' cannot be searched"),
    ],
)
def test_grid_refuses_continuous_spaces_naming_the_parameter(spec, message):
    with pytest.raises(ValueError, match="parameters.model.lr") as err:
        sw.parse_sweep(config({"model.lr": spec}))
    assert message in str(err.value) and "int_uniform, q_uniform" in str(err.value)


def test_random_draws_count_trials_reproducibly_within_their_spaces():
    sweep = sw.parse_sweep(
        config(
            {
                "model.lr": {"distribution": "log_uniform_values", "min": 1e-3, "max": 0.3},
                "local_steps": {"min": 1, "max": 64},
                "method": {"values": ["slowcal", "local_sgd", "minibatch_sgd"]},
                "model.weight_power": {"min": 0.5, "max": 2.0},
                "batch_size": {"distribution": "q_uniform", "min": 1, "max": 9, "q": 2},
                "seed_everything": {"value": 7},
            },
            method="random",
        )
    )
    trials = sw.expand_trials(sweep, count=50, seed=3)
    assert len(trials) == 50 and trials == sw.expand_trials(sweep, count=50, seed=3)
    assert trials != sw.expand_trials(sweep, count=50, seed=4)
    assert sw.expand_trials(sweep, count=10, seed=3) == trials[:10]  # a larger count extends the same draws
    for t in trials:
        assert 1e-3 <= t["model.lr"] <= 0.3 and isinstance(t["model.lr"], float)
        assert 1 <= t["local_steps"] <= 64 and isinstance(t["local_steps"], int)
        assert t["method"] in ("slowcal", "local_sgd", "minibatch_sgd")
        assert 0.5 <= t["model.weight_power"] <= 2.0
        assert t["batch_size"] in (0, 2, 4, 6, 8, 10) and isinstance(t["batch_size"], int)  # int q gives ints
        assert t["seed_everything"] == 7
    # Log-uniform: about as many draws below the geometric midpoint as above it.
    below = sum(t["model.lr"] < math.sqrt(1e-3 * 0.3) for t in sw.expand_trials(sweep, count=400, seed=0))
    assert 150 < below < 250
    with pytest.raises(ValueError, match="--count N or run_cap"):
        sw.expand_trials(sweep)
    assert len(sw.expand_trials(sw.parse_sweep({**config(sweep_params(), method="random"), "run_cap": 2}))) <= 2


@pytest.mark.parametrize(
    ("cfg", "needles"),
    [
        ({**config(sweep_params()), "early_stop": 1}, ["'early_stop'", "allowed here: method, parameters"]),
        (config({"model.lr": {"vals": [0.1]}}), ["parameters.model.lr", "keys given: vals"]),
        (
            config({"model.lr": {"values": [0.1], "q": 2}}),
            ["parameters.model.lr", "unknown key 'q'", "allowed: distribution, values"],
        ),
        (config({"model.lr": {"distribution": "gaussian"}}), ["'gaussian'", "log_uniform_values", "int_uniform"]),
        (
            config({"model.lr": {"distribution": "int_uniform", "min": 0.5, "max": 2}}),
            ["int_uniform needs integer min and max"],
        ),
        (config({"model.lr": {"distribution": "log_uniform_values", "min": 0, "max": 1}}), ["needs min > 0"]),
        (config(sweep_params(), method="bayes"), ["'bayes' needs W&B's server", "allowed here: grid, random"]),
        (config(sweep_params(), method="hyperband"), ["'hyperband'", "allowed here: grid, random"]),
        (config({"model": {"parameters": {"lr": {"value": 0.1}}}}), ["parameters.model", "nested parameters"]),
        ({**config(sweep_params()), "metric": {"name": "val_acc"}}, ["'val_acc'", "test_acc"]),
        ({**config(sweep_params()), "metric": {"name": "test_acc", "goal": "max"}}, ["'max'", "minimize, maximize"]),
        ({**config(sweep_params()), "command": ["python", "train.py", "${args}"]}, ["must run lit_slowcal"]),
        ({**config(sweep_params()), "command": COMMAND[:-1]}, ["exactly one ${args}"]),
        (
            {**config(sweep_params()), "command": [*COMMAND[:-1], "${args_json}"]},
            ["exactly one ${args}", "${args_json}"],
        ),
        ({**config(sweep_params()), "command": ["python", "-m", "lit_slowcal", "test", "${args}"]}, ["must be fit"]),
        ({k: v for k, v in config(sweep_params()).items() if k != "command"}, ["command: required here"]),
    ],
)
def test_refusals_name_the_key_and_the_allowed_values(cfg, needles):
    with pytest.raises(ValueError) as err:
        sw.parse_sweep(cfg)
    for needle in needles:
        assert needle in str(err.value)


def test_command_gives_the_base_arguments_around_args():
    sweep = sw.parse_sweep(
        {**config(sweep_params()), "command": [*COMMAND[:-1], "--eval_every=5", "${args}", "--wandb=false"]}
    )
    assert sweep.args_before == ["fit", "--config", "configs/paper.yaml", "--eval_every=5"]
    assert sw.trial_args(sweep, {"local_steps": 2}, ["--run_dir=x"]) == [
        "fit", "--config", "configs/paper.yaml", "--eval_every=5", "--local_steps=2", "--wandb=false", "--run_dir=x",
    ]  # fmt: skip


def test_trial_arguments_are_formatted_as_the_wandb_agent_formats_them():
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    sweep = sw.load_sweep(REPO / "sweeps" / "lr.yaml")
    params = {"method": "slowcal", "model.lr": 1e-05, "num_machines": 16, "seed_everything": 1, "wandb": True}
    agent = create_sweep_command_args({"args": {k: {"value": v} for k, v in params.items()}})["args"]
    assert sw.trial_args(sweep, params)[len(sweep.args_before) :] == agent
    assert "--model.lr=1e-05" in agent and "--wandb=True" in agent


# ------------------------------------------------------------------------------- CLI acceptance


def wandb_values(param: sw.Param) -> list:
    s = param.spec
    if param.distribution == "constant":
        return [s["value"]]
    if "values" in s:
        return list(s["values"])
    return [s["min"], s["max"]]


# Table 1's sweep files hold the other methods' trials: the same CLI path as paper.yaml's and lr.yaml's
# again, so the second CI pass (the oldest Lightning, ``-m "not other_methods"``) leaves them out (conftest.py).
@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.other_methods) if p.name.startswith("table1") else p for p in SWEEP_FILES],
    ids=[p.name for p in SWEEP_FILES],
)
@pytest.mark.slow
def test_every_sweep_parameter_reaches_its_cli_key_as_wandb_passes_it(path, command_line):
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    sweep = sw.load_sweep(path)
    assert sweep.args_before[:3] == ["fit", "--config", "configs/paper.yaml"]
    checked = 0
    for param in sweep.params:
        for value in wandb_values(param):
            (flag,) = create_sweep_command_args({"args": {param.name: {"value": value}}})["args"]
            cfg = command_line.parse([*sweep.args_before, flag, *sweep.args_after])
            parsed = cfg[f"fit.{param.name}"]
            if isinstance(value, str):
                assert parsed == value, flag
            else:
                assert type(parsed) is type(value) and parsed == value, flag
            checked += 1
    assert checked == sum(len(wandb_values(p)) for p in sweep.params) > 0
    # and trials as a whole (linked settings included), plus the --wandb=false passthrough: every value of
    # every setting with every method (as the sweep's own check parses them: a parse per value, not per trial)
    covered: set[tuple[str, str, str]] = set()
    for trial in sw.expand_trials(sweep):
        settings = {(trial["method"], name, repr(value)) for name, value in trial.items()}
        if settings <= covered:
            continue
        covered |= settings
        cfg = command_line.parse(sw.trial_args(sweep, trial, ["--wandb=false"]))
        assert cfg["fit.method"] == trial["method"] and cfg["fit.wandb"] is False


def test_paper_sweep_is_the_papers_grid_with_the_papers_learning_rates(command_line):
    sweep = sw.load_sweep(REPO / "sweeps" / "paper.yaml")
    trials = sw.expand_trials(sweep)
    assert len(trials) == 135 and len({sw.trial_key(t) for t in trials}) == 135
    assert {t["num_machines"] for t in trials} == {16, 32, 64}
    assert {t["local_steps"] for t in trials} == {4, 8, 16, 32, 64}
    assert {t["seed_everything"] for t in trials} == {1, 2, 3}
    cfg = command_line.parse(sw.trial_args(sweep, trials[0]))
    assert cfg["fit.model.lr"] is None  # unset: MachinesModel takes the method's paper_lr
    assert cfg["fit.batch_size"] == 1 and cfg["fit.data.dirichlet_alpha"] == 0.1 and cfg["fit.trainer.max_epochs"] == 1


def test_table1_sweep_is_the_paper_grid_for_all_five_methods(command_line):
    sweep = sw.load_sweep(REPO / "sweeps" / "table1.yaml")
    trials = sw.expand_trials(sweep)
    assert len(trials) == 225 and len({sw.trial_key(t) for t in trials}) == 225
    assert {t["method"] for t in trials} == set(TABLE1_METHODS)
    paper = {sw.trial_key(t) for t in sw.expand_trials(sw.load_sweep(REPO / "sweeps" / "paper.yaml"))}
    assert paper < {sw.trial_key(t) for t in trials}
    cfg = command_line.parse(sw.trial_args(sweep, trials[0]))
    assert cfg["fit.model.lr"] is None


def test_lr_sweep_covers_every_method_and_the_registry_holds_its_choice_for_the_new_ones():
    sweep = sw.load_sweep(REPO / "sweeps" / "lr.yaml")
    assert {t["method"] for t in sw.expand_trials(sweep)} == set(TABLE1_METHODS)
    records = [json.loads(line) for line in (REPO / "sweeps" / "results" / "lr.jsonl").read_text().splitlines()]
    for name in TABLE1_METHODS:
        entry = METHODS[name]
        done = [r for r in records if r["params"]["method"] == name and r["status"] == "finished"]
        assert len(done) == 6, name
        if name in ("accel_minibatch_sgd", "scaffold"):  # the paper's three keep the paper's rates
            best = max(done, key=lambda r: r["metrics"]["test_acc"])
            assert best["params"]["model.lr"] == entry.paper_lr, name


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["here", "in-workers"])
def test_cli_refusals_are_reported_before_anything_runs(tmp_path, capsys, workers):
    # With --workers the forked workers parse a share of the trials each; the refusal is the same.
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config({"model.lrate": {"values": [0.1]}})))
    assert sw.main([str(bad), "--results", str(tmp_path / "r.jsonl"), *workers]) == 2
    err = capsys.readouterr().err
    assert "model.lrate=0.1" in err and "unrecognized arguments: --model.lrate=0.1" in err
    bad.write_text(yaml.safe_dump(config({"local_steps": {"values": [2, 4, 8, 0, 16]}})))
    assert sw.main([str(bad), "--results", str(tmp_path / "r.jsonl"), *workers]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("error") == 1
        and "trial local_steps=0" in err
        and "Invalid local_steps: 0 (must be an integer >= 1)" in err
    )
    assert not (tmp_path / "r.jsonl").exists()


# ------------------------------------------------------------------------------------ results file


def test_results_file_appends_new_trials_and_replaces_a_retried_one_atomically(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    results = sw.ResultsFile(path)
    results.put({"params": {"a": 1}, "status": "failed"})
    inode = path.stat().st_ino
    results.put({"params": {"a": 2}, "status": "finished"})
    assert path.stat().st_ino == inode  # appended: the file itself stays
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("killed")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        results.put({"params": {"a": 1}, "status": "finished"})  # a retried trial: the file is rewritten
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".r.jsonl.lock", "r.jsonl"]  # old file, no temp left
    monkeypatch.undo()
    results.put({"params": {"a": 1}, "status": "finished"})  # same trial: replaced, not duplicated
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"params": {"a": 1}, "status": "finished"},
        {"params": {"a": 2}, "status": "finished"},
    ]
    assert sw.ResultsFile(path).get({"a": 2}) == {"params": {"a": 2}, "status": "finished"}
    path.write_text('{"params": {"a": 1}, "status": "failed"}\n{"params"\n')
    with pytest.raises(ValueError, match="line 2"):
        sw.ResultsFile(path)


def test_results_file_read_while_a_record_is_appended_sees_it_once_it_is_whole(tmp_path):
    # A sweep's workers read the file while the sweep appends (no lock for reading): the kernel makes an
    # append visible a page at a time, so a reader can see a record's first part; it is not read until whole.
    path = tmp_path / "r.jsonl"
    results = sw.ResultsFile(path)
    results.put({"params": {"a": 1}, "status": "finished"})
    line = json.dumps({"params": {"a": 2}, "status": "finished"}) + "\n"
    with open(path, "a") as f:
        f.write(line[:10])
    assert list(sw.ResultsFile(path).records.values()) == [{"params": {"a": 1}, "status": "finished"}]
    with pytest.raises(OSError, match="last line is cut short"):  # no append is under way while put holds the lock
        results.put({"params": {"a": 3}, "status": "finished"})
    with open(path, "a") as f:
        f.write(line[10:])
    assert len(sw.ResultsFile(path).records) == 2


def test_results_file_keeps_its_permission_bits(tmp_path):
    path = tmp_path / "r.jsonl"
    results = sw.ResultsFile(path)
    results.put({"params": {"a": 1}, "status": "finished"})
    path.chmod(0o640)
    results.put({"params": {"a": 2}, "status": "finished"})
    assert path.stat().st_mode & 0o7777 == 0o640
    assert len(sw.ResultsFile(path).records) == 2


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("lit_slowcal.experiments.sweep", "lit_slowcal.experiments.run.cli"),
        ("lit_slowcal.experiments.run.cli", "lit_slowcal.experiments.sweep"),
    ],
)
@pytest.mark.slow
def test_sweep_reaches_the_cli_only_to_run_trials_and_the_cli_never_imports_sweep(module, absent):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith({absent!r})))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", f"importing {module} imports {proc.stdout.strip()}"


def test_summary_table_gives_the_best_lr_per_method():
    params = {
        "method": {"values": ["slowcal", "local_sgd"]},
        "model.lr": {"values": [0.01, 0.1]},
        "seed_everything": {"values": [1, 2]},
    }
    sweep = sw.parse_sweep(config(params))

    def rec(method, lr, seed, acc, status="finished"):
        metrics = {"test_acc": acc, "test_loss": None if acc is None else round(1 - acc, 6)}
        return {
            "params": {"method": method, "model.lr": lr, "seed_everything": seed},
            "status": status,
            "metrics": metrics,
        }

    records = [
        rec("slowcal", 0.01, 1, 0.90), rec("slowcal", 0.01, 2, 0.80),  # mean 0.85
        rec("slowcal", 0.1, 1, 0.86), rec("slowcal", 0.1, 2, None, "diverged"),  # mean 0.86 (one finished)
        rec("local_sgd", 0.01, 1, 0.70), rec("local_sgd", 0.01, 2, 0.72),  # mean 0.71
        rec("local_sgd", 0.1, 1, None, "failed"), rec("local_sgd", 0.1, 2, None, "failed"),
    ]  # fmt: skip
    rows = sw.summary_table(sweep, records).splitlines()
    assert rows[0] == "| method | best lr | test_acc | test_loss | trials at best lr | lrs tried | diverged or failed |"
    assert rows[2] == "| slowcal | 0.1 | 0.8600 | 0.1400 | 1 | 2 | 1 |"
    assert rows[3] == "| local_sgd | 0.01 | 0.7100 | 0.2900 | 2 | 2 | 2 |"


def test_summary_table_keeps_trials_of_other_communication_options_apart():
    """Trials that differ in how a round travels (compression, overlap_delay, participation, the outer optimizer,
    ...) are rows of their own: an int8 trial's accuracy is never averaged with an exact one's."""
    params = {
        "method": {"values": ["slowcal"]},
        "model.lr": {"values": [0.01, 0.1]},
        "compression": {"values": ["null", "int8"]},
        "overlap_delay": {"values": [0, 1]},
        "seed_everything": {"values": [1, 2]},
    }
    sweep = sw.parse_sweep(config(params))
    acc = {  # (lr, compression, tau, seed) -> test_acc
        (lr, code, tau, seed): round(0.5 + 0.2 * (lr == 0.1) + 0.1 * (code == "null") + 0.01 * tau + 0.002 * seed, 6)
        for lr in (0.01, 0.1) for code in ("null", "int8") for tau in (0, 1) for seed in (1, 2)
    }  # fmt: skip
    records = [
        {
            "params": {
                "method": "slowcal",
                "model.lr": lr,
                "compression": code,
                "overlap_delay": tau,
                "seed_everything": seed,
            },
            "status": "finished",
            "metrics": {"test_acc": a, "test_loss": round(1 - a, 6)},
        }
        for (lr, code, tau, seed), a in acc.items()
    ]
    rows = sw.summary_table(sweep, records).splitlines()
    assert rows[0] == (
        "| method | compression | overlap_delay | best lr | test_acc | test_loss | trials at best lr | lrs tried "
        "| diverged or failed |"
    )
    assert rows[1] == "|---|---|---|---|---|---|---|---|---|"
    expected = []
    for code in ("null", "int8"):
        for tau in (0, 1):
            mean = (acc[0.1, code, tau, 1] + acc[0.1, code, tau, 2]) / 2  # lr 0.1 is the best of each: its seeds' mean
            expected.append(f"| slowcal | {code} | {tau} | 0.1 | {mean:.4f} | {1 - mean:.4f} | 2 | 2 | 0 |")
    assert rows[2:] == expected


# ------------------------------------------------------------------------------------ running


def tiny_sweep(tmp_path: Path, methods=("slowcal", "local_sgd"), lrs=(0.01, 0.1)) -> Path:
    """2 x 2 trials of 3 rounds each on 4 machines."""
    cfg = {
        "method": "grid",
        "metric": {"name": "test_acc", "goal": "maximize"},
        "parameters": {
            "method": {"values": list(methods)},
            "model.lr": {"values": list(lrs)},
            "num_machines": {"value": 4},
            "local_steps": {"value": 2},
        },
        "command": [
            *COMMAND[:-1],
            "--trainer.limit_train_batches=3",
            "--eval_every=3",
            f"--run_dir={tmp_path / 'runs'}",
            "${args}",
        ],
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def completed_run_folders(runs: Path) -> dict[tuple[str, float], list[Path]]:
    """(method, lr) -> version folders whose metrics.csv holds the final evaluation (round 3)."""
    done: dict[tuple[str, float], list[Path]] = {}
    for cfg_file in runs.glob("*/version_*/config.yaml"):
        metrics = cfg_file.parent / "metrics.csv"
        if not metrics.exists():
            continue
        with open(metrics) as f:
            rows = list(csv.DictReader(f))
        if any(row.get("test_acc") and float(row["round"]) == 3 for row in rows):
            cfg = yaml.safe_load(cfg_file.read_text())
            done.setdefault((cfg["method"], cfg["model"]["lr"]), []).append(cfg_file.parent)
    return done


@pytest.mark.slow
def test_sweep_killed_after_a_trial_resumes_without_losing_or_repeating_any(tmp_path, monkeypatch, capsys):
    yaml_path, results = tiny_sweep(tmp_path), tmp_path / "results.jsonl"
    # One trial at a time, in the sweep's process: killed once the first is recorded, before the second is.
    cmd = [
        sys.executable,
        "-m",
        "lit_slowcal",
        "sweep",
        str(yaml_path),
        "--results",
        str(results),
        "--no-stack",
        "--workers",
        "1",
    ]
    env = clean_env(tmp_path)  # W&B on, offline (no account): every trial gets its own offline run
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 300
        while not (results.exists() and results.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, "the sweep ended before its first trial did"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the sweep and the W&B service it started
        proc.wait()
    first = read_records(results)
    assert len(first) == 1 and first[0]["status"] == "finished"

    rerun = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "4 trials, 1 already in" in rerun.stdout and "3 to run" in rerun.stdout
    records = read_records(results)
    assert records[0] == first[0]  # untouched
    assert sorted((r["params"]["method"], r["params"]["model.lr"]) for r in records) == [
        ("local_sgd", 0.01), ("local_sgd", 0.1), ("slowcal", 0.01), ("slowcal", 0.1),
    ]  # fmt: skip
    for r in records:
        assert r["status"] == "finished" and r["error"] is None
        assert r["metrics"]["round"] == 3 and 0 < r["metrics"]["test_acc"] <= 1 and r["metrics"]["test_loss"] > 0
        assert r["args"][:3] == ["fit", "--config", "configs/paper.yaml"] and r["wall_time_s"] > 0
        assert len(list(Path(r["run_dir"]).glob("wandb/offline-run-*"))) == 1  # its own W&B run
    assert len({r["run_dir"] for r in records}) == 4
    # Each trial completed in exactly one folder: the one its record names.
    done = completed_run_folders(tmp_path / "runs")
    assert sorted(done) == sorted((r["params"]["method"], r["params"]["model.lr"]) for r in records)
    for r in records:
        assert done[r["params"]["method"], r["params"]["model.lr"]] == [Path(r["run_dir"])]
    # The first trial was never started again; at most the trial killed mid-run left a partial folder.
    all_folders = list((tmp_path / "runs").glob("*/version_*"))
    assert len(all_folders) - 4 in (0, 1)
    assert "| slowcal |" in rerun.stdout and "| local_sgd |" in rerun.stdout  # best lr per method

    monkeypatch.chdir(REPO)
    assert sw.main(cmd[4:]) == 0  # once more, here: nothing left to run
    assert "4 trials, 4 already in" in capsys.readouterr().out and read_records(results) == records


def test_failing_and_diverging_trials_are_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    from lit_slowcal.experiments.train.model import MachinesModel

    training_step = MachinesModel.training_step
    threads = []

    def failing(self, batch, batch_idx):
        threads.append(torch.get_num_threads())
        if self.hparams.method == "local_sgd":
            raise RuntimeError("machine on fire")
        return training_step(self, batch, batch_idx)

    monkeypatch.setattr(MachinesModel, "training_step", failing)
    monkeypatch.chdir(REPO)
    for key in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(key)
    torch_threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    yaml_path, results = tiny_sweep(tmp_path, lrs=(0.01, 1e38)), tmp_path / "results.jsonl"
    args = [
        str(yaml_path),
        "--results",
        str(results),
        "--wandb=false",
        "--no-stack",
        "--workers",
        "1",
    ]  # each trial alone, here
    assert sw.main(args) == 0
    by_trial = {(r["params"]["method"], r["params"]["model.lr"]): r for r in read_records(results)}
    assert by_trial["slowcal", 0.01]["status"] == "finished"
    assert by_trial["slowcal", 1e38]["status"] == "diverged"
    assert by_trial["slowcal", 1e38]["error"].startswith("Training diverged: train loss nan in round 1")
    for lr in (0.01, 1e38):
        failed = by_trial["local_sgd", lr]
        assert failed["status"] == "failed" and failed["error"] == "RuntimeError: machine on fire"
        assert Path(failed["run_dir"]).is_dir()  # its log folder is kept and named
    out = capsys.readouterr().out
    assert "1 finished, 1 diverged, 2 failed of 4 trials" in out
    # One torch thread in every trial (--threads 1, kept although Lightning's launcher resets it), restored after.
    assert threads and set(threads) == {1}
    assert torch.get_num_threads() == torch_threads and os.environ.get("OMP_NUM_THREADS") == omp

    # Not retried by default; retried with --retry-failed (and replaced, not duplicated).
    monkeypatch.setattr(MachinesModel, "training_step", training_step)
    assert sw.main(args) == 0 and "0 to run" in capsys.readouterr().out
    assert sw.main([*args, "--retry-failed"]) == 0 and "3 to run" in capsys.readouterr().out
    records = read_records(results)
    assert len(records) == 4
    statuses = {(r["params"]["method"], r["params"]["model.lr"]): r["status"] for r in records}
    assert statuses == {
        ("slowcal", 0.01): "finished", ("slowcal", 1e38): "diverged",
        ("local_sgd", 0.01): "finished", ("local_sgd", 1e38): "diverged",
    }  # fmt: skip


def test_dry_run_lists_the_trials_and_runs_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    yaml_path, results = tiny_sweep(tmp_path), tmp_path / "results.jsonl"
    failed = {"local_steps": 2, "method": "slowcal", "model.lr": 0.1, "num_machines": 4}
    # A record as written before identities were stored: its arguments give its identity.
    args = sw.trial_args(sw.load_sweep(yaml_path), failed, ["--wandb=false"])
    sw.ResultsFile(results).put({"params": failed, "status": "failed", "args": args})
    assert sw.main([str(yaml_path), "--results", str(results), "--dry-run", "--wandb=false"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("4 trials, 1 already in " + str(results) + ", 3 to run")
    assert [line.split()[:2] for line in lines[1:]] == [
        ["[1/4]", "pending"], ["[2/4]", "failed"], ["[3/4]", "pending"], ["[4/4]", "pending"],
    ]  # fmt: skip
    assert lines[2].endswith("--local_steps=2 --method=slowcal --model.lr=0.1 --num_machines=4 --wandb=false")
    assert not (tmp_path / "runs").exists() and len(read_records(results)) == 1


# ----------------------------------------------------------------------------- W&B agent path


def wandb_records(path: Path):
    """Records of a .wandb file (W&B's LevelDB-style log: 7-byte file header, 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunk = path.read_bytes(), 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # full or last piece
            record = pb.Record()
            record.ParseFromString(chunk)
            yield record
            chunk = b""


@pytest.mark.slow
def test_cli_run_started_by_the_wandb_agent_joins_the_agents_run(tmp_path):
    """The agent's command and environment, rebuilt with W&B's own functions, offline (no server)."""
    from wandb.sdk.launch.sweeps import utils as sweep_utils
    from wandb.sdk.lib import config_util

    lr_yaml = yaml.safe_load((REPO / "sweeps" / "lr.yaml").read_text())
    args = {
        "method": "local_sgd", "model.lr": 0.003, "num_machines": 4, "local_steps": 2, "seed_everything": 1,
        "trainer.limit_train_batches": 2, "eval_every": 2, "run_dir": str(tmp_path / "runs"),
    }  # fmt: skip
    args = {k: {"value": v} for k, v in args.items()}
    param_path = tmp_path / "wandb" / "sweep-sw1" / "config-run1.yaml"
    param_path.parent.mkdir(parents=True)
    config_util.save_config_file_from_dict(str(param_path), args)  # as Agent._command_run does
    macros = {
        **sweep_utils.create_sweep_command_args({"args": args}),
        "env": ["/usr/bin/env"],
        "interpreter": ["python"],
    }
    cmd = []
    for token in map(str, sweep_utils.create_sweep_command(lr_yaml["command"])):
        cmd += macros[token[2:-1]] if token.startswith("${") else [sys.executable if token == "python" else token]
    env = clean_env(tmp_path)
    env.update(WANDB_MODE="offline", WANDB_SWEEP_ID="sw1", WANDB_RUN_ID="run1", WANDB_SWEEP_PARAM_PATH=str(param_path))
    env["WANDB_DIR"] = str(tmp_path)  # the agent sets it to its working folder
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_folder = tmp_path / "runs" / "local_sgd_M4_K2_b1_seed1" / "version_0"
    (run_file,) = glob.glob(str(run_folder / "wandb" / "offline-run-*-run1" / "run-run1.wandb"))
    (run,) = [r.run for r in wandb_records(Path(run_file)) if r.WhichOneof("record_type") == "run"]
    assert run.run_id == "run1" and run.sweep_id == "sw1"  # the agent's run, in the agent's sweep
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["model.lr"] == 0.003 and config["method"] == "local_sgd" and config["num_machines"] == 4
    assert "Ignoring project 'lit_slowcal' when running a sweep" in proc.stderr  # the sweep's project wins


@pytest.mark.parametrize(("interrupt", "code"), [("ctrl-c", 130), ("sigterm", 143)])
def test_ctrl_c_or_sigterm_stops_the_sweep_and_keeps_what_finished(tmp_path, monkeypatch, capsys, interrupt, code):
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lit_slowcal.experiments.train.model import MachinesModel

    training_step = MachinesModel.training_step

    def interrupted(self, batch, batch_idx):
        if self.hparams.method == "local_sgd":  # the last two trials
            raise KeyboardInterrupt if interrupt == "ctrl-c" else SIGTERMException()
        return training_step(self, batch, batch_idx)

    monkeypatch.setattr(MachinesModel, "training_step", interrupted)
    monkeypatch.chdir(REPO)
    sigint = signal.getsignal(signal.SIGINT)  # Lightning ignores SIGINT after a Ctrl-C
    yaml_path, results = tiny_sweep(tmp_path), tmp_path / "results.jsonl"
    try:
        assert (
            sw.main([str(yaml_path), "--results", str(results), "--wandb=false", "--no-stack", "--workers", "1"])
            == code
        )
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert "sweep interrupted" in capsys.readouterr().err
    records = read_records(results)
    assert [(r["params"]["method"], r["status"]) for r in records] == [("slowcal", "finished"), ("slowcal", "finished")]


@pytest.mark.slow
def test_trials_build_the_cli_parsers_once_and_run_as_a_fresh_cli_would(tmp_path, monkeypatch, command_line):
    """The parsers are built by the first trial of the process and reused; every trial still gets
    exactly the metrics and the saved config of a fresh ``SlowcalCLI`` run of its arguments, also when
    it is given the sweep check's parse of them (which it leaves unchanged) instead of parsing again."""
    from lightning.pytorch.cli import LightningCLI

    from lit_slowcal.experiments.run.cli import SlowcalCLI
    from lit_slowcal.experiments.sweep import single

    monkeypatch.chdir(REPO)
    builds = []
    setup_parser = LightningCLI.setup_parser

    def counting(self, *args, **kwargs):
        builds.append(type(self).__name__)
        return setup_parser(self, *args, **kwargs)

    monkeypatch.setattr(LightningCLI, "setup_parser", counting)
    common = ["fit", "--config", "configs/paper.yaml", "--wandb=false", "--num_machines=8", "--local_steps=4",
              "--trainer.limit_train_batches=5", "--eval_every=2"]  # fmt: skip
    trials = [["--method=slowcal"], ["--method=minibatch_sgd", "--model.lr=0.05"], ["--method=slowcal"]]
    records = [sw.run_trial([*common, f"--run_dir={tmp_path / 'trials'}", *t]) for t in trials]
    assert len(builds) <= 1  # none when an earlier test of this process built them already
    assert all(r["status"] == "finished" for r in records)
    assert records[0]["metrics"] == records[2]["metrics"] != records[1]["metrics"]
    given, parses = [], []
    for t in trials[:2]:
        args = [*common, f"--run_dir={tmp_path / 'given'}", *t]
        parsed = command_line.parse(args)
        kept = parsed.clone()
        with monkeypatch.context() as m:  # the given parse is used: the trial parses nothing
            parse_args = type(command_line.parser).parse_args
            m.setattr(
                type(command_line.parser),
                "parse_args",
                lambda self, *a, **k: parses.append(a) or parse_args(self, *a, **k),
            )
            given.append(sw.run_trial(args, parsed))
        assert parsed == kept
    assert len(builds) <= 1 and parses == []

    for trial, record in [*zip(trials[:2], records), *zip(trials[:2], given)]:
        with single._trial_environment():
            fresh = SlowcalCLI(args=[*common, f"--run_dir={tmp_path / 'fresh'}", *trial])
        metrics = {k: float(v) for k, v in fresh.trainer.callback_metrics.items() if k not in MEASURED}
        assert metrics == record["metrics"] and record["train_s"] > 0  # the measured seconds beside the metrics
        saved = yaml.safe_load((Path(record["run_dir"]) / "config.yaml").read_text())
        expected = yaml.safe_load((Path(fresh.trainer.log_dir) / "config.yaml").read_text())
        assert saved.pop("run_dir") in (str(tmp_path / "trials"), str(tmp_path / "given"))
        assert expected.pop("run_dir") == str(tmp_path / "fresh")
        assert saved == expected


# ----------------------------------------------------------------------------- a trial's identity


def test_a_record_of_another_command_or_config_is_never_taken_for_a_trials(tmp_path, monkeypatch, capsys):
    """A trial is its parameters and everything its command and config set: the same parameters with another
    command run again, and each record stays with its own identity."""
    monkeypatch.chdir(REPO)
    yaml_path, results = tiny_sweep(tmp_path, methods=("slowcal",), lrs=(0.01,)), tmp_path / "results.jsonl"
    assert sw.main([str(yaml_path), "--results", str(results), "--wandb=false"]) == 0
    (first,) = read_records(results)
    assert first["status"] == "finished" and len(first["identity"]) == 25
    cfg = yaml.safe_load(yaml_path.read_text())
    cfg["command"].insert(-1, "--data.dirichlet_alpha=1.0")
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(cfg, sort_keys=False))
    capsys.readouterr()
    assert sw.main([str(other), "--results", str(results), "--wandb=false", "--dry-run"]) == 0
    assert "1 trials, 0 already in" in capsys.readouterr().out
    assert sw.main([str(other), "--results", str(results), "--wandb=false"]) == 0
    out = capsys.readouterr().out
    records = read_records(results)
    assert len(records) == 2 and records[0] == first and records[1]["params"] == first["params"]
    assert (
        records[1]["identity"] != first["identity"]
        and records[1]["metrics"]["test_loss"] != first["metrics"]["test_loss"]
    )
    assert f"| {records[1]['metrics']['test_acc']:.4f} |" in out  # the table shows this command's trial
    # A config file edited between two runs of the same command: another identity too.
    config = tmp_path / "paper.yaml"
    config.write_text((REPO / "configs" / "paper.yaml").read_text())
    cfg["command"][cfg["command"].index("configs/paper.yaml")] = str(config)
    other.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert sw.main([str(other), "--results", str(results), "--wandb=false", "--dry-run"]) == 0
    assert "1 trials, 1 already in" in capsys.readouterr().out  # same settings, another path: the same run
    config.write_text(config.read_text().replace("init: official", "init: zeros"))
    assert sw.main([str(other), "--results", str(results), "--wandb=false", "--dry-run"]) == 0
    assert "1 trials, 0 already in" in capsys.readouterr().out
    # The first command still finds its own record; what may change on resume (run_dir, W&B) is not part of it.
    assert sw.main([str(yaml_path), "--results", str(results), "--wandb=true", "--dry-run"]) == 0
    assert "1 trials, 1 already in" in capsys.readouterr().out


@pytest.mark.slow
def test_a_sweep_with_another_command_does_not_take_the_shipped_results_as_its_own(tmp_path, monkeypatch, capsys):
    # The shipped results were written before identities were stored: their arguments give theirs.
    monkeypatch.chdir(REPO)
    cfg = yaml.safe_load((REPO / "sweeps" / "lr.yaml").read_text())
    cfg["command"][-1:-1] = ["--data.split=balanced", "--model.weight_decay=0.01"]
    (tmp_path / "lr.yaml").write_text(yaml.safe_dump(cfg))
    before = (REPO / "sweeps" / "results" / "lr.jsonl").read_bytes()
    assert sw.main([str(tmp_path / "lr.yaml"), "--dry-run", "--wandb=false"]) == 0
    assert "30 trials, 0 already in sweeps/results/lr.jsonl, 30 to run" in capsys.readouterr().out
    assert sw.main([str(REPO / "sweeps" / "lr.yaml"), "--dry-run", "--wandb=false"]) == 0
    assert "30 trials, 30 already in sweeps/results/lr.jsonl, 0 to run" in capsys.readouterr().out
    assert (REPO / "sweeps" / "results" / "lr.jsonl").read_bytes() == before


def test_a_killed_worker_is_noticed_its_trial_recorded_as_failed_and_the_sweep_ends_non_zero(
    tmp_path, monkeypatch, capsys
):
    from lit_slowcal.experiments.sweep import single

    monkeypatch.chdir(REPO)
    sweep_pid, run_trial = os.getpid(), single.run_trial

    def killed(args, parsed=None):
        if os.getpid() != sweep_pid and "--model.lr=0.1" in args and "--method=local_sgd" in args:
            os.kill(os.getpid(), signal.SIGKILL)  # as `kill -9 <worker>` mid-trial
        return run_trial(args, parsed)

    def hung(signum, frame):
        raise TimeoutError("the sweep waits for its lost worker forever")

    monkeypatch.setattr(single, "run_trial", killed)
    yaml_path, results = tiny_sweep(tmp_path), tmp_path / "results.jsonl"
    args = [str(yaml_path), "--results", str(results), "--wandb=false", "--workers", "2", "--no-stack"]
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(90)
    try:
        assert sw.main(args) == 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "lit_slowcal sweep: error: the worker process (pid " in err and "--retry-failed" in err
    )
    statuses = {(r["params"]["method"], r["params"]["model.lr"]): r["status"] for r in read_records(results)}
    assert statuses == {
        ("slowcal", 0.01): "finished", ("slowcal", 0.1): "finished", ("local_sgd", 0.01): "finished", ("local_sgd", 0.1): "failed",
    }  # fmt: skip
    (lost,) = [r for r in read_records(results) if r["status"] == "failed"]
    assert "ended before it did" in lost["error"] and lost["identity"] and lost["args"][-1] == "--wandb=false"

    monkeypatch.setattr(single, "run_trial", run_trial)
    assert sw.main([*args, "--retry-failed"]) == 0
    assert "4 trials, 3 already in" in capsys.readouterr().out
    assert sorted(r["status"] for r in read_records(results)) == ["finished"] * 4


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "method: grid\nparameters:\n  model.lr: {values: [0.1, 0.2}\n",
            "not valid YAML: expected ',' or ']', but got '}' at line 3, column 31",
        ),
        (
            "method: grid\n\tparameters: {}\n",
            "not valid YAML: found character '\\t' that cannot start any token at line 2, column 1",
        ),
        (b"\x89PNG\r\n\x1a\n\x00\xff", "not a text file"),
    ],
    ids=["syntax", "tab", "binary"],
)
def test_a_sweep_file_that_is_not_yaml_is_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert sw.main([str(path), "--results", str(tmp_path / "r.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"lit_slowcal sweep: error: {path}: ") and message in err


def test_a_results_path_that_is_a_link_is_followed_when_a_retried_trial_is_replaced(tmp_path):
    real, link = tmp_path / "store" / "r.jsonl", tmp_path / "link.jsonl"
    real.parent.mkdir()
    link.symlink_to(real)
    sw.ResultsFile(link).put({"params": {"a": 1}, "status": "failed"})
    sw.ResultsFile(link).put({"params": {"a": 2}, "status": "finished"})
    sw.ResultsFile(link).put({"params": {"a": 1}, "status": "finished"})  # --retry-failed: an atomic rewrite
    assert link.is_symlink() and link.resolve() == real
    assert [json.loads(line)["status"] for line in real.read_text().splitlines()] == ["finished", "finished"]


def test_a_large_grid_says_its_size_and_the_checks_time_first_and_an_estimate_once_a_trial_ran(
    tmp_path, monkeypatch, capsys
):
    from lit_slowcal.experiments.sweep import checks

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(checks, "LARGE_GRID", 3)  # "large": more than 3 trials here
    yaml_path, results = tiny_sweep(tmp_path), tmp_path / "results.jsonl"
    assert sw.main([str(yaml_path), "--results", str(results), "--wandb=false", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"sweep {yaml_path}: 4 trials; checking their arguments with the CLI first ..."
    assert lines[1].startswith("checked the arguments of 4 trials in ")
    assert sw.main([str(yaml_path), "--results", str(results), "--wandb=false", "--count", "2"]) == 0
    assert "estimate:" not in capsys.readouterr().out  # 2 trials: not large
    assert sw.main([str(yaml_path), "--results", str(results), "--wandb=false"]) == 0
    out = capsys.readouterr().out
    assert "4 trials, 2 already in" in out
    assert "estimate: the 1 trials left take about " not in out  # 2 to run: not large
    results.unlink()
    assert sw.main([str(yaml_path), "--results", str(results), "--wandb=false", "--no-stack", "--workers", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (estimate,) = [i for i, line in enumerate(lines) if line.startswith("estimate: the 3 trials left take about ")]
    assert lines[estimate - 1].startswith("[1/4] finished")


def test_a_value_listed_twice_in_a_grid_is_one_trial():
    sweep = sw.parse_sweep(
        config({"model.lr": {"values": [0.01, 0.01, 0.1, 1, 1.0]}, "local_steps": {"values": [2, 2]}})
    )
    assert sw.expand_trials(sweep) == [
        {"local_steps": 2, "model.lr": 0.01}, {"local_steps": 2, "model.lr": 0.1},
        {"local_steps": 2, "model.lr": 1}, {"local_steps": 2, "model.lr": 1.0},
    ]  # fmt: skip


def test_the_results_file_is_checked_before_any_trial_and_a_failed_write_names_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    yaml_path = tiny_sweep(tmp_path)
    (tmp_path / "a_file").write_text("")
    cases = [
        (tmp_path / "a_file" / "r.jsonl", "cannot create its folder"),
        (tmp_path / "torn.jsonl", "its last line is cut short"),
        (tmp_path, "Is a directory"),
    ]
    (tmp_path / "torn.jsonl").write_text('{"params": {"a": 1}, "status": "failed"}\n{"params": {"a"')
    for path, message in cases:
        assert sw.main([str(yaml_path), "--results", str(path), "--wandb=false"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(path) in err and message in err
    assert not (tmp_path / "runs").exists()  # no trial ran
    assert sw.main([str(yaml_path), "--results", str(tmp_path / "r.jsonl"), "--threads", "-5"]) == 2
    assert "Invalid --threads: -5 (must be an integer >= 0)" in capsys.readouterr().err

    results = sw.ResultsFile(tmp_path / "full.jsonl")
    results.put({"params": {"a": 1}, "status": "finished"})
    before = results.path.read_bytes()

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as err:
        results.put({"params": {"a": 2}, "status": "finished"})
    assert str(err.value) == f"{results.path}: cannot add a record (No space left on device); the file is as it was"
    assert results.path.read_bytes() == before


def test_a_results_file_holding_bytes_that_are_not_text_is_one_line_naming_it(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"params": {"a": 1}, "status": "failed"}\n\xd6\x90\xff\x00binary\n')
    with pytest.raises(ValueError, match=f"{path}, line 2: not (JSON|text)"):
        sw.ResultsFile(path)
    assert sw.main([str(tiny_sweep(tmp_path)), "--results", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}, line 2: not" in err


def test_a_trial_value_no_type_of_the_option_takes_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config({"model.lr": {"values": [0.1, "abc"]}})))
    assert sw.main([str(bad), "--results", str(tmp_path / "r.jsonl"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "trial model.lr=abc: the CLI refuses it: model.lr: 'abc' is not a number or null" in err
    )


@pytest.mark.slow
def test_a_large_grid_checked_by_parts_gives_every_trial_its_own_parse_and_identity(monkeypatch, command_line):
    """Options whose values set keys no other option changes (one key: the rate, K; with the settings linked from
    it alone: M, the seed, the method) are parsed value by value, the others (sources of settings linked from
    several) per combination: each trial's parse and identity are those of its own arguments. Nothing is linked
    from K (its steps per round are the run's shape's, not the parse's): every option here is parsed value by
    value."""
    from lit_slowcal.experiments.sweep import checks

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(checks, "_checker", command_line)
    params = {
        "method": {"values": ["slowcal", "minibatch_sgd"]}, "local_steps": {"values": [2, 8]},
        "seed_everything": {"values": [1, 2]}, "model.lr": {"values": [0.03, 1]}, "num_machines": {"values": [4, 8]},
        "model.weight_decay": {"values": [0.0, 0.001]}, "data.split": {"values": ["official", "balanced"]},
        "checkpoint_every": {"values": [0, 5]},
    }  # fmt: skip
    sweep = sw.parse_sweep(config(params))
    trials = [(p, sw.trial_args(sweep, p)) for p in sw.expand_trials(sweep)]
    assert len(trials) == 256
    parses = []
    parse = command_line.parse
    monkeypatch.setattr(command_line, "parse", lambda args: parses.append(args) or parse(args))
    by_parts = checks.check_by_parts(trials, lambda p: sw.trial_args(sweep, p))
    assert by_parts is not None and len(parses) == 1 + 2 * len(params)  # the first trial, then every value
    monkeypatch.setattr(command_line, "parse", parse)
    for p, args in trials:
        own = parse(args)
        got_args, got, identity = by_parts[sw.trial_key(p)]
        assert got_args == args and got == own and dict(got.items()) == dict(own.items())
        assert identity == checks.trial_identity_of(own)
    assert len({identity for _, _, identity in by_parts.values()}) == 128  # checkpoint_every is not part of a run

    bad = sw.parse_sweep(config({**params, "trainer.limit_train_batches": {"values": [3, "abc"]}}))
    trials = [(p, sw.trial_args(bad, p)) for p in sw.expand_trials(bad)]
    with pytest.raises(
        ValueError,
        match="trainer.limit_train_batches=abc: the CLI refuses it: trainer.limit_train_batches: 'abc' is not",
    ):
        checks.check_by_parts(trials, lambda p: sw.trial_args(bad, p))


@pytest.mark.slow
def test_a_10000_trial_grid_is_checked_with_a_parse_per_value_and_seed_not_per_trial(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    cfg = config(
        {
            "model.lr": {"values": [round(0.001 * (i + 1), 4) for i in range(100)]},
            "seed_everything": {"values": list(range(1, 101))},
        }
    )
    (tmp_path / "big.yaml").write_text(yaml.safe_dump(cfg))
    parses, parse = [], sw.CommandLine.parse
    monkeypatch.setattr(sw.CommandLine, "parse", lambda self, args: parses.append(1) or parse(self, args))
    assert sw.main([str(tmp_path / "big.yaml"), "--results", str(tmp_path / "r.jsonl"), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"sweep {tmp_path / 'big.yaml'}: 10000 trials; checking their arguments with the CLI first ..."
    assert "10000 trials, 0 already in" in lines[2] and len(lines) == 3 + 10000
    assert len(parses) == 1 + 100 + 100  # the first trial, each learning rate, each seed


def test_the_estimate_of_the_time_left_weighs_the_units_by_their_cost_and_counts_the_workers():
    from types import SimpleNamespace

    from lit_slowcal.experiments.sweep.runner import _duration, _Progress
    from lit_slowcal.experiments.sweep.units import Unit

    def unit(label, trials, cost):
        return Unit(label, label, [SimpleNamespace(params={}, identity=None, args=[])] * trials, cost)

    # Four equal groups of 15 trials on 2 workers: the first ends with half the work left, 10 s more after 10 s.
    progress = _Progress([unit(f"group {i}/4", 15, 4.0) for i in range(1, 5)], workers=2)
    assert [progress.first_ended("group 2/4") for _ in range(15)] == [False] * 14 + [True]
    assert progress.seconds_left(10.0) == pytest.approx(10.0)
    assert not progress.first_ended("group 1/4")  # one estimate per sweep
    # A large group and small ones (a stacked grid): the pace is the first group's cost, not its trials.
    # Before, 15 trials of 225 at 21 s gave "88 min"; here 21 s x (100 - 2 x 20) / (2 x 20).
    groups = [unit("group 1/3", 15, 20.0), unit("group 2/3", 15, 20.0), unit("group 3/3", 195, 60.0)]
    progress = _Progress(groups, workers=2)
    assert not any(progress.first_ended("group 1/3") for _ in range(14)) and progress.first_ended("group 1/3")
    assert progress.seconds_left(21.0) == pytest.approx(31.5)
    # Trials alone have no cost: each weighs one trial; one worker runs one unit at a time.
    progress = _Progress([unit(f"{i}/4", 1, 0.0) for i in range(1, 5)], workers=1)
    assert progress.first_ended("1/4") and progress.seconds_left(3.0) == pytest.approx(9.0)
    assert (_duration(31.5), _duration(119.4), _duration(600.0)) == ("32 s", "119 s", "10 min")


def test_a_null_value_is_refused_saying_how_to_pass_null(tmp_path, capsys):
    """null reaches the CLI as the text None (as the W&B agent formats it): refused, with how to pass null."""
    path, results = tmp_path / "grid.yaml", tmp_path / "r.jsonl"
    path.write_text(yaml.safe_dump(config({"model.lr": {"values": [0.01, None]}, "local_steps": {"value": 2}})))
    assert sw.main([str(path), "--results", str(results), "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        f"lit_slowcal sweep: error: {path}: parameters.model.lr.values: null cannot be passed to the CLI (the W&B agent "
        "writes it as --model.lr=None, the text None); write it quoted, 'null', to give the option null, or leave the "
        "parameter out for its default\n"
    )
    path.write_text(yaml.safe_dump(config({"model.lr": {"values": [0.01, "null"]}})))
    assert sw.main([str(path), "--results", str(results), "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines()[2].endswith("--model.lr=null")


def test_two_spellings_of_one_value_are_one_run_refused_before_any_trial(tmp_path, capsys):
    """1e-2 (text to YAML) beside 0.01, or 1 beside 1.0, are one run: refused, naming both."""
    path, results = tmp_path / "grid.yaml", tmp_path / "r.jsonl"
    path.write_text("method: grid\nparameters:\n  model.lr: {values: [0.01, 1e-2]}\n  local_steps: {values: [2, 4]}\n"
                    f"command: {json.dumps(COMMAND)}\n")  # fmt: skip
    assert sw.main([str(path), "--results", str(results), "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        "lit_slowcal sweep: error: the trials local_steps=2 model.lr=0.01 and local_steps=2 model.lr=1e-2 are one run: "
        "the CLI reads model.lr 0.01 and '1e-2' alike (YAML reads 1e-2 without a dot as text); list each value once\n"
    )
    path.write_text(yaml.safe_dump(config({"model.lr": {"values": [1, 1.0]}, "eval_every": {"values": [1, 2]}})))
    assert sw.main([str(path), "--results", str(results), "--dry-run"]) == 2
    assert "the CLI reads model.lr 1 and 1.0 alike" in capsys.readouterr().err
    # Values that differ in a setting that does not change the run's results (eval_every) stay two trials.
    path.write_text(yaml.safe_dump(config({"model.lr": {"value": 0.01}, "eval_every": {"values": [1, 2]}})))
    assert sw.main([str(path), "--results", str(results), "--dry-run"]) == 0
    assert "2 trials, 0 already in" in capsys.readouterr().out
    assert not results.exists()


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.slow
def test_a_sweep_whose_reader_ends_stops_quietly_keeping_what_it_recorded(tmp_path, workers):
    """``sweep ... | head``: once the reader is gone the sweep stops as at SIGPIPE (status 141, no error line),
    and no trial is recorded as failed for it."""
    yaml_path, results = tiny_sweep(tmp_path, methods=("slowcal",), lrs=(0.01, 0.1, 0.03)), tmp_path / "r.jsonl"
    cmd = [sys.executable, "-m", "lit_slowcal", "sweep", str(yaml_path), "--results", str(results), "--wandb=false",
           "--no-stack", "--workers", workers]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=clean_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = []
    while not lines or not lines[-1].startswith(b"[1/3]"):  # a trial has started: then the reader ends
        lines.append(proc.stdout.readline().lstrip(b"\n"))
        assert lines[-1] or proc.poll() is None, lines
    proc.stdout.close()
    stderr = proc.communicate(timeout=300)[1].decode()
    assert proc.returncode == 141, stderr
    assert "Broken pipe" not in stderr and "Traceback" not in stderr and "error" not in stderr
    records = read_records(results) if results.exists() else []
    assert all(r["status"] == "finished" for r in records) and len(records) < 3


def test_a_grid_or_a_draw_too_large_to_list_is_refused_at_once():
    """A grid over a billion integers was listed whole (memory exhausted, even with --count 2): refused, with its size."""
    huge = sw.parse_sweep(config({"local_steps": {"min": 1, "max": 10**9}, "model.lr": {"values": [0.1, 0.01]}}))
    start = time.perf_counter()
    for count in (None, 2):
        with pytest.raises(ValueError) as err:
            sw.expand_trials(huge, count)
        assert str(err.value) == (
            "method: grid: 1,000,000,000 values of local_steps x 2 values of model.lr: more trials than a sweep runs here "
            "(1,000,000); narrow the grid"
        )
    draws = sw.parse_sweep(config({"model.lr": {"min": 0.001, "max": 0.1}}, method="random"))
    with pytest.raises(
        ValueError, match=r"method: random: 100,000,000 draws, more trials than a sweep runs here \(1,000,000\)"
    ):
        sw.expand_trials(draws, 10**8)
    assert time.perf_counter() - start < 1
    assert len(sw.expand_trials(sw.parse_sweep(config({"local_steps": {"min": 1, "max": 10**6}})), 3)) == 3
