"""Time the paper grid through the sweep runner against a minimal one-at-a-time torch loop of the same runs.

The runner: ``python -m lit_slowcal sweep`` on ``sweeps/paper.yaml`` restricted to seed 1 (3 methods
x M in {16, 32, 64} x K in {4, 8, 16, 32, 64} = 45 runs, one epoch of MNIST each), as users run it:
a fresh process, ``--wandb=false``, one trial after another, ``--threads`` torch threads (default 1).
The only change to the sweep file is ``--run_dir`` pointing into a temporary folder (the runs still
write their CSV logs, config and class-distribution figure there) and a temporary results file.
Reported: the command's wall time (Python start-up, imports, decoding MNIST and checking every
trial's arguments included) and the runner's own "N trials in X s" (the trials alone), and each
trial's ``wall_time_s`` from the results file.

The minimal loop, in this process, for each of the same 45 runs: no Lightning, no LightningModule,
no strategy. The project's ``partition`` (the official split, as ``configs/paper.yaml``) and
per-machine ``MachineStreams`` (``data.py``) give the very samples the runner's run draws; the
machines are stacked tensors W ``(M, 10, 784)`` and bias ``(M, 10)`` starting from
``official_init`` (``model.init: official``), a step is one batched matmul (``baddbmm``, the form ``SimulatedMachines`` uses), the
per-machine mean cross-entropy summed over machines and ``backward``; the optimizer is
``SlowcalSGD`` (slowcal) or ``torch.optim.SGD`` (local_sgd, minibatch_sgd) on the stacked tensors,
with the paper's learning rates; every K steps (every step for Minibatch-SGD, whose per-step batch
is K samples) x (and SLowcal's w) are replaced by their mean over the machines. After the epoch
the averaged model is evaluated on the 10,000 test images. Timed per run: partition, streams,
training and the final evaluation (MNIST is decoded once, before). The ratio is against this.

The runs also evaluate the model every ``eval_every`` = 10 rounds (their test curve): 966
evaluations of 10,000 x 784 in the 45 runs. The minimal loop does the same evaluations too, timed
apart (column ``evals``), and a second ratio compares against the loop with them.

Cross-check: the final test accuracy (and loss) of every run, runner against minimal loop. The two
compute the same float operations in the same order, so they should agree exactly; any difference
is printed.

The minimal loop runs before and after the runner, and the ratio uses their mean: on a shared
machine a busy spell then hits both sides.

``--full`` also runs the whole 135-run paper grid (seeds 1, 2, 3) through the runner and prints its
wall time.

    python benchmarks/bench_grid.py [--threads 1] [--full] [--root data]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ROOT / "sweeps" / "paper.yaml"
GOAL_RATIO = 1.5
GOAL_FULL_S = 90.0


def _sweep_file(folder: Path, seeds: list[int] | None) -> Path:
    """sweeps/paper.yaml with its runs logging under ``folder`` (and only ``seeds``, if given)."""
    spec = yaml.safe_load(SWEEP.read_text())
    if seeds is not None:
        spec["parameters"]["seed_everything"] = {"values": seeds}
    spec["command"] = [*spec["command"], f"--run_dir={folder / 'runs'}"]
    path = folder / f"paper_seed{'_'.join(map(str, seeds))}.yaml" if seeds else folder / "paper.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_sweep(folder: Path, seeds: list[int] | None, threads: int) -> tuple[float, float, list[dict]]:
    """The runner as a user runs it; returns (command wall s, the runner's trials s, result records)."""
    sweep = _sweep_file(folder, seeds)
    results = folder / f"{sweep.stem}.jsonl"
    log = folder / f"{sweep.stem}.log"
    cmd = [sys.executable, "-m", "lit_slowcal", "sweep", str(sweep), "--results", str(results),
           "--wandb=false", f"--threads={threads}"]  # fmt: skip
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    text = log.read_text()
    if proc.returncode != 0:
        raise SystemExit(f"the sweep failed (exit {proc.returncode}):\n{text[-3000:]}")
    trials_s = float("nan")
    for line in text.splitlines():
        if " trials in " in line and line.endswith(str(results)):
            trials_s = float(line.split(" trials in ")[1].split(" s;")[0])
    records = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return wall, trials_s, records


def _settings(method: str, local_steps: int) -> tuple[int, int, float]:
    """(steps per round, per-step batch, lr) of a method with b = 1, as the CLI links them."""
    from lit_slowcal.experiments.model import PAPER_LR

    if method == "minibatch_sgd":
        return 1, local_steps, PAPER_LR[method]
    return local_steps, 1, PAPER_LR[method]


def minimal_run(method: str, num_machines: int, local_steps: int, seed: int, mnist, eval_every: int = 10):
    """One run of the minimal loop; returns (seconds without the intermediate evaluations, seconds of
    the intermediate evaluations, final test accuracy, final test loss, rounds)."""
    from lit_slowcal.experiments.data import MachineStreams, num_rounds
    from lit_slowcal.experiments.model import official_init
    from lit_slowcal.experiments.partition import partition
    from lit_slowcal.optimizer import SlowcalSGD

    x, y, test_x, test_y = mnist
    start = time.perf_counter()
    steps, batch, lr = _settings(method, local_steps)
    rounds = num_rounds(len(y), num_machines, steps, batch)
    shards = [torch.from_numpy(s) for s in partition(y.numpy(), num_machines, 0.1, split="official", seed=seed)]
    streams = MachineStreams(x, y, shards, list(range(num_machines)), batch, steps, rounds, seed)
    W, bias = (t.requires_grad_() for t in official_init(num_machines, seed))  # each machine its own x_0
    opt = SlowcalSGD([W, bias], lr=lr) if method == "slowcal" else torch.optim.SGD([W, bias], lr=lr)
    sync_every = 1 if method == "minibatch_sgd" else local_steps

    def evaluate():
        with torch.no_grad():
            logits = F.linear(test_x, W.mean(0), bias.mean(0))
            return (logits.argmax(1) == test_y).float().mean().item(), F.cross_entropy(logits, test_y).item()

    t, eval_s = 0, 0.0
    for r, (xs, ys) in enumerate(streams, 1):  # one round: (steps, M, batch, 784), (steps, M, batch)
        for k in range(len(xs)):
            xk, yk = xs[k], ys[k]
            logits = torch.baddbmm(bias.unsqueeze(-1), W, xk.transpose(1, 2)).transpose(1, 2)
            loss = F.cross_entropy(logits.flatten(0, 1), yk.flatten(), reduction="none").view(yk.shape).mean(1)
            opt.zero_grad()
            loss.sum().backward()
            opt.step()
            t += 1
            if t % sync_every == 0:
                with torch.no_grad():
                    tensors = [W, bias] + ([opt.state[p]["w"] for p in (W, bias)] if method == "slowcal" else [])
                    for tensor in tensors:
                        tensor.copy_(tensor.mean(0, keepdim=True).expand_as(tensor))
        if r % eval_every == 0 and r < rounds:  # the runs' evaluations every eval_every rounds
            e = time.perf_counter()
            evaluate()
            eval_s += time.perf_counter() - e
    acc, loss = evaluate()
    return time.perf_counter() - start - eval_s, eval_s, acc, loss, rounds


def minimal_grid(trials: list[dict], mnist) -> dict[str, tuple]:
    return {
        _key(p): minimal_run(p["method"], p["num_machines"], p["local_steps"], p["seed_everything"], mnist)
        for p in trials
    }


def _key(params: dict) -> str:
    return f"{params['method']}_M{params['num_machines']}_K{params['local_steps']}_seed{params['seed_everything']}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads on both sides (default 1, the runner's default)")
    p.add_argument("--full", action="store_true", help="also run the whole 135-run paper grid through the runner")
    p.add_argument("--root", default=str(ROOT / "data"), help="folder holding MNIST/raw/")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))

    from lit_slowcal.experiments.data import load_mnist
    from lit_slowcal.experiments.sweep.spec import load_sweep
    from lit_slowcal.experiments.sweep.trials import expand_trials

    trials = [t for t in expand_trials(load_sweep(SWEEP)) if t["seed_everything"] == 1]
    start = time.perf_counter()
    mnist = load_mnist(args.root)
    load_s = time.perf_counter() - start
    print(f"torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} CPUs; {len(trials)} runs "
          f"(sweeps/paper.yaml, seed 1); MNIST decoded in {load_s:.2f} s (minimal loop: once, not counted)")  # fmt: skip

    minimal_grid(trials[:1], mnist)  # warm-up
    first = minimal_grid(trials, mnist)
    with tempfile.TemporaryDirectory(prefix="bench_grid_") as tmp:
        wall, trials_s, records = run_sweep(Path(tmp), [1], args.threads)
    second = minimal_grid(trials, mnist)

    print(f"\n{'run':<28} {'rounds':>6} {'runner s':>9} {'minimal s':>10} {'ratio':>6} {'(+evals)':>9}  "
          f"{'acc runner':>10} {'acc minimal':>11}")  # fmt: skip
    by_key = {_key(r["params"]): r for r in records}
    total_runner = total_minimal = total_evals = 0.0
    mismatches = []
    for params in trials:
        key = _key(params)
        record = by_key[key]
        seconds = (first[key][0] + second[key][0]) / 2
        evals = (first[key][1] + second[key][1]) / 2
        _, _, acc, loss, rounds = first[key]
        acc_r, loss_r = record["metrics"].get("test_acc"), record["metrics"].get("test_loss")
        total_runner += record["wall_time_s"]
        total_minimal += seconds
        total_evals += evals
        if record["status"] != "finished" or acc_r is None or abs(acc_r - acc) > 1e-6 or abs(loss_r - loss) > 1e-5:
            mismatches.append(f"{key}: runner {record['status']} acc {acc_r} loss {loss_r}, minimal acc {acc} loss {loss}")
        print(f"{key:<28} {rounds:>6} {record['wall_time_s']:>9.3f} {seconds:>10.3f} "
              f"{record['wall_time_s'] / seconds:>6.2f} {evals:>+9.3f}  {acc_r:>10.4f} {acc:>11.4f}")  # fmt: skip
    m1 = sum(v[0] for v in first.values())
    m2 = sum(v[0] for v in second.values())
    print(f"\nminimal loop, {len(trials)} runs (final evaluation only): {m1:.1f} s before the runner, {m2:.1f} s "
          f"after; mean {total_minimal:.1f} s. The runs' evaluations every 10 rounds would add {total_evals:.1f} s")  # fmt: skip
    print(f"runner, {len(trials)} runs: {wall:.1f} s the whole command (start-up, MNIST, argument checks), "
          f"{trials_s:.1f} s the trials (sum of their wall_time_s: {total_runner:.1f} s)")  # fmt: skip
    print(f"ratio runner / minimal loop: {wall / total_minimal:.2f}x the command, {trials_s / total_minimal:.2f}x "
          f"the trials (goal <= {GOAL_RATIO}x)")  # fmt: skip
    with_evals = total_minimal + total_evals
    print(f"against the minimal loop with the same evaluations ({with_evals:.1f} s): {wall / with_evals:.2f}x the "
          f"command, {trials_s / with_evals:.2f}x the trials")  # fmt: skip
    if mismatches:
        print(f"final test metrics differ in {len(mismatches)} of {len(trials)} runs:")
        for line in mismatches:
            print("  " + line)
    else:
        print(f"final test accuracy and loss: the same in all {len(trials)} runs (accuracy to 1e-6, loss to 1e-5)")

    if args.full:
        with tempfile.TemporaryDirectory(prefix="bench_grid_") as tmp:
            wall, trials_s, records = run_sweep(Path(tmp), None, args.threads)
        done = sum(r["status"] == "finished" for r in records)
        print(f"\nthe whole paper grid ({len(records)} runs, {done} finished) through the runner: {wall:.1f} s the "
              f"command, {trials_s:.1f} s the trials (goal < {GOAL_FULL_S:.0f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
