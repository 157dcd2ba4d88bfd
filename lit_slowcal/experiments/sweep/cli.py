"""``python -m lit_slowcal sweep SWEEP.yaml``: the sweep's command line (its options, ``main``).

``main`` reads the sweep file (``spec``) and expands it into trials (``trials``), checks every trial's arguments
with the training CLI's own parser before anything runs (``checks``; with several workers, forked workers check a
share each), then hands the checked sweep to the runner (``runner``). Every trial runs with ``--threads`` torch
threads (one by default), its online W&B run in one group per sweep. Each note (a line the same for every
trial: Lightning's, why there is no excess loss) is printed once per sweep (``notes.once_per_sweep``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Optional

from lit_slowcal._validation import check_int, check_number
from lit_slowcal.experiments.data.limits import available_memory
from lit_slowcal.experiments.print_once import once_per_sweep
from lit_slowcal.experiments.run.threads import check_thread_count, usable_cpus
from lit_slowcal.experiments.sweep import checks, output
from lit_slowcal.experiments.sweep.runner import run_sweep
from lit_slowcal.experiments.sweep.spec import load_sweep
from lit_slowcal.experiments.sweep.trials import expand_trials, trial_args
from lit_slowcal.experiments.sweep.workers import checking_pool, choose_workers

__all__ = ["main"]


@contextlib.contextmanager
def _sweep_environment(threads: int, group: str) -> Iterator[None]:
    """Torch threads for every trial, and a W&B group for them; both as they were afterwards."""
    import torch

    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "WANDB_RUN_GROUP")}
    saved_threads = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
        # Lightning's launcher sets torch's threads to cores / processes unless OMP_NUM_THREADS is set.
        os.environ["OMP_NUM_THREADS"] = str(threads)
    # Online W&B runs of a local sweep appear as one group (a W&B sweep needs W&B's server).
    os.environ.setdefault("WANDB_RUN_GROUP", group)
    try:
        yield
    finally:
        torch.set_num_threads(saved_threads)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lit_slowcal sweep",
        description="Run a W&B sweep file here, without a W&B server: the trials that share a shape train "
        "stacked, as one program per group, the others one at a time, in worker processes as the cores allow; "
        "each is appended to a results file as it ends, and a rerun skips finished trials.",
    )
    p.add_argument("sweep", type=Path, help="W&B sweep YAML (method grid or random)")
    p.add_argument("--results", type=Path, help="JSON-lines results file (default: sweeps/results/<sweep stem>.jsonl)")
    p.add_argument("--count", type=int, help="keep the first N trials (random search: draw N; default run_cap)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random search's draws (default 0)")
    p.add_argument("--dry-run", action="store_true", help="list the trials and which are done; run nothing")
    p.add_argument("--retry-failed", action="store_true", help="run failed and diverged trials again")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for the trials (default 1: the model is tiny, and extra threads mostly spin, "
        "badly so when other jobs share the cores; 0 keeps torch's default)",
    )
    p.add_argument(
        "--stack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="train the trials that differ only in model.lr, the seed and K as one vectorized program per group "
        "(exact: each trial's results equal its single run's); the others run one at a time, each reason why "
        "said once (default: --stack; --no-stack runs every trial one at a time)",
    )
    p.add_argument(
        "--stack-memory",
        type=float,
        metavar="GIB",
        help="memory budget of one stacked group in GiB (default: a "
        "quarter of this machine's memory, at most 8 GiB); larger groups are split",
    )
    p.add_argument(
        "--workers",
        type=int,
        help="processes running groups or trials at once, each with --threads threads (default: the cores this "
        "process may use / --threads, no more than the trials nor than the memory holds, 1 for trials on a GPU; "
        "printed); 1 runs every trial in this process; records, resume and the table are the same",
    )
    p.add_argument(
        "--wandb",
        type=_bool,
        metavar="{true,false}",
        help="add --wandb=true|false to every trial (default: the config's)",
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lit_slowcal sweep SWEEP.yaml [--results PATH] [--count N] [--dry-run] [--retry-failed] [--wandb=false]``.

    When the reader of its output ends (``| head -1``), the sweep stops quietly with status 141, as after SIGPIPE
    (``output``): the trials recorded stay, the one running is not recorded.
    """
    with output.guarded():
        try:
            return _main(argv)
        except output.OutputClosed:
            return output.EXIT_STATUS


def _main(argv: Optional[Sequence[str]]) -> int:
    opts = _parser().parse_args(argv)
    results_path = opts.results or Path("sweeps") / "results" / f"{opts.sweep.stem}.jsonl"
    extra = [] if opts.wandb is None else [f"--wandb={str(opts.wandb).lower()}"]
    try:
        if opts.stack_memory is not None:
            check_number("--stack-memory", opts.stack_memory)
        if opts.workers is not None:
            check_int("--workers", opts.workers)
        check_int("--threads", opts.threads, minimum=0)
        check_thread_count("--threads", opts.threads)  # far too many threads crash the workers
        sweep = load_sweep(opts.sweep)
        trials = expand_trials(sweep, opts.count, opts.seed)
        checks.new_command_line()  # built before the workers fork: they check trials with it too
        results = checks.results_file(results_path)
        if not opts.dry_run:
            results.check_writable()  # before any trial: a trial's record is never lost for its file
    except (ValueError, OSError) as err:
        print(f"lit_slowcal sweep: error: {err}", file=sys.stderr)
        return 2

    # The workers that check the trials (a dry run too), and run them unless the runner picks fewer (memory, GPU).
    machine = dict(cores=usable_cpus(), threads=opts.threads, available=available_memory())
    workers = choose_workers(given=opts.workers, trials=len(trials), **machine).workers
    with contextlib.ExitStack() as scope:
        if not opts.dry_run:
            scope.enter_context(_sweep_environment(opts.threads, f"sweep-{sweep.name or opts.sweep.stem}"))
        scope.enter_context(once_per_sweep())  # before the workers fork: they keep their notes for the sweep
        pool = scope.enter_context(checking_pool(workers, opts.threads))
        try:  # every trial, before the first runs
            arguments = [(p, trial_args(sweep, p, extra)) for p in trials]
            start = time.perf_counter()
            if len(trials) > checks.LARGE_GRID:  # say what takes the time before it does
                print(
                    f"sweep {opts.sweep}: {len(trials)} trials; checking their arguments with the CLI first ...",
                    flush=True,
                )
            checked = checks.check_trials(arguments, pool, workers, lambda p: trial_args(sweep, p, extra))
            checks.check_distinct(trials, checked)
            if len(trials) > checks.LARGE_GRID:
                print(
                    f"checked the arguments of {len(trials)} trials in {time.perf_counter() - start:.1f} s", flush=True
                )
        except ValueError as err:
            print(f"lit_slowcal sweep: error: {err}", file=sys.stderr)
            return 2
        return run_sweep(opts, sweep, trials, results, results_path, checked, pool, workers)
