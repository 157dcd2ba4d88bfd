"""A sweep's search space as a list of trials, and each trial as the CLI arguments of its run.

``expand_trials`` turns the search space into trials, each a ``{name: value}`` dict: ``grid`` takes
the product of every parameter's values in W&B's order (names sorted), ``random`` draws ``--count``
(or ``run_cap``) trials from a seeded generator, so a rerun draws the same ones.

``trial_args`` gives the argument list the W&B agent would pass: the ``command`` with ``${args}``
replaced by ``--name=value`` (``str(value)``, as the agent formats it). ``trial_key`` is a trial's
identity (its parameter dict) in the results file.
"""

from __future__ import annotations

import itertools
import json
import random
from typing import Any, Optional, Sequence

from lit_slowcal._validation import check_int
from lit_slowcal.experiments.sweep.spec import Sweep

__all__ = ["expand_trials", "trial_args", "trial_key"]


def expand_trials(sweep: Sweep, count: Optional[int] = None, seed: int = 0) -> list[dict[str, Any]]:
    """The sweep's trials, each ``{name: value}`` with names sorted (W&B's order).

    Grid: the product of every parameter's values, the first name varying slowest. Random: draws
    from ``random.Random(seed)``, one value per parameter in name order; identical draws are kept
    once. ``count`` (default: ``run_cap``) keeps the first ``count`` trials; random needs one.
    """
    if count is not None:
        check_int("--count", count)
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
