"""Time to a target: the modelled wall time each method needs to reach a test accuracy or an excess loss, per link.

``python -m lit_slowcal report RESULTS.jsonl --target test_acc=0.9 --link 1Gbit/s,10ms --link 10Gbit/s,1ms``
adds ``<name>_time_to_target.md`` (a table) and ``<name>_time_to_target.png`` (the metric against modelled
time, one panel per M and link) to the report.

A trial's modelled time after round r is, with blocking rounds (compute and communication add),

    r * (s * c  +  hops * latency  +  bytes / bandwidth)

where, per round and per machine, ``s`` is the samples a machine draws (K * b for every method), ``c`` the
compute time of one sample (``--sample_seconds``), and ``hops`` and ``bytes`` what one machine sends on the
ring in a round (``lit_slowcal.link``: 2 (P - 1) latency terms, 2 (P - 1) / P of its payload), read from the
counts the trial logged (``ring_hops``, ``ring_bytes_per_machine``). Every round of a run sends the same, so
the counts of its last row give every round's. ``--scale N`` models a model N times larger with the same
trajectory: N times the bytes, the latency terms the same, and the compute of a sample the one given
(``--sample_seconds``, measured for the larger model: ``benchmarks/bench_sample_seconds.py``). The time to the target is that of
the first evaluation that reaches it (``test_acc`` at least the value; any other metric at most); a cell
(method, M, K) reports the mean over its seeds when every seed reaches it, else how many did.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lit_slowcal.experiments.analysis.records import cell_of, located, method_label, save_figure
from lit_slowcal.experiments.train.methods import METHODS
from lit_slowcal.files import atomic_write
from lit_slowcal.link import Link

__all__ = [
    "Target", "Trajectory", "at_tuned_rates", "cell_times", "time_table", "trajectory", "write_time_to_target",
]  # fmt: skip

#: Metrics a target can name; ``test_acc`` is reached from below, the others from above.
TARGET_METRICS = ("test_acc", "test_loss", "excess_loss", "train_objective")


@dataclass(frozen=True)
class Target:
    """``metric=value``: the first evaluation with ``test_acc >= value`` (or ``metric <= value``) reaches it."""

    metric: str
    value: float

    @classmethod
    def parse(cls, text: str) -> Target:
        name, sep, value = text.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or name not in TARGET_METRICS or not math.isfinite(number):
            raise ValueError(
                f"Invalid --target: {text!r} (metric=value, the metric one of {', '.join(TARGET_METRICS)}, "
                "e.g. test_acc=0.9 or excess_loss=0.1)"
            )
        return cls(name, number)

    def reached(self, value: float) -> bool:
        return value >= self.value if self.metric == "test_acc" else value <= self.value

    def __str__(self) -> str:
        return f"{self.metric} {'>=' if self.metric == 'test_acc' else '<='} {self.value:g}"


@dataclass(frozen=True)
class Trajectory:
    """One trial's evaluations and what each of its rounds costs.

    Attributes:
        points: ``(round, value)`` of every evaluation of the target's metric, in order.
        samples: the samples one machine draws in a round.
        ring_bytes: the bytes one machine sends on the ring in a round.
        ring_hops: the ring's latency terms of a round.
    """

    points: tuple[tuple[float, float], ...]
    samples: float
    ring_bytes: float
    ring_hops: float

    def seconds(self, rounds: float, link: Link, sample_seconds: float, scale: float = 1.0) -> float:
        """The modelled wall time of ``rounds`` rounds at ``link`` (see the module docstring)."""
        return rounds * (
            self.samples * sample_seconds + scale * self.ring_bytes / link.bandwidth + self.ring_hops * link.latency
        )

    def first_reaching(self, target: Target) -> Optional[float]:
        """The round of the first evaluation that reaches ``target`` (``None``: none does)."""
        return next((r for r, v in self.points if target.reached(v)), None)


def trajectory(record: dict[str, Any], metric: str, machines: int) -> Trajectory:
    """A finished trial's ``Trajectory``: its evaluations of ``metric`` from its ``metrics.csv``, its counts per
    round from its record's final metrics (``round``, ``samples_seen`` over its ``machines``, the ring counts).

    Raises:
        ValueError: naming the record when its counts or its log are missing (a run of an earlier version).
    """
    metrics = record.get("metrics") or {}
    needed = ("round", "samples_seen", "ring_bytes_per_machine", "ring_hops")
    missing = [k for k in needed if not isinstance(metrics.get(k), (int, float))]
    if missing or not metrics["round"]:
        raise located(
            record,
            f"the trial logged no {', '.join(missing) or 'round'}: time to a target needs the counts a run logs "
            "since the link model (rerun the sweep with this version)",
        )
    path = Path(record.get("run_dir") or "") / "metrics.csv"
    if not record.get("run_dir") or not path.is_file():
        raise located(record, f"its log {path} is not there: time to a target reads each trial's evaluations")
    rounds = float(metrics["round"])
    points = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row.get(metric) and row.get("round"):
                points.append((float(row["round"]), float(row[metric])))
    return Trajectory(
        points=tuple(points),
        samples=float(metrics["samples_seen"]) / (machines * rounds),
        ring_bytes=float(metrics["ring_bytes_per_machine"]) / rounds,
        ring_hops=float(metrics["ring_hops"]) / rounds,
    )


def at_tuned_rates(records: Sequence[dict[str, Any]], *tuned_csvs: str | Path) -> list[dict[str, Any]]:
    """The records at their cell's tuned rate: where a ``tuned_csvs`` file (``python -m lit_slowcal tune``'s output:
    method, M, K, lr) has a row for a record's (method, M, K), the record is kept only when its ``model.lr`` is that
    row's (a later file's row wins); records of cells none holds are all kept."""
    tuned: dict[tuple[str, int, int], float] = {}
    for path in tuned_csvs:
        with open(path, newline="") as f:
            tuned.update({(r["method"], int(r["M"]), int(r["K"])): float(r["lr"]) for r in csv.DictReader(f)})
    kept = []
    for r in records:
        cell = cell_of(r, "--tuned picks records by (method, M, K)")
        lr = r["params"].get("model.lr")
        if cell not in tuned or (isinstance(lr, (int, float)) and float(lr) == tuned[cell]):
            kept.append(r)
    return kept


@dataclass(frozen=True)
class CellTime:
    """A cell's time to the target at one link: the mean over its seeds when every seed reached it."""

    seconds: Optional[float]
    rounds: Optional[float]
    reached: int
    seeds: int

    def text(self) -> str:
        if self.seconds is None:
            return f"not reached ({self.reached}/{self.seeds})"
        return f"{_duration(self.seconds)} ({self.rounds:.0f} rounds)"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.3g} s"


def cell_times(
    records: Sequence[dict[str, Any]], target: Target, links: Sequence[Link], sample_seconds: float, scale: float = 1.0
) -> tuple[dict[tuple[int, int, str], dict[Link, CellTime]], dict[tuple[int, int, str], list[Trajectory]]]:
    """Every cell's ``CellTime`` at each link, and its trials' trajectories, from the finished records."""
    trajectories: dict[tuple[int, int, str], list[Trajectory]] = {}
    for r in records:
        if r.get("status") != "finished":
            continue
        method, m, k = cell_of(r, "time to a target is per (method, M, K)")
        trajectories.setdefault((m, k, method), []).append(trajectory(r, target.metric, m))
    out: dict[tuple[int, int, str], dict[Link, CellTime]] = {}
    for cell, runs in sorted(trajectories.items()):
        firsts = [t.first_reaching(target) for t in runs]
        reached = [(t, r) for t, r in zip(runs, firsts) if r is not None]
        out[cell] = {}
        for link in links:
            if len(reached) < len(runs):
                out[cell][link] = CellTime(None, None, len(reached), len(runs))
                continue
            seconds = statistics.fmean(t.seconds(r, link, sample_seconds, scale) for t, r in reached)
            out[cell][link] = CellTime(seconds, statistics.fmean(r for _, r in reached), len(runs), len(runs))
    return out, trajectories


def time_table(times: dict[tuple[int, int, str], dict[Link, CellTime]], target: Target, links: Sequence[Link]) -> str:
    """The markdown table: one row per (M, K, method), one column per link; the fastest of each (M, link) in bold."""
    head = "| M | K | method | " + " | ".join(str(link) for link in links) + " |\n"
    head += "|---|---|---|" + "---|" * len(links) + "\n"
    best: dict[tuple[int, Link], float] = {}
    for (m, _, _), per_link in times.items():
        for link, t in per_link.items():
            if t.seconds is not None:
                best[m, link] = min(best.get((m, link), math.inf), t.seconds)
    rows = []
    for (m, k, method), per_link in times.items():
        cells = []
        for link in links:
            t = per_link[link]
            text = t.text()
            cells.append(f"**{text}**" if t.seconds is not None and t.seconds == best.get((m, link)) else text)
        rows.append(f"| {m} | {k} | {method_label(method)} | " + " | ".join(cells) + " |")
    return (
        f"Modelled wall time to {target} (mean over seeds; bold: the fastest at each M and link)\n\n"
        + head
        + "\n".join(rows)
        + "\n"
    )


def plot_times(
    trajectories: dict[tuple[int, int, str], list[Trajectory]],
    target: Target,
    links: Sequence[Link],
    sample_seconds: float,
    scale: float,
    path: str | Path,
) -> None:
    """The target's metric against modelled wall time (log scale), mean over seeds, one panel per (M, link)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted({m for m, _, _ in trajectories})
    methods = sorted({method for _, _, method in trajectories})
    ks = sorted({k for _, k, _ in trajectories})
    colors = {m: METHODS[m].color if m in METHODS else f"C{i % 10}" for i, m in enumerate(methods)}
    styles = ("-", "--", ":", "-.")
    fig, axes = plt.subplots(len(ms), len(links), figsize=(4.2 * len(links), 3.4 * len(ms)), squeeze=False)
    for row, m in enumerate(ms):
        for col, link in enumerate(links):
            ax = axes[row][col]
            for (mm, k, method), runs in sorted(trajectories.items(), key=lambda item: (item[0][2], item[0][1])):
                if mm != m or not runs[0].points:
                    continue
                n = min(len(t.points) for t in runs)
                xs = [
                    statistics.fmean(t.seconds(t.points[i][0], link, sample_seconds, scale) for t in runs)
                    for i in range(n)
                ]
                ys = [statistics.fmean(t.points[i][1] for t in runs) for i in range(n)]
                label = method_label(method) + (f" K={k}" if len(ks) > 1 else "")
                style = styles[ks.index(k) % len(styles)]
                ax.plot(xs, ys, marker=".", markersize=3, color=colors[method], linestyle=style, label=label)
            ax.axhline(target.value, color="grey", linestyle=":", linewidth=1)
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            if target.metric != "test_acc":
                ax.set_yscale("log")
            ax.set_title(f"M = {m}, {link}", fontsize=9)
            ax.set_xlabel("modelled wall time (s)")
            ax.set_ylabel(target.metric)
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def write_time_to_target(
    records: Sequence[dict[str, Any]],
    target: Target,
    links: Sequence[Link],
    sample_seconds: float,
    scale: float,
    out: Path,
    name: str,
    command: str,
) -> list[Path]:
    """``<name>_time_to_target.md`` and ``.png`` in ``out``; returns their paths."""
    times, trajectories = cell_times(records, target, links, sample_seconds, scale)
    if not times:
        raise ValueError("no finished trial: nothing reaches a target")
    paths = [out / f"{name}_time_to_target.png", out / f"{name}_time_to_target.md"]
    plot_times(trajectories, target, links, sample_seconds, scale, paths[0])
    scaled = f"; a model {scale:g} times larger (its bytes)" if scale != 1 else ""
    text = (
        f"# Time to {target}\n\n![time to target]({paths[0].name})\n\n"
        + time_table(times, target, links)
        + f"\nCompute {sample_seconds:g} s a sample a machine{scaled}; communication from the ring model "
        f"(lit_slowcal.link). Made by `{command}`.\n"
    )
    with atomic_write(paths[1], encoding="utf-8") as f:
        f.write(text)
    return paths
