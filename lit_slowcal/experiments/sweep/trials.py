"""A sweep's search space as a list of trials, and each trial as the CLI arguments of its run.

``expand_trials`` turns the search space into trials, each a ``{name: value}`` dict: ``grid`` takes
the product of every parameter's values in W&B's order (names sorted), ``random`` draws ``--count``
(or ``run_cap``) trials from a seeded generator, so a rerun draws the same ones.

``trial_args`` gives the argument list the W&B agent would pass: the ``command`` with ``${args}``
replaced by ``--name=value`` (``str(value)``, as the agent formats it). ``trial_key`` is a trial's
parameter dict as text; ``record_key`` adds the identity of its run (``identity_digest`` of everything
that defines the run: the swept parameters and the command and config they run with), the key of its
record in the results file.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from collections.abc import Sequence
from typing import Any, Optional

from lit_slowcal._validation import check_int
from lit_slowcal.experiments.sweep.spec import Sweep

__all__ = ["MAX_TRIALS", "expand_trials", "identity_digest", "record_key", "setting_of", "trial_args", "trial_key"]

#: The most trials a sweep expands (each is parsed by the CLI before any runs).
MAX_TRIALS = 1_000_000


def expand_trials(sweep: Sweep, count: Optional[int] = None, seed: int = 0) -> list[dict[str, Any]]:
    """The sweep's trials, each ``{name: value}`` with names sorted (W&B's order).

    Grid: the product of every parameter's distinct values, the first name varying slowest. Random: draws
    from ``random.Random(seed)``, one value per parameter in name order; identical draws are kept
    once. ``count`` (default: ``run_cap``) keeps the first ``count`` trials; random needs one. A grid of
    more than ``MAX_TRIALS`` trials (over a range of a billion integers), or as many draws, is refused before any
    is listed.
    """
    if count is not None:
        check_int("--count", count)
    limit = count if count is not None else sweep.run_cap
    names = sweep.param_names
    if sweep.method == "grid" and math.prod(p.grid_size() for p in sweep.params) > MAX_TRIALS:
        shown = " x ".join(f"{p.grid_size():,} values of {p.name}" for p in sweep.params)
        raise ValueError(f"method: grid: {shown}: more trials than a sweep runs here ({MAX_TRIALS:,}); narrow the grid")
    if sweep.method == "random" and limit is not None and limit > MAX_TRIALS:
        raise ValueError(
            f"method: random: {limit:,} draws, more trials than a sweep runs here ({MAX_TRIALS:,}); draw fewer"
        )
    if sweep.method == "grid":  # a value listed twice makes one trial, not two
        grid = itertools.product(*(_distinct(p.grid_values()) for p in sweep.params))
        return [dict(zip(names, values)) for values in itertools.islice(grid, limit)]
    if limit is None:
        raise ValueError("method: random draws trials without end; give --count N or run_cap in the sweep file")
    rng = random.Random(seed)
    trials: dict[str, dict[str, Any]] = {}
    for _ in range(limit):
        trial = {p.name: p.sample(rng) for p in sweep.params}
        trials.setdefault(trial_key(trial), trial)
    return list(trials.values())


def _distinct(values: list[Any]) -> list[Any]:
    """``values`` without repeats (as their JSON: 1 and 1.0 are two values, as they are two arguments), in order."""
    seen: dict[str, Any] = {}
    for v in values:
        seen.setdefault(json.dumps(v, sort_keys=True, default=str) + type(v).__name__, v)
    return list(seen.values())


def trial_key(params: dict[str, Any]) -> str:
    """A trial's identity: its parameter dict as canonical JSON."""
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


def identity_digest(identity: dict[str, Any], seed_keys: Sequence[str] = ()) -> str:
    """A run's identity (``lit_slowcal.experiments.run.identity.trial_identity``) in short: ``<setting>-<seed>``, 16 and
    8 hex digits of the sha256 of its settings but the ``seed_keys``, and of those. Runs that differ in their
    seed only share the first part (``setting_of``): the report averages over them."""

    def digest(d: dict[str, Any], n: int) -> str:
        text = json.dumps(d, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:n]

    seeds = {k: v for k, v in identity.items() if k in seed_keys}
    return f"{digest({k: v for k, v in identity.items() if k not in seeds}, 16)}-{digest(seeds, 8)}"


def setting_of(identity: str) -> str:
    """The part of an ``identity_digest`` that all seeds of one setting share."""
    return identity.partition("-")[0]


def record_key(params: dict[str, Any], identity: Optional[str]) -> str:
    """The key of a trial's record in the results file: its parameters and its run's identity digest."""
    return f"{trial_key(params)}@{identity}"


def trial_args(sweep: Sweep, params: dict[str, Any], extra: Sequence[str] = ()) -> list[str]:
    """The CLI arguments of a trial, as the W&B agent builds them: ``--name=str(value)`` at ``${args}``."""
    flags = [f"--{name}={value}" for name, value in params.items()]
    return [*sweep.args_before, *flags, *sweep.args_after, *extra]
