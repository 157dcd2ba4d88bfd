"""W&B sweep files run here, without a W&B server: ``python -m lit_slowcal sweep sweeps/lr.yaml``.

The same YAML works both ways. With a W&B account, ``wandb sweep sweeps/lr.yaml`` and ``wandb agent
<sweep id>`` run it on W&B's controller; this module runs it in one process:

1. The sweep file is read and checked as W&B would (``parse_sweep``): the top-level keys, every
   parameter's search space, the ``metric`` and the ``command``. What W&B's controller alone can do
   (``bayes``, ``custom``, nested parameters) is refused with the key and the allowed values.
2. The search space becomes a list of trials (``expand_trials``), each a ``{name: value}`` dict:
   ``grid`` takes the product of every parameter's values in W&B's order (names sorted), ``random``
   draws ``--count`` (or ``run_cap``) trials from a seeded generator, so a rerun draws the same ones.
3. Each trial becomes the argument list the W&B agent would pass: the ``command`` with ``${args}``
   replaced by ``--name=value`` (``str(value)``, as the agent formats it). Every trial's arguments
   are parsed by ``SlowcalCLI``'s own parser before anything runs (``CommandLine``): a parameter the
   CLI does not take, or a value it refuses, stops the sweep before the first run.
4. Trials run one after another in this process (``run_trial``: ``SlowcalCLI(args=...)``; MNIST is
   decoded once; one torch thread by default, see ``--threads``). A trial that raises is recorded
   as ``failed`` (``diverged`` for a non-finite training loss) and the sweep goes on; Ctrl-C or
   SIGTERM stops the sweep, leaving the interrupted trial unrecorded.
5. Every finished trial is added to the results file (JSON lines) at once, by rewriting the file
   atomically (``ResultsFile``): a sweep killed at any moment leaves a readable file, and running
   the same command again skips the trials it holds (a trial is its parameter dict).
   Failed and diverged trials are retried only with ``--retry-failed``.
6. The sweep ends with a markdown table: the best ``model.lr`` per ``method`` when both are swept,
   otherwise every trial.

Supported distributions (W&B's names): ``constant`` (``value``), ``categorical`` (``values``),
``categorical_w_probabilities``, ``int_uniform`` and ``uniform`` (``min``/``max``: ints give
``int_uniform``, floats ``uniform``), ``q_uniform``, ``log_uniform``, ``log_uniform_values``,
``q_log_uniform``, ``q_log_uniform_values``, ``inv_log_uniform``, ``inv_log_uniform_values``,
``normal``, ``q_normal``, ``log_normal``, ``q_log_normal``, ``beta``, ``q_beta``. Grid search takes
``constant``, ``categorical``, ``int_uniform`` (min..max) and ``q_uniform`` (``min, min + q, ...``
below ``max``), as W&B's grid does. Random draws are seeded and reproducible, not W&B's stream.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import yaml

__all__ = [
    "CommandLine",
    "Param",
    "ResultsFile",
    "Sweep",
    "expand_trials",
    "load_sweep",
    "main",
    "parse_sweep",
    "run_trial",
    "summary_table",
    "trial_args",
    "trial_key",
]

#: Top-level keys of a W&B sweep file that a local sweep understands. ``name``, ``description``,
#: ``project``, ``entity`` and ``program`` are W&B's bookkeeping and are ignored here;
#: ``early_terminate`` needs W&B's controller and is ignored (every trial runs to its end).
TOP_LEVEL_KEYS = (
    "method",
    "parameters",
    "command",
    "metric",
    "run_cap",
    "name",
    "description",
    "project",
    "entity",
    "program",
    "early_terminate",
)
METHODS = ("grid", "random")
METRIC_KEYS = ("name", "goal", "target", "impute", "impute_while_running")
#: Metrics the model logs; a trial records their final values.
KNOWN_METRICS = ("test_acc", "test_loss", "train_loss", "round", "samples_seen", "floats_communicated")

_MIN_MAX = ("min", "max")
#: distribution -> (required keys, optional keys with W&B's defaults)
DISTRIBUTIONS: dict[str, tuple[tuple[str, ...], dict[str, float]]] = {
    "constant": (("value",), {}),
    "categorical": (("values",), {}),
    "categorical_w_probabilities": (("values", "probabilities"), {}),
    "int_uniform": (_MIN_MAX, {}),
    "uniform": (_MIN_MAX, {}),
    "q_uniform": (_MIN_MAX, {"q": 1.0}),
    "log_uniform": (_MIN_MAX, {}),
    "log_uniform_values": (_MIN_MAX, {}),
    "q_log_uniform": (_MIN_MAX, {"q": 1.0}),
    "q_log_uniform_values": (_MIN_MAX, {"q": 1.0}),
    "inv_log_uniform": (_MIN_MAX, {}),
    "inv_log_uniform_values": (_MIN_MAX, {}),
    "normal": ((), {"mu": 0.0, "sigma": 1.0}),
    "q_normal": ((), {"mu": 0.0, "sigma": 1.0, "q": 1.0}),
    "log_normal": ((), {"mu": 0.0, "sigma": 1.0}),
    "q_log_normal": ((), {"mu": 0.0, "sigma": 1.0, "q": 1.0}),
    "beta": ((), {"a": 1.0, "b": 1.0}),
    "q_beta": ((), {"a": 1.0, "b": 1.0, "q": 1.0}),
}
GRID_DISTRIBUTIONS = ("constant", "categorical", "int_uniform", "q_uniform")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")  # W&B's pattern for parameter names

#: Command tokens that start the program (W&B's macros, the interpreter, ``-m lit_slowcal``).
_LAUNCHERS = {"${env}", "/usr/bin/env", "env", "${interpreter}", "${program}", "-m", "lit_slowcal", "lit-slowcal"}
_PYTHON = re.compile(r"^(.*/)?python[0-9.]*$")
_ENVVAR = re.compile(r"\$\{envvar:([A-Z0-9_]*)\}")
_VERSION_ENV = "LIT_SLOWCAL_RUN_VERSION"  # lit_slowcal.experiments.cli keeps a run's version folder here


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _allowed(values: Sequence[str]) -> str:
    return ", ".join(values)


@dataclass(frozen=True)
class Param:
    """One swept parameter: its CLI name (``model.lr``), W&B distribution and spec with defaults filled in."""

    name: str
    distribution: str
    spec: dict[str, Any]

    def grid_values(self) -> list[Any]:
        """The values a grid search takes, as W&B's grid search enumerates them."""
        d, s = self.distribution, self.spec
        if d == "constant":
            return [s["value"]]
        if d == "categorical":
            return list(s["values"])
        if d == "int_uniform":
            return list(range(s["min"], s["max"] + 1))
        if d == "q_uniform":  # numpy.arange(min, max, q): max itself is not included
            q = s["q"]
            count = max(0, math.ceil((s["max"] - s["min"]) / q))
            return [s["min"] + i * q for i in range(count)]
        raise ValueError(
            f"parameters.{self.name}: distribution {d!r} cannot be searched by method: grid "
            f"(grid takes {_allowed(GRID_DISTRIBUTIONS)}); use method: random with --count or run_cap"
        )

    def sample(self, rng: random.Random) -> Any:
        """One random draw, by W&B's definition of each distribution."""
        d, s = self.distribution, self.spec
        if d == "constant":
            return s["value"]
        if d == "categorical":
            return s["values"][rng.randrange(len(s["values"]))]
        if d == "categorical_w_probabilities":
            return rng.choices(s["values"], weights=s["probabilities"])[0]
        if d == "int_uniform":
            return rng.randint(s["min"], s["max"])
        if d in ("uniform", "q_uniform"):
            x = rng.uniform(s["min"], s["max"])
        elif d in ("log_uniform", "q_log_uniform"):  # min and max are exponents
            x = math.exp(rng.uniform(s["min"], s["max"]))
        elif d in ("log_uniform_values", "q_log_uniform_values"):
            x = math.exp(rng.uniform(math.log(s["min"]), math.log(s["max"])))
        elif d == "inv_log_uniform":
            x = math.exp(-rng.uniform(s["min"], s["max"]))
        elif d == "inv_log_uniform_values":
            x = math.exp(-rng.uniform(-math.log(s["max"]), -math.log(s["min"])))
        elif d in ("normal", "q_normal"):
            x = rng.gauss(s["mu"], s["sigma"])
        elif d in ("log_normal", "q_log_normal"):
            x = math.exp(rng.gauss(s["mu"], s["sigma"]))
        elif d in ("beta", "q_beta"):
            x = rng.betavariate(s["a"], s["b"])
        else:  # parse_sweep admits only the distributions above
            raise ValueError(f"parameters.{self.name}: unknown distribution {d!r}")
        if d.startswith("q_"):
            q = s["q"]
            return int(round(x / q) * q) if _is_int(q) else round(x / q) * q
        return x


@dataclass
class Sweep:
    """A checked sweep file: its search, metric and the CLI arguments around ``${args}``."""

    method: str
    params: list[Param]
    args_before: list[str]
    args_after: list[str] = field(default_factory=list)
    metric: str = "test_acc"
    goal: str = "maximize"
    run_cap: Optional[int] = None
    name: Optional[str] = None
    ignored: list[str] = field(default_factory=list)

    @property
    def param_names(self) -> list[str]:
        return [p.name for p in self.params]


def _parse_param(name: Any, spec: Any) -> Param:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"parameters: invalid name {name!r} (letters, digits, _, . and -, as the CLI option: model.lr)")
    where = f"parameters.{name}"
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected a mapping such as {{values: [...]}} or {{value: ...}}, got {spec!r}")
    if "parameters" in spec:
        raise ValueError(f"{where}: nested parameters are not supported here; use dotted names such as model.lr")
    distribution = spec.get("distribution")
    if distribution is None:  # W&B's inference
        if "value" in spec:
            distribution = "constant"
        elif "values" in spec:
            distribution = "categorical_w_probabilities" if "probabilities" in spec else "categorical"
        elif "min" in spec and "max" in spec:
            distribution = "int_uniform" if _is_int(spec["min"]) and _is_int(spec["max"]) else "uniform"
        else:
            raise ValueError(
                f"{where}: give values, value, min and max, or a distribution "
                f"(keys given: {_allowed(sorted(map(str, spec))) or 'none'})"
            )
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"{where}.distribution: unknown distribution {distribution!r} (allowed: {_allowed(DISTRIBUTIONS)})")
    required, optional = DISTRIBUTIONS[distribution]
    allowed = ("distribution", *required, *optional)
    for key in spec:
        if key not in allowed:
            raise ValueError(
                f"{where}: unknown key {key!r} for distribution {distribution!r} (allowed: {_allowed(allowed)})"
            )
    for key in required:
        if key not in spec:
            raise ValueError(f"{where}: distribution {distribution!r} needs {key!r} (keys: {_allowed(allowed)})")
    filled = {**optional, **{k: v for k, v in spec.items() if k != "distribution"}}
    _check_spec(where, distribution, filled)
    return Param(name, distribution, filled)


def _check_spec(where: str, distribution: str, s: dict[str, Any]) -> None:
    if "values" in s and (not isinstance(s["values"], list) or not s["values"]):
        raise ValueError(f"{where}.values: expected a non-empty list, got {s['values']!r}")
    if "probabilities" in s:
        p = s["probabilities"]
        if (
            not isinstance(p, list)
            or len(p) != len(s["values"])
            or not all(_is_number(x) and x >= 0 for x in p)
            or not math.isclose(sum(p), 1.0, rel_tol=1e-6)
        ):
            raise ValueError(f"{where}.probabilities: expected {len(s['values'])} numbers >= 0 summing to 1, got {p!r}")
    for key in ("min", "max", "q", "mu", "sigma", "a", "b"):
        if key in s and not _is_number(s[key]):
            raise ValueError(f"{where}.{key}: expected a number, got {s[key]!r}")
    if distribution == "int_uniform" and not (_is_int(s["min"]) and _is_int(s["max"])):
        raise ValueError(f"{where}: int_uniform needs integer min and max, got {s['min']!r} and {s['max']!r}")
    if "min" in s and s["min"] > s["max"]:
        raise ValueError(f"{where}: min {s['min']!r} is greater than max {s['max']!r}")
    if distribution.endswith("_values") and s["min"] <= 0:
        raise ValueError(f"{where}.min: {distribution} needs min > 0, got {s['min']!r}")
    if "q" in s and s["q"] <= 0:
        raise ValueError(f"{where}.q: expected a number > 0, got {s['q']!r}")
    for key in ("sigma", "a", "b"):
        if key in s and s[key] < 0:
            raise ValueError(f"{where}.{key}: expected a number >= 0, got {s[key]!r}")


def _parse_command(command: Any, program: Any) -> tuple[list[str], list[str]]:
    """The CLI arguments before and after ``${args}`` in W&B's command list."""
    example = "[${env}, python, -m, lit_slowcal, fit, --config, configs/paper.yaml, ${args}]"
    if command is None:
        raise ValueError(f"command: required here, the trials run `lit_slowcal fit`; e.g. command: {example}")
    if not isinstance(command, list) or not command:
        raise ValueError(f"command: expected a list such as {example}, got {command!r}")
    tokens = [_ENVVAR.sub(lambda m: os.environ.get(m.group(1), m.group(1)), str(c)) for c in command]
    start = 0
    while start < len(tokens) and (tokens[start] in _LAUNCHERS or _PYTHON.match(tokens[start])):
        if tokens[start] == "${program}" and str(program) not in ("lit_slowcal", "lit_slowcal/__main__.py"):
            raise ValueError(f"command: ${{program}} is {program!r}; here the program must be lit_slowcal")
        start += 1
    rest = tokens[start:]
    if tokens[:start].count("lit_slowcal") + tokens[:start].count("lit-slowcal") + tokens[:start].count("${program}") != 1:
        raise ValueError(f"command: must run lit_slowcal (python -m lit_slowcal fit ...), got {command!r}")
    macros = [t for t in rest if t.startswith("${")]
    if macros != ["${args}"]:
        raise ValueError(
            f"command: expected exactly one ${{args}} after the program (the only macro supported there), "
            f"got {macros or 'none'} in {command!r}"
        )
    i = rest.index("${args}")
    before, after = rest[:i], rest[i + 1 :]
    if not before or before[0] != "fit":
        raise ValueError(f"command: the CLI subcommand must be fit (python -m lit_slowcal fit ...), got {command!r}")
    return before, after


def parse_sweep(config: Any) -> Sweep:
    """Check a sweep configuration (the loaded YAML) and return it as a ``Sweep``.

    Raises:
        ValueError: naming the offending key and the allowed keys or values.
    """
    if not isinstance(config, dict):
        raise ValueError(f"a sweep file is a mapping of {_allowed(TOP_LEVEL_KEYS)}; got {type(config).__name__}")
    for key in config:
        if key not in TOP_LEVEL_KEYS:
            raise ValueError(f"unknown top-level key {key!r} (allowed here: {_allowed(TOP_LEVEL_KEYS)})")
    method = config.get("method")
    if method not in METHODS:
        need = " needs W&B's server (wandb sweep + wandb agent)" if method in ("bayes", "custom") else ""
        raise ValueError(f"method: {method!r}{need}; allowed here: {_allowed(METHODS)}")
    parameters = config.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        raise ValueError("parameters: expected a non-empty mapping of CLI option names to search spaces")
    params = [_parse_param(name, parameters[name]) for name in sorted(parameters, key=str)]
    if method == "grid":
        for p in params:
            if p.distribution not in GRID_DISTRIBUTIONS:
                p.grid_values()  # raises, naming the parameter
    metric = config.get("metric", {"name": "test_acc", "goal": "maximize"})
    if not isinstance(metric, dict) or "name" not in metric:
        raise ValueError(f"metric: expected {{name: ..., goal: minimize|maximize}}, got {metric!r}")
    for key in metric:
        if key not in METRIC_KEYS:
            raise ValueError(f"metric: unknown key {key!r} (allowed: {_allowed(METRIC_KEYS)})")
    if metric["name"] not in KNOWN_METRICS:
        raise ValueError(f"metric.name: {metric['name']!r} is not logged by lit_slowcal (allowed: {_allowed(KNOWN_METRICS)})")
    goal = metric.get("goal", "minimize")  # W&B's default
    if goal not in ("minimize", "maximize"):
        raise ValueError(f"metric.goal: {goal!r} (allowed: minimize, maximize)")
    run_cap = config.get("run_cap")
    if run_cap is not None and (not _is_int(run_cap) or run_cap < 1):
        raise ValueError(f"run_cap: expected an integer >= 1, got {run_cap!r}")
    before, after = _parse_command(config.get("command"), config.get("program"))
    ignored = [k for k in ("early_terminate",) if k in config]
    return Sweep(method, params, before, after, metric["name"], goal, run_cap, config.get("name"), ignored)


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a W&B sweep YAML file."""
    with open(path) as f:
        config = yaml.safe_load(f)
    try:
        return parse_sweep(config)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def expand_trials(sweep: Sweep, count: Optional[int] = None, seed: int = 0) -> list[dict[str, Any]]:
    """The sweep's trials, each ``{name: value}`` with names sorted (W&B's order).

    Grid: the product of every parameter's values, the first name varying slowest. Random: draws
    from ``random.Random(seed)``, one value per parameter in name order; identical draws are kept
    once. ``count`` (default: ``run_cap``) keeps the first ``count`` trials; random needs one.
    """
    if count is not None and (not _is_int(count) or count < 1):
        raise ValueError(f"--count: expected an integer >= 1, got {count!r}")
    limit = count if count is not None else sweep.run_cap
    names = sweep.param_names
    if sweep.method == "grid":
        grid = itertools.product(*(p.grid_values() for p in sweep.params))
        return [dict(zip(names, values)) for values in itertools.islice(grid, limit)]
    if limit is None:
        raise ValueError("method: random draws trials without end; give --count N or run_cap in the sweep file")
    rng = random.Random(seed)
    trials: dict[str, dict[str, Any]] = {}
    for _ in range(limit):
        trial = {p.name: p.sample(rng) for p in sweep.params}
        trials.setdefault(trial_key(trial), trial)
    return list(trials.values())


def trial_key(params: dict[str, Any]) -> str:
    """A trial's identity: its parameter dict as canonical JSON."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


def trial_args(sweep: Sweep, params: dict[str, Any], extra: Sequence[str] = ()) -> list[str]:
    """The CLI arguments of a trial, as the W&B agent builds them: ``--name=str(value)`` at ``${args}``."""
    flags = [f"--{name}={value}" for name, value in params.items()]
    return [*sweep.args_before, *flags, *sweep.args_after, *extra]


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

        try:
            _ParserOnly(args=[])
        except _Built as built:
            cli = built.args[0]
        self.parser = cli.parser
        for parser in (self.parser, *cli._subcommand_parsers.values()):
            parser.exit_on_error = False  # raise ArgumentError instead of printing usage and exiting

    def parse(self, args: Sequence[str]) -> Any:
        """The parsed configuration (a jsonargparse Namespace; keys such as ``fit.model.lr``).

        Raises:
            ValueError: with the parser's message when the CLI refuses the arguments.
        """
        try:
            return self.parser.parse_args(list(args))
        except argparse.ArgumentError as err:
            raise ValueError(str(err)) from None


@contextlib.contextmanager
def _trial_environment() -> Iterator[None]:
    # LightningCLI warns when given args while sys.argv has some (ours: the sweep's); and the CLI
    # remembers its run folder version in the environment for its DDP children: each trial needs a fresh one.
    argv = sys.argv
    sys.argv = argv[:1]
    os.environ.pop(_VERSION_ENV, None)
    try:
        yield
    finally:
        sys.argv = argv
        os.environ.pop(_VERSION_ENV, None)


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


def run_trial(args: Sequence[str]) -> dict[str, Any]:
    """Run ``SlowcalCLI(args=args)`` here; never raises for a failing run.

    Ctrl-C (KeyboardInterrupt) and SIGTERM (Lightning's SIGTERMException) are raised: they stop the
    sweep, and the interrupted trial is not recorded.

    Returns:
        ``status`` (``finished``, ``diverged`` or ``failed``), ``error`` (None or the message),
        ``metrics`` (final ``trainer.callback_metrics``), ``run_dir`` (the CSV log folder) and
        ``wall_time_s``.
    """
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lit_slowcal.experiments.cli import SlowcalCLI

    started: list[Any] = []

    class _TrialCLI(SlowcalCLI):
        def before_instantiate_classes(self) -> None:
            started.append(self)  # keeps the trainer reachable when fit raises
            super().before_instantiate_classes()

    status, error = "finished", None
    start = time.perf_counter()
    with _trial_environment():
        try:
            _TrialCLI(args=list(args))
        except SIGTERMException:  # Lightning's form of SIGTERM: stop the sweep, not just this trial
            status = "interrupted"
            raise
        except FloatingPointError as err:
            status, error = ("diverged" if str(err).startswith("Training diverged") else "failed"), str(err)
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
    trainer = getattr(started[0], "trainer", None) if started else None
    metrics: dict[str, Optional[float]] = {}
    run_dir = None
    if trainer is not None:
        for key, value in trainer.callback_metrics.items():
            if getattr(value, "numel", lambda: 1)() == 1:
                v = float(value)
                metrics[key] = v if math.isfinite(v) else None  # strict JSON: no NaN
        run_dir = next((str(lg.log_dir) for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)
    return {"status": status, "error": error, "metrics": metrics, "run_dir": run_dir, "wall_time_s": round(wall, 3)}


class ResultsFile:
    """Finished trials, one JSON object a line, keyed by ``trial_key(record["params"])``.

    ``put`` rewrites the whole file atomically (temporary file in the same folder, fsync,
    ``os.replace``): a reader, or a sweep restarted after a kill, sees the old file or the new one.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.records: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            with open(self.path) as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                        key = trial_key(record["params"])
                    except (json.JSONDecodeError, KeyError, TypeError) as err:
                        raise ValueError(f"{self.path}, line {n}: not a trial record ({err})") from None
                    self.records[key] = record

    def get(self, params: dict[str, Any]) -> Optional[dict[str, Any]]:
        return self.records.get(trial_key(params))

    def put(self, record: dict[str, Any]) -> None:
        """Add (or replace) a trial's record and write the file."""
        self.records[trial_key(record["params"])] = record
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                for r in self.records.values():
                    f.write(json.dumps(r, allow_nan=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with contextlib.suppress(OSError):  # make the rename itself durable
            dirfd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dirfd)
            finally:
                os.close(dirfd)


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _param_text(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def summary_table(sweep: Sweep, records: list[dict[str, Any]]) -> str:
    """Markdown: the best ``model.lr`` per ``method`` (by the sweep's metric, averaged over the other
    swept parameters) when both are swept, otherwise one row per trial."""
    metric, sign = sweep.metric, (1.0 if sweep.goal == "maximize" else -1.0)
    if "method" in sweep.param_names and "model.lr" in sweep.param_names:
        groups: dict[str, dict[Any, list[dict[str, Any]]]] = {}
        for r in records:
            groups.setdefault(r["params"]["method"], {}).setdefault(r["params"]["model.lr"], []).append(r)
        cols = list(dict.fromkeys([metric, "test_acc", "test_loss"]))
        lines = [
            f"| method | best lr | {' | '.join(cols)} | trials at best lr | lrs tried | diverged or failed |",
            "|---|---|" + "---|" * len(cols) + "---|---|---|",
        ]
        for method, by_lr in groups.items():
            def mean(rs: list[dict[str, Any]], key: str) -> Optional[float]:
                vals = [r["metrics"].get(key) for r in rs if r["status"] == "finished"]
                vals = [v for v in vals if v is not None]
                return sum(vals) / len(vals) if vals else None

            scored = [(mean(rs, metric), lr, rs) for lr, rs in by_lr.items()]
            bad = sum(r["status"] != "finished" for rs in by_lr.values() for r in rs)
            ok = [s for s in scored if s[0] is not None]
            if not ok:
                lines.append(f"| {method} | n/a |" + " n/a |" * len(cols) + f" 0 | {len(by_lr)} | {bad} |")
                continue
            _, lr, rs = max(ok, key=lambda s: sign * s[0])
            finished = sum(r["status"] == "finished" for r in rs)
            vals = " | ".join(_fmt(mean(rs, c)) for c in cols)
            lines.append(f"| {method} | {lr} | {vals} | {finished} | {len(by_lr)} | {bad} |")
        return "\n".join(lines)
    names = sweep.param_names
    lines = [
        f"| {' | '.join(names)} | status | test_acc | test_loss | wall s |",
        "|" + "---|" * (len(names) + 4),
    ]
    for r in records:
        p, m = r["params"], r["metrics"]
        cells = [str(p.get(n)) for n in names]
        cells += [r["status"], _fmt(m.get("test_acc")), _fmt(m.get("test_loss")), _fmt(r.get("wall_time_s"), 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
        "--wandb", type=_bool, metavar="{true,false}", help="add --wandb=true|false to every trial (default: the config's)"
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lit_slowcal sweep SWEEP.yaml [--results PATH] [--count N] [--dry-run] [--retry-failed] [--wandb=false]``."""
    opts = _parser().parse_args(argv)
    results_path = opts.results or Path("sweeps") / "results" / f"{opts.sweep.stem}.jsonl"
    extra = [] if opts.wandb is None else [f"--wandb={str(opts.wandb).lower()}"]
    try:
        sweep = load_sweep(opts.sweep)
        trials = expand_trials(sweep, opts.count, opts.seed)
        results = ResultsFile(results_path)
        checker = CommandLine()
        for params in trials:
            try:
                checker.parse(trial_args(sweep, params, extra))
            except ValueError as err:
                raise ValueError(f"trial {_param_text(params)}: the CLI refuses it: {err}") from None
    except (ValueError, OSError) as err:
        print(f"lit_slowcal sweep: error: {err}", file=sys.stderr)
        return 2

    for key in sweep.ignored:
        print(f"note: {key} needs W&B's controller and is ignored here; every trial runs to its end")

    def pending(params: dict[str, Any]) -> bool:
        record = results.get(params)
        return record is None or (opts.retry_failed and record["status"] != "finished")

    todo = [t for t in trials if pending(t)]
    print(
        f"sweep {opts.sweep} ({sweep.method}): {len(trials)} trials, {len(trials) - len(todo)} already in "
        f"{results_path}, {len(todo)} to run",
        flush=True,
    )
    if opts.dry_run:
        for i, params in enumerate(trials, 1):
            record = results.get(params)
            state = "pending" if record is None else record["status"]
            if record is not None and pending(params):
                state += ", will retry"
            print(f"  [{i}/{len(trials)}] {state:<20} {' '.join(trial_args(sweep, params, extra))}")
        return 0

    sweep_start, ran = time.perf_counter(), 0
    with _sweep_environment(opts.threads, f"sweep-{sweep.name or opts.sweep.stem}"):
        try:
            for i, params in enumerate(todo, 1):
                args = trial_args(sweep, params, extra)
                print(f"\n[{i}/{len(todo)}] {_param_text(params)}", flush=True)
                outcome = run_trial(args)
                ended = datetime.now(timezone.utc).isoformat(timespec="seconds")
                results.put({"params": params, **outcome, "args": args, "ended_at": ended})
                ran += 1
                value = outcome["metrics"].get(sweep.metric)
                line = f"[{i}/{len(todo)}] {outcome['status']}: {sweep.metric} {_fmt(value)} in {outcome['wall_time_s']:.1f} s"
                if outcome["error"]:
                    line += f" ({outcome['error'].splitlines()[0][:200]})"
                print(line, flush=True)
        except (KeyboardInterrupt, SystemExit) as err:  # Ctrl-C, or SIGTERM as Lightning raises it
            print(
                f"\nsweep interrupted ({type(err).__name__}) after {ran} of {len(todo)} trials; they are in "
                f"{results_path}. Run the same command again to go on.",
                file=sys.stderr,
            )
            return 130 if isinstance(err, KeyboardInterrupt) else 143
    if todo:
        print(f"\n{len(todo)} trials in {time.perf_counter() - sweep_start:.1f} s; results in {results_path}")
    done = [r for r in (results.get(t) for t in trials) if r is not None]
    counts = {s: sum(r["status"] == s for r in done) for s in ("finished", "diverged", "failed")}
    print(f"{counts['finished']} finished, {counts['diverged']} diverged, {counts['failed']} failed of {len(trials)} trials\n")
    print(summary_table(sweep, done))
    return 0
