"""The main job under the conditions a shared machine sees, with the thread policy and with torch's default.

For each policy -- ``auto`` (the default: ``--threads`` not given) and torch's default
(``--threads 0``) -- with ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` unset, it runs the default
job (``python -m lit_slowcal fit --config configs/slowcal.yaml --wandb=false --run_dir <tmp>``):

* alone;
* two at once (each job's training time, and the pair's whole-process time: from starting both to
  the end of the later one);
* beside a multi-threaded torch process that this script starts and stops itself (a float32
  512 x 512 matmul loop on 2 threads);

and prints each figure with its ratio to "alone" under the same policy. Training time is read from a
small callback added with ``--trainer.callbacks+=`` (from ``on_train_start`` to ``on_train_end``;
it also reports ``torch.get_num_threads()`` during training); set-up is the time from starting the
process to ``on_train_start`` (imports, parsing, decoding and splitting MNIST, the class figure).
The runs of one repeat alternate between the policies, so a busy spell on a shared machine hits
both; figures are medians over the repeats. Each repeat waits (up to 30 s) for a quiet second on
the machine, and the CPUs other processes used during it are printed (``/proc/stat``), to judge how
idle "alone" was. A job still running after ``--limit`` seconds is stopped and shown as "> limit".

Then the import time of ``lit_slowcal.experiments.run.cli`` next to ``import torch`` alone (fresh
interpreters, median; wall and CPU time), with ``import lightning.pytorch``, ``torchmetrics`` and
``torch._dynamo`` to show where the difference goes: ``import lightning.pytorch`` is the floor of
any app on Lightning (it imports ``torch._dynamo`` in ``lightning.fabric.wrappers``, and
torchmetrics, which imports matplotlib.pyplot and, from 1.9, torchvision's models when they are
installed).

``--steps`` instead prints the measurement behind ``--threads auto``'s rule
(``lit_slowcal/experiments/run/threads.py``): one local step of the model (``SimulatedMachines`` of
``nn.Linear(784, 10)``, m machines x b samples, forward + backward + ``SlowcalSGD`` step) with 1
and 2 threads, for m * b = 16 ... 262,144 samples per step, idle and beside the same competing
process (paused with SIGSTOP for the idle samples, so idle and busy samples alternate). A sample
during which other processes used the CPUs is left out and the size measured again.

    python benchmarks/bench_conditions.py [--repeats 2] [--limit 20] [--import-repeats 3] [--policies auto,default]
    python benchmarks/bench_conditions.py --steps [--step-repeats 5] [--shapes 16x1,64x1024]
    python benchmarks/bench_conditions.py --imports [--repeats 2] [--import-repeats 3]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
GOAL_PAIR_EACH, GOAL_PAIR_WHOLE, GOAL_BESIDE, GOAL_IMPORT_S = 1.2, 1.5, 2.0, 1.0

# The competing process: float32 matmuls on 2 threads, forever (until this script stops it).
COMPETITOR = """
import sys, torch
torch.set_num_threads(2)
a, b = torch.randn(512, 512), torch.randn(512, 512)
c = a @ b
print("ready", flush=True)
while True:
    c = a @ b
"""

# Added to the job with --trainer.callbacks+=_bench_clock.TrainClock: wall-clock stamps of the
# training's start and end (time.time(), comparable across processes) and the torch threads in use.
CLOCK = """
import time, torch
import lightning.pytorch as pl

class TrainClock(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        print(f"bench: train_start {time.time():.6f} threads {torch.get_num_threads()}", flush=True)

    def on_train_end(self, trainer, pl_module):
        print(f"bench: train_end {time.time():.6f} threads {torch.get_num_threads()}", flush=True)
"""


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without thread settings, rendezvous, W&B or lit_slowcal variables."""
    drop = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "RANK",
            "WORLD_SIZE", "LOCAL_WORLD_SIZE")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("WANDB_", "LIT_SLOWCAL_"))}
    env.update(extra)
    return env


def _cpu_jiffies() -> Optional[tuple[int, int]]:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + fields[4]
    return sum(fields[:8]) - idle, sum(fields[:8])


class OtherLoad:
    """CPUs used by processes other than this one (and ``exclude``) between ``start()`` and ``cpus()``."""

    def __init__(self, exclude: Optional[int] = None, children: bool = False) -> None:
        self.exclude = exclude
        self.children = children  # count this process's finished (waited for) children as its own
        self.busy = 0.0
        self.wall = 0.0

    def _now(self) -> Optional[tuple[float, float]]:
        jiffies = _cpu_jiffies()
        if jiffies is None:
            return None
        tick = os.sysconf("SC_CLK_TCK")
        ours = time.process_time()
        if self.children:
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            ours += usage.ru_utime + usage.ru_stime
        if self.exclude is not None:
            try:
                with open(f"/proc/{self.exclude}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ours += (int(fields[11]) + int(fields[12])) / tick
            except OSError:
                pass
        return jiffies[0] / tick - ours, time.perf_counter()

    def start(self) -> None:
        self._start = self._now()

    def stop(self) -> None:
        end = self._now()
        if self._start is not None and end is not None:
            self.busy += end[0] - self._start[0]
            self.wall += end[1] - self._start[1]

    def cpus(self) -> float:
        return max(0.0, self.busy / self.wall) if self.wall else float("nan")


def background(seconds: float = 0.5) -> str:
    """The share of all CPUs busy over ``seconds`` while this script waits (other processes' load)."""
    a = _cpu_jiffies()
    time.sleep(seconds)
    b = _cpu_jiffies()
    if a is None or b is None or b[1] == a[1]:
        return "background load unknown"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return f"other processes used {(b[0] - a[0]) / (b[1] - a[1]) * cpus:.1f} of {cpus} CPUs"


@contextmanager
def competitor() -> Iterator[subprocess.Popen]:
    """A 2-thread float32 matmul loop in another process, running while the block runs.

    The block may pause it (``SIGSTOP``) and let it go on (``SIGCONT``) through the process it gets.
    """
    proc = subprocess.Popen([sys.executable, "-c", COMPETITOR], env=clean_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        yield proc
    finally:
        proc.kill()
        proc.wait()


class Job:
    """One default main job in a subprocess; ``.result()`` waits for it and reads its figures."""

    def __init__(self, policy: str, run_dir: Path, clock_dir: Path) -> None:
        args = [sys.executable, "-m", "lit_slowcal", "fit", "--config=configs/slowcal.yaml", "--wandb=false",
                f"--run_dir={run_dir}", "--trainer.enable_progress_bar=false",
                "--trainer.callbacks+=_bench_clock.TrainClock"]  # fmt: skip
        if policy == "default":
            args.append("--threads=0")
        env = clean_env(PYTHONPATH=os.pathsep.join(filter(None, [str(clock_dir), os.environ.get("PYTHONPATH")])))
        self.start = time.time()
        self.proc = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def result(self, limit: float) -> dict:
        """The job's figures; a job still running ``limit`` seconds after its start is stopped (times: inf)."""
        try:
            out, _ = self.proc.communicate(timeout=max(1.0, self.start + limit - time.time()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return {"process": math.inf, "setup": math.nan, "training": math.inf, "threads": None,
                    "line": "(stopped before the end)", "accuracy": None}  # fmt: skip
        end = time.time()
        if self.proc.returncode != 0:
            raise RuntimeError(f"the job failed (exit {self.proc.returncode}):\n{out[-3000:]}")
        start = re.search(r"bench: train_start ([\d.]+) threads (\d+)", out)
        stop = re.search(r"bench: train_end ([\d.]+)", out)
        line = re.search(r"^threads: .*$", out, re.M)
        return {
            "process": end - self.start,
            "setup": float(start.group(1)) - self.start,
            "training": float(stop.group(1)) - float(start.group(1)),
            "threads": int(start.group(2)),
            "line": line.group(0) if line else "(no threads line)",
            "accuracy": re.search(r"final test accuracy (\S+)", out).group(1),
        }


def _s(seconds: float, limit: float) -> str:
    return f"{seconds:6.2f} s" if math.isfinite(seconds) else f"> {limit:.0f} s".rjust(8)


def _x(value: float, base: float, limit: float) -> str:
    """value / base; "> N x" when value is a stopped job's (inf), n/a when base is."""
    if not math.isfinite(base):
        return "  n/a "
    if not math.isfinite(value):
        return f"> {limit / base:.0f}x".rjust(6)
    return f"{value / base:5.2f}x"


def conditions(
    repeats: int, import_repeats: int, limit: float, policies: tuple[str, ...] = ("auto", "default")
) -> None:
    figures: dict[tuple[str, str], list[float]] = {}
    lines = {policy: "(no finished run)" for policy in policies}

    def add(policy: str, what: str, value: float) -> None:
        figures.setdefault((policy, what), []).append(value)

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "_bench_clock.py").write_text(CLOCK)
        run_dir = tmp_path / "runs"
        # One unmeasured job first: file caches, the decompressed MNIST files next to the .gz.
        Job("auto", run_dir, tmp_path).result(limit)
        for rep in range(repeats):
            quiet = wait_quiet(30.0, 0.25)
            load = OtherLoad(children=True)
            load.start()
            for policy in policies:
                alone = Job(policy, run_dir, tmp_path).result(limit)
                if alone["threads"] is not None:
                    lines[policy] = f"{alone['line']}   [torch threads in training: {alone['threads']}]"
                add(policy, "alone training", alone["training"])
                add(policy, "alone process", alone["process"])
                add(policy, "alone setup", alone["setup"])
                start = time.time()
                pair = [Job(policy, run_dir, tmp_path), Job(policy, run_dir, tmp_path)]
                results = [job.result(limit) for job in pair]
                finished = all(math.isfinite(r["process"]) for r in results)
                add(policy, "pair whole", time.time() - start if finished else math.inf)
                for r in results:
                    add(policy, "pair each training", r["training"])
                with competitor():
                    add(policy, "beside training", Job(policy, run_dir, tmp_path).result(limit)["training"])
            load.stop()
            print(
                f"repeat {rep + 1}/{repeats}: other processes used {load.cpus():.2f} CPUs on average meanwhile"
                f"{'' if quiet else ' (no quiet second in the 30 s waited before it)'}",
                flush=True,
            )

    med = {key: statistics.median(values) for key, values in figures.items()}
    print(f"\nthe default job (M=16, K=16, b=1), {len(os.sched_getaffinity(0))} CPUs; medians of {repeats} "
          f"repeats (pair: of both jobs of every repeat); a job still running after {limit:.0f} s is stopped")  # fmt: skip
    for policy in policies:
        name = "auto (default)" if policy == "auto" else "torch's default (--threads 0)"
        print(f"\npolicy {name}:  {lines[policy]}")
        alone_t, alone_p = med[(policy, "alone training")], med[(policy, "alone process")]
        setup = med[(policy, "alone setup")]
        print(f"  alone                     training {_s(alone_t, limit)}   process {_s(alone_p, limit)}   set-up "
              f"{_s(setup, limit) if math.isfinite(setup) else 'n/a'}")  # fmt: skip
        each, whole, beside = (med[(policy, k)] for k in ("pair each training", "pair whole", "beside training"))
        print(f"  two at once, each job     training {_s(each, limit)}   {_x(each, alone_t, limit)} alone   "
              f"(goal <= {GOAL_PAIR_EACH}x)")  # fmt: skip
        print(f"  two at once, whole pair   process  {_s(whole, limit)}   {_x(whole, alone_p, limit)} alone   "
              f"(goal <= {GOAL_PAIR_WHOLE}x)")  # fmt: skip
        print(f"  beside 2-thread matmuls   training {_s(beside, limit)}   {_x(beside, alone_t, limit)} alone   "
              f"(goal <= {GOAL_BESIDE}x)")  # fmt: skip
    keys = ("alone training", "pair each training", "beside training")
    if set(policies) == {"auto", "default"}:
        print("\ntorch's default against auto, training time: " + ", ".join(
            f"{what} {_x(med[('default', k)], med[('auto', k)], limit).strip()}"
            for what, k in zip(("alone", "two at once", "beside matmuls"), keys)
        ))  # fmt: skip
    if import_repeats > 0:
        imports(import_repeats, med[(policies[0], "alone setup")])


def start_up(repeats: int, import_repeats: int, limit: float) -> None:
    """The default job's set-up alone (``auto`` policy; median of ``repeats`` after one unmeasured), then the imports."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        (tmp_path / "_bench_clock.py").write_text(CLOCK)
        Job("auto", tmp_path / "runs", tmp_path).result(limit)
        setups = [Job("auto", tmp_path / "runs", tmp_path).result(limit)["setup"] for _ in range(repeats)]
    imports(import_repeats, statistics.median(setups))


def _import_seconds(module: str) -> tuple[float, float, float, float]:
    """A fresh interpreter importing ``module``: (the import alone, process start to the import's end,
    the whole interpreter including its exit, the import's CPU time: less sensitive to other load)."""
    code = ("import time; t, c = time.perf_counter(), time.process_time(); import " + module
            + "; print(time.perf_counter() - t, time.time(), time.process_time() - c)")  # fmt: skip
    start, wall = time.time(), time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=clean_env(), capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - wall
    alone, done, cpu = (float(x) for x in out.stdout.split())
    return alone, done - start, wall, cpu


def imports(repeats: int, setup: float) -> None:
    modules = ("torch", "lit_slowcal.experiments.run.cli", "lightning.pytorch", "torchmetrics", "torch._dynamo",
               "matplotlib.pyplot")  # fmt: skip
    times: dict[str, list[tuple[float, float, float, float]]] = {m: [] for m in modules}
    for _ in range(repeats):
        for module in modules:  # alternating, so that noise hits all
            times[module].append(_import_seconds(module))
    med = {m: [statistics.median(t[i] for t in v) for i in range(4)] for m, v in times.items()}
    torch_import, torch_ready, torch_cpu = med["torch"][0], med["torch"][1], med["torch"][3]
    print(f"\nimports, a fresh interpreter each (median of {repeats}): the import, wall and CPU; from starting the "
          f"process to the import's end; the whole interpreter, its exit included; {background()}")  # fmt: skip
    for module in modules:
        alone, ready, wall, cpu = med[module]
        against = "(without torch)            " if module == "matplotlib.pyplot" else (
            f"({alone - torch_import:+5.2f} s, cpu {cpu - torch_cpu:+5.2f} s)")  # fmt: skip
        print(f"  import {module:<29} {alone:5.2f} s, cpu {cpu:5.2f} s {against} vs torch   ready {ready:5.2f} s   "
              f"whole {wall:5.2f} s")  # fmt: skip
    cpu_of = {m: med[m][3] - torch_cpu for m in modules}
    print(f"  the floor of any Lightning app, import lightning.pytorch against import torch: cpu {cpu_of['lightning.pytorch']:+.2f} s; "
          f"in it torch._dynamo {cpu_of['torch._dynamo']:.2f} s (lightning.fabric.wrappers imports it, whatever else is "
          f"installed) and torchmetrics (Lightning imports it; it imports matplotlib.pyplot, {med['matplotlib.pyplot'][3]:.2f} s "
          f"alone, and since 1.9 torchvision's models, which import torch._dynamo first); lit_slowcal's own share "
          f"(the cli against lightning.pytorch): cpu {cpu_of['lit_slowcal.experiments.run.cli'] - cpu_of['lightning.pytorch']:+.2f} s")  # fmt: skip
    if math.isfinite(setup):
        print(f"  the default job, from starting the process to its first training step: {setup:.2f} s, "
              f"{setup - torch_ready:+.2f} s against starting a process that imports torch (goal <= "
              f"+{GOAL_IMPORT_S:.0f} s); {setup - torch_ready - (med['lightning.pytorch'][0] - torch_import):+.2f} s "
              f"beyond importing Lightning")  # fmt: skip


# ---- --steps: the measurement behind the auto rule ------------------------------------------

STEP_CONFIGS = [(16, 1), (64, 1), (16, 16), (64, 16), (1024, 1), (64, 64), (1024, 4), (64, 256), (1024, 16),
                (64, 1024), (256, 256), (256, 1024)]  # fmt: skip


def _step_timer(m: int, b: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lit_slowcal.optimizer import SlowcalSGD
    from lit_slowcal.simulated import SimulatedMachines

    torch.manual_seed(0)
    template = nn.Linear(784, 10)
    nn.init.zeros_(template.weight)
    nn.init.zeros_(template.bias)
    machines = SimulatedMachines(template, m)
    opt = SlowcalSGD(machines.parameters(), lr=0.01)
    x, y = torch.randn(m, b, 784) * 0.3, torch.randint(0, 10, (m, b))

    def step() -> None:
        logits = machines(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)
        opt.zero_grad()
        loss.sum().backward()
        opt.step()

    def seconds_per_step(threads: int, budget: float = 0.1) -> float:
        torch.set_num_threads(threads)
        step()
        n, start = 0, time.perf_counter()
        while True:
            step()
            n += 1
            elapsed = time.perf_counter() - start
            if elapsed > budget and n >= 2:
                return elapsed / n

    return seconds_per_step


def wait_quiet(seconds: float, quiet: float, exclude: Optional[int] = None) -> bool:
    """Wait up to ``seconds`` for a second in which other processes use less than ``quiet`` CPUs."""
    end = time.perf_counter() + seconds
    while True:
        load = OtherLoad(exclude=exclude)
        load.start()
        time.sleep(1.0)
        load.stop()
        if load.cpus() < quiet:
            return True
        if time.perf_counter() > end:
            return False


def steps(repeats: int, shapes: list[tuple[int, int]], quiet: float = 0.25, max_wait: float = 300.0) -> None:
    """The step table; a sample counts only when other processes used less than ``quiet`` CPUs meanwhile.

    On a shared machine, sizes whose samples were disturbed are measured again (up to 3x the repeats),
    after waiting up to 10 s for a quiet spell, ``max_wait`` seconds of waiting in all.
    """
    import signal

    import torch

    saved = torch.get_num_threads()
    samples: dict[tuple[str, int, int], list[tuple[float, float, float]]] = {}
    print(f"{background()} before the measurement", flush=True)
    # The competitor runs throughout but is paused (SIGSTOP) for the idle measurements: idle and busy
    # timings of every size alternate, so that other load on a shared machine hits both.
    deadline = time.perf_counter() + max_wait
    with competitor() as proc:
        for m, b in shapes:
            timer = _step_timer(m, b)
            quiet_pairs, tries = 0, 0
            # Up to 3x the repeats while others keep the CPUs busy, waiting for a quiet spell in between.
            while quiet_pairs < repeats and tries < 3 * repeats:
                tries += 1
                if tries > repeats:
                    proc.send_signal(signal.SIGSTOP)
                    wait_quiet(min(10.0, max(0.0, deadline - time.perf_counter())), quiet, exclude=proc.pid)
                pair = []
                for condition, sig in (("idle", signal.SIGSTOP), ("busy", signal.SIGCONT)):
                    proc.send_signal(sig)
                    time.sleep(0.02)
                    load = OtherLoad(exclude=proc.pid)
                    load.start()
                    one, two = timer(1), timer(2)
                    load.stop()
                    samples.setdefault((condition, m, b), []).append((one, two, load.cpus()))
                    pair.append(load.cpus() < quiet)
                quiet_pairs += all(pair)
            proc.send_signal(signal.SIGCONT)
    torch.set_num_threads(saved)
    print(f"{background()} after it", flush=True)

    def cell(condition: str, m: int, b: int) -> tuple[str, float, float]:
        got = samples[(condition, m, b)]
        clean = [s for s in got if s[2] < quiet]
        if not clean:
            return f"{'(others busy)':>24}", float("nan"), float("nan")
        one, two = statistics.median(s[0] for s in clean), statistics.median(s[1] for s in clean)
        ratio = statistics.median(s[1] / s[0] for s in clean)
        return f"{one * 1e3:8.2f} {two * 1e3:8.2f} {ratio:6.2f}", one, two

    print(f"\none local step (forward, backward, SlowcalSGD step), 784 features; ms per step and 2t/1t, medians of "
          f"the samples during which other processes used < {quiet} CPUs; busy: beside a 2-thread "
          "float32 matmul loop")  # fmt: skip
    print(f"{'m':>5} {'b':>5} {'m*b':>7} | {'idle 1t':>8} {'idle 2t':>8} {'2t/1t':>6} | {'busy 1t':>8} {'busy 2t':>8} "
          f"{'2t/1t':>6} | quiet samples idle, busy")  # fmt: skip
    for m, b in shapes:
        idle, busy = cell("idle", m, b)[0], cell("busy", m, b)[0]
        counts = [sum(s[2] < quiet for s in samples[(c, m, b)]) for c in ("idle", "busy")]
        print(
            f"{m:5d} {b:5d} {m * b:7d} | {idle} | {busy} | {counts[0]}/{len(samples[('idle', m, b)])}, {counts[1]}/{len(samples[('busy', m, b)])}"
        )
    # Samples taken while others were busy: the 2t/1t of each, to show what a neighbour does.
    noisy = [(s[1] / s[0], s[2]) for key, got in samples.items() if key[0] == "idle" for s in got if s[2] >= quiet]
    if noisy:
        ratios = sorted(r for r, _ in noisy)
        print(
            f"idle samples during which others used >= {quiet} CPUs: {len(noisy)}, 2t/1t median "
            f"{statistics.median(ratios):.2f} (range {ratios[0]:.2f} ... {ratios[-1]:.2f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="repeats of every condition (default 2)")
    parser.add_argument("--policies", default="auto,default", help="auto, default or both (default auto,default)")
    parser.add_argument(
        "--limit", type=float, default=20.0, help="stop a job still running after this many s (default 20)"
    )
    parser.add_argument("--import-repeats", type=int, default=3, help="fresh interpreters per import (default 3)")
    parser.add_argument("--steps", action="store_true", help="print the step measurement behind --threads auto instead")
    parser.add_argument(
        "--imports",
        action="store_true",
        help="only the start-up: the default job alone (--repeats times) and the imports",
    )
    parser.add_argument(
        "--shapes",
        default=",".join(f"{m}x{b}" for m, b in STEP_CONFIGS),
        help="with --steps: machines x samples per step to time, e.g. 16x1,64x1024 (default: 16 ... 262,144 samples)",
    )
    parser.add_argument("--step-repeats", type=int, default=5, help="with --steps: quiet samples per size (default 5)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.steps:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
        steps(args.step_repeats, shapes)
    elif args.imports:
        start_up(args.repeats, args.import_repeats, args.limit)
    else:
        conditions(args.repeats, args.import_repeats, args.limit, tuple(args.policies.split(",")))


if __name__ == "__main__":
    main()
