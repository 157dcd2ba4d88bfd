"""The run of a checked sweep (``run_sweep``): its pending trials listed (``--dry-run``) or run, then its table.

1. The trials the results file holds are skipped (failed and diverged ones are run again only with
   ``--retry-failed``).
2. The others become units (``units``): unless ``--no-stack``, the trials that differ only in ``model.lr``,
   the seed and K train first, one group at a time, as one vectorized program each (``grouping``,
   ``stacked``), each trial exactly as alone; the others one at a time (``single``).
3. The units run here, one after another, or in N worker processes (``workers``: ``--workers N``, else as
   many as the cores, the memory and the trials allow, printed with why), longest first. Every trial is
   recorded in the results file as its unit ends; a unit whose worker process dies has its trials recorded
   as failed. Ctrl-C or SIGTERM stops the sweep, leaving the interrupted trial unrecorded.
4. The sweep ends with the counts of finished, diverged and failed trials and the markdown table (``table``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from lit_slowcal.experiments.data.limits import available_memory
from lit_slowcal.experiments.run.threads import usable_cpus
from lit_slowcal.experiments.sweep import checks
from lit_slowcal.experiments.sweep.results import ResultsFile
from lit_slowcal.experiments.sweep.table import format_value, param_text, summary_table
from lit_slowcal.experiments.sweep.trials import trial_key
from lit_slowcal.experiments.sweep.units import Unit, pending, run_unit
from lit_slowcal.experiments.sweep.workers import WorkerChoice, choose_workers, end_pool, run_in_workers, worker_pool

__all__ = ["run_sweep"]


class _SweepRun:
    """One run of a checked sweep: which of its trials are to run, their units, and the record of each."""

    def __init__(
        self, opts: argparse.Namespace, sweep: Any, trials: list[dict[str, Any]], results: ResultsFile, results_path: Path,
        checked: dict[str, Any],
    ) -> None:  # fmt: skip
        self.opts, self.sweep, self.trials, self.checked = opts, sweep, trials, checked
        self.results, self.results_path = results, results_path
        self.todo = [t for t in trials if self.pending(t)]
        self.ran, self.start = 0, time.perf_counter()
        self.progress: Optional[_Progress] = None  # the units to run, for the estimate of the time left

    def get(self, params: dict[str, Any]) -> Optional[dict[str, Any]]:
        """The record of this very trial (its parameters and identity) in the results file, if any."""
        return self.results.get(params, self.checked[trial_key(params)][2])

    def pending(self, params: dict[str, Any]) -> bool:
        return pending(self.get(params), self.opts.retry_failed)

    def list_trials(self) -> None:
        """``--dry-run``: every trial with its state and arguments."""
        for i, params in enumerate(self.trials, 1):
            record = self.get(params)
            state = "pending" if record is None else record["status"]
            if record is not None and self.pending(params):
                state += ", will retry"
            print(f"  [{i}/{len(self.trials)}] {state:<20} {' '.join(self.checked[trial_key(params)][0])}")

    def record(
        self, params: dict[str, Any], identity: str, outcome: dict[str, Any], args: list[str], label: str
    ) -> None:
        """A trial's outcome into the results file, and its line; once the first unit of a large grid ends, an estimate."""
        ended = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.results.put({"params": params, "identity": identity, **outcome, "args": args, "ended_at": ended})
        self.ran += 1
        metric = self.sweep.metric
        line = f"[{label}] {outcome['status']}: {metric} {format_value(outcome['metrics'].get(metric))} in {outcome['wall_time_s']:.1f} s"
        if outcome["error"]:
            line += f" ({outcome['error'].splitlines()[0][:200]})"
        print(line, flush=True)
        if self.progress is not None and self.progress.first_ended(label) and len(self.todo) > checks.LARGE_GRID:
            left = len(self.todo) - self.ran
            seconds = self.progress.seconds_left(time.perf_counter() - self.start)
            print(f"estimate: the {left} trials left take about {_duration(seconds)} more at this pace", flush=True)

    def lost(self, unit: Unit, message: str) -> None:
        """Its worker died: the trials of ``unit`` that are still to run are recorded as failed with ``message``."""
        self.results.refresh()
        for params, identity, args in unit.members():
            if pending(self.results.get(params, identity), self.opts.retry_failed):
                outcome = {"status": "failed", "error": message, "metrics": {}, "run_dir": None, "wall_time_s": 0.0}
                self.record(params, identity, outcome, args, unit.label)

    def plan(self) -> tuple[list[Any], list[tuple[dict[str, Any], list[str]]]]:
        """The trials to run: stacked groups (unless ``--no-stack``; ``grouping.plan_stacked`` prints how many,
        and why the others are not stacked, once per reason), and the trials that run alone ``(params, args)``."""
        if not self.opts.stack:
            return [], [(params, self.checked[trial_key(params)][0]) for params in self.todo]
        from lit_slowcal.experiments.sweep.grouping import plan_stacked

        self.results.refresh()  # another sweep writing the same file may have run some meanwhile
        parsed = [(p, *self.checked[trial_key(p)]) for p in self.todo if self.pending(p)]
        memory = self.opts.stack_memory
        return plan_stacked(parsed, int(memory * 2**30) if memory else None)

    def choose_workers(self, groups: list[Any], alone: list[tuple[dict[str, Any], list[str]]]) -> WorkerChoice:
        """``--workers N``, or as many as the cores, the memory and the trials allow (``choose_workers``)."""
        import torch

        from lit_slowcal.experiments.sweep.grouping import trial_bytes, trial_device

        trials = len(alone) + sum(map(len, groups))
        configs = [g[0].config for g in groups]
        if torch.cuda.is_available() and self.opts.workers is None:  # else no trial trains on a GPU
            configs += [self.checked[trial_key(p)][1].get("fit").as_dict() for p, _ in alone]
        return choose_workers(
            given=self.opts.workers, cores=usable_cpus(), threads=self.opts.threads, available=available_memory(),
            trials=trials, group_bytes=max((sum(trial_bytes(t.config) for t in g) for g in groups), default=0),
            cuda=any(getattr(trial_device(c), "type", None) == "cuda" for c in configs),
        )  # fmt: skip

    def units(self, groups: list[Any], alone: list[tuple[dict[str, Any], list[str]]], workers: int) -> list[Unit]:
        """The trials to run as units: the stacked groups first (balanced over the workers), then the trials
        that run alone."""
        from lit_slowcal.experiments.sweep.grouping import balance_groups, group_cost, group_title

        if workers > 1 and groups:
            groups = balance_groups(groups, workers)
        units = [
            Unit(f"group {g}/{len(groups)}", group_title(group), group, group_cost(group))
            for g, group in enumerate(groups, 1)
        ]
        for i, (p, _) in enumerate(alone, 1):
            units.append(Unit(f"{i}/{len(alone)}", param_text(p), (p, *self.checked[trial_key(p)])))
        return units

    def run_units(self, units: list[Unit], pool: Any, workers: int) -> list[str]:
        """Every unit, here or in the workers (``pool``, or a pool started now); the messages of lost workers."""
        check = (str(self.results_path), self.opts.retry_failed)
        self.progress = _Progress(units, workers)
        if workers == 1 or len(units) <= 1:
            for unit in units:
                label, outcomes = run_unit(check, unit)
                for params, identity, outcome, args in outcomes:
                    self.record(params, identity, outcome, args, label)
            return []
        with contextlib.ExitStack() as scope:
            if pool is None:
                pool = scope.enter_context(worker_pool(min(workers, len(units)), self.opts.threads))
            return run_in_workers(pool, units, check, self.record, self.lost)

    def summary(self, died: list[str]) -> int:
        """The counts and the table; 1 where a worker died (its trials are recorded as failed), else 0."""
        if self.todo:
            print(
                f"\n{len(self.todo)} trials in {time.perf_counter() - self.start:.1f} s; results in {self.results_path}"
            )
        done = [r for r in map(self.get, self.trials) if r is not None]
        counts = {s: sum(r["status"] == s for r in done) for s in ("finished", "diverged", "failed")}
        print(
            f"{counts['finished']} finished, {counts['diverged']} diverged, {counts['failed']} failed of {len(self.trials)} trials\n"
        )
        print(summary_table(self.sweep, done))
        if died:
            print(
                f"lit_slowcal sweep: error: {'; '.join(died)}; its trials are recorded as failed in {self.results_path}: "
                "run the same command with --retry-failed to run them again",
                file=sys.stderr,
            )
            return 1
        return 0


class _Progress:
    """The units of a sweep as they end, for one estimate of the time left once the first has ended: the units'
    work is their costs (``group_cost``) where every unit has one, else their trials; the first unit ends after
    about its own work on each of the ``workers`` at once (they started together, the longest first)."""

    def __init__(self, units: list[Unit], workers: int) -> None:
        costed = all(u.cost > 0 for u in units)
        self.work = {u.label: (u.cost if costed else float(len(u.members()))) for u in units}
        self.total = sum(self.work.values())
        self.left = {u.label: len(u.members()) for u in units}  # its trials not recorded yet
        self.workers = max(1, min(workers, len(units)))
        self.first: Optional[str] = None

    def first_ended(self, label: str) -> bool:
        """A trial of unit ``label`` is recorded: whether that ends the first unit to end."""
        if label not in self.left:
            return False
        self.left[label] -= 1
        if self.left[label] or self.first is not None:
            return False
        self.first = label
        return True

    def seconds_left(self, spent: float) -> float:
        """The time left, ``spent`` seconds after the units started, at the pace of the first to end."""
        assert self.first is not None
        done = min(self.total, self.workers * self.work[self.first])
        return spent * (self.total - done) / max(done, 1e-12)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def run_sweep(
    opts: argparse.Namespace,
    sweep: Any,
    trials: list[dict[str, Any]],
    results: ResultsFile,
    results_path: Path,
    checked: dict[str, Any],
    pool: Any,
    workers: int,
) -> int:
    """The checked sweep (``checked``: ``check_trials``'s result): its pending trials run (or, with ``--dry-run``,
    are listed), then its table; the exit status."""
    for key in sweep.ignored:
        print(f"note: {key} needs W&B's controller and is ignored here; every trial runs to its end")
    run = _SweepRun(opts, sweep, trials, results, results_path, checked)
    todo = run.todo
    print(
        f"sweep {opts.sweep} ({sweep.method}): {len(trials)} trials, {len(trials) - len(todo)} already in "
        f"{results_path}, {len(todo)} to run",
        flush=True,
    )
    if opts.dry_run:
        run.list_trials()
        return 0
    run.start = time.perf_counter()
    try:
        groups, alone = run.plan()
        choice = run.choose_workers(groups, alone)
        if groups or alone:
            print(choice.line(), flush=True)
        if pool is not None and choice.workers != workers:  # the pool that checked the trials: another size
            end_pool(pool)
            pool = None
        died = run.run_units(run.units(groups, alone, choice.workers), pool, choice.workers)
    except (KeyboardInterrupt, SystemExit) as err:  # Ctrl-C, or SIGTERM as Lightning (or the pool) raises it
        print(
            f"\nsweep interrupted ({type(err).__name__}) after {run.ran} of {len(todo)} trials; they are in "
            f"{results_path}. Run the same command again to go on.",
            file=sys.stderr,
        )
        return 130 if isinstance(err, KeyboardInterrupt) else 143
    return run.summary(died)
