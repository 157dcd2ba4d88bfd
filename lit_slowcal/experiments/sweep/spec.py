"""The W&B sweep-file format, read and checked as W&B would (``parse_sweep``, ``load_sweep``).

A sweep file's top-level keys, every parameter's search space, the ``metric`` and the ``command``
are checked here. What W&B's controller alone can do (``bayes``, ``custom``, nested parameters) is
refused with the key and the allowed values.

Supported distributions (W&B's names): ``constant`` (``value``), ``categorical`` (``values``),
``categorical_w_probabilities``, ``int_uniform`` and ``uniform`` (``min``/``max``: ints give
``int_uniform``, floats ``uniform``), ``q_uniform``, ``log_uniform``, ``log_uniform_values``,
``q_log_uniform``, ``q_log_uniform_values``, ``inv_log_uniform``, ``inv_log_uniform_values``,
``normal``, ``q_normal``, ``log_normal``, ``q_log_normal``, ``beta``, ``q_beta``. Grid search takes
``constant``, ``categorical``, ``int_uniform`` (min..max) and ``q_uniform`` (``min, min + q, ...``
below ``max``), as W&B's grid does. Random draws are seeded and reproducible, not W&B's stream.
"""

from __future__ import annotations

import math
import os
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from lit_slowcal._validation import check_int, check_number, is_int, is_number

__all__ = ["DISTRIBUTIONS", "GRID_DISTRIBUTIONS", "KNOWN_METRICS", "Param", "Sweep", "load_sweep", "parse_sweep"]

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
#: Metrics the model and its Diagnostics callback log; a trial records their final values.
KNOWN_METRICS = (
    "test_acc", "test_loss", "train_loss", "round", "samples_seen", "floats_communicated", "train_objective", "excess_loss",
)  # fmt: skip

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


def _allowed(values: Iterable[str]) -> str:
    return ", ".join(values)


@dataclass(frozen=True)
class Param:
    """One swept parameter: its CLI name (``model.lr``), W&B distribution and spec with defaults filled in."""

    name: str
    distribution: str
    spec: dict[str, Any]

    def grid_size(self) -> int:
        """How many values a grid search takes (as ``grid_values`` lists them, repeats included), without listing them."""
        d, s = self.distribution, self.spec
        if d == "int_uniform":
            return s["max"] - s["min"] + 1
        if d == "q_uniform":
            return max(0, math.ceil((s["max"] - s["min"]) / s["q"]))
        return len(self.grid_values())

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
            return int(round(x / q) * q) if is_int(q) else round(x / q) * q
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
        raise ValueError(
            f"parameters: invalid name {name!r} (letters, digits, _, . and -, as the CLI option: model.lr)"
        )
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
            distribution = "int_uniform" if is_int(spec["min"]) and is_int(spec["max"]) else "uniform"
        else:
            raise ValueError(
                f"{where}: give values, value, min and max, or a distribution "
                f"(keys given: {_allowed(sorted(map(str, spec))) or 'none'})"
            )
    if distribution not in DISTRIBUTIONS:
        raise ValueError(
            f"{where}.distribution: unknown distribution {distribution!r} (allowed: {_allowed(DISTRIBUTIONS)})"
        )
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
    if s.get("value", ...) is None or None in s.get("values", ()):
        # W&B's agent passes every value as --name=str(value): null would reach the CLI as the text None.
        key = "value" if "value" in s else "values"
        raise ValueError(
            f"{where}.{key}: null cannot be passed to the CLI (the W&B agent writes it as --{where.removeprefix('parameters.')}=None, the "
            "text None); write it quoted, 'null', to give the option null, or leave the parameter out for its default"
        )
    if "probabilities" in s:
        p = s["probabilities"]
        if (
            not isinstance(p, list)
            or len(p) != len(s["values"])
            or not all(is_number(x) and x >= 0 for x in p)
            or not math.isclose(sum(p), 1.0, rel_tol=1e-6)
        ):
            raise ValueError(f"{where}.probabilities: expected {len(s['values'])} numbers >= 0 summing to 1, got {p!r}")
    for key in ("min", "max", "q", "mu", "sigma", "a", "b"):
        if key in s and not is_number(s[key]):
            raise ValueError(f"{where}.{key}: expected a number, got {s[key]!r}")
    if distribution == "int_uniform" and not (is_int(s["min"]) and is_int(s["max"])):
        raise ValueError(f"{where}: int_uniform needs integer min and max, got {s['min']!r} and {s['max']!r}")
    if "min" in s and s["min"] > s["max"]:
        raise ValueError(f"{where}: min {s['min']!r} is greater than max {s['max']!r}")
    if distribution.endswith("_values") and s["min"] <= 0:
        raise ValueError(f"{where}.min: {distribution} needs min > 0, got {s['min']!r}")
    if "q" in s:
        check_number(f"{where}.q", s["q"])
    for key in ("sigma", "a", "b"):
        if key in s:
            check_number(f"{where}.{key}", s[key], strict=False)


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
    if (
        tokens[:start].count("lit_slowcal") + tokens[:start].count("lit-slowcal") + tokens[:start].count("${program}")
        != 1
    ):
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
        raise ValueError(
            f"metric.name: {metric['name']!r} is not logged by lit_slowcal (allowed: {_allowed(KNOWN_METRICS)})"
        )
    goal = metric.get("goal", "minimize")  # W&B's default
    if goal not in ("minimize", "maximize"):
        raise ValueError(f"metric.goal: {goal!r} (allowed: minimize, maximize)")
    run_cap = config.get("run_cap")
    if run_cap is not None:
        check_int("run_cap", run_cap)
    before, after = _parse_command(config.get("command"), config.get("program"))
    ignored = [k for k in ("early_terminate",) if k in config]
    return Sweep(method, params, before, after, metric["name"], goal, run_cap, config.get("name"), ignored)


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a W&B sweep YAML file."""
    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{path}: not valid YAML: {problem}{where}; fix the sweep file") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a text file ({err}); a sweep file is YAML") from None
    try:
        return parse_sweep(config)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
