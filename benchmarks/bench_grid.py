"""Time the paper grid through the sweep runner against a minimal one-at-a-time torch loop of the same runs.

The runner: ``python -m lit_slowcal sweep`` on ``sweeps/paper.yaml`` restricted to seed 1 (3 methods
x M in {16, 32, 64} x K in {4, 8, 16, 32, 64} = 45 runs, one epoch of MNIST each), as users run it:
a fresh process, ``--wandb=false``, with the runner's defaults (stacked trials, workers from the cores;
``--runner='--workers 1'`` or ``--runner='--no-stack'`` for others), ``--threads`` torch threads (default 1).
The only change to the sweep file is ``--run_dir`` pointing into a temporary folder (the runs still
write their CSV logs, config and class-distribution figure there) and a temporary results file.
Reported: the command's wall time (Python start-up, imports, decoding MNIST and checking every
trial's arguments included) and the runner's own "N trials in X s" (the trials alone), and each
trial's ``wall_time_s`` from the results file.

The minimal loop, in this process, for each of the same 45 runs: no Lightning, no LightningModule,
no strategy. The project's ``partition`` (the official split, as ``configs/paper.yaml``) and
per-machine ``MachineStreams`` (``streams.py``) give the very samples the runner's run draws; the
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
apart (column ``+evals``), and a second ratio compares against the loop with them. By default the
runs also log the training objective f(x) at every evaluation (one product of the 60,000
training images, 6x a test evaluation) and the per-round diagnostics
(``lit_slowcal.experiments.measure.diagnostics``); the minimal loop computes f at the same evaluations too,
timed apart (column ``+obj.``).

The runner runs the grid twice (``--variants``): ``bare``, with ``--objective=false
--diagnostics=false``, the minimal loop's work, which the goal (1.5x the minimal loop) is about;
and ``default``, as configured, against the minimal loop with the same evaluations and objective.

Cross-checks: the final test accuracy (and loss) of every run, runner against minimal loop (the two
compute the same float operations in the same order, so they should agree exactly; any difference
is printed); and every metric that ``sweeps/results/paper.jsonl`` holds for the run, compared
exactly (results must not change).

The minimal loop runs before and after the runner, and the ratio uses their mean: on a shared
machine a busy spell then hits both sides. The load average and the CPUs other processes used
during each runner are printed.

``--full`` also runs the whole 135-run paper grid (seeds 1, 2, 3) through the runner and prints its
wall time.

    python benchmarks/bench_grid.py [--threads 1] [--variants bare,default] [--full] [--runner='--workers 1'] [--root data]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ROOT / "sweeps" / "paper.yaml"
STORED = ROOT / "sweeps" / "results" / "paper.jsonl"
GOAL_RATIO = 1.5
GOAL_FULL_S = 90.0


def _sweep_file(folder: Path, seeds: list[int] | None, flags: list[str] = ()) -> Path:
    """sweeps/paper.yaml with its runs logging under ``folder`` (and only ``seeds``, if given), ``flags`` added."""
    spec = yaml.safe_load(SWEEP.read_text())
    if seeds is not None:
        spec["parameters"]["seed_everything"] = {"values": seeds}
    spec["command"] = [*spec["command"], f"--run_dir={folder / 'runs'}", *flags]
    path = folder / f"paper_seed{'_'.join(map(str, seeds))}.yaml" if seeds else folder / "paper.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_sweep(
    folder: Path, seeds: list[int] | None, threads: int, flags: list[str] = (), runner: list[str] = ()
) -> tuple[float, float, list[dict]]:
    """The runner as a user runs it (``runner``: its own options, e.g. ``--workers 1``; none: its defaults,
    stacked, workers from the cores); returns (command wall s, the runner's trials s, result records)."""
    sweep = _sweep_file(folder, seeds, flags)
    results = folder / f"{sweep.stem}.jsonl"
    log = folder / f"{sweep.stem}.log"
    cmd = [sys.executable, "-m", "lit_slowcal", "sweep", str(sweep), "--results", str(results),
           "--wandb=false", f"--threads={threads}", *runner]  # fmt: skip
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


def _shape(method: str, num_machines: int, local_steps: int, train_size: int) -> tuple[Any, float]:
    """The run's ``RunShape`` with b = 1, as the CLI builds it, and the method's paper lr."""
    from lit_slowcal.experiments.train.methods import get_method
    from lit_slowcal.experiments.train.shape import RunShape

    shape = RunShape.of(method, num_machines, local_steps, 1, train_size=train_size)
    return shape, get_method(method).paper_lr


def minimal_run(method: str, num_machines: int, local_steps: int, seed: int, mnist, eval_every: int = 10):
    """One run of the minimal loop; returns (seconds without the intermediate evaluations, seconds of
    the intermediate evaluations, final test accuracy, final test loss, rounds, seconds of the
    training objective at every evaluation, the final one included)."""
    from lit_slowcal.experiments.data.datamodule import MachineStreams
    from lit_slowcal.experiments.data.partition import partition
    from lit_slowcal.experiments.train.model import official_init
    from lit_slowcal.optimizer import SlowcalSGD

    x, y, test_x, test_y = mnist
    start = time.perf_counter()
    shape, lr = _shape(method, num_machines, local_steps, len(y))
    steps, batch, rounds = shape.steps_per_round, shape.per_step_batch, shape.rounds
    shards = [torch.from_numpy(s) for s in partition(y.numpy(), num_machines, 0.1, split="official", seed=seed)]
    streams = MachineStreams(x, y, shards, list(range(num_machines)), batch, steps, rounds, seed)
    W, bias = (t.requires_grad_() for t in official_init(num_machines, seed))  # each machine its own x_0
    opt = SlowcalSGD([W, bias], lr=lr) if method == "slowcal" else torch.optim.SGD([W, bias], lr=lr)
    sync_every = shape.sync_every

    def evaluate():
        with torch.no_grad():
            logits = F.linear(test_x, W.mean(0), bias.mean(0))
            return (logits.argmax(1) == test_y).float().mean().item(), F.cross_entropy(logits, test_y).item()

    def objective_seconds(state: dict) -> float:
        """f(x) on every machine's shard (weights 1 / (M n_i), float64 reduction), as the runs log it."""
        e = time.perf_counter()
        if not state:  # once per run: the per-sample weights and the used samples
            weights = torch.zeros(len(y), dtype=torch.float64)
            for shard in shards:
                weights[shard] = 1.0 / (num_machines * len(shard))
            used = weights.nonzero().squeeze(1)
            state.update(used=used, weights=weights[used], labels=y[used])
        with torch.no_grad():
            logits = torch.addmm(bias.mean(0), x, W.mean(0).T)[state["used"]].double()
            (state["weights"] * F.cross_entropy(logits, state["labels"], reduction="none")).sum().item()
        return time.perf_counter() - e

    t, eval_s, objective_s, objective_state = 0, 0.0, 0.0, {}
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
            objective_s += objective_seconds(objective_state)
    acc, loss = evaluate()
    objective_s += objective_seconds(objective_state)
    return time.perf_counter() - start - eval_s - objective_s, eval_s, acc, loss, rounds, objective_s


def minimal_grid(trials: list[dict], mnist) -> dict[str, tuple]:
    return {
        _key(p): minimal_run(p["method"], p["num_machines"], p["local_steps"], p["seed_everything"], mnist)
        for p in trials
    }


def _key(params: dict) -> str:
    return f"{params['method']}_M{params['num_machines']}_K{params['local_steps']}_seed{params['seed_everything']}"


#: The runner's variants: the runs as configured (the objective and the per-round diagnostics on, the
#: CLI's default) and without them (the same work as the minimal loop, which computes neither).
VARIANTS = {"default": [], "bare": ["--objective=false", "--diagnostics=false"]}


def check_stored(records: list[dict]) -> tuple[int, list[str]]:
    """Every metric that both ``records`` and sweeps/results/paper.jsonl's record of the same trial hold, compared
    by the exactness contract (``sweep.contract``: bit for bit, the diagnostics within 1e-12 relative)."""
    from lit_slowcal.experiments.sweep.contract import differences

    stored = {
        _key(r["params"]): r for r in map(json.loads, STORED.read_text().splitlines()) if r["status"] == "finished"
    }
    same, differ = 0, []
    for record in records:
        old = stored.get(_key(record["params"]))
        if old is None:
            continue
        # The metrics both hold: the stored records are the runs as configured (objective and diagnostics on),
        # so a bare run lacks those and is compared on the rest.
        common = [k for k in old["metrics"] if k in record["metrics"]]
        diff = differences({k: old["metrics"][k] for k in common}, {k: record["metrics"][k] for k in common})
        if diff:
            differ.append(f"{_key(record['params'])}: {diff}")
        else:
            same += 1
    return same, differ


def main() -> None:
    from bench_conditions import OtherLoad  # this folder is on sys.path when the script runs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads on both sides (default 1, the runner's default)"
    )
    p.add_argument("--full", action="store_true", help="also run the whole 135-run paper grid through the runner")
    p.add_argument(
        "--runner", default="", help="the runner's own options, e.g. '--workers 1' or '--no-stack --workers 2' (default: "
        "none, the sweep's defaults: stacked, workers from the cores)",
    )  # fmt: skip
    p.add_argument("--root", default=str(ROOT / "data"), help="folder holding MNIST/raw/")
    p.add_argument(
        "--variants", default="bare,default", help="runner variants, comma-separated: bare (--objective=false "
        "--diagnostics=false: the minimal loop's work) and default (as configured) (default: both)",
    )  # fmt: skip
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown or not variants:
        p.error(f"--variants: {args.variants!r} (allowed: {', '.join(VARIANTS)})")
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))

    from lit_slowcal.experiments.data.datamodule import load_mnist
    from lit_slowcal.experiments.sweep.spec import load_sweep
    from lit_slowcal.experiments.sweep.trials import expand_trials

    trials = [t for t in expand_trials(load_sweep(SWEEP)) if t["seed_everything"] == 1]
    start = time.perf_counter()
    mnist = load_mnist(args.root)
    load_s = time.perf_counter() - start
    print(f"torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} CPUs; {len(trials)} runs "
          f"(sweeps/paper.yaml, seed 1); MNIST decoded in {load_s:.2f} s (minimal loop: once, not counted); "
          f"load average {open('/proc/loadavg').read().split()[0]}")  # fmt: skip

    minimal_grid(trials[:1], mnist)  # warm-up
    first = minimal_grid(trials, mnist)
    runs: dict[str, tuple[float, float, list[dict], float]] = {}
    for variant in variants:
        load = OtherLoad(children=True)
        load.start()
        with tempfile.TemporaryDirectory(prefix="bench_grid_") as tmp:
            wall, trials_s, records = run_sweep(Path(tmp), [1], args.threads, VARIANTS[variant], args.runner.split())
        load.stop()
        runs[variant] = (wall, trials_s, records, load.cpus())
    second = minimal_grid(trials, mnist)

    names = {"bare": "bare s", "default": "default s"}
    print(f"\n{'run':<28} {'rounds':>6} " + " ".join(f"{names[v]:>9}" for v in variants)
          + f" {'minimal s':>10} {'+evals':>7} {'+obj.':>6}  {'acc runner':>10} {'acc minimal':>11}")  # fmt: skip
    by_key = {v: {_key(r["params"]): r for r in runs[v][2]} for v in variants}
    total = {v: 0.0 for v in variants}
    total_minimal = total_evals = total_objective = 0.0
    mismatches = []
    for params in trials:
        key = _key(params)
        seconds = (first[key][0] + second[key][0]) / 2
        evals = (first[key][1] + second[key][1]) / 2
        objective = (first[key][5] + second[key][5]) / 2
        _, _, acc, loss, rounds, _ = first[key]
        total_minimal += seconds
        total_evals += evals
        total_objective += objective
        cells = []
        for v in variants:
            record = by_key[v][key]
            acc_r, loss_r = record["metrics"].get("test_acc"), record["metrics"].get("test_loss")
            total[v] += record["wall_time_s"]
            cells.append(f"{record['wall_time_s']:>9.3f}")
            if record["status"] != "finished" or acc_r is None or abs(acc_r - acc) > 1e-6 or abs(loss_r - loss) > 1e-5:
                mismatches.append(
                    f"{key} ({v}): runner {record['status']} acc {acc_r} loss {loss_r}, minimal acc {acc} loss {loss}"
                )
        print(f"{key:<28} {rounds:>6} {' '.join(cells)} {seconds:>10.3f} {evals:>+7.3f} {objective:>+6.3f}  "
              f"{acc_r:>10.4f} {acc:>11.4f}")  # fmt: skip
    m1 = sum(v[0] for v in first.values())
    m2 = sum(v[0] for v in second.values())
    print(f"\nminimal loop, {len(trials)} runs (final test evaluation only): {m1:.1f} s before the runner, {m2:.1f} s "
          f"after; mean {total_minimal:.1f} s. The runs' test evaluations every 10 rounds would add {total_evals:.1f} s, "
          f"the training objective at each evaluation {total_objective:.1f} s more")  # fmt: skip
    bases = {
        "bare": [("the minimal loop", total_minimal), ("with the same test evaluations", total_minimal + total_evals)],
        "default": [("with the same test evaluations and objective", total_minimal + total_evals + total_objective),
                    ("the minimal loop", total_minimal)],
    }  # fmt: skip
    for v in variants:
        wall, trials_s, records, others = runs[v]
        flags = " ".join(VARIANTS[v]) or "as configured: objective and diagnostics on"
        print(f"\nrunner, {v} ({flags}), {len(trials)} runs: {wall:.1f} s the whole command (start-up, MNIST, "
              f"argument checks), {trials_s:.1f} s the trials (sum of their wall_time_s: {total[v]:.1f} s); other "
              f"processes used {others:.2f} CPUs meanwhile")  # fmt: skip
        for i, (what, base) in enumerate(bases[v]):
            goal = f" (goal <= {GOAL_RATIO}x)" if v == "bare" and i == 0 else ""
            print(
                f"  against {what} ({base:.1f} s): {wall / base:.2f}x the command, {trials_s / base:.2f}x the trials{goal}"
            )
        same, differ = check_stored(records)
        print(f"  against {STORED.relative_to(ROOT)}: every stored metric identical in {same} of {len(records)} runs"
              + "".join(f"\n    differs: {line}" for line in differ))  # fmt: skip
    if mismatches:
        print(f"\nfinal test metrics differ from the minimal loop's in {len(mismatches)} cases:")
        for line in mismatches:
            print("  " + line)
    else:
        print(f"\nfinal test accuracy and loss: the same as the minimal loop's in all {len(trials)} runs (accuracy to "
              "1e-6, loss to 1e-5)")  # fmt: skip

    if args.full:
        for v in variants:
            with tempfile.TemporaryDirectory(prefix="bench_grid_") as tmp:
                wall, trials_s, records = run_sweep(Path(tmp), None, args.threads, VARIANTS[v], args.runner.split())
            done = sum(r["status"] == "finished" for r in records)
            same, differ = check_stored(records)
            print(f"\nthe whole paper grid, {v} ({len(records)} runs, {done} finished) through the runner "
                  f"({args.runner or 'its defaults'}): {wall:.1f} s "
                  f"the command, {trials_s:.1f} s the trials (goal < {GOAL_FULL_S:.0f} s); stored metrics identical in "
                  f"{same} of {len(records)} runs; load average {open('/proc/loadavg').read().split()[0]}")  # fmt: skip


if __name__ == "__main__":
    main()
