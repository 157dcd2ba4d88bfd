"""What ``python -m lit_slowcal sweep FILE`` does without flags: it stacks (``--no-stack`` runs every trial alone),
picks its workers from the cores, the memory and the trials (``--workers N`` to set), and prints each note
once per sweep, in the sweep's process and with worker processes."""

import json
import logging
import warnings
from pathlib import Path

import pytest
from test_lightning import lightning_has_tip
from test_stacked import REPO, grid_file

from lit_slowcal.experiments import sweep as sw
from lit_slowcal.experiments._lightning import LIGHTNING_INFO_LOGGERS
from lit_slowcal.experiments.sweep.contract import DIAGNOSTICS, differences
from lit_slowcal.experiments.sweep.workers import WORKER_BYTES, choose_workers

GIB = 2**30
NOTE = "excess_loss: not logged: MNIST softmax regression without weight decay has no attained minimiser"


def records(path: Path) -> dict:
    return {sw.trial_key(r["params"]): r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.slow
def test_a_sweep_without_flags_stacks_and_no_stack_runs_each_trial_alone_with_the_same_records(
    tmp_path, monkeypatch, capfd
):
    monkeypatch.chdir(REPO)
    path = grid_file(tmp_path, lrs=(0.01, 0.03), seeds=(1,), methods=("slowcal", "local_sgd"))
    assert sw.main([str(path), "--results", str(tmp_path / "default.jsonl")]) == 0
    out = capfd.readouterr().out
    assert "stacking: 4 trials in 2 groups" in out and "method=slowcal M=4 K=4 b=1: 2 trials stacked" in out
    assert sw.main([str(path), "--results", str(tmp_path / "alone.jsonl"), "--no-stack"]) == 0
    out = capfd.readouterr().out
    assert "stacking:" not in out and "[1/4] local_steps=4 method=slowcal model.lr=0.01" in out

    default, alone = records(tmp_path / "default.jsonl"), records(tmp_path / "alone.jsonl")
    assert sorted(default) == sorted(alone) and len(default) == 4
    for key, r in default.items():
        single = alone[key]
        assert r["stacked"] == 2 and "stacked" not in single  # stacked by default; one at a time with --no-stack
        assert r["status"] == single["status"] == "finished"
        assert {"train_loss", "test_acc", "test_loss", "train_objective"} <= set(r["metrics"])
        # The contract: training and test bit for bit, the diagnostics within 1e-12 relative.
        assert differences(r["metrics"], single["metrics"]) == [], key
        assert all(r["metrics"][k] == single["metrics"][k] for k in r["metrics"] if k not in DIAGNOSTICS), key
    assert len({r["metrics"]["test_loss"] for r in default.values()}) == 4  # four different trials


@pytest.mark.slow
def test_trials_that_cannot_stack_run_alone_by_default_each_reason_said_once_with_its_count(
    tmp_path, monkeypatch, capfd
):
    monkeypatch.chdir(REPO)
    path = grid_file(tmp_path, lrs=(0.01, 0.03), seeds=(1,), methods=("local_sgd",), extra=("--trainer.max_epochs=2",))
    assert sw.main([str(path), "--results", str(tmp_path / "r.jsonl")]) == 0
    out = capfd.readouterr().out
    assert "stacking: 0 trials in 0 groups" in out and "; 2 run one at a time\n" in out
    assert [line for line in out.splitlines() if "not stacked" in line] == [
        "  2 trials not stacked: trainer.max_epochs is 2 (stacking runs one epoch)"
    ]
    assert [r["status"] for r in records(tmp_path / "r.jsonl").values()] == ["finished"] * 2


def test_stack_is_still_accepted_as_the_explicit_default(tmp_path):
    path = grid_file(tmp_path, lrs=(0.01,), seeds=(1,), methods=("slowcal",))
    opts = [sw.cli._parser().parse_args([str(path), *flags]) for flags in ([], ["--stack"], ["--no-stack"])]
    assert [o.stack for o in opts] == [True, True, False] and [o.workers for o in opts] == [None] * 3


# (cores, threads, available memory, trials, largest group, cuda) -> workers and the reason printed
CASES = [
    ((2, 1, 100 * GIB, 135, 0, False), 2, "2 cores, 1 thread each; --workers N to set"),
    ((16, 1, 100 * GIB, 135, 0, False), 16, "16 cores, 1 thread each; --workers N to set"),
    ((16, 4, 100 * GIB, 135, 0, False), 4, "16 cores, 4 threads each; --workers N to set"),
    ((16, 3, 100 * GIB, 135, 0, False), 5, "16 cores, 3 threads each; --workers N to set"),
    ((2, 4, 100 * GIB, 135, 0, False), 1, "2 cores, 4 threads each; --workers N to set"),
    ((8, 0, 100 * GIB, 135, 0, False), 1, "8 cores, torch's default threads (every core) each; --workers N to set"),
    ((1, 1, 100 * GIB, 135, 0, False), 1, "1 core, 1 thread each; --workers N to set"),
    ((16, 1, 100 * GIB, 3, 0, False), 3, "16 cores, 1 thread each; 3 trials to run; --workers N to set"),
    ((16, 1, 100 * GIB, 1, 0, False), 1, "16 cores, 1 thread each; 1 trial to run; --workers N to set"),
    # memory: (768 MiB + the largest group) per worker
    (
        (16, 1, 4 * GIB, 135, GIB // 4, False),
        4,
        "16 cores, 1 thread each; memory for 4: 1.0 GiB each of 4.0 GiB available; --workers N to set",
    ),
    (
        (16, 1, 3 * GIB, 135, 2 * GIB, False),
        1,
        "16 cores, 1 thread each; memory for 1: 2.8 GiB each of 3.0 GiB available; --workers N to set",
    ),
    (
        (16, 1, GIB // 2, 135, 0, False),
        1,
        "16 cores, 1 thread each; memory for 1: 0.8 GiB each of 0.5 GiB available; --workers N to set",
    ),
    (
        (16, 1, 4 * GIB, 2, GIB // 4, False),
        2,
        "16 cores, 1 thread each; memory for 4: 1.0 GiB each of 4.0 GiB available; 2 trials to run; --workers N to set",
    ),
    ((2, 1, 4 * GIB, 135, GIB // 4, False), 2, "2 cores, 1 thread each; --workers N to set"),  # the cores bind first
    # a GPU: one process
    ((16, 1, 100 * GIB, 135, 0, True), 1, "the trials train on the GPU: one process; --workers N to set"),
    # memory unknown (no /proc/meminfo, no sysconf): the cores and the trials
    ((4, 1, None, 135, GIB, False), 4, "4 cores, 1 thread each; --workers N to set"),
]


@pytest.mark.parametrize(("given", "workers", "reason"), CASES)
def test_the_workers_are_the_cores_per_thread_capped_by_the_memory_the_trials_and_the_gpu(given, workers, reason):
    cores, threads, available, trials, group_bytes, cuda = given
    choice = choose_workers(
        cores=cores, threads=threads, available=available, trials=trials, group_bytes=group_bytes, cuda=cuda
    )
    assert (choice.workers, choice.reason) == (workers, reason)
    assert choice.line() == f"workers: {workers} ({reason})"


def test_workers_given_are_taken_up_to_the_trials_whatever_the_machine():
    machine = dict(cores=2, threads=1, available=GIB // 2, cuda=True)
    assert choose_workers(given=4, trials=135, **machine).line() == "workers: 4 (--workers 4, 1 thread each)"
    assert choose_workers(given=4, trials=3, **machine).line() == "workers: 3 (--workers 4, 1 thread each)"
    assert (
        choose_workers(given=1, trials=135, **machine).line() == "workers: 1 (--workers 1: every trial in this process)"
    )
    assert WORKER_BYTES == 768 * 2**20


@pytest.mark.slow
def test_a_sweep_prints_how_many_workers_and_why_and_runs_its_trials_here_with_one(tmp_path, monkeypatch, capfd):
    import os

    from lit_slowcal.experiments.sweep import cli, runner, single

    monkeypatch.chdir(REPO)
    path = grid_file(tmp_path, lrs=(0.01, 0.03, 0.1), seeds=(1,), methods=("slowcal",))
    ran_in, run_trial = [], single.run_trial
    monkeypatch.setattr(single, "run_trial", lambda *a: ran_in.append(os.getpid()) or run_trial(*a))
    for module in (cli, runner):
        monkeypatch.setattr(module, "usable_cpus", lambda: 2)
        monkeypatch.setattr(module, "available_memory", lambda: 100 * GIB)
    assert sw.main([str(path), "--results", str(tmp_path / "a.jsonl"), "--no-stack"]) == 0
    out = capfd.readouterr().out
    assert out.count("workers: ") == 1 and "workers: 2 (2 cores, 1 thread each; --workers N to set)\n" in out
    assert ran_in == []  # in the workers
    assert sw.main([str(path), "--results", str(tmp_path / "b.jsonl"), "--no-stack", "--workers", "1"]) == 0
    assert "workers: 1 (--workers 1: every trial in this process)\n" in capfd.readouterr().out
    assert ran_in == [os.getpid()] * 3
    # Memory for one worker only, once the trials are known: the pool that checked them is stopped, they run here.
    monkeypatch.setattr(runner, "available_memory", lambda: WORKER_BYTES + 2**20)
    assert sw.main([str(path), "--results", str(tmp_path / "c.jsonl"), "--no-stack"]) == 0
    out = capfd.readouterr().out
    assert (
        "workers: 1 (2 cores, 1 thread each; memory for 1: 0.8 GiB each of 0.8 GiB available; --workers N to set)\n"
        in out
    )
    assert ran_in == [os.getpid()] * 6 and len(records(tmp_path / "c.jsonl")) == 3


LIGHTNING_LINES = ("GPU available: ", "TPU available: ", "💡 Tip: ", "`Trainer.fit` stopped: `max_epochs=1` reached.")


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--workers", "1"],
        ["--no-stack", "--workers", "1"],
        ["--no-stack", "--workers", "2"],
        ["--workers", "2"],
        ["--no-stack", "--workers", "2", "spawn"],
    ],
    ids=["default", "stacked-here", "alone-here", "alone-2-workers", "stacked-2-workers", "alone-2-spawned-workers"],
)
@pytest.mark.slow
def test_each_repeated_line_is_printed_once_per_sweep(tmp_path, monkeypatch, capfd, flags):
    from lit_slowcal.experiments.sweep import workers

    monkeypatch.chdir(REPO)
    if "spawn" in flags:  # as elsewhere than Linux, or once CUDA is in use: the workers start afresh
        flags.remove("spawn")
        monkeypatch.setattr(workers, "_forks", lambda: False)
    # 4 trials; log_every_n_steps above the 7 batches: Lightning warns in every trial run alone.
    path = grid_file(
        tmp_path,
        lrs=(0.01, 0.03),
        seeds=(1,),
        methods=("slowcal", "local_sgd"),
        extra=("--trainer.log_every_n_steps=10",),
    )
    # Lightning prints its lines through its own handler, or through the root logger's where there was one when it
    # was imported (pytest's: then they are not on stderr): what its loggers emit is counted here, after their filters.
    said: list[str] = []
    counter = logging.Handler()
    counter.emit = lambda record: said.append(record.getMessage())
    loggers = [logging.getLogger(name) for name in LIGHTNING_INFO_LOGGERS]
    for logger in loggers:
        logger.addHandler(counter)
    try:
        with warnings.catch_warnings(record=True) as caught:  # pytest's filters: each warning shown once per place
            assert sw.main([str(path), "--results", str(tmp_path / "r.jsonl"), *flags]) == 0
    finally:
        for logger in loggers:
            logger.removeHandler(counter)
    out, err = capfd.readouterr()
    lines = (out + err).splitlines()
    assert sum(line.startswith(NOTE) for line in lines) == 1, out
    assert not any(
        line.startswith(f"  ({NOTE}") for line in lines
    )  # the summaries of trials alone leave it to the note
    # (a process prints its threads once: not again where an earlier test of this process printed them)
    assert sum(line.startswith("threads: 1 (") for line in lines) <= (0 if "--no-stack" not in flags else 1)
    for start in LIGHTNING_LINES:
        printed = start != "💡 Tip: " or lightning_has_tip()  # the tip is Lightning 2.6's
        assert sum(line.startswith(start) for line in said) == (1 if "--no-stack" in flags and printed else 0), (
            start,
            said,
        )
    logging_interval = [w for w in caught if "smaller than the logging interval" in str(w.message)]
    assert len(logging_interval) == (1 if "--no-stack" in flags else 0)
    # What differs per trial stays: each trial's result line.
    assert sum("] finished: test_acc " in line for line in lines) == 4
    assert len(records(tmp_path / "r.jsonl")) == 4


def test_a_fit_alone_still_prints_its_note_and_its_summary_line(tmp_path, monkeypatch, capfd):
    from lit_slowcal.experiments.run.cli import run

    monkeypatch.chdir(REPO)
    args = ["fit", "--config", "configs/paper.yaml", "--trainer.limit_train_batches=3", "--num_machines=4", "--local_steps=2",
            "--wandb=false", f"--run_dir={tmp_path}", "--trainer.enable_progress_bar=false"]  # fmt: skip
    run(args)
    lines = capfd.readouterr().out.splitlines()
    assert sum(line.startswith(NOTE) for line in lines) == 1
    assert sum(line.startswith(f"  ({NOTE}") for line in lines) == 1  # in its summary, as before


@pytest.mark.parametrize("flags", [[], ["--no-stack", "--workers", "2"]], ids=["stacked", "alone-2-workers"])
@pytest.mark.slow
def test_an_optimum_read_from_the_cache_is_said_once_per_sweep(tmp_path, monkeypatch, capfd, flags):
    """Every trial of a split reads the same x* from the cache: its line (f*, G_*, where it is cached) once per
    sweep, not once per trial; the solve that filled the cache is said where it happens."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    extra = ("--data.problem=Quadratic", "--model.weight_decay=1e-4")
    path = grid_file(tmp_path, lrs=(0.01, 0.03), seeds=(1,), methods=("slowcal", "local_sgd"), extra=extra)
    assert sw.main([str(path), "--results", str(tmp_path / "first.jsonl"), *flags]) == 0
    lines = capfd.readouterr().out.splitlines()
    solved = [line for line in lines if line.startswith("optimum of ") and "solved in " in line]
    read = [line for line in lines if line.startswith("optimum of ") and "read from " in line]
    # 4 trials of one split: a solve (in each worker that needed x* before the other's was cached), the others read it
    assert 1 <= len(solved) <= 2 and len(read) <= 1  # 2 workers (the 2 cores, or --workers 2)
    assert sw.main([str(path), "--results", str(tmp_path / "second.jsonl"), *flags]) == 0
    lines = capfd.readouterr().out.splitlines()
    (line,) = [line for line in lines if line.startswith("optimum of ")]
    assert "read from " in line and "f* = " in line
    first, second = records(tmp_path / "first.jsonl"), records(tmp_path / "second.jsonl")
    assert len(first) == 4 and {k: r["metrics"] for k, r in first.items()} == {
        k: r["metrics"] for k, r in second.items()
    }
    assert all(r["metrics"]["excess_loss"] > 0 for r in first.values())
