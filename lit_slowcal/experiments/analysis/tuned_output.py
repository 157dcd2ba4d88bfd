"""The tuned choices written out: the CSV table, the markdown tables, the figures.

The CSV (``CSV_HEADER``) has one row per cell, the figures at the chosen rate (means and sample
standard deviations over its seeds; an empty field where the records lack the metric), in the
order of the choices (``lit_slowcal.experiments.analysis.rate_choice.tune``). The test figures are read here,
after choosing, never before.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from lit_slowcal.experiments.analysis.rate_choice import Choice, Win, winners
from lit_slowcal.experiments.analysis.records import method_label, save_figure
from lit_slowcal.experiments.train.methods import METHODS
from lit_slowcal.files import atomic_write

__all__ = [
    "CSV_HEADER", "communication_table", "floats_per_machine", "markdown", "plot_accuracy_vs_floats", "rows",
    "win_table", "write_csv", "write_docs",
]  # fmt: skip

#: The columns of the tuned table, in order.
CSV_HEADER = (
    "method", "M", "K", "lr", "lr_at_edge", "n_seeds", "train_objective_mean", "excess_loss_mean", "excess_loss_std",
    "test_acc_mean", "test_acc_std", "test_loss_mean", "test_loss_std",
)  # fmt: skip


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
                row.append(f"**{method_label(w.best)}** (alone)")
                continue
            lead = "∞" if math.isinf(w.margin_in_spreads) else f"{w.margin_in_spreads:.2f}"
            row.append(f"**{method_label(w.best)}** over {method_label(w.runner_up)}: {w.margin:.2e} ({lead} σ)")
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def write_docs(choices: Sequence[Choice], criterion: str, folder: Path, stem: str) -> list[Path]:
    """``stem``.md (the tuned table and the map of winners) and two figures in ``folder``."""
    from lit_slowcal.experiments.analysis.report import Cell, plot_metric

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for metric, label, log_y in (
        ("excess_loss", "excess loss f(x_R) - f*", True),
        ("test_acc", "test accuracy", False),
    ):
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
            ax.text(j + 0.5, i + 0.5, f"{method_label(w.best)}\n{lead}", ha="center", va="center", fontsize=7)
        ax.set_xlim(0, len(ks)), ax.set_ylim(0, len(ms))
        ax.set_xticks([j + 0.5 for j in range(len(ks))], [str(k) for k in ks])
        ax.set_yticks([i + 0.5 for i in range(len(ms))], [str(m) for m in ms])
        ax.set_xlabel("K"), ax.set_ylabel("M")
        ax.set_title(
            f"lowest {metric} per cell (tuned); lead over the runner-up in seeds' spreads\n(pale: lead < 2σ)",
            fontsize=9,
        )
        path = folder / f"{stem}_wins.png"
        save_figure(fig, path)
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
            f"| {method_label(c.method)} | {c.M} | {c.K} | {c.lr:g} | {c.lr_at_edge} | {len(c.records)} | "
            f"{_pm(c, 'train_loss', '.4f')} | {_pm(c, 'test_acc', '.4f')} | {'n/a' if floats is None else f'{floats:.3g}'} |"
        )
    return "\n".join(lines) + "\n"


def plot_accuracy_vs_floats(choices: Sequence[Choice], path: str | Path, title: str, zoom: float = 0.1) -> None:
    """Test accuracy against the floats a machine sent (log axis), one line per method through its cells
    (its values of K) in the order of the floats, error bars: the sample std over the seeds. Left: every
    point; right: the top ``zoom`` of accuracy below the best mean, where the methods are told apart."""
    from matplotlib.figure import Figure

    by_method: dict[str, list[tuple[float, float, float, int]]] = {}
    for c in choices:
        floats, acc = floats_per_machine(c), c.mean("test_acc")
        if floats is not None and acc is not None:
            by_method.setdefault(c.method, []).append((floats, acc, c.std("test_acc") or 0.0, c.K))
    if not by_method:
        raise ValueError(
            f"no chosen cell has test_acc and floats_communicated in its records; nothing to draw in {path}"
        )
    fig = Figure(figsize=(10.0, 4.0), layout="constrained")
    axes = fig.subplots(1, 2)
    order = {name: i for i, name in enumerate(METHODS)}
    for method in sorted(by_method, key=lambda m: (order.get(m, len(order)), m)):
        points = sorted(by_method[method])
        color = METHODS[method].color if method in METHODS else None
        for ax in axes:
            ax.errorbar(
                [f for f, *_ in points], [a for _, a, *_ in points], yerr=[s for _, _, s, _ in points], marker="o",
                capsize=3, color=color, label=method_label(method),
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
    save_figure(fig, path)
