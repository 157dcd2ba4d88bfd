"""Figures and a table from a sweep's results: ``python -m lit_slowcal report sweeps/results/paper.jsonl --out docs/``.

Reads the JSON-lines file written by ``lit_slowcal sweep`` and draws the paper's Figure 2 layout:
final test accuracy (and test loss) against K, one panel per M, one line per method, the mean over
seeds with a min-max band, K on a log2 axis. Writes ``<name>_accuracy.png``, ``<name>_loss.png``
and ``<name>_results.md`` (rows M, K; per method mean ± std over seeds), ``<name>`` being the
results file's stem. Only finished trials count; diverged and failed ones are listed under the table.

When the trials logged an excess loss f(x) - f* (``lit_slowcal.experiments.measure.diagnostics``; runs with
weight decay), the report adds ``<name>_excess_loss.png`` (final excess loss against K, log scale,
one panel per M) and ``<name>_excess_rounds.png`` (excess loss against rounds, log scale, for one
(M, K), every method: ``--curve M,K``, by default the largest M and K; read from each trial's
``metrics.csv``), and the table gains the excess loss per method and G_* of each M's split (mean
over seeds; G_* depends on the split, hence on M and the seed, not on K or the method).
Each output is written atomically (``lit_slowcal.files``): a report stopped midway leaves the previous
files whole.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lit_slowcal.experiments.analysis.records import (
    CELL_KEYS,
    SEED,
    cell_of,
    check_one_setting,
    integer_param,
    load_results,
    method_label,
    methods_in_order,
    save_figure,
)
from lit_slowcal.experiments.analysis.time_to_target import Target, at_tuned_rates, write_time_to_target
from lit_slowcal.experiments.run.options import modelled_link
from lit_slowcal.experiments.train.methods import METHODS
from lit_slowcal.files import atomic_write
from lit_slowcal.link import Link

__all__ = ["Cell", "aggregate", "load_results", "main", "markdown_table", "plot_metric"]


@dataclass(frozen=True)
class Cell:
    """One (M, K, method) point: the final metric of every finished seed."""

    values: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def std(self) -> float:
        """Sample standard deviation over seeds (0 for a single seed)."""
        return statistics.stdev(self.values) if self.n > 1 else 0.0


def aggregate(records: list[dict[str, Any]], metric: str) -> dict[tuple[int, int, str], Cell]:
    """``{(M, K, method): Cell}`` of ``metric`` over the finished trials (seeds).

    Raises:
        ValueError: when a record lacks method, num_machines or local_steps, or when a parameter other
            than the seed varies within one (M, K, method) point (e.g. a learning-rate sweep).
    """
    groups: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for r in records:
        method, m, k = cell_of(r, "the report plots against M and K")
        groups.setdefault((m, k, method), []).append(r)
    cells = {}
    for key, rs in groups.items():
        for name in {k for r in rs for k in r["params"]} - {*CELL_KEYS, SEED}:
            values = {json.dumps(r["params"].get(name)) for r in rs}
            if len(values) > 1:
                raise ValueError(
                    f"{name} takes several values ({', '.join(sorted(values))}) at M={key[0]}, K={key[1]}, "
                    f"{key[2]}: the report averages over seeds only; keep one value of {name}"
                )
        check_one_setting(key, rs)
        values = [r.get("metrics", {}).get(metric) for r in rs if r.get("status") == "finished"]
        values = [float(v) for v in values if v is not None and math.isfinite(v)]
        if values:
            cells[key] = Cell(tuple(values))
    return cells


def plot_metric(
    cells: dict[tuple[int, int, str], Cell], ylabel: str, title: str, path: str | Path, log_y: bool = False
) -> None:
    """Metric against K (log2 axis), one panel per M, mean line and min-max band per method.

    The figure's format is the suffix of ``path`` (PNG without one); the file is replaced atomically.
    ``log_y``: a logarithmic metric axis (excess losses).
    """
    from matplotlib.figure import Figure

    ms = sorted({m for m, _, _ in cells})
    ks = sorted({k for _, k, _ in cells})
    methods = methods_in_order([method for _, _, method in cells])
    fig = Figure(figsize=(4.2 * len(ms), 3.6), layout="constrained")
    axes = fig.subplots(1, len(ms), sharey=True, squeeze=False)[0]
    for ax, m in zip(axes, ms):
        for method in methods:
            points = [(k, cells[m, k, method]) for k in ks if (m, k, method) in cells]
            if not points:
                continue
            x = [k for k, _ in points]
            # A method outside the registry takes the next colour of matplotlib's cycle.
            color = METHODS[method].color if method in METHODS else None
            (line,) = ax.plot(x, [c.mean for _, c in points], marker="o", color=color, label=method_label(method))
            ax.fill_between(
                x, [min(c.values) for _, c in points], [max(c.values) for _, c in points], color=line.get_color(),
                alpha=0.2, lw=0,
            )  # fmt: skip
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        ax.set_title(f"M = {m}")
        ax.set_xlabel("K (local steps per round)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(ylabel)
    axes[0].legend(fontsize="small")
    n = max((c.n for c in cells.values()), default=0)
    fig.suptitle(f"{title} (mean over {n} seeds, band: min to max)")
    save_figure(fig, path)


def split_cells(records: list[dict[str, Any]], metric: str) -> dict[int, Cell]:
    """``{M: Cell}`` of a per-split metric (``G_star``): one value per (M, seed), whatever K or the method."""
    by_split: dict[tuple[int, str], float] = {}
    for r in records:
        p, v = r.get("params", {}), r.get("metrics", {}).get(metric)
        if r.get("status") == "finished" and v is not None and math.isfinite(v) and "num_machines" in p:
            by_split.setdefault((integer_param(r, "num_machines"), json.dumps(p.get(SEED), sort_keys=True)), float(v))
    cells: dict[int, list[float]] = {}
    for (m, _), v in sorted(by_split.items()):
        cells.setdefault(m, []).append(v)
    return {m: Cell(tuple(vs)) for m, vs in cells.items()}


def excess_curves(records: list[dict[str, Any]], m: int, k: int) -> dict[str, list[tuple[float, float]]]:
    """``{method: [(round, mean excess loss over seeds), ...]}`` at (M, K), from each finished trial's ``metrics.csv``."""
    import csv

    per_method: dict[str, dict[float, list[float]]] = {}
    for r in records:
        p = r.get("params", {})
        if (
            r.get("status") != "finished"
            or (p.get("num_machines"), p.get("local_steps")) != (m, k)
            or not r.get("run_dir")
        ):
            continue
        path = Path(r["run_dir"]) / "metrics.csv"
        if not path.exists():
            continue
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if row.get("excess_loss") and row.get("round"):
                    per_method.setdefault(str(p["method"]), {}).setdefault(float(row["round"]), []).append(
                        float(row["excess_loss"])
                    )
    return {
        method: [(rnd, statistics.fmean(vs)) for rnd, vs in sorted(points.items())]
        for method, points in per_method.items()
    }


def plot_excess_rounds(curves: dict[str, list[tuple[float, float]]], m: int, k: int, path: str | Path) -> None:
    """Excess loss against rounds (log scale), one line per method."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.2, 3.6), layout="constrained")
    ax = fig.subplots()
    for method in methods_in_order(list(curves)):
        points = curves[method]
        color = METHODS[method].color if method in METHODS else None
        ax.plot([r for r, _ in points], [v for _, v in points], marker=".", color=color, label=method_label(method))
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel("excess loss f(x) - f*")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"Excess loss against rounds, M = {m}, K = {k} (mean over seeds)")
    save_figure(fig, path)


def markdown_table(
    acc: dict[tuple[int, int, str], Cell],
    loss: dict[tuple[int, int, str], Cell],
    skipped: Sequence[str] = (),
    excess: Optional[dict[tuple[int, int, str], Cell]] = None,
    g_star: Optional[dict[int, Cell]] = None,
) -> str:
    """Rows (M, K); per method the test accuracy and test loss as mean ± std over seeds (best accuracy in bold),
    and, when given, the excess loss per method and G_* of the row's split (per M)."""
    keys = sorted({(m, k) for m, k, _ in acc} | {(m, k) for m, k, _ in loss})
    methods = methods_in_order([method for _, _, method in [*acc, *loss]])
    labels = [method_label(m) for m in methods]
    header = [
        "M",
        "K",
        *(["G_*"] if g_star else []),
        *(f"{lab} acc" for lab in labels),
        *(f"{lab} loss" for lab in labels),
    ]
    if excess:
        header += [f"{lab} excess loss" for lab in labels]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def cell(c: Optional[Cell], bold: bool = False, fmt: str = ".4f") -> str:
        if c is None:
            return "n/a"
        text = f"{c.mean:{fmt}} ± {c.std:{fmt}}"
        return f"**{text}**" if bold else text

    for m, k in keys:
        accs = {method: acc.get((m, k, method)) for method in methods}
        best = max((c.mean for c in accs.values() if c is not None), default=None)
        row = [str(m), str(k)] + ([cell(g_star.get(m))] if g_star else [])
        row += [cell(c, bold=c is not None and len(methods) > 1 and c.mean == best) for c in accs.values()]
        row += [cell(loss.get((m, k, method))) for method in methods]
        if excess:
            row += [cell(excess.get((m, k, method)), fmt=".3e") for method in methods]
        lines.append("| " + " | ".join(row) + " |")
    seeds = sorted({c.n for c in acc.values()})
    notes = [
        "",
        f"Final test accuracy and test loss after one epoch: mean ± sample std over {'/'.join(map(str, seeds))} seeds "
        "(bold: the best mean accuracy of the row).",
    ]
    if excess or g_star:
        notes.append(
            "Excess loss: f(x) - f* of the final x on the training objective (every machine's shard, weight decay "
            "included); G_*: sqrt(2 (1/M) sum_i ||grad f_i(x*)||^2) of the split, per M (mean ± std over seeds)."
        )
    if skipped:
        notes.append(f"Not counted ({len(skipped)}): " + "; ".join(skipped) + ".")
    return "\n".join(lines + notes) + "\n"


def _curve_choice(text: Optional[str], excess: dict[tuple[int, int, str], Cell]) -> Optional[tuple[int, int]]:
    """(M, K) of the rounds figure: ``--curve M,K``, else the largest M, then K, with an excess loss."""
    if text is None:
        return max(((m, k) for m, k, _ in excess), default=None)
    try:
        m, k = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"Invalid --curve: {text!r} (must be M,K, two integers, e.g. 64,64)") from None
    return m, k


def _parser() -> argparse.ArgumentParser:
    """``python -m lit_slowcal report``'s arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m lit_slowcal report",
        description="Plot test accuracy and loss against K (one panel per M, one line per method) and write a "
        "markdown table, from a sweep's results file.",
    )
    parser.add_argument("results", type=Path, help="JSON-lines file written by `lit_slowcal sweep`")
    parser.add_argument("--out", type=Path, default=Path("docs"), help="output folder (default: docs)")
    parser.add_argument("--name", help="file name prefix (default: the results file's stem)")
    parser.add_argument(
        "--curve",
        help="M,K of the excess-loss-against-rounds figure (default: the largest M and K with an excess loss)",
    )
    parser.add_argument(
        "--target",
        action="append",
        default=[],
        help="also the modelled time to reach it, per method and link: metric=value (test_acc=0.9, excess_loss=0.1); "
        "repeat for several (docs/library.md, what a round costs)",
    )
    parser.add_argument(
        "--link",
        action="append",
        default=[],
        help='with --target: a link "<bandwidth>,<latency>" (repeat; default 1Gbit/s,10ms 10Gbit/s,1ms 100Gbit/s,10us)',
    )
    parser.add_argument(
        "--sample_seconds", type=float, help="with --target: compute time of one sample on one machine (required)"
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="with --target: a model this many times larger (its bytes; its compute is --sample_seconds)",
    )
    parser.add_argument(
        "--tuned",
        type=Path,
        action="append",
        default=[],
        help="only each cell's tuned rate, from `tune`'s CSV (method, M, K, lr; repeat for several); cells none holds: all",
    )
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lit_slowcal report RESULTS.jsonl [--out DIR] [--name NAME]``."""
    opts = _parser().parse_args(argv)
    name = opts.name or opts.results.stem
    try:
        notes: list[str] = []
        records = load_results(opts.results, notes)
        if opts.tuned:
            records = at_tuned_rates(records, *opts.tuned)
        for line in notes:
            print(f"note: {line}", file=sys.stderr)
        acc = aggregate(records, "test_acc")
        loss = aggregate(records, "test_loss")
        excess = aggregate(records, "excess_loss")
        g_star = split_cells(records, "G_star")
        curve = _curve_choice(opts.curve, excess)
        targets, links = _time_options(opts)
    except (OSError, ValueError) as err:
        print(f"lit_slowcal report: error: {err}", file=sys.stderr)
        return 2
    if not acc:
        print(f"lit_slowcal report: error: no finished trial with test_acc in {opts.results}", file=sys.stderr)
        return 2
    paths = _write_figures_and_table(records, opts, name, (acc, loss, excess), g_star, curve)
    for target in targets:
        command = " ".join(["python -m lit_slowcal report", *(argv if argv is not None else sys.argv[1:])])
        try:
            written = write_time_to_target(
                records, target, links, opts.sample_seconds, opts.scale, opts.out, f"{name}_{target.metric}", command
            )
        except (OSError, ValueError) as err:
            print(f"lit_slowcal report: error: {err}", file=sys.stderr)
            return 2
        paths.extend(written)
        print(written[-1].read_text(encoding="utf-8"))
    print("wrote " + ", ".join(map(str, paths)))
    return 0


def _write_figures_and_table(
    records: list[dict[str, Any]],
    opts: argparse.Namespace,
    name: str,
    cells: tuple[dict[tuple[int, int, str], Cell], ...],
    g_star: dict[int, Cell],
    curve: Optional[tuple[int, int]],
) -> list[Path]:
    """The accuracy and loss figures, the excess-loss figures where there is an excess loss, and the markdown table
    (printed too): the paths written, the table last. ``cells``: the accuracy's, the loss's and the excess loss's."""
    acc, loss, excess = cells
    skipped = [
        f"{r['params'].get('method')} M={r['params'].get('num_machines')} K={r['params'].get('local_steps')} "
        f"seed={r['params'].get(SEED)} {r.get('status')}"
        for r in records
        if r.get("status") != "finished"
    ]
    opts.out.mkdir(parents=True, exist_ok=True)
    paths = [opts.out / f"{name}_accuracy.png", opts.out / f"{name}_loss.png", opts.out / f"{name}_results.md"]
    plot_metric(acc, "final test accuracy", "MNIST test accuracy against K", paths[0])
    plot_metric(loss, "final test loss", "MNIST test loss against K", paths[1])
    table = markdown_table(acc, loss, skipped, excess=excess, g_star=g_star)
    head = f"# Results of {opts.results.name}\n\n![test accuracy]({paths[0].name})\n\n![test loss]({paths[1].name})\n\n"
    if excess:
        figures = [opts.out / f"{name}_excess_loss.png"]
        plot_metric(excess, "final excess loss f(x) - f*", "Excess loss against K", figures[0], log_y=True)
        curves = excess_curves(records, *curve) if curve else {}
        if curves:
            figures.append(opts.out / f"{name}_excess_rounds.png")
            plot_excess_rounds(curves, *curve, figures[1])
        head += "".join(f"![{f.stem.removeprefix(name + '_').replace('_', ' ')}]({f.name})\n\n" for f in figures)
        paths[2:2] = figures
    wall = sum(float(r.get("wall_time_s") or 0.0) for r in records)
    finished = sum(r.get("status") == "finished" for r in records)
    tail = (
        f"\n{len(records)} trials ({finished} finished), {wall / 60:.1f} min of training in all. "
        f"Made by `python -m lit_slowcal report {opts.results.as_posix()} --out {opts.out.as_posix()}`.\n"
    )
    with atomic_write(paths[-1], encoding="utf-8") as f:
        f.write(head + table + tail)
    print(table)
    return paths


def _time_options(opts: argparse.Namespace) -> tuple[list[Target], list[Link]]:
    """``--target``, ``--link``, ``--sample_seconds`` and ``--scale``, checked: one line naming the one refused."""
    targets = [Target.parse(text) for text in opts.target]
    links = [modelled_link(text) for text in opts.link or ("1Gbit/s,10ms", "10Gbit/s,1ms", "100Gbit/s,10us")]
    if targets:
        if opts.sample_seconds is None or not (opts.sample_seconds >= 0 and math.isfinite(opts.sample_seconds)):
            raise ValueError(
                f"Invalid --sample_seconds: {opts.sample_seconds!r} (with --target: the compute time of one sample on "
                "one machine, a number >= 0, e.g. 2e-5)"
            )
        if not (opts.scale > 0 and math.isfinite(opts.scale)):
            raise ValueError(f"Invalid --scale: {opts.scale!r} (a number > 0)")
    elif opts.link or opts.sample_seconds is not None or opts.scale != 1.0:
        raise ValueError("--link, --sample_seconds and --scale need --target (what time to reach)")
    return targets, links
