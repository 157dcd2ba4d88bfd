"""Figures and a table from a sweep's results: ``python -m lit_slowcal report sweeps/results/paper.jsonl --out docs/``.

Reads the JSON-lines file written by ``lit_slowcal sweep`` and draws the paper's Figure 2 layout:
final test accuracy (and test loss) against K, one panel per M, one line per method, the mean over
seeds with a min-max band, K on a log2 axis. Writes ``<name>_accuracy.png``, ``<name>_loss.png``
and ``<name>_results.md`` (rows M, K; per method mean ± std over seeds), ``<name>`` being the
results file's stem. Only finished trials count; diverged and failed ones are listed under the table.
Each output is written atomically (``lit_slowcal.files``): a report stopped midway leaves the previous
files whole.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from lit_slowcal.experiments.methods import METHODS
from lit_slowcal.files import atomic_path, atomic_write

__all__ = ["Cell", "aggregate", "load_results", "main", "markdown_table", "plot_metric"]

_KEYS = ("method", "num_machines", "local_steps")
_SEED = "seed_everything"


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


def load_results(path: str | Path) -> list[dict[str, Any]]:
    """The records of a results file (one JSON object a line)."""
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}, line {n}: not JSON ({err})") from None
    return records


def _methods(found: Sequence[str]) -> list[str]:
    """The methods found: the registry's in its order, then any others by name."""
    return [m for m in METHODS if m in found] + sorted(m for m in set(found) if m not in METHODS)


def _label(method: str) -> str:
    return METHODS[method].label if method in METHODS else method


def aggregate(records: list[dict[str, Any]], metric: str) -> dict[tuple[int, int, str], Cell]:
    """``{(M, K, method): Cell}`` of ``metric`` over the finished trials (seeds).

    Raises:
        ValueError: when a record lacks method, num_machines or local_steps, or when a parameter other
            than the seed varies within one (M, K, method) point (e.g. a learning-rate sweep).
    """
    groups: dict[tuple[int, int, str], list[dict[str, Any]]] = {}
    for r in records:
        p = r.get("params", {})
        missing = [k for k in _KEYS if k not in p]
        if missing:
            raise ValueError(f"a trial lacks {', '.join(missing)} in its params ({p}); the report plots against M and K")
        groups.setdefault((int(p["num_machines"]), int(p["local_steps"]), str(p["method"])), []).append(r)
    cells = {}
    for key, rs in groups.items():
        for name in {k for r in rs for k in r["params"]} - {*_KEYS, _SEED}:
            values = {json.dumps(r["params"].get(name)) for r in rs}
            if len(values) > 1:
                raise ValueError(
                    f"{name} takes several values ({', '.join(sorted(values))}) at M={key[0]}, K={key[1]}, "
                    f"{key[2]}: the report averages over seeds only; keep one value of {name}"
                )
        values = [r["metrics"].get(metric) for r in rs if r.get("status") == "finished"]
        values = [float(v) for v in values if v is not None and math.isfinite(v)]
        if values:
            cells[key] = Cell(tuple(values))
    return cells


def plot_metric(cells: dict[tuple[int, int, str], Cell], ylabel: str, title: str, path: str | Path) -> None:
    """Metric against K (log2 axis), one panel per M, mean line and min-max band per method.

    The figure's format is the suffix of ``path`` (PNG without one); the file is replaced atomically.
    """
    from matplotlib.figure import Figure

    ms = sorted({m for m, _, _ in cells})
    ks = sorted({k for _, k, _ in cells})
    methods = _methods([method for _, _, method in cells])
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
            (line,) = ax.plot(x, [c.mean for _, c in points], marker="o", color=color, label=_label(method))
            ax.fill_between(
                x, [min(c.values) for _, c in points], [max(c.values) for _, c in points], color=line.get_color(),
                alpha=0.2, lw=0,
            )  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        ax.set_title(f"M = {m}")
        ax.set_xlabel("K (local steps per round)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(ylabel)
    axes[0].legend(fontsize="small")
    n = max((c.n for c in cells.values()), default=0)
    fig.suptitle(f"{title} (mean over {n} seeds, band: min to max)")
    # The temporary file's suffix is not the target's: the format is given, not inferred.
    fmt = Path(path).suffix[1:].lower() or "png"
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format=fmt)


def markdown_table(
    acc: dict[tuple[int, int, str], Cell], loss: dict[tuple[int, int, str], Cell], skipped: Sequence[str] = ()
) -> str:
    """Rows (M, K); per method the test accuracy and test loss as mean ± std over seeds (best accuracy in bold)."""
    keys = sorted({(m, k) for m, k, _ in acc} | {(m, k) for m, k, _ in loss})
    methods = _methods([method for _, _, method in [*acc, *loss]])
    labels = [_label(m) for m in methods]
    header = ["M", "K", *(f"{lab} acc" for lab in labels), *(f"{lab} loss" for lab in labels)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def cell(c: Optional[Cell], bold: bool = False) -> str:
        if c is None:
            return "n/a"
        text = f"{c.mean:.4f} ± {c.std:.4f}"
        return f"**{text}**" if bold else text

    for m, k in keys:
        accs = {method: acc.get((m, k, method)) for method in methods}
        best = max((c.mean for c in accs.values() if c is not None), default=None)
        row = [str(m), str(k)]
        row += [cell(c, bold=c is not None and len(methods) > 1 and c.mean == best) for c in accs.values()]
        row += [cell(loss.get((m, k, method))) for method in methods]
        lines.append("| " + " | ".join(row) + " |")
    seeds = sorted({c.n for c in acc.values()})
    notes = [
        "",
        f"Final test accuracy and test loss after one epoch: mean ± sample std over {'/'.join(map(str, seeds))} seeds "
        "(bold: the best mean accuracy of the row).",
    ]
    if skipped:
        notes.append(f"Not counted ({len(skipped)}): " + "; ".join(skipped) + ".")
    return "\n".join(lines + notes) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lit_slowcal report RESULTS.jsonl [--out DIR] [--name NAME]``."""
    parser = argparse.ArgumentParser(
        prog="python -m lit_slowcal report",
        description="Plot test accuracy and loss against K (one panel per M, one line per method) and write a "
        "markdown table, from a sweep's results file.",
    )
    parser.add_argument("results", type=Path, help="JSON-lines file written by `lit_slowcal sweep`")
    parser.add_argument("--out", type=Path, default=Path("docs"), help="output folder (default: docs)")
    parser.add_argument("--name", help="file name prefix (default: the results file's stem)")
    opts = parser.parse_args(argv)
    name = opts.name or opts.results.stem
    try:
        records = load_results(opts.results)
        acc = aggregate(records, "test_acc")
        loss = aggregate(records, "test_loss")
    except (OSError, ValueError) as err:
        print(f"lit_slowcal report: error: {err}", file=sys.stderr)
        return 2
    if not acc:
        print(f"lit_slowcal report: error: no finished trial with test_acc in {opts.results}", file=sys.stderr)
        return 2
    skipped = [
        f"{r['params'].get('method')} M={r['params'].get('num_machines')} K={r['params'].get('local_steps')} "
        f"seed={r['params'].get(_SEED)} {r.get('status')}"
        for r in records
        if r.get("status") != "finished"
    ]
    opts.out.mkdir(parents=True, exist_ok=True)
    paths = [opts.out / f"{name}_accuracy.png", opts.out / f"{name}_loss.png", opts.out / f"{name}_results.md"]
    plot_metric(acc, "final test accuracy", "MNIST test accuracy against K", paths[0])
    plot_metric(loss, "final test loss", "MNIST test loss against K", paths[1])
    table = markdown_table(acc, loss, skipped)
    head = f"# Results of {opts.results.name}\n\n![test accuracy]({paths[0].name})\n\n![test loss]({paths[1].name})\n\n"
    wall = sum(float(r.get("wall_time_s") or 0.0) for r in records)
    finished = sum(r.get("status") == "finished" for r in records)
    tail = (
        f"\n{len(records)} trials ({finished} finished), {wall / 60:.1f} min of training in all. "
        f"Made by `python -m lit_slowcal report {opts.results.as_posix()} --out {opts.out.as_posix()}`.\n"
    )
    with atomic_write(paths[2], encoding="utf-8") as f:
        f.write(head + table + tail)
    print(table)
    print("wrote " + ", ".join(map(str, paths)))
    return 0
