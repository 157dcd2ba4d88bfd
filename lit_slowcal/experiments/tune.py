"""Tuning without the test set: ``python -m lit_slowcal tune sweeps/results/table1_tuned.jsonl --out docs/table1_tuned.csv``.

Reads a sweep's results file (``lit_slowcal sweep``), groups its trials by cell (method, M, K) and
learning rate, averages a criterion over the seeds at each rate, and picks per cell the rate with
the best mean. Only then are the test figures at that rate read: the test set never chooses.

Criteria (``--criterion``), each a final metric of the trials' records:

* ``train_objective`` (default): f(x_R), the training objective at the end of the run (the paper's
  global objective, weight decay included; ``lit_slowcal.experiments.diagnostics``);
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
grid should be extended that way. The CSV has one row per cell, the figures at the chosen rate
(means and sample standard deviations over its seeds; an empty field where the records lack the
metric), in the registry's method order, then M, then K.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from lit_slowcal.experiments.methods import METHODS
from lit_slowcal.experiments.report import load_results
from lit_slowcal.files import atomic_write

__all__ = [
    "CSV_HEADER", "Choice", "check_criterion", "communication_table", "floats_per_machine", "main",
    "plot_accuracy_vs_floats", "tune", "winners", "write_csv", "write_docs",
]  # fmt: skip

#: The columns of the tuned table, in order.
CSV_HEADER = (
    "method", "M", "K", "lr", "lr_at_edge", "n_seeds", "train_objective_mean", "excess_loss_mean", "excess_loss_std",
    "test_acc_mean", "test_acc_std", "test_loss_mean", "test_loss_std",
)  # fmt: skip

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
        found = [r["metrics"].get(metric) for r in self.records]
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
    if not isinstance(criterion, str) or not (criterion in ("train_objective", "excess_loss", "train_loss") or criterion.startswith("val_")):
        reason = "the test set is never a tuning criterion; " if str(criterion).startswith("test") else ""
        raise ValueError(f"Invalid --criterion: {criterion!r} ({reason}allowed: train_objective, excess_loss, train_loss, val_<metric>)")
    return criterion


def _lr(params: dict[str, Any]) -> float:
    if _LR in params:
        return float(params[_LR])
    method = params["method"]
    if method in METHODS:
        return METHODS[method].paper_lr  # a trial without model.lr trains at its method's paper-config rate
    raise ValueError(f"a trial of method {method!r} (not in the registry) lacks model.lr in its params ({params})")


def tune(records: list[dict[str, Any]], criterion: str = "train_objective") -> list[Choice]:
    """The best rate per (method, M, K) by the seeds' mean of ``criterion``, in the registry's order.

    Raises:
        ValueError: for a test criterion, a record without method, num_machines or local_steps, a
            parameter other than the rate and the seed that varies within a cell, or a cell where
            no rate has every seed finished with the criterion.
    """
    check_criterion(criterion)
    sign = -1.0 if criterion.endswith("acc") else 1.0  # minimised; accuracies maximised
    cells: dict[tuple[str, int, int], dict[float, list[dict[str, Any]]]] = {}
    for r in records:
        p = r.get("params", {})
        missing = [k for k in _CELL if k not in p]
        if missing:
            raise ValueError(f"a trial lacks {', '.join(missing)} in its params ({p}); tuning is per (method, M, K)")
        key = (str(p["method"]), int(p["num_machines"]), int(p["local_steps"]))
        cells.setdefault(key, {}).setdefault(_lr(p), []).append(r)
    choices = []
    for (method, m, k), by_lr in cells.items():
        where = f"{method} M={m} K={k}"
        trials = [r for rs in by_lr.values() for r in rs]
        for name in {n for r in trials for n in r["params"]} - {*_CELL, _LR, _SEED}:
            values = {json.dumps(r["params"].get(name)) for r in trials}
            if len(values) > 1:
                raise ValueError(
                    f"{name} takes several values ({', '.join(sorted(values))}) at {where}: tuning compares rates "
                    f"averaged over seeds only; tune each value of {name} from its own results file"
                )
        scores = {}
        for lr, rs in by_lr.items():
            values = [r["metrics"].get(criterion) for r in rs if r.get("status") == "finished"]
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


def _field(value: Optional[float]) -> str:
    return "" if value is None else repr(value)


def rows(choices: Sequence[Choice]) -> list[list[str]]:
    """The CSV rows (``CSV_HEADER``'s columns) of the choices; the test figures are read here, after choosing."""
    out = []
    for c in choices:
        out.append([
            c.method, str(c.M), str(c.K), repr(c.lr), c.lr_at_edge, str(len(c.records)),
            _field(c.mean("train_objective")), _field(c.mean("excess_loss")), _field(c.std("excess_loss")),
            _field(c.mean("test_acc")), _field(c.std("test_acc")), _field(c.mean("test_loss")), _field(c.std("test_loss")),
        ])  # fmt: skip
    return out


def write_csv(choices: Sequence[Choice], path: str | Path) -> None:
    """The tuned table as CSV, replaced atomically."""
    with atomic_write(path, newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(CSV_HEADER)
        writer.writerows(rows(choices))


def _pm(c: Choice, metric: str, fmt: str) -> str:
    mean, std = c.mean(metric), c.std(metric)
    return "n/a" if mean is None else f"{mean:{fmt}} ± {std:{fmt}}"


def markdown(choices: Sequence[Choice], criterion: str) -> str:
    """The tuned table for the terminal: per cell the rate, its edge flag and the figures at it."""
    lines = [
        f"| method | M | K | lr | at edge | seeds | {criterion} (chose) | excess loss | test accuracy | test loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in choices:
        lines.append(
            f"| {c.method} | {c.M} | {c.K} | {c.lr:g} | {c.lr_at_edge} | {len(c.records)} | {c.criterion_mean:.6g} | "
            f"{_pm(c, 'excess_loss', '.3e')} | {_pm(c, 'test_acc', '.4f')} | {_pm(c, 'test_loss', '.4f')} |"
        )
    edges = [f"{c.method} M={c.M} K={c.K} ({c.lr_at_edge})" for c in choices if c.lr_at_edge != "no"]
    note = f"Chosen by the seeds' mean {criterion}; the test figures are read at the chosen rate only."
    if edges:
        note += f" At the edge of its grid ({len(edges)}): " + "; ".join(edges) + "."
    return "\n".join(lines) + "\n\n" + note + "\n"


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


def _label(method: str) -> str:
    return METHODS[method].label if method in METHODS else method


def win_table(wins: Sequence[Win], metric: str) -> str:
    """Markdown: rows M, columns K, the winner and its lead in seeds' spreads."""
    ms, ks = sorted({w.M for w in wins}), sorted({w.K for w in wins})
    at = {(w.M, w.K): w for w in wins}
    lines = ["| M \\ K | " + " | ".join(str(k) for k in ks) + " |", "|---|" + "---|" * len(ks)]
    for m in ms:
        row = []
        for k in ks:
            w = at.get((m, k))
            if w is None:
                row.append("")
                continue
            if w.runner_up is None:
                row.append(f"**{_label(w.best)}** (alone)")
                continue
            lead = "∞" if math.isinf(w.margin_in_spreads) else f"{w.margin_in_spreads:.2f}"
            row.append(f"**{_label(w.best)}** over {_label(w.runner_up)}: {w.margin:.2e} ({lead} σ)")
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def write_docs(choices: Sequence[Choice], criterion: str, folder: Path, stem: str) -> list[Path]:
    """``stem``.md (the tuned table and the map of winners) and two figures in ``folder``."""
    from lit_slowcal.experiments.report import Cell, _save, plot_metric

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for metric, label, log_y in (("excess_loss", "excess loss f(x_R) - f*", True), ("test_acc", "test accuracy", False)):
        cells = {(c.M, c.K, c.method): Cell(tuple(c.values(metric))) for c in choices if c.values(metric)}
        if cells:
            path = folder / f"{stem}_{metric}.png"
            plot_metric(cells, label, f"{label} at each cell's tuned rate", path, log_y=log_y)
            written.append(path)
    metric = "excess_loss" if any(c.values("excess_loss") for c in choices) else criterion
    wins = winners(choices, metric)
    if wins:
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle

        ms, ks = sorted({w.M for w in wins}), sorted({w.K for w in wins})
        fig = Figure(figsize=(1.6 * len(ks) + 1.5, 0.9 * len(ms) + 1.2), layout="constrained")
        ax = fig.subplots()
        for w in wins:
            i, j = ms.index(w.M), ks.index(w.K)
            color = METHODS[w.best].color if w.best in METHODS else "grey"
            strong = math.isinf(w.margin_in_spreads) or w.margin_in_spreads >= 2
            ax.add_patch(Rectangle((j, i), 1, 1, color=color, alpha=0.85 if strong else 0.35))
            lead = "∞" if math.isinf(w.margin_in_spreads) else f"{w.margin_in_spreads:.1f}σ"
            ax.text(j + 0.5, i + 0.5, f"{_label(w.best)}\n{lead}", ha="center", va="center", fontsize=7)
        ax.set_xlim(0, len(ks)), ax.set_ylim(0, len(ms))
        ax.set_xticks([j + 0.5 for j in range(len(ks))], [str(k) for k in ks])
        ax.set_yticks([i + 0.5 for i in range(len(ms))], [str(m) for m in ms])
        ax.set_xlabel("K"), ax.set_ylabel("M")
        ax.set_title(f"lowest {metric} per cell (tuned); lead over the runner-up in seeds' spreads\n(pale: lead < 2σ)", fontsize=9)
        path = folder / f"{stem}_wins.png"
        _save(fig, path)
        written.append(path)
    lines = [
        f"# {stem}: every method at its own tuned rate per (M, K)",
        "",
        f"Rates chosen per cell by the seeds' mean {criterion} (never the test set); the test figures are read at "
        "the chosen rate only. Generated by `python -m lit_slowcal tune` from the results file.",
        "",
        *[f"![{p.stem}]({p.name})" for p in written],
        "",
        f"## Which method wins each cell ({metric}, lower is better)",
        "",
        "Each cell: the winner, the runner-up, the gap between their means, and that gap in units of the larger",
        "of the two methods' standard deviations over seeds (σ); under 2 σ the seeds do not separate them.",
        "",
        win_table(wins, metric),
        "## The tuned table",
        "",
        markdown(choices, criterion),
    ]
    path = folder / f"{stem}.md"
    with atomic_write(path, encoding="utf-8") as f:
        f.write("\n".join(lines))
    return [path, *written]


def floats_per_machine(choice: Choice) -> Optional[float]:
    """The floats a machine sent over the run at the chosen rate: the records' ``floats_communicated`` (the
    machines' total) over M, averaged over the seeds (with partial participation: per machine on average)."""
    total = choice.mean("floats_communicated")
    return None if total is None else total / choice.M


def communication_table(choices: Sequence[Choice]) -> str:
    """Markdown, one row per cell: the tuned rate, the final train loss and test accuracy (mean ± sample std
    over the seeds at that rate) and the floats a machine sent; the test figures are read after choosing."""
    lines = [
        "| method | M | K | tuned lr | at edge | seeds | final train loss | final test accuracy | floats sent per machine |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in choices:
        floats = floats_per_machine(c)
        lines.append(
            f"| {_label(c.method)} | {c.M} | {c.K} | {c.lr:g} | {c.lr_at_edge} | {len(c.records)} | "
            f"{_pm(c, 'train_loss', '.4f')} | {_pm(c, 'test_acc', '.4f')} | {'n/a' if floats is None else f'{floats:.3g}'} |"
        )
    return "\n".join(lines) + "\n"


def plot_accuracy_vs_floats(choices: Sequence[Choice], path: str | Path, title: str, zoom: float = 0.1) -> None:
    """Test accuracy against the floats a machine sent (log axis), one line per method through its cells
    (its values of K) in the order of the floats, error bars: the sample std over the seeds. Left: every
    point; right: the top ``zoom`` of accuracy below the best mean, where the methods are told apart."""
    from matplotlib.figure import Figure

    from lit_slowcal.experiments.report import _save

    by_method: dict[str, list[tuple[float, float, float, int]]] = {}
    for c in choices:
        floats, acc = floats_per_machine(c), c.mean("test_acc")
        if floats is not None and acc is not None:
            by_method.setdefault(c.method, []).append((floats, acc, c.std("test_acc") or 0.0, c.K))
    if not by_method:
        raise ValueError(f"no chosen cell has test_acc and floats_communicated in its records; nothing to draw in {path}")
    fig = Figure(figsize=(10.0, 4.0), layout="constrained")
    axes = fig.subplots(1, 2)
    order = {name: i for i, name in enumerate(METHODS)}
    for method in sorted(by_method, key=lambda m: (order.get(m, len(order)), m)):
        points = sorted(by_method[method])
        color = METHODS[method].color if method in METHODS else None
        for ax in axes:
            ax.errorbar(
                [f for f, *_ in points], [a for _, a, *_ in points], yerr=[s for _, _, s, _ in points], marker="o",
                capsize=3, color=color, label=_label(method),
            )  # fmt: skip
        for f, a, _, k in points:
            axes[1].annotate(f"K={k}", (f, a), textcoords="offset points", xytext=(4, -10), fontsize=6, color=color)
    best = max(a for points in by_method.values() for _, a, _, _ in points)
    axes[1].set_ylim(best - zoom, best + zoom / 5)
    axes[1].set_title(f"zoom: within {zoom:g} of the best mean", fontsize=9)
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("floats sent per machine over the run")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final test accuracy")
    axes[0].legend(fontsize="small")
    n = max(len(c.records) for c in choices)
    fig.suptitle(f"{title} (each method at its tuned rate per K; mean over {n} seeds, bars: std)", fontsize=10)
    _save(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lit_slowcal tune RESULTS.jsonl [--criterion C] [--out FILE.csv] [--docs DIR] [--floats FIGURE.png]``."""
    parser = argparse.ArgumentParser(
        prog="python -m lit_slowcal tune",
        description="Choose the learning rate of every (method, M, K) by a training criterion averaged over seeds "
        "(never the test set), then report the test figures at it.",
    )
    parser.add_argument("results", type=Path, help="JSON-lines file written by `lit_slowcal sweep`")
    parser.add_argument(
        "--criterion", default="train_objective",
        help="train_objective (f(x_R), default), excess_loss (f(x_R) - f*), train_loss (the last logged loss of the "
        "machines' steps; non-linear models) or val_<metric>; test_* is refused",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the table as CSV there (columns: " + ",".join(CSV_HEADER) + ")")
    parser.add_argument(
        "--docs", type=Path,
        help="write <results stem>.md (the table, the map of which method wins each cell) and its figures there",
    )  # fmt: skip
    parser.add_argument(
        "--floats", type=Path, metavar="FIGURE.png",
        help="draw the final test accuracy against the floats sent per machine there (one line per method through "
        "its K) and print the table of tuned rate, train loss, test accuracy and floats per machine",
    )  # fmt: skip
    opts = parser.parse_args(argv)
    try:
        check_criterion(opts.criterion)
        choices = tune(load_results(opts.results), opts.criterion)
        if opts.out is not None:
            if opts.out.parent != Path(""):
                opts.out.parent.mkdir(parents=True, exist_ok=True)
            write_csv(choices, opts.out)
        if opts.docs is not None:
            for path in write_docs(choices, opts.criterion, opts.docs, opts.results.stem):
                print(f"wrote {path}")
        if opts.floats is not None:
            plot_accuracy_vs_floats(choices, opts.floats, f"{opts.results.stem}: final test accuracy against communication")
            print(communication_table(choices))
            print(f"wrote {opts.floats}")
    except (OSError, ValueError) as err:
        print(f"lit_slowcal tune: error: {err}", file=sys.stderr)
        return 2
    print(markdown(choices, opts.criterion))
    if opts.out is not None:
        print(f"wrote {opts.out}")
    return 0
