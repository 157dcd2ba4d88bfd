"""Time to accuracy measured on a shaped link: the app's runs on P processes, each in its own network namespace.

    python benchmarks/bench_time_to_accuracy.py --target test_acc=0.85 --out docs/time_to_accuracy/shaped_cnn \
        ddp=sweeps/time_to_accuracy/cnn_ddp.yaml slowcal=sweeps/time_to_accuracy/cnn_slowcal.yaml \
        'diloco_int8=sweeps/time_to_accuracy/cnn_diloco.yaml --compression=int8'        # as root

Each run is a sweep file's trial (its command and one value of each parameter: ``--seed``'s seed, the first
value of any other list; extra arguments after the path), trained by ``python -m lit_slowcal fit`` on ``--procs``
processes (the run's M machines spread over them), each process a node of its own (``--trainer.num_nodes=P``) in a
namespace of ``benchmarks/shaped_link.py``, its link shaped at ``--rate``. The same run goes twice: on the shaped
link, and on the same namespaces unshaped (``--rate none``: the compute and the CPU's part of each
synchronisation). At every evaluation the app logs ``train_s``, the seconds measured in the rounds so far (the
slowest process's), next to the metric; so for each run:

- **measured s to the target**: ``train_s`` at the first evaluation that reaches it, on the shaped link;
- **compute s**: the unshaped run's ``train_s`` there, and the **utilisation**, compute s / measured s;
- **modelled s**: compute s plus the ring model's seconds of the rounds so far at ``--rate`` and ``--hop-latency``,
  what docs/time_to_accuracy.md's tables add. The app counts a ring of its M machines (``ring_bytes_per_machine``,
  ``ring_hops``); the wire carries a ring of the P processes (each process's machines average in memory), so the
  counts are taken to P: bytes x ((P - 1) / P) / ((M - 1) / M), hops x (P - 1) / (M - 1) (every round's
  collectives, all-reduce or a code's two stages, scale so);
- **MB sent** by a process up to there, on that ring of P.

Run it from the repository root (the sweep files' paths are the repository's). It writes ``<out>.md`` (the table), ``<out>.csv`` (every evaluation of every run) and ``<out>.png`` (the metric
against measured seconds, one line per run), and prints the table. Where namespaces cannot be made it says why in
one line and exits 2 (``shaped_link.refusal``).
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shaped_link import Plan, Refused, ShapedLink, refusal  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: Each process is a node of one device: the app's run over P processes, started by the harness, not by Lightning.
NODE = 'NODE_RANK=$RANK LOCAL_RANK=0 exec "$@"'


def rate_bits(rate: str) -> float:
    """A tc rate (``100mbit``, ``1gbit``, ``500kbit``) in bits a second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"Invalid rate: {rate!r} (a tc rate such as 100mbit or 1gbit)")


def on_processes(row: dict[str, float], machines: int, procs: int) -> tuple[float, float]:
    """(bytes, hops) a process sent on the ring of ``procs`` processes, from the app's counts on its ring of
    ``machines`` machines (``ring_bytes_per_machine``, ``ring_hops``; both scale by the ring's size)."""
    if machines == 1:
        return 0.0, 0.0
    share = ((procs - 1) / procs) / ((machines - 1) / machines)
    return row["ring_bytes_per_machine"] * share, row["ring_hops"] * (procs - 1) / (machines - 1)


def trial_command(spec: str, seed: int) -> tuple[str, list[str]]:
    """``label=path.yaml [extra args]``: the label, and the ``fit`` arguments of the sweep file's trial (its
    command's own arguments, then one value of each parameter: ``seed_everything`` = ``seed``, else the first)."""
    label, _, rest = spec.partition("=")
    if not rest:
        raise ValueError(f"Invalid run: {spec!r} (label=sweep.yaml [extra arguments])")
    path, *extra = shlex.split(rest)
    sweep = yaml.safe_load((ROOT / path).read_text())
    command = [a for a in sweep["command"] if a not in ("${env}", "${args}")]
    fit = command[command.index("fit") + 1 :]
    for name, values in sweep["parameters"].items():
        value = seed if name == "seed_everything" else values.get("value", (values.get("values") or [None])[0])
        fit.append(f"--{name}={value}")
    return label, [*fit, *extra]


def evaluations(run_dir: Path) -> list[dict[str, float]]:
    """The run's evaluation rows (metric, ``round``, ``train_s``) and, from its training rows, what was sent by
    each evaluation: ``ring_bytes_per_machine`` and every ``comm_s_*`` at the last training row at or before it
    (the training rows are logged at the evaluations' rounds: ``--trainer.log_every_n_steps`` = ``--eval_every``)."""
    (metrics,) = run_dir.glob("*/version_*/metrics.csv")
    with open(metrics, newline="") as f:
        rows = list(csv.DictReader(f))
    sent: dict[float, dict[str, float]] = {}
    for r in rows:
        if r.get("ring_bytes_per_machine"):
            sent[float(r["round"])] = {k: float(r[k]) for k in ("ring_bytes_per_machine", "ring_hops")}
    out = []
    for r in rows:
        if r.get("train_s"):
            done = max((k for k in sent if k <= float(r["round"])), default=None)
            out.append({**{k: float(v) for k, v in r.items() if v}, **(sent[done] if done is not None else {})})
    return out


def run(plan: Plan, args: list[str], run_dir: Path, timeout: float) -> list[dict[str, float]]:
    """``python -m lit_slowcal fit <args>`` on the plan's namespaces, its logs under ``run_dir``: its evaluations."""
    nodes = [f"--trainer.num_nodes={plan.procs}", "--trainer.devices=1", "--trainer.accelerator=cpu"]
    argv = ["sh", "-c", NODE, "sh", sys.executable, "-m", "lit_slowcal", "fit", *args, *nodes, f"--run_dir={run_dir}"]
    with ShapedLink(plan) as net:
        codes = net.run(argv, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"})
    if any(codes):
        raise RuntimeError(f"the run failed (exit statuses by rank: {codes}): {' '.join(args)}")
    return evaluations(run_dir)


def first_reaching(rows: list[dict[str, float]], metric: str, target: float) -> Optional[dict[str, float]]:
    """The first evaluation whose ``metric`` reaches ``target`` (accuracy: at least; a loss: at most)."""
    higher = metric.endswith("acc")
    return next((r for r in rows if metric in r and (r[metric] >= target if higher else r[metric] <= target)), None)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="label=sweep.yaml [extra fit arguments], one a run")
    p.add_argument("--target", required=True, help="metric=value, e.g. test_acc=0.85 or test_bpc=2.5")
    p.add_argument("--procs", type=int, default=2, help="processes, one a namespace (default 2)")
    p.add_argument("--rate", default="100mbit", help="each link's rate, as tc writes it (default 100mbit)")
    p.add_argument("--burst", default="256kb", help="tbf's burst (default 256kb)")
    p.add_argument(
        "--hop-latency", type=float, default=2e-4, help="the model's latency a hop, s (measured: 1.4-2.2e-4)"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800, help="seconds a run may take (default 1800)")
    p.add_argument("--out", type=Path, default=None, help="<out>.md, .csv and .png (default: print only)")
    p.add_argument("--keep", type=Path, default=None, help="keep the runs' logs under this folder")
    p.add_argument("--report-only", action="store_true", help="run nothing: the table of the runs kept under --keep")
    a = p.parse_args(argv)
    metric, _, value = a.target.partition("=")
    target = float(value)
    why = None if a.report_only else refusal()
    if why is not None:
        print(f"bench_time_to_accuracy: refused: {why}", file=sys.stderr)
        return 2
    base = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="tta-"))
    results: list[dict[str, Any]] = []
    try:
        for spec in a.runs:
            label, fit = trial_command(spec, a.seed)
            every = next((x.split("=", 1)[1] for x in reversed(fit) if x.startswith("--eval_every=")), "10")
            # the training rows (what was sent) at the evaluations' rounds, no more often: logging costs time
            fit += [f"--trainer.log_every_n_steps={every}", "--wandb=false", "--checkpoint_every=0"]
            print(f"{label}: {' '.join(fit)}", flush=True)
            if a.report_only:
                shaped, free = evaluations(base / label / "shaped"), evaluations(base / label / "unshaped")
            else:
                shaped = run(Plan(a.procs, a.rate, burst=a.burst), fit, base / label / "shaped", a.timeout)
                free = run(Plan(a.procs, None), fit, base / label / "unshaped", a.timeout)
            machines = int(next(x.split("=", 1)[1] for x in reversed(fit) if x.startswith("--num_machines=")))
            results.append({"label": label, "machines": machines, "shaped": shaped, "unshaped": free})
    except (Refused, RuntimeError, TimeoutError) as e:
        print(f"bench_time_to_accuracy: {e}", file=sys.stderr)
        return 1
    lines = table(results, metric, target, a)
    print("\n".join(lines))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        write_csv(results, metric, a.out.with_suffix(".csv"))
        figure(results, metric, target, a.out.with_suffix(".png"), a)
    return 0


def table(results: list[dict[str, Any]], metric: str, target: float, a: argparse.Namespace) -> list[str]:
    lines = [
        f"{metric} {target:g}, P = {a.procs} processes, {a.rate} links (tbf burst {a.burst}), seed {a.seed}:",
        "",
        "| run | evaluations | round at target | measured s | compute s (unshaped) | utilisation | modelled s | "
        "measured / modelled | MB a process |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        hit = first_reaching(r["shaped"], metric, target)
        if hit is None:
            pick = max if metric.endswith("acc") else min
            best = pick((e[metric] for e in r["shaped"] if metric in e), default=float("nan"))
            lines.append(f"| {r['label']} | {len(r['shaped'])} | not reached (best {best:.4f}) | | | | | | |")
            continue
        free = next(e for e in r["unshaped"] if e["round"] == hit["round"])
        sent, hops = on_processes(hit, r["machines"], a.procs)
        modelled = free["train_s"] + hops * a.hop_latency + sent * 8 / rate_bits(a.rate)
        lines.append(
            f"| {r['label']} | {len(r['shaped'])} | {hit['round']:g} | {hit['train_s']:.2f} | {free['train_s']:.2f} | "
            f"{free['train_s'] / hit['train_s']:.2f} | {modelled:.2f} | {hit['train_s'] / modelled:.2f} | "
            f"{sent / 1e6:.3f} |"
        )
    return lines


def write_csv(results: list[dict[str, Any]], metric: str, path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "link", "round", "train_s", metric, "test_loss", "ring_bytes_per_machine"])
        for r in results:
            for which in ("shaped", "unshaped"):
                for e in r[which]:
                    w.writerow([r["label"], which, e["round"], e["train_s"], e.get(metric), e.get("test_loss"),
                                e.get("ring_bytes_per_machine")])  # fmt: skip


def figure(results: list[dict[str, Any]], metric: str, target: float, path: Path, a: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        rows = r["shaped"]
        seconds = [e["train_s"] for e in rows]
        (line,) = axes[0].plot(seconds, [e.get("test_loss") for e in rows], marker=".", label=r["label"])
        axes[1].plot(seconds, [e.get(metric) for e in rows], marker=".", color=line.get_color(), label=r["label"])
    axes[1].axhline(target, color="grey", ls=":", lw=1)
    for ax, name in zip(axes, ("test loss", metric)):
        ax.set_xlabel(f"measured seconds (P = {a.procs}, {a.rate} links)")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
