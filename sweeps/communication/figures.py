"""The tables and figures of docs/communication.md, from the records of sweeps/communication/run.sh.

    python sweeps/communication/figures.py [--out docs/communication]

Each cell (method, compression, error feedback, overlap) is the mean over its seeds of the final test
accuracy, test loss and excess loss, and of what one machine sent on the ring (``ring_bytes_per_machine``).
The modelled time at 1 Gbit/s and 10 ms is the link model's (``lit_slowcal.link``): compute (the run's
measured seconds a step times its steps) plus the communication seconds, from the ring bytes and latencies
the run logged. An overlapped round's seconds are hidden behind the tau steps that follow it, up to tau
steps' compute: the time counts ``max(0, round - tau x step)`` for each scheduled round (those the
schedule starts: steps / (K / F)), and the blocking ones (the rounds closed at evaluations and at the end)
in full. A fragment's round sends 1 / F of the model (the fragments hold equal bytes to within a tensor).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lit_slowcal.link import Link, LinkCounts, hidden_seconds  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LINK = Link.parse("1Gbit/s,10ms")
LABELS = {"slowcal": "SLowcal-SGD", "local_sgd": "Local-SGD", "diloco": "DiLoCo"}


def load(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["status"] == "finished"]


def variant(params: dict) -> str:
    """The communication a run used: float32, bf16 / int8 with or without error feedback, or overlap."""
    if params.get("overlap_delay", 0):
        return f"overlap tau={params['overlap_delay']} F={params.get('fragments', 1)}"
    comp = params.get("compression")
    if comp is None:
        return "float32"
    return f"{comp}" + ("" if params.get("error_feedback", True) else " no EF")


def modelled_seconds(r: dict) -> float:
    """Compute plus the communication the link model leaves visible (module docstring)."""
    p, m = r["params"], r["metrics"]
    M, K = p["num_machines"], p["local_steps"]
    steps, step_s = m["optimizer_steps"], r["step_seconds"]
    comm = LINK.latency * m["ring_hops"] + m["ring_bytes_per_machine"] / LINK.bandwidth
    tau, F = p.get("overlap_delay", 0), p.get("fragments", 1)
    if tau:
        syncs = m["ring_hops"] / (2 * (M - 1))
        scheduled = steps // (K // F)
        blocking = syncs - scheduled
        full = m["ring_bytes_per_machine"] / (scheduled / F + blocking)  # a whole model's ring bytes
        overlapped = LinkCounts(syncs=scheduled, ring_bytes=scheduled * full / F, ring_hops=scheduled * 2 * (M - 1))
        comm -= hidden_seconds(overlapped, LINK, tau * step_s)
    return steps * step_s + comm


def cells(rows: list[dict]) -> dict[tuple, dict[str, float]]:
    """Mean over seeds per (method, M, K, variant)."""
    grouped: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        p = r["params"]
        grouped[(p["method"], p["num_machines"], p["local_steps"], variant(p))].append(r)
    out = {}
    for key, rs in grouped.items():
        metrics = {
            k: statistics.fmean(r["metrics"][k] for r in rs)
            for k in ("test_acc", "test_loss", "excess_loss", "ring_bytes_per_machine")
            if all(k in r["metrics"] for r in rs)
        }
        metrics["seconds"] = statistics.fmean(modelled_seconds(r) for r in rs)
        metrics["seeds"] = len(rs)
        out[key] = metrics
    return out


def table(found: dict[tuple, dict[str, float]], where: tuple) -> list[str]:
    """A markdown table of the cells at ``where`` = (M, K), with bytes relative to the float32 run of each method."""
    lines = [
        "| method | communication | seeds | test accuracy | excess loss | MB a machine | x float32's bytes | modelled time at 1 Gbit/s, 10 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (method, M, K, var), c in sorted(found.items(), key=lambda kv: (kv[0][0], kv[0][3] != "float32", kv[0][3])):
        if (M, K) != where:
            continue
        base = found.get((method, M, K, "float32"), {}).get("ring_bytes_per_machine")
        ratio = f"{c['ring_bytes_per_machine'] / base:.3f}" if base else ""
        excess = f"{c['excess_loss']:.4f}" if "excess_loss" in c else ""
        lines.append(
            f"| {LABELS.get(method, method)} | {var} | {c['seeds']} | {c['test_acc']:.4f} | {excess} | "
            f"{c['ring_bytes_per_machine'] / 1e6:.2f} | {ratio} | {c['seconds']:.1f} s |"
        )
    return lines


def figure(found: dict, where: tuple, metrics: list[tuple[str, str]], xs: list[tuple[str, str]], path: Path) -> None:
    fig, axes = plt.subplots(len(metrics), len(xs), figsize=(5.5 * len(xs), 3.8 * len(metrics)), squeeze=False)
    markers = {"float32": "o", "bf16": "s", "bf16 no EF": "D", "int8": "^", "int8 no EF": "v",
               "overlap tau=1 F=1": "P", "overlap tau=1 F=4": "*"}  # fmt: skip
    for (method, M, K, var), c in sorted(found.items()):
        if (M, K) != where:
            continue
        color = {"slowcal": "C0", "local_sgd": "C1", "diloco": "C2"}[method]
        for i, (metric, mlabel) in enumerate(metrics):
            for j, (x, xlabel) in enumerate(xs):
                ax = axes[i][j]
                ax.scatter(
                    c[x] / (1e6 if x == "ring_bytes_per_machine" else 1), c[metric], color=color,
                    marker=markers.get(var, "*"), s=60, label=f"{LABELS[method]}, {var}",
                )  # fmt: skip
                ax.set_xscale("log")
                ax.set_xlabel(xlabel)
                ax.set_ylabel(mlabel)
                ax.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(
        f"M = {where[0]}, K = {where[1]}: final metrics against\nwhat a machine sent (mean of the seeds)", fontsize=10
    )
    fig.tight_layout(rect=(0, 0.12, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "communication"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mnist = cells(load(ROOT / "sweeps" / "results" / "communication_mnist.jsonl"))
    cnn_path = ROOT / "sweeps" / "results" / "communication_cnn.jsonl"
    cnn = cells(load(cnn_path)) if cnn_path.exists() else {}
    mb = ("ring_bytes_per_machine", "MB a machine sent (ring)")
    for title, found, where in (
        ("The main job (configs/slowcal.yaml)", mnist, (16, 16)),
        ("The paper's problem, weight decay 1e-4, tuned rates", mnist, (64, 64)),
        ("The small CNN", cnn, (16, 16)),
    ):
        print(f"{title}, M = {where[0]}, K = {where[1]}\n")
        print("\n".join(table(found, where)) + "\n")
    figure(
        mnist,
        (64, 64),
        [("test_acc", "test accuracy"), ("excess_loss", "excess loss")],
        [mb],
        out / "mnist_m64_k64.png",
    )
    if cnn:
        seconds = ("seconds", "modelled seconds at 1 Gbit/s, 10 ms")
        figure(cnn, (16, 16), [("test_acc", "test accuracy")], [mb, seconds], out / "cnn.png")


if __name__ == "__main__":
    main()
