"""Time stacked trials (``sweep --stack``) against one trial at a time, and check they give the same results.

The measurements, all in this process (MNIST decoded once, one torch thread, ``--wandb=false``,
run folders and results files in a temporary folder):

1. A subset of the paper grid (``sweeps/paper.yaml``; ``--subset K``: the M = 16 group of that K,
   default 16, every method, three seeds: 9 runs) one at a time through the runner (``run_trial``,
   Lightning), then the same trials stacked; the ratio of the two wall times, and whether every
   metric of every trial is the same (``--no-alone`` leaves this part out).
2. The 30-run learning-rate grid (``sweeps/lr.yaml``) stacked, and its 18-run part of the paper's
   three methods (slowcal, local_sgd, minibatch_sgd), compared with ``sweeps/results/lr.jsonl``
   (written one at a time).
3. With ``--full``: the whole 135-run paper grid stacked (``--machines 16 32`` keeps a part of it),
   compared with ``sweeps/results/paper.jsonl`` (written one at a time by the runner). With
   ``--full-alone`` also the same grid one trial at a time through the runner (same ``--workers``), in
   this process too: the ratio of the two wall times, and whether every metric of every trial is the same.

``--device cuda`` runs the stacked trials on the first CUDA device (``--trainer.accelerator=gpu``;
IEEE float32 matmuls, no TF32): the wall times end with ``torch.cuda.synchronize()``, the peak GPU
memory is ``torch.cuda.max_memory_allocated()``, and the results are compared with the CPU's files
to a relative tolerance (the largest relative difference of each metric is printed): float32 sums
run in another order there. ``--light`` adds ``--objective=false --diagnostics=false`` to every
trial (the comparisons then cover the metrics both sides have). Peak host memory is the process's
peak resident set (``ru_maxrss``), MNIST and the imports included. Run on a shared machine: the
load average is printed with the figures.

``--workers N`` runs every sweep of the benchmark (the one-at-a-time subset too) with ``sweep --workers N``: N
processes, one torch thread each; the peak memory is then also given for the largest worker.

    python benchmarks/bench_stacked.py [--full [--full-alone]] [--subset 16] [--device cuda] [--light] [--no-alone] [--workers 2]
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


def compare(results: Path, reference: Path) -> tuple[int, int, dict[str, float]]:
    """(trials whose status and every metric equal the reference's, trials compared, the largest relative
    difference of each metric). Metrics that only one side has (``--light``) are left out."""
    got, ref = load(results), load(reference)
    same, worst = 0, {}
    for k, r in got.items():
        if k not in ref:
            continue
        theirs = ref[k]["metrics"]
        common = [m for m in r["metrics"] if m in theirs]
        same += r["status"] == ref[k]["status"] and all(r["metrics"][m] == theirs[m] for m in common)
        for m in common:
            a, b = r["metrics"][m], theirs[m]
            if a is not None and b is not None:
                worst[m] = max(worst.get(m, 0.0), abs(a - b) / max(abs(b), 1e-30))
    return same, len(got), worst


def sweep_file(tmp: Path, source: Path, keep: dict | None = None, extra: tuple[str, ...] = (), name: str = "") -> Path:
    """``source`` with its run folders under ``tmp``, ``extra`` arguments for every trial, and its parameters
    narrowed to ``keep``."""
    import yaml

    cfg = yaml.safe_load(source.read_text())
    at = cfg["command"].index("${args}")
    cfg["command"][at:at] = [f"--run_dir={tmp / 'runs'}", *extra]
    for key, values in (keep or {}).items():
        cfg["parameters"][key] = {"values": values}
    path = tmp / (name or source.name)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_sweep(path: Path, results: Path, *extra: str, device: str = "cpu", workers: int = 1) -> float:
    sync(device)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = sw.main([str(path), "--results", str(results), "--wandb=false", f"--workers={workers}", *extra])
    sync(device)
    assert code == 0, f"sweep {path} exited with {code}"
    return time.perf_counter() - start


def differences(worst: dict[str, float]) -> str:
    """The largest relative differences, the nonzero ones."""
    nonzero = {k: v for k, v in worst.items() if v}
    return ", ".join(f"{k} {v:.1e}" for k, v in sorted(nonzero.items())) or "none"


def print_ratio(label: str, alone: float, stacked: float, stacked_results: Path, alone_results: Path) -> None:
    """One line: the wall times one at a time and stacked, their ratio, and whether every metric is the same."""
    same, n, worst = compare(stacked_results, alone_results)
    print(f"{label}, {n} runs: one at a time (cpu) {alone:.1f} s, stacked {stacked:.1f} s: {alone / stacked:.2f}x; "
          f"identical metrics {same}/{n}; largest relative differences: {differences(worst)}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="also the 135-run paper grid stacked")
    p.add_argument(
        "--full-alone", action="store_true", help="with --full: also that grid one trial at a time, and the ratio"
    )
    p.add_argument(
        "--machines", type=int, nargs="+", default=[16, 32, 64], help="with --full: the M values of the grid to run"
    )
    p.add_argument(
        "--subset", type=int, default=16, help="K of the one-at-a-time subset (M = 16, all methods, 3 seeds)"
    )
    p.add_argument("--no-alone", action="store_true", help="leave out the one-at-a-time subset")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the stacked trials train")
    p.add_argument("--light", action="store_true", help="every trial with --objective=false --diagnostics=false")
    p.add_argument(
        "--workers", type=int, default=1, help="sweep --workers: processes running groups (or trials) at once"
    )
    opts = p.parse_args()
    os.chdir(ROOT)
    torch.set_num_threads(1)
    extra = ("--objective=false", "--diagnostics=false") if opts.light else ()
    stacked_extra = extra + (("--trainer.accelerator=gpu",) if opts.device == "cuda" else ())
    if opts.device == "cuda":
        torch.set_float32_matmul_precision("highest")
        torch.cuda.reset_peak_memory_stats()
        print(f"device {torch.cuda.get_device_name()}")
    print(f"torch {torch.__version__}, 1 thread, {opts.workers} worker(s), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"stacked on {opts.device}{' (light: no objective, no diagnostics)' if opts.light else ''}")  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if not opts.no_alone:
            keep = {"num_machines": [16], "local_steps": [opts.subset]}
            one_at_a_time = sweep_file(tmp, ROOT / "sweeps" / "paper.yaml", keep, extra, "alone.yaml")
            alone = run_sweep(one_at_a_time, tmp / "alone.jsonl", "--no-stack", workers=opts.workers)
            sub = sweep_file(tmp, ROOT / "sweeps" / "paper.yaml", keep, stacked_extra, "sub.yaml")
            stacked = run_sweep(sub, tmp / "stacked.jsonl", "--stack", device=opts.device, workers=opts.workers)
            print_ratio(f"paper grid, M=16 K={opts.subset}", alone, stacked, tmp / "stacked.jsonl", tmp / "alone.jsonl")
        reference = ROOT / "sweeps" / "results" / "lr.jsonl"
        for label, keep in (
            ("lr grid", None),
            ("lr grid, 3 methods", {"method": ["slowcal", "local_sgd", "minibatch_sgd"]}),
        ):
            name = label.replace(" ", "_").replace(",", "") + ".yaml"
            path = sweep_file(tmp, ROOT / "sweeps" / "lr.yaml", keep, stacked_extra, name)
            results = tmp / f"{path.stem}.jsonl"
            seconds = run_sweep(path, results, "--stack", device=opts.device, workers=opts.workers)
            same, n, worst = compare(results, reference)
            print(f"{label}, {n} runs stacked: {seconds:.1f} s; identical to sweeps/results/lr.jsonl: {same}/{n}; "
                  f"largest relative differences: {differences(worst)}")  # fmt: skip
        if opts.full:
            keep = {"num_machines": opts.machines}
            paper = sweep_file(tmp, ROOT / "sweeps" / "paper.yaml", keep, stacked_extra)
            full = run_sweep(paper, tmp / "paper.jsonl", "--stack", device=opts.device, workers=opts.workers)
            same, n, worst = compare(tmp / "paper.jsonl", ROOT / "sweeps" / "results" / "paper.jsonl")
            print(f"paper grid (M in {opts.machines}), {n} runs stacked: {full:.1f} s; identical to sweeps/results/paper.jsonl: "
                  f"{same}/{n}; largest relative differences: {differences(worst)}")  # fmt: skip
            if opts.full_alone:
                alone_path = sweep_file(tmp, ROOT / "sweeps" / "paper.yaml", keep, extra, "paper_alone.yaml")
                alone = run_sweep(alone_path, tmp / "paper_alone.jsonl", "--no-stack", workers=opts.workers)
                print_ratio(
                    f"paper grid (M in {opts.machines})", alone, full, tmp / "paper.jsonl", tmp / "paper_alone.jsonl"
                )
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"peak memory (resident, whole process): {peak_mib():.0f} MiB" + (f", the largest worker {workers:.0f} MiB" if opts.workers > 1 else "")
          + f"; load average now {os.getloadavg()[0]:.1f}")  # fmt: skip
    if opts.device == "cuda":
        print(f"peak GPU memory (torch.cuda.max_memory_allocated): {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
