"""Time stacked trials (``sweep --stack``) against one trial at a time, and check they give the same results.

Three measurements, all in this process (MNIST decoded once, one torch thread, ``--wandb=false``,
run folders and results files in a temporary folder):

1. A subset of the paper grid (``sweeps/paper.yaml``; ``--subset`` groups of three seeds, default
   the M = 16, K = 16 group of each method: 9 runs) one at a time through the runner
   (``run_trial``, Lightning), then the same trials stacked; the ratio of the two wall times, and
   whether every metric of every trial is the same.
2. The 30-run learning-rate grid (``sweeps/lr.yaml``) stacked, compared with
   ``sweeps/results/lr.jsonl`` (written one at a time).
3. With ``--full``: the whole 135-run paper grid stacked, compared with ``sweeps/results/paper.jsonl``
   (written one at a time by the runner).

Peak memory is the process's peak resident set (``ru_maxrss``), MNIST and the imports included.
Run on a shared machine: the load average is printed with the figures.

    python benchmarks/bench_stacked.py [--full] [--subset 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lit_slowcal.experiments import sweep as sw  # noqa: E402
from lit_slowcal.experiments.sweep.trials import trial_key  # noqa: E402


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load(path: Path) -> dict[str, dict]:
    return {trial_key(r["params"]): r for r in map(json.loads, path.read_text().splitlines())}


def compare(results: Path, reference: Path) -> tuple[int, int]:
    """(trials whose status and every metric equal the reference's, trials compared)."""
    got, ref = load(results), load(reference)
    same = sum(r["status"] == ref[k]["status"] and r["metrics"] == ref[k]["metrics"] for k, r in got.items() if k in ref)
    return same, len(got)


def sweep_file(tmp: Path, source: Path, keep: dict | None = None) -> Path:
    """``source`` with its run folders under ``tmp`` (and its parameters narrowed to ``keep``)."""
    import yaml

    cfg = yaml.safe_load(source.read_text())
    cfg["command"].insert(cfg["command"].index("${args}"), f"--run_dir={tmp / 'runs'}")
    for name, values in (keep or {}).items():
        cfg["parameters"][name] = {"values": values}
    path = tmp / source.name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_sweep(path: Path, results: Path, *extra: str) -> float:
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = sw.main([str(path), "--results", str(results), "--wandb=false", *extra])
    assert code == 0, f"sweep {path} exited with {code}"
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="also the whole 135-run paper grid stacked")
    p.add_argument("--subset", type=int, default=16, help="K of the one-at-a-time subset (M = 16, all methods, 3 seeds)")
    opts = p.parse_args()
    os.chdir(ROOT)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        keep = {"num_machines": [16], "local_steps": [opts.subset]}
        sub = sweep_file(tmp, ROOT / "sweeps" / "paper.yaml", keep)
        alone = run_sweep(sub, tmp / "alone.jsonl")
        stacked = run_sweep(sub, tmp / "stacked.jsonl", "--stack")
        same, n = compare(tmp / "stacked.jsonl", tmp / "alone.jsonl")
        print(
            f"paper grid, M=16 K={opts.subset}, {n} runs: one at a time {alone:.1f} s, stacked {stacked:.1f} s: "
            f"{alone / stacked:.2f}x; identical metrics {same}/{n}"
        )
        lr = run_sweep(sweep_file(tmp, ROOT / "sweeps" / "lr.yaml"), tmp / "lr.jsonl", "--stack")
        same, n = compare(tmp / "lr.jsonl", ROOT / "sweeps" / "results" / "lr.jsonl")
        print(f"lr grid, {n} runs stacked: {lr:.1f} s; identical to sweeps/results/lr.jsonl: {same}/{n}")
        if opts.full:
            full = run_sweep(sweep_file(tmp, ROOT / "sweeps" / "paper.yaml"), tmp / "paper.jsonl", "--stack")
            same, n = compare(tmp / "paper.jsonl", ROOT / "sweeps" / "results" / "paper.jsonl")
            print(f"paper grid, {n} runs stacked: {full:.1f} s; identical to sweeps/results/paper.jsonl: {same}/{n}")
    print(f"peak memory (resident, whole process): {peak_mib():.0f} MiB; load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
