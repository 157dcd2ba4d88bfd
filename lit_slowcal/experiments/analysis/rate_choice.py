"""Choosing learning rates without the test set: the rate per (method, M, K) a training criterion picks.

``tune`` takes a sweep's records (``lit_slowcal sweep``), groups its trials by cell (method, M, K) and
learning rate, averages a criterion over the seeds at each rate, and picks per cell the rate with
the best mean. Only then are the test figures at that rate read: the test set never chooses.

Criteria (``--criterion``), each a final metric of the trials' records:

* ``train_objective`` (default): f(x_R), the training objective at the end of the run (the paper's
  global objective, weight decay included; ``lit_slowcal.experiments.measure.diagnostics``);
* ``excess_loss``: f(x_R) - f*, which the paper's guarantees bound (runs with weight decay);
* ``train_loss``: the last logged training loss, the mean loss of the machines' own steps over the
  rounds since the previous log (every ``trainer.log_every_n_steps`` rounds, and after the last). The
  criterion of the non-linear models (``--model.arch=mlp|cnn``), whose runs have no training objective;
  it is measured on each machine's local model, before the round's average;
* ``val_<metric>``: a held-out validation metric, where the records have one (maximised when its name
  ends in ``acc``, minimised otherwise).

``test_*`` is refused. A rate at which a seed diverged or failed, or lacks the criterion, is not
chosen. A cell whose chosen rate is the smallest or the largest of the rates it searched is flagged
(``lr_at_edge``: ``low`` or ``high``; ``only`` when it searched one rate; ``no`` otherwise): its
grid should be extended that way. The choices come in the registry's method order, then M, then K;
``winners`` names the best tuned method of each (M, K). The choices are written out by
``lit_slowcal.experiments.analysis.tuned_output``; ``lit_slowcal.experiments.analysis.tune`` is the command.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from lit_slowcal.experiments.analysis.records import cell_of, check_one_setting
from lit_slowcal.experiments.train.methods import METHODS

__all__ = ["Choice", "Win", "check_criterion", "tune", "winners"]

_CELL = ("method", "num_machines", "local_steps")
_LR, _SEED = "model.lr", "seed_everything"


@dataclass(frozen=True)
class Choice:
    """A cell's chosen rate and the finished trials (one per seed) at it."""

    method: str
    M: int
    K: int
    lr: float
    lr_at_edge: str
    criterion_mean: float
    records: tuple[dict[str, Any], ...]

    def values(self, metric: str) -> list[float]:
        found = [r.get("metrics", {}).get(metric) for r in self.records]
        return [float(v) for v in found if v is not None and math.isfinite(v)]

    def mean(self, metric: str) -> Optional[float]:
        values = self.values(metric)
        return statistics.fmean(values) if values else None

    def std(self, metric: str) -> Optional[float]:
        """Sample standard deviation over the seeds (0 for one seed)."""
        values = self.values(metric)
        if not values:
            return None
        return statistics.stdev(values) if len(values) > 1 else 0.0


def check_criterion(criterion: str) -> str:
    """``criterion`` if it may choose a rate; else one line naming it and what is allowed."""
    if not isinstance(criterion, str) or not (
        criterion in ("train_objective", "excess_loss", "train_loss") or criterion.startswith("val_")
    ):
        reason = "the test set is never a tuning criterion; " if str(criterion).startswith("test") else ""
        raise ValueError(
            f"Invalid --criterion: {criterion!r} ({reason}allowed: train_objective, excess_loss, train_loss, val_<metric>)"
        )
    return criterion


def _lr(record: dict[str, Any]) -> float:
    from lit_slowcal.experiments.analysis.records import located

    params = record["params"]
    value = params.get(_LR)
    if value is not None and value != "null":  # null: the method's paper-config rate, as the CLI reads it
        try:
            lr = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else math.nan
        except ValueError:
            lr = math.nan
        if not math.isfinite(lr):
            raise located(record, f"{_LR} is {value!r}, expected a finite number")
        return lr
    method = params["method"]
    if method in METHODS:
        return METHODS[method].paper_lr  # a trial without model.lr trains at its method's paper-config rate
    raise located(record, f"a trial of method {method!r} (not in the registry) lacks model.lr in its params ({params})")


def tune(records: list[dict[str, Any]], criterion: str = "train_objective") -> list[Choice]:
    """The best rate per (method, M, K) by the seeds' mean of ``criterion``, in the registry's order.

    Raises:
        ValueError: for a test criterion, a record without method, num_machines or local_steps (or with
            one, or model.lr, not of its type: naming its file and line when it was read from one), a
            parameter other than the rate and the seed that varies within a cell, or a cell where
            no rate has every seed finished with the criterion.
    """
    check_criterion(criterion)
    sign = -1.0 if criterion.endswith("acc") else 1.0  # minimised; accuracies maximised
    cells: dict[tuple[str, int, int], dict[float, list[dict[str, Any]]]] = {}
    for r in records:
        key = cell_of(r, "tuning is per (method, M, K)")
        cells.setdefault(key, {}).setdefault(_lr(r), []).append(r)
    choices = []
    for (method, m, k), by_lr in cells.items():
        where = f"{method} M={m} K={k}"
        trials = [r for rs in by_lr.values() for r in rs]
        # One setting per cell but the rate (by the records' arguments), and per rate but the seed (their identities).
        check_one_setting((m, k, method), trials, varies=(_LR,), averages="tuning compares rates averaged")
        for rs in by_lr.values():
            check_one_setting((m, k, method), rs, averages="tuning compares rates averaged")
        for name in {n for r in trials for n in r["params"]} - {*_CELL, _LR, _SEED}:
            values = {json.dumps(r["params"].get(name)) for r in trials}
            if len(values) > 1:
                raise ValueError(
                    f"{name} takes several values ({', '.join(sorted(values))}) at {where}: tuning compares rates "
                    f"averaged over seeds only; tune each value of {name} from its own results file"
                )
        scores = {}
        for lr, rs in by_lr.items():
            values = [r.get("metrics", {}).get(criterion) for r in rs if r.get("status") == "finished"]
            if len(values) == len(rs) and all(v is not None and math.isfinite(v) for v in values):
                scores[lr] = statistics.fmean(float(v) for v in values)
        if not scores:
            raise ValueError(
                f"no rate at {where} has every seed finished with {criterion} in its metrics (rates: "
                f"{', '.join(f'{lr:g}' for lr in sorted(by_lr))}); runs log train_loss, train_objective unless "
                "--objective=false or the model is not linear, excess_loss with --model.weight_decay > 0"
            )
        lr = min(scores, key=lambda v: (sign * scores[v], v))  # ties: the smaller rate
        searched = sorted(by_lr)
        edge = "only" if len(searched) == 1 else "low" if lr == searched[0] else "high" if lr == searched[-1] else "no"
        choices.append(Choice(method, m, k, lr, edge, scores[lr], tuple(by_lr[lr])))
    order = {name: i for i, name in enumerate(METHODS)}
    return sorted(choices, key=lambda c: (order.get(c.method, len(order)), c.method, c.M, c.K))


@dataclass(frozen=True)
class Win:
    """The method with the lowest mean of a metric in one (M, K) cell, and its lead over the runner-up."""

    M: int
    K: int
    best: str
    runner_up: Optional[str]
    margin: float  # runner-up's mean minus the best's
    spread: float  # the larger of the two methods' standard deviations over seeds

    @property
    def margin_in_spreads(self) -> float:
        """The lead in units of the seeds' spread (inf when both spreads are 0)."""
        return self.margin / self.spread if self.spread > 0 else math.inf


def winners(choices: Sequence[Choice], metric: str = "excess_loss") -> list[Win]:
    """Per (M, K): the tuned method with the lowest seeds' mean of ``metric``, and the runner-up's gap."""
    cells: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    for c in choices:
        mean, std = c.mean(metric), c.std(metric)
        if mean is not None:
            cells.setdefault((c.M, c.K), []).append((mean, std or 0.0, c.method))
    out = []
    for (m, k), found in sorted(cells.items()):
        found.sort()
        (best_mean, best_std, best), rest = found[0], found[1:]
        if rest:
            second_mean, second_std, second = rest[0]
            out.append(Win(m, k, best, second, second_mean - best_mean, max(best_std, second_std)))
        else:
            out.append(Win(m, k, best, None, math.inf, 0.0))
    return out
