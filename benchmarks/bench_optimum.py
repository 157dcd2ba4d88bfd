"""Solve for the MNIST optimum x* (float64 Newton-CG, ``optimum.solve``) and time it, then the cached read.

For each seed: the paper configs' split (``official``, Dirichlet(0.1)) over M machines, the
objective f with weight decay lambda (the bias penalised too, as in training), x* solved to
``--tol`` into a fresh cache folder (or ``--cache_dir``), then read again from the cache. Prints
f*, the gradient norm reached (recomputed by autograd), the Newton steps and CG iterations
(Hessian-vector products), the seconds of each call, G_* of the split and the load average (the
machine may be shared). Seeds run one after another.

    python benchmarks/bench_optimum.py [--seeds 1 2 3] [--num_machines 64] [--weight_decay 1e-4] [--tol 1e-8]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lit_slowcal.experiments.data.datamodule import ProblemDataModule  # noqa: E402
from lit_slowcal.experiments.measure.objective import Objective, heterogeneity  # noqa: E402
from lit_slowcal.experiments.measure.optimum import optimum  # noqa: E402


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--num_machines", type=int, default=64)
    parser.add_argument("--weight_decay", type=float, default=1e-4)
    parser.add_argument("--tol", type=float, default=1e-8)
    parser.add_argument("--root", default=str(ROOT / "data"))
    parser.add_argument("--cache_dir", default=None, help="default: a temporary folder (every seed solved)")
    parser.add_argument("--tighter", type=float, default=None, help="then go on from the cached x* to this tolerance")
    parser.add_argument("--verbose", action="store_true", help="print every Newton step")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, {load()}")
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache_dir or tmp
        for seed in args.seeds:
            data = ProblemDataModule(root=args.root, num_machines=args.num_machines, split="official", seed=seed)
            objective = Objective(data.problem_samples(), "cross_entropy", args.weight_decay)
            identity = {
                "problem": data.problem.describe(),
                "num_machines": args.num_machines,
                "seed": seed,
            }  # as the CLI's
            began = time.perf_counter()

            def progress(steps: int, value: float, grad_norm: float) -> None:
                if args.verbose:
                    print(
                        f"  step {steps}: f = {value:.15g}, ||grad f|| = {grad_norm:.2e}, {time.perf_counter() - began:.1f} s",
                        flush=True,
                    )

            found, path, cached = optimum(objective, (10, 784), identity, cache, tol=args.tol, progress=progress)
            first = time.perf_counter() - began
            began = time.perf_counter()
            again, _, cached_again = optimum(objective, (10, 784), identity, cache, tol=args.tol)
            second = time.perf_counter() - began
            assert cached_again and torch.equal(again.weight, found.weight)
            print(
                f"seed {seed}: f* = {found.value:.12f}, ||grad f(x*)|| = {found.grad_norm:.2e} (tol {args.tol:g}), "
                f"{found.iterations} Newton steps, {found.cg_iterations} CG iterations, {first:.1f} s "
                f"({'cached' if cached else 'solved'}); again: {second:.2f} s (cached); "
                f"G_* = {heterogeneity(objective, found.params):.4f}; {load()}",
                flush=True,
            )
            if args.tighter is not None:
                began = time.perf_counter()
                finer, _, _ = optimum(objective, (10, 784), identity, cache, tol=args.tighter, progress=progress)
                print(
                    f"  on to {args.tighter:g} from the cached x*: f* = {finer.value:.12f} (change {finer.value - found.value:.1e}), "
                    f"||grad f(x*)|| = {finer.grad_norm:.2e}, {finer.iterations - found.iterations} more Newton steps, "
                    f"{finer.cg_iterations - found.cg_iterations} CG iterations, {time.perf_counter() - began:.1f} s; {load()}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
