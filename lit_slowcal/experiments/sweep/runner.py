"""Running a sweep here, trial after trial: ``python -m lit_slowcal sweep sweeps/lr.yaml`` (``main``).

1. The sweep file is read and checked (``spec``) and expanded into trials (``trials``).
2. Every trial's arguments are parsed by ``SlowcalCLI``'s own parser before anything runs
   (``CommandLine``; with ``--workers``, forked workers parse a share each): a parameter the CLI
   does not take, or a value it refuses, stops the sweep before the first run. A trial then runs
   from that parse; it does not parse its arguments again.
3. Trials run one after another in this process (``run_trial``: ``SlowcalCLI(args=...)``; one torch
   thread by default, see ``--threads``). What does not depend on the trial is set up once per
   process: the CLI's parsers, MNIST decoded, each (M, seed) split and its figure; and a trial
   trains in one process, without a process group. A trial that raises is recorded
   as ``failed`` (``diverged`` for a non-finite training loss) and the sweep goes on; Ctrl-C or
   SIGTERM stops the sweep, leaving the interrupted trial unrecorded.
   With ``--stack``, the trials that differ only in ``model.lr``, the seed and K train first, one
   group at a time, as one vectorized program each (``stacked``), each trial exactly as alone.
   With ``--workers N``, N processes (forked on Linux) run the groups or trials, longest first,
   each taking the next when it is done; this process records every trial as its worker ends it.
4. Every finished trial is added to the results file at once (``results``); a rerun of the same
   command skips the trials it holds, and so does a sweep writing the same file at the same time
   (each trial is checked against the file just before it runs). Failed and diverged trials are
   retried only with ``--retry-failed``.
5. The sweep ends with a markdown table (``table``).

The training CLI is imported only when a sweep checks or runs trials; it never imports this package.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from lit_slowcal._validation import check_int, check_number
from lit_slowcal.experiments.sweep.results import ResultsFile
from lit_slowcal.experiments.sweep.spec import load_sweep
from lit_slowcal.experiments.sweep.table import format_value, param_text, summary_table
from lit_slowcal.experiments.sweep.trials import expand_trials, identity_digest, trial_args, trial_key

__all__ = ["CommandLine", "main", "run_trial"]


class CommandLine:
    """``SlowcalCLI``'s parser, built once without instantiating anything, to check trial arguments.

    Parsing runs exactly what ``SlowcalCLI(args=...)`` runs before it builds the model: the config
    file, every option's type and the linked settings (K >= 1, ...). About 0.2 s to build, 0.04 s a parse.
    """

    def __init__(self) -> None:
        from lit_slowcal.experiments.cli import SlowcalCLI

        class _Built(Exception):
            pass

        class _ParserOnly(SlowcalCLI):
            def parse_arguments(self, parser: Any, args: Any) -> None:
                raise _Built(self)

        # Parsers that raise ArgumentError instead of printing usage and exiting: the main parser
        # and, through their own keyword arguments, each subcommand's.
        no_exit = {"exit_on_error": False}
        subcommands = {name: dict(no_exit) for name in SlowcalCLI.subcommands()}
        try:
            _ParserOnly(args=[], parser_kwargs={"prog": "python -m lit_slowcal", **no_exit, **subcommands})
        except _Built as built:
            cli = built.args[0]
        self.parser = cli.parser

    def parse(self, args: Sequence[str]) -> Any:
        """The parsed configuration (a jsonargparse Namespace; keys such as ``fit.model.lr``).

        Raises:
            ValueError: with the parser's message when the CLI refuses the arguments.
        """
        from lit_slowcal.experiments.options import one_line_message

        try:
            return self.parser.parse_args(list(args))
        except argparse.ArgumentError as err:
            raise ValueError(one_line_message(err)) from None
        except SystemExit as err:  # an option that prints and exits (--help, --print_config) among them
            raise ValueError(f"the CLI exits (status {err.code}) instead of running the trial") from None


@contextlib.contextmanager
def _trial_environment() -> Iterator[None]:
    # LightningCLI warns when given args while sys.argv has some (ours: the sweep's); and the CLI
    # remembers its run folder version in the environment for its DDP children: each trial needs a fresh one.
    from lit_slowcal.experiments.run_folder import RUN_VERSION_ENV

    argv = sys.argv
    sys.argv = argv[:1]
    os.environ.pop(RUN_VERSION_ENV, None)
    try:
        yield
    finally:
        sys.argv = argv
        os.environ.pop(RUN_VERSION_ENV, None)


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


def _finish_wandb(failed: bool) -> None:
    # WandbLogger reuses a run left open; the next trial must start its own.
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish(exit_code=1 if failed else 0)


@functools.lru_cache(maxsize=None)
def _trial_cli() -> Any:
    """``SlowcalCLI`` for trials: it keeps the trainer reachable when fit raises, and builds its parsers once.

    Building the parsers (jsonargparse reads the signature of the Trainer, the model and the data
    module, for each of the four subcommands) takes longer than a short run trains; the parsers
    depend on nothing but the class, so the first trial of the process builds them and the next
    ones reuse them. Each trial still parses its own arguments (and reads its config file) afresh.
    """
    from lit_slowcal.experiments.cli import SlowcalCLI

    built: dict[str, dict[str, Any]] = {}

    class TrialCLI(SlowcalCLI):
        last: Optional["TrialCLI"] = None  # the running trial's CLI
        given: Any = None  # the running trial's arguments as the sweep's check parsed them, or None

        def parse_arguments(self, parser: Any, args: Any) -> None:
            # The sweep's check (CommandLine) parsed these very arguments with the same parser class:
            # its result is what this parse would give (0.03 s a trial).
            if self.given is None:
                super().parse_arguments(parser, args)
            else:
                self.config = self.given

        def setup_parser(
            self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
        ) -> None:
            # What setup_parser sets on the CLI (the parser, the subcommand parsers and the names of
            # their method arguments), recorded once and set again on every later trial's CLI.
            key = repr((add_subcommands, main_kwargs, subparser_kwargs))
            if key not in built:
                before = dict(vars(self))
                super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
                built[key] = {k: v for k, v in vars(self).items() if k not in before or before[k] is not v}
            vars(self).update(built[key])

        def before_instantiate_classes(self) -> None:
            type(self).last = self  # keeps the trainer reachable when fit raises
            super().before_instantiate_classes()

    return TrialCLI


def run_trial(args: Sequence[str], parsed: Any = None) -> dict[str, Any]:
    """Run ``SlowcalCLI(args=args)`` here; never raises for a failing run.

    ``parsed``: ``CommandLine().parse(args)``, when the caller has it (the sweep's check): the CLI uses
    it instead of parsing ``args`` again. It is not changed.

    Ctrl-C (KeyboardInterrupt) and SIGTERM (Lightning's SIGTERMException) are raised: they stop the
    sweep, and the interrupted trial is not recorded.

    Returns:
        ``status`` (``finished``, ``diverged`` or ``failed``), ``error`` (None or the message),
        ``metrics`` (final ``trainer.callback_metrics``), ``run_dir`` (the CSV log folder) and
        ``wall_time_s``.
    """
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lit_slowcal.experiments.rounds import trial_status

    trial_cli = _trial_cli()
    trial_cli.last = None
    trial_cli.given = None if parsed is None else parsed.clone()
    status, error = "finished", None
    start = time.perf_counter()
    with _trial_environment():
        try:
            trial_cli(args=list(args))
        except SIGTERMException:  # Lightning's form of SIGTERM: stop the sweep, not just this trial
            status = "interrupted"
            raise
        except FloatingPointError as err:  # TrainingDiverged: diverged; another: failed
            status, error = trial_status(err), str(err)
        except SystemExit as err:
            if isinstance(err.__context__, KeyboardInterrupt):  # Lightning exits this way after Ctrl-C
                status = "interrupted"
                raise KeyboardInterrupt from err
            status, error = "failed", f"SystemExit: {err}"  # e.g. the parser's exit
        except Exception as err:
            status, error = "failed", f"{type(err).__name__}: {err}"
        except BaseException:  # KeyboardInterrupt outside the trainer
            status = "interrupted"
            raise
        finally:
            _finish_wandb(failed=status != "finished")
    wall = time.perf_counter() - start
    trainer = getattr(trial_cli.last, "trainer", None)
    trial_cli.last = trial_cli.given = None
    metrics: dict[str, Optional[float]] = {}
    run_dir = None
    if trainer is not None:
        for key, value in trainer.callback_metrics.items():
            if getattr(value, "numel", lambda: 1)() == 1:
                v = float(value)
                metrics[key] = v if math.isfinite(v) else None  # strict JSON: no NaN
        run_dir = next((str(lg.log_dir) for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)
    return {"status": status, "error": error, "metrics": metrics, "run_dir": run_dir, "wall_time_s": round(wall, 3)}


#: Grids larger than this say their size and the time of their check before it starts, and an estimate of their
#: running time once a trial has run.
_MANY = 100

# The sweep's parser, read by the workers forked to check trials (_parse): a forked worker has it already.
_checker: Optional[CommandLine] = None

def trial_identity_of(parsed: Any) -> str:
    """The identity digest of a trial's run from its parse (``CommandLine.parse``): everything that defines
    its results (``lit_slowcal.experiments.identity.trial_identity``), the command and config included."""
    from lit_slowcal.experiments.identity import SEED_KEYS, trial_identity

    # As the CLI takes a run's identity: the dump leaves out the settings linked from others (data.batch_size, ...).
    dumped = json.loads(_command_line().parser.dump(parsed, format="json", skip_unset=False, skip_validation=True))
    return identity_digest(trial_identity(dumped["fit"]), SEED_KEYS)


def _command_line() -> CommandLine:
    """The sweep's parser (``_checker``), built here where it is not yet (a spawned worker)."""
    global _checker
    if _checker is None:
        _checker = CommandLine()
    return _checker


# Identities of records written before identities were stored, by their arguments (parsed once per process).
_legacy: dict[tuple[str, ...], Optional[str]] = {}


def _legacy_identity(record: dict[str, Any]) -> Optional[str]:
    """The identity of a record that stores none: its ``args`` parsed by the CLI now (``None`` if it cannot
    tell: no args, or args the CLI refuses today). Its config file is read as it is now."""
    args = record.get("args")
    if not isinstance(args, list) or not args:
        return None
    key = tuple(args)
    if key not in _legacy:
        try:
            _legacy[key] = trial_identity_of(_command_line().parse(args))
        except (ValueError, OSError):
            _legacy[key] = None
    return _legacy[key]


def results_file(path: str | Path) -> ResultsFile:
    """The sweep's results file, whose records without a stored identity get one from their arguments."""
    return ResultsFile(path, identify=_legacy_identity)


@dataclass
class _Unit:
    """What one process runs at a time: a stacked group (``StackedTrial`` s), or one trial alone
    (``(params, args, parsed, identity)``, ``parsed`` being ``CommandLine.parse(args)``)."""

    label: str  # "group 2/9", "4/20"
    title: str  # what it runs, printed as it starts
    trials: Any  # list[StackedTrial] (a group) or (params, args, parsed, identity) (a trial alone)
    cost: float = 0.0  # relative running time (groups: stacked.group_cost), to start the longest first


def _pending(record: Optional[dict[str, Any]], retry_failed: bool) -> bool:
    """Whether a trial whose record in the results file is ``record`` (None: none) is to run."""
    return record is None or (retry_failed and record["status"] != "finished")


_Outcome = tuple[dict[str, Any], str, dict[str, Any], list[str]]  # (params, identity, outcome, args) of a trial


def _run_unit(check: tuple[str, bool], unit: _Unit, index: Optional[int] = None) -> tuple[str, list[_Outcome]]:
    """Run ``unit`` here; return its label and ``(params, identity, outcome, args)`` of each trial it ran: the
    trials that the results file ``check = (path, retry_failed)`` holds already (another sweep ran them
    meanwhile) are left out, read just before the unit starts. In a worker, ``index`` is the unit's number,
    sent to the sweep with this process's id as the unit starts (``_started``)."""
    if _started is not None and index is not None:
        _started.put((index, os.getpid()))
    results, retry = results_file(check[0]), check[1]
    if isinstance(unit.trials, tuple):
        params, args, parsed, identity = unit.trials
        if not _pending(results.get(params, identity), retry):
            print(f"\n[{unit.label}] {unit.title}: already in {check[0]}", flush=True)
            return unit.label, []
        print(f"\n[{unit.label}] {unit.title}", flush=True)
        return unit.label, [(params, identity, run_trial(args, parsed), args)]
    from lit_slowcal.experiments.sweep.stacked import config_yaml, group_title, run_group

    group = [t for t in unit.trials if _pending(results.get(t.params, t.identity), retry)]
    if not group:
        print(f"\n[{unit.label}] {unit.title}: already in {check[0]}", flush=True)
        return unit.label, []
    title = unit.title if len(group) == len(unit.trials) else f"{group_title(group)} ({len(unit.trials) - len(group)} already in {check[0]})"
    print(f"\n[{unit.label}] {title}", flush=True)
    run_group(group, config_yaml)
    return unit.label, [(t.params, t.identity, t.outcome, t.args) for t in group]

# In a worker: the queue on which it tells the sweep which unit it starts (_run_unit); in the sweep: the
# queue of its pool's workers (_worker_pool), read by _run_in_workers to tell which unit a lost worker ran.
_started: Any = None
_pool_started: Any = None


def _worker_start(threads: int, started: Any = None) -> None:
    import torch

    global _started
    _started = started
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the sweep, which stops the workers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (a forked worker inherits the sweep's handler)
    if threads > 0:
        torch.set_num_threads(threads)


def _forks() -> bool:
    """Whether workers are forked. Forked workers start at once with what this process loaded (torch, Lightning,
    the parser); spawned ones import it all again (seconds each). Fork only on Linux (macOS: unsafe) and before
    CUDA is in use here."""
    import torch

    return sys.platform.startswith("linux") and not torch.cuda.is_initialized()


@contextlib.contextmanager
def _worker_pool(workers: int, threads: int) -> Iterator[Any]:
    """``workers`` processes (forked where ``_forks()``, else spawned) for as long as the sweep needs them;
    SIGTERM to the sweep ends them too (it leaves through the pool's exit)."""
    import multiprocessing

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    global _pool_started
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        context = multiprocessing.get_context("fork" if _forks() else "spawn")
        _pool_started = context.SimpleQueue()  # put writes at once (a Queue's thread might not before a kill)
        with context.Pool(workers, initializer=_worker_start, initargs=(threads, _pool_started)) as pool:
            yield pool
    finally:
        signal.signal(signal.SIGTERM, previous)
        _pool_started = None


def _parse(args: list[str]) -> tuple[Any, Optional[str], Optional[str]]:
    """``(_checker.parse(args), its identity, None)``, or ``(None, None, the CLI's message)`` when it refuses them."""
    assert _checker is not None
    try:
        parsed = _checker.parse(args)
    except ValueError as err:
        return None, None, str(err)
    return parsed, trial_identity_of(parsed), None


def _leaf_key(name: str) -> bool:
    """Whether the option ``name`` is one key of the parsed ``fit`` section and of a run's identity (``model.lr``,
    ``checkpoint_every``), not a source of a linked setting: a value of it changes that key only."""
    from lit_slowcal.experiments.options import PARSE_LINK_SOURCES

    parts = name.split(".")
    return name not in PARSE_LINK_SOURCES and (len(parts) == 1 or (len(parts) == 2 and parts[0] in ("model", "data", "trainer")))


def _check_by_parts(trials: list[tuple[dict[str, Any], list[str]]], make_args: Any) -> Optional[dict[str, Any]]:
    """``_check``'s result with fewer parses, or ``None`` where it would not save any.

    A swept option that is one key of the configuration (``_leaf_key``; the check confirms that a value of it
    changes that key only) is parsed value by value; the trials are parsed once per combination of the other
    options' values; each trial's parse is its combination's with its own values of the first options set in.
    It is the parse of the trial's own arguments (``tests/test_sweep.py`` compares them).
    """
    from lit_slowcal.experiments.identity import SEED_KEYS, trial_identity

    first = trials[0][0]
    names = list(first)
    candidates = [n for n in names if _leaf_key(n)]
    distinct = {n: {trial_key({n: t[0][n]}) for t in trials} for n in names}
    rest = {tuple(trial_key({n: t[0][n]}) for n in names if n not in candidates) for t in trials}
    if not candidates or 1 + sum(len(distinct[n]) for n in candidates) + len(rest) > len(trials) // 2:
        return None

    def parse(params: dict[str, Any], what: str) -> Any:
        config, _, error = _parse(make_args(params))
        if error is not None:
            raise ValueError(f"{what}: the CLI refuses it: {error}")
        return config

    base = dict(parse(first, f"trial {param_text(first)}").items())
    leaves: dict[str, dict[str, tuple[Any, Any]]] = {}  # name -> value -> (its parsed value, its dumped value)
    for n in candidates:
        values = {trial_key({n: t[0][n]}): t[0][n] for t in trials}
        leaves[n] = {}
        for key, v in values.items():
            config = parse({**first, n: v}, f"{n}={v}")
            changed = {k for k, x in config.items() if k not in base or base[k] != x} | (base.keys() - dict(config.items()).keys())
            if not changed <= {f"fit.{n}"}:
                break
            dumped = json.loads(_command_line().parser.dump(config, format="json", skip_unset=False, skip_validation=True))
            leaves[n][key] = (config[f"fit.{n}"], json.loads(json.dumps(_get(dumped["fit"], n), default=str)))
        else:
            continue
        del leaves[n]  # it changes other keys too: checked with the combinations
    others = [n for n in names if n not in leaves]
    combos: dict[tuple[str, ...], tuple[Any, dict[str, Any]]] = {}
    checked: dict[str, Any] = {}
    for params, args in trials:
        combo = tuple(trial_key({n: params[n]}) for n in others)
        if combo not in combos:
            config = parse(params, f"trial {param_text(params)}")
            dumped = json.loads(_command_line().parser.dump(config, format="json", skip_unset=False, skip_validation=True))
            combos[combo] = (config, trial_identity(dumped["fit"]))
        config, identity = combos[combo]
        config, identity = config.clone(), dict(identity)
        for n, values in leaves.items():
            parsed_value, dumped_value = values[trial_key({n: params[n]})]
            config[f"fit.{n}"] = parsed_value
            if n in identity:  # the identity's keys are the configuration's, flattened one level (model.lr)
                identity[n] = dumped_value
        checked[trial_key(params)] = (args, config, identity_digest(identity, SEED_KEYS))
    return checked


def _get(d: dict[str, Any], name: str) -> Any:
    for part in name.split("."):
        d = d[part]
    return d


def _check(
    trials: list[tuple[dict[str, Any], list[str]]], pool: Any = None, workers: int = 1, make_args: Any = None
) -> dict[str, Any]:
    """Every trial's ``(params, args)`` as ``(args, parsed, identity)`` by trial key, ``parsed`` by the CLI's parser
    (``_checker``): in this process, or shared among the forked workers of ``pool`` (each has ``_checker`` from
    this process).

    With ``make_args`` (a trial's arguments from its parameters), a large grid is checked by parts
    (``_check_by_parts``) where that saves parses.

    Raises:
        ValueError: naming the first trial the CLI refuses, with its message.
    """
    if make_args is not None and len(trials) > _MANY:
        by_parts = _check_by_parts(trials, make_args)
        if by_parts is not None:
            return by_parts
    args = [a for _, a in trials]
    if pool is None:
        outcomes: Any = map(_parse, args)
    else:  # a few chunks per worker: even shares, and few round trips
        outcomes = pool.imap(_parse, args, chunksize=max(1, len(args) // (4 * workers)))
    checked: dict[str, Any] = {}
    for (params, trial), (config, identity, error) in zip(trials, outcomes):
        if error is not None:
            raise ValueError(f"trial {param_text(params)}: the CLI refuses it: {error}")
        checked[trial_key(params)] = (trial, config, identity)
    return checked


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:  # ended, and reaped by the pool (which starts another worker in its place)
        return False
    except PermissionError:
        pass
    return True


def _run_in_workers(
    pool: Any, workers: int, units: list[_Unit], threads: int, check: tuple[str, bool], record: Any, lost: Any
) -> list[str]:
    """Run ``units`` in the ``workers`` processes of ``pool``, longest first, each taking the next when it is done;
    every trial is recorded here, as its unit ends. A unit whose worker process ends before it does (killed,
    out of memory) is given to ``lost(unit, message)`` (which records its trials as failed) and the others go
    on; returns those messages."""
    order = sorted(units, key=lambda u: -u.cost)  # stable: the lone trials, cost 0, keep the sweep's order
    each = f"{threads} torch thread{'s' if threads > 1 else ''}" if threads > 0 else "torch's default threads"
    print(f"workers: {workers} processes, each running one group or trial at a time with {each}", flush=True)
    waiting = {i: pool.apply_async(_run_unit, (check, unit, i)) for i, unit in enumerate(order)}
    running: dict[int, int] = {}  # unit -> the worker process running it
    messages: list[str] = []
    while waiting:
        next(iter(waiting.values())).wait(0.2)
        for i, result in list(waiting.items()):
            if result.ready():
                del waiting[i]
                running.pop(i, None)
                label, outcomes = result.get()
                for params, identity, outcome, args in outcomes:
                    record(params, identity, outcome, args, label)
        while not _pool_started.empty():
            i, pid = _pool_started.get()
            running[i] = pid
        for i, pid in list(running.items()):
            if i in waiting and not _alive(pid) and not waiting[i].wait(0.5):  # its result would be there by now
                del waiting[i], running[i]
                message = f"the worker process (pid {pid}) running {order[i].label} ended before it did (killed, or out of memory?)"
                lost(order[i], message)
                messages.append(message)
    return messages


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lit_slowcal sweep",
        description="Run a W&B sweep file here, without a W&B server: the trials run one after another in "
        "this process, each is appended to a results file as it ends, and a rerun skips finished trials.",
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
        action="store_true",
        help="train the trials that differ only in model.lr, the seed and K as one vectorized program per group "
        "(exact: each trial's results equal its single run's); the others run one at a time",
    )
    p.add_argument(
        "--stack-memory", type=float, metavar="GIB", help="memory budget of one stacked group in GiB (default: a "
        "quarter of this machine's memory, at most 8 GiB); larger groups are split",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes running trials (with --stack: groups) at once, each with --threads threads (default 1; "
        "on a machine of its own, as many as its cores: --workers 2 --threads 1 on 2 cores); records, resume and "
        "the table are the same",
    )
    p.add_argument(
        "--wandb", type=_bool, metavar="{true,false}", help="add --wandb=true|false to every trial (default: the config's)"
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lit_slowcal sweep SWEEP.yaml [--results PATH] [--count N] [--dry-run] [--retry-failed] [--wandb=false]``."""
    global _checker
    opts = _parser().parse_args(argv)
    results_path = opts.results or Path("sweeps") / "results" / f"{opts.sweep.stem}.jsonl"
    extra = [] if opts.wandb is None else [f"--wandb={str(opts.wandb).lower()}"]
    try:
        if opts.stack_memory is not None:
            check_number("--stack-memory", opts.stack_memory)
        check_int("--workers", opts.workers)
        check_int("--threads", opts.threads, minimum=0)
        sweep = load_sweep(opts.sweep)
        trials = expand_trials(sweep, opts.count, opts.seed)
        _checker = CommandLine()  # built before the workers fork: they check trials with it too
        results = results_file(results_path)
        if not opts.dry_run:
            results.check_writable()  # before any trial: a trial's record is never lost for its file
    except (ValueError, OSError) as err:
        print(f"lit_slowcal sweep: error: {err}", file=sys.stderr)
        return 2

    workers = min(opts.workers, len(trials))  # a dry run too: the workers share the check
    with contextlib.ExitStack() as scope:
        if not opts.dry_run:
            scope.enter_context(_sweep_environment(opts.threads, f"sweep-{sweep.name or opts.sweep.stem}"))
        # Forked workers start at once and share the check (0.03 s a trial); spawned ones only when trials run.
        pool = scope.enter_context(_worker_pool(workers, opts.threads)) if workers > 1 and _forks() else None
        try:  # every trial, before the first runs
            arguments = [(p, trial_args(sweep, p, extra)) for p in trials]
            start = time.perf_counter()
            if len(trials) > _MANY:  # say what takes the time before it does
                print(f"sweep {opts.sweep}: {len(trials)} trials; checking their arguments with the CLI first ...", flush=True)
            checked = _check(arguments, pool, workers, lambda p: trial_args(sweep, p, extra))
            if len(trials) > _MANY:
                print(f"checked the arguments of {len(trials)} trials in {time.perf_counter() - start:.1f} s", flush=True)
        except ValueError as err:
            print(f"lit_slowcal sweep: error: {err}", file=sys.stderr)
            return 2
        return _run(opts, sweep, trials, results, results_path, checked, pool, workers)


def _run(
    opts: argparse.Namespace,
    sweep: Any,
    trials: list[dict[str, Any]],
    results: ResultsFile,
    results_path: Path,
    checked: dict[str, Any],
    pool: Any,
    workers: int,
) -> int:
    """The checked sweep (``checked``: ``_check``'s result): its pending trials run (or, with ``--dry-run``, are
    listed), then its table."""
    for key in sweep.ignored:
        print(f"note: {key} needs W&B's controller and is ignored here; every trial runs to its end")

    def get(params: dict[str, Any]) -> Optional[dict[str, Any]]:  # the record of this very trial, if any
        return results.get(params, checked[trial_key(params)][2])

    def pending(params: dict[str, Any]) -> bool:
        return _pending(get(params), opts.retry_failed)

    todo = [t for t in trials if pending(t)]
    print(
        f"sweep {opts.sweep} ({sweep.method}): {len(trials)} trials, {len(trials) - len(todo)} already in "
        f"{results_path}, {len(todo)} to run",
        flush=True,
    )
    if opts.dry_run:
        for i, params in enumerate(trials, 1):
            record = get(params)
            state = "pending" if record is None else record["status"]
            if record is not None and pending(params):
                state += ", will retry"
            print(f"  [{i}/{len(trials)}] {state:<20} {' '.join(checked[trial_key(params)][0])}")
        return 0

    sweep_start, ran = time.perf_counter(), 0

    def record(params: dict[str, Any], identity: str, outcome: dict[str, Any], args: list[str], label: str) -> None:
        nonlocal ran
        ended = datetime.now(timezone.utc).isoformat(timespec="seconds")
        results.put({"params": params, "identity": identity, **outcome, "args": args, "ended_at": ended})
        ran += 1
        value = outcome["metrics"].get(sweep.metric)
        line = f"[{label}] {outcome['status']}: {sweep.metric} {format_value(value)} in {outcome['wall_time_s']:.1f} s"
        if outcome["error"]:
            line += f" ({outcome['error'].splitlines()[0][:200]})"
        print(line, flush=True)
        if ran == 1 and len(todo) > _MANY:
            spent = time.perf_counter() - sweep_start
            print(f"estimate: the {len(todo) - 1} trials left take about {spent * (len(todo) - 1) / 60:.0f} min more at this pace", flush=True)

    died: list[str] = []
    try:
        units: list[_Unit] = []
        alone = [(params, checked[trial_key(params)][0]) for params in todo]
        if opts.stack:  # see stacked.py: groups of trials as one program, the rest one at a time
            from lit_slowcal.experiments.sweep.stacked import balance_groups, group_cost, group_title, plan_stacked

            results.refresh()  # another sweep writing the same file may have run some meanwhile
            parsed = [(p, *checked[trial_key(p)]) for p in todo if pending(p)]
            groups, alone = plan_stacked(parsed, int(opts.stack_memory * 2**30) if opts.stack_memory else None)
            if workers > 1:
                groups = balance_groups(groups, workers)
            for g, group in enumerate(groups, 1):
                label = f"group {g}/{len(groups)}"
                units.append(_Unit(label, group_title(group), group, group_cost(group)))
        units += [
            _Unit(f"{i}/{len(alone)}", param_text(p), (p, *checked[trial_key(p)])) for i, (p, _) in enumerate(alone, 1)
        ]
        check = (str(results_path), opts.retry_failed)

        def lost(unit: _Unit, message: str) -> None:  # its worker died: its trials that are still to run fail
            results.refresh()
            trials = [(t.params, t.identity, t.args) for t in unit.trials] if isinstance(unit.trials, list) else [
                (unit.trials[0], unit.trials[3], unit.trials[1])
            ]
            for params, identity, args in trials:
                if _pending(results.get(params, identity), opts.retry_failed):
                    outcome = {"status": "failed", "error": message, "metrics": {}, "run_dir": None, "wall_time_s": 0.0}
                    record(params, identity, outcome, args, unit.label)

        if workers == 1 or len(units) <= 1:
            for unit in units:
                label, outcomes = _run_unit(check, unit)
                for params, identity, outcome, args in outcomes:
                    record(params, identity, outcome, args, label)
        else:
            busy = min(workers, len(units))
            with contextlib.ExitStack() as scope:
                if pool is None:
                    pool = scope.enter_context(_worker_pool(busy, opts.threads))
                died = _run_in_workers(pool, busy, units, opts.threads, check, record, lost)
    except (KeyboardInterrupt, SystemExit) as err:  # Ctrl-C, or SIGTERM as Lightning (or the pool) raises it
        print(
            f"\nsweep interrupted ({type(err).__name__}) after {ran} of {len(todo)} trials; they are in "
            f"{results_path}. Run the same command again to go on.",
            file=sys.stderr,
        )
        return 130 if isinstance(err, KeyboardInterrupt) else 143
    if todo:
        print(f"\n{len(todo)} trials in {time.perf_counter() - sweep_start:.1f} s; results in {results_path}")
    done = [r for r in map(get, trials) if r is not None]
    counts = {s: sum(r["status"] == s for r in done) for s in ("finished", "diverged", "failed")}
    print(f"{counts['finished']} finished, {counts['diverged']} diverged, {counts['failed']} failed of {len(trials)} trials\n")
    print(summary_table(sweep, done))
    if died:
        print(
            f"lit_slowcal sweep: error: {'; '.join(died)}; its trials are recorded as failed in {results_path}: "
            "run the same command with --retry-failed to run them again",
            file=sys.stderr,
        )
        return 1
    return 0
