"""The tables, figures and tuned choices of docs/adaptive.md, from the records of sweeps/adaptive/run.sh.

    python sweeps/adaptive/figures.py seeds     # after the seed-1 grid: the seed files at each cell's rate
    python sweeps/adaptive/figures.py curves    # the tuned runs' test curves from their run folders
    python sweeps/adaptive/figures.py           # docs/adaptive.csv, the tables, docs/adaptive/*.png

The rate of a cell (problem, method, M, K) is the one of the grid with the lowest training criterion, never a
test metric: the language model's ``train_loss`` (the machines' loss over the last two rounds): seed 1's whole
grid, then seeds 2 and 3 at the rates within 5 % of its best (the contenders), the rate the contenders' mean over
seeds 1-3 picks; the convex MNIST problem's ``train_objective`` f(x_R), the mean
over seeds 1-3 of the whole grid. ``lr_at_edge`` says whether that rate is the grid's smallest or largest.
The metric reported is the test bits per character (language model) or the excess loss f(x_R) - f* (MNIST), the
mean and standard deviation over the seeds at the chosen rate. ``lr_range_within_5pct`` is the sensitivity: the
ratio of the largest to the smallest rate of the run of consecutive grid rates around the chosen one whose
criterion is within 5 % of the best (1 where only the chosen rate is); the wider, the less tuning a method needs.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "sweeps" / "results"
DOCS = ROOT / "docs"
LM, MNIST = RESULTS / "adaptive_lm.jsonl", RESULTS / "adaptive_mnist.jsonl"
CURVES = RESULTS / "adaptive_lm_curves.jsonl"
SEEDS = ROOT / "sweeps" / "adaptive" / "seeds"
HEADER = "problem,method,M,K,lr,lr_at_edge,n_seeds,metric,metric_mean,metric_std,lr_range_within_5pct".split(",")
LABELS = {
    "adaptive_slowcal": "Adaptive SLowcal",
    "slowcal": "SLowcal-SGD",
    "diloco": "DiLoCo (AdamW inner, Nesterov outer)",
    "local_adamw": "Local-SGD with AdamW",
}
COLORS = {"adaptive_slowcal": "tab:pink", "slowcal": "tab:blue", "diloco": "tab:purple", "local_adamw": "tab:orange"}
PROBLEMS = {  # problem: (records, criterion, metric, tuning seeds)
    "charlm": (LM, "train_loss", "test_bpc", (1,)),
    "mnist": (MNIST, "train_objective", "excess_loss", (1, 2, 3)),
}


def method_of(record: dict) -> str:
    """The method's name, Local-SGD with AdamW told apart from DiLoCo by its plain average."""
    p = record["params"]
    return "local_adamw" if "--model.outer=none" in record["args"] else p["method"]


def load(path: Path) -> dict[tuple, dict[float, dict[int, dict]]]:
    """(method, M, K) -> lr -> seed -> the record's metrics (a diverged trial's as inf)."""
    cells: dict[tuple, dict[float, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        p = r["params"]
        metrics = r["metrics"] if r["status"] == "finished" else {}  # diverged or failed: every value inf
        key = (method_of(r), int(p["num_machines"]), int(p["local_steps"]))
        cells[key][float(p["model.lr"])][int(p["seed_everything"])] = {**metrics, "run_dir": r.get("run_dir")}
    return cells


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if all(math.isfinite(v) for v in values) else math.inf


def choose(grid: dict[float, dict[int, dict]], criterion: str, seeds: tuple[int, ...]) -> dict:
    """The cell's choice: the rate, whether at the grid's edge, and the sensitivity."""
    rates = sorted(lr for lr, runs in grid.items() if all(s in runs for s in seeds))
    score = {lr: mean([grid[lr][s].get(criterion, math.inf) for s in seeds]) for lr in rates}
    best = min(rates, key=lambda lr: score[lr])
    i = lo = hi = rates.index(best)
    while lo > 0 and score[rates[lo - 1]] <= 1.05 * score[best]:
        lo -= 1
    while hi < len(rates) - 1 and score[rates[hi + 1]] <= 1.05 * score[best]:
        hi += 1
    return {
        "lr": best,
        "at_edge": "yes" if i in (0, len(rates) - 1) else "no",
        "range": rates[hi] / rates[lo],
        "contenders": rates[lo : hi + 1],
        "scores": score,
    }


def choices() -> list[dict]:
    rows = []
    for problem, (path, criterion, metric, seeds) in PROBLEMS.items():
        if not path.exists():
            continue
        for (method, m, k), grid in sorted(load(path).items()):
            c = choose(grid, criterion, seeds)
            if problem == "charlm":  # among seed 1's contenders, the lowest mean over the seeds they all ran
                ran = [lr for lr in c["contenders"] if all(s in grid[lr] for s in (1, 2, 3))]
                if ran:
                    c["lr"] = min(ran, key=lambda lr: mean([grid[lr][s].get(criterion, math.inf) for s in (1, 2, 3)]))
            runs = grid[c["lr"]]
            values = [runs[s].get(metric, math.inf) for s in sorted(runs)]
            rows.append({
                "problem": problem, "method": method, "M": m, "K": k, "lr": c["lr"], "lr_at_edge": c["at_edge"],
                "n_seeds": len(values), "metric": metric, "metric_mean": mean(values),
                "metric_std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "lr_range_within_5pct": round(c["range"], 2), "scores": c["scores"], "runs": runs,
                "contenders": c["contenders"],
            })  # fmt: skip
    return rows


def write_seed_files(rows: list[dict]) -> None:
    """For each language-model cell, a sweep of seeds 2 and 3 at its seed-1 rate (sweeps/adaptive/seeds/)."""
    SEEDS.mkdir(exist_ok=True)
    for row in (r for r in rows if r["problem"] == "charlm"):
        source = ROOT / "sweeps" / "adaptive" / f"lm_{row['method']}.yaml"
        text = source.read_text()
        head, _, rest = text.partition("parameters:\n")
        params, _, command = rest.partition("command:\n")
        lines = [ln for ln in params.splitlines()]
        out, skip = [], False
        for ln in lines:
            if ln.startswith("  local_steps:") or ln.startswith("  seed_everything:") or ln.startswith("  model.lr:"):
                skip = True
                continue
            if skip and ln.startswith("    "):
                continue
            skip = False
            out.append(ln)
        out += [
            f"  local_steps:\n    values: [{row['K']}]",
            "  seed_everything:\n    values: [2, 3]",
            f"  model.lr:\n    values: [{', '.join(f'{lr:g}' for lr in row['contenders'])}]",
        ]
        note = (
            f"# Generated by sweeps/adaptive/figures.py seeds: seeds 2 and 3 of {row['method']} at K = {row['K']},"
            " at the rates whose seed-1 train_loss is within 5 % of the grid's best (the chosen one among them by the\n"
            "# mean of seeds 1-3).\n"
        )
        name = SEEDS / f"{row['method']}_K{row['K']}.yaml"
        name.write_text(note + head + "parameters:\n" + "\n".join(out) + "\ncommand:\n" + command)
        print(name.relative_to(ROOT))


def write_curves(rows: list[dict]) -> None:
    """The tuned language-model runs' test curves (round, test_bpc) and bytes a round, from their metrics.csv."""
    with CURVES.open("w") as f:
        for row in (r for r in rows if r["problem"] == "charlm"):
            for seed, metrics in sorted(row["runs"].items()):
                path = ROOT / metrics["run_dir"] / "metrics.csv"
                with path.open(newline="") as g:
                    table = list(csv.DictReader(g))
                points = sorted({(float(t["round"]), float(t["test_bpc"])) for t in table if t.get("test_bpc")})
                per_round = metrics["ring_bytes_per_machine"] / metrics["round"]
                f.write(json.dumps({
                    "method": row["method"], "K": row["K"], "lr": row["lr"], "seed": seed,
                    "bytes_per_round": per_round, "rounds": [p[0] for p in points], "test_bpc": [p[1] for p in points],
                }) + "\n")  # fmt: skip
    print(CURVES.relative_to(ROOT))


def table(rows: list[dict]) -> str:
    out = [
        "| problem | method | M | K | rate | at edge | seeds | metric | mean ± std | rates within 5 % |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['problem']} | {LABELS[r['method']]} | {r['M']} | {r['K']} | {r['lr']:g} | {r['lr_at_edge']} | "
            f"{r['n_seeds']} | {r['metric']} | {r['metric_mean']:.4f} ± {r['metric_std']:.4f} | "
            f"{r['lr_range_within_5pct']:g}x |"
        )
    return "\n".join(out)


def figures(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    out = DOCS / "adaptive"
    out.mkdir(exist_ok=True)
    if CURVES.exists():
        curves = [json.loads(line) for line in CURVES.read_text().splitlines() if line.strip()]
        ks = sorted({c["K"] for c in curves})
        fig, axes = plt.subplots(2, len(ks), figsize=(4.2 * len(ks), 7), squeeze=False)
        for j, k in enumerate(ks):
            for method in LABELS:
                runs = [c for c in curves if c["K"] == k and c["method"] == method]
                if not runs:
                    continue
                rounds = runs[0]["rounds"]
                bpc = [statistics.fmean(c["test_bpc"][i] for c in runs) for i in range(len(rounds))]
                label = f"{LABELS[method]} (lr {runs[0]['lr']:g})"
                axes[0][j].plot(rounds, bpc, color=COLORS[method], label=label)
                mb = [r * runs[0]["bytes_per_round"] / 1e6 for r in rounds]
                axes[1][j].plot(mb, bpc, color=COLORS[method], label=label)
            axes[0][j].set_title(f"M = 8, K = {k}", fontsize=10)
            axes[0][j].set_xlabel("rounds")
            axes[1][j].set_xlabel("MB sent per machine (ring)")
            axes[1][j].set_xscale("log")
            axes[1][j].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            for ax in (axes[0][j], axes[1][j]):
                ax.set_ylabel("test bits per character")
                ax.set_ylim(top=4.0)
                ax.grid(alpha=0.3)
            axes[0][j].legend(fontsize=7)
        fig.suptitle(
            "The character transformer on StdlibChars: mean of 3 seeds at each method's tuned rate", fontsize=10
        )
        fig.tight_layout()
        fig.savefig(out / "lm_bpc.png", dpi=110)
        plt.close(fig)
    cells = sorted({(r["problem"], r["M"], r["K"]) for r in rows})
    columns = max(sum(c[0] == p for c in cells) for p in PROBLEMS)
    fig, axes = plt.subplots(len(PROBLEMS), columns, figsize=(3.3 * columns, 6.6), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for row_index, problem in enumerate(PROBLEMS):
        for ax, (_, m, k) in zip(axes[row_index], [c for c in cells if c[0] == problem]):
            ax.set_visible(True)
            for r in (r for r in rows if (r["problem"], r["M"], r["K"]) == (problem, m, k)):
                rates = sorted(lr for lr, v in r["scores"].items() if math.isfinite(v))
                best = r["scores"][r["lr"]]
                ax.plot([lr / r["lr"] for lr in rates], [r["scores"][lr] / best for lr in rates], "o-", ms=3,
                        color=COLORS[r["method"]], label=f"{LABELS[r['method']]} ({r['lr']:g})")  # fmt: skip
            ax.axhline(1.05, color="grey", lw=0.8, ls="--")
            ax.set_xscale("log")
            ax.set_ylim(0.98, 1.3)
            ax.set_title(f"{problem}, M = {m}, K = {k}", fontsize=9)
            ax.set_xlabel("rate / chosen rate", fontsize=8)
            ax.set_ylabel(f"{PROBLEMS[problem][1]} / its best", fontsize=8)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle("Sensitivity: each method's criterion against its rate, both relative to its chosen one (dashed: 5 %)",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out / "sensitivity.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", nargs="?", choices=("seeds", "curves", "docs"), default="docs")
    args = parser.parse_args()
    rows = choices()
    if args.step == "seeds":
        write_seed_files(rows)
        return
    if args.step == "curves":
        write_curves(rows)
        return
    with (DOCS / "adaptive.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=HEADER, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    print(table(rows))
    figures(rows)


if __name__ == "__main__":
    main()
