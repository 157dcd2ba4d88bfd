"""Time one epoch of SLowcal-SGD through Lightning against a minimal hand-written torch loop (CPU or CUDA).

Both sides train multinomial logistic regression (784 -> 10, x_0 = 0) on MNIST split over M
machines (Dirichlet alpha = 0.1, balanced, seed 1), b samples per machine per step, K local steps
per round, R = ceil(60,000 / (M K b)) rounds, lr = 0.01, weights alpha_t = t + 1:

* minimal loop: no Lightning and no lit_slowcal model, strategy or optimizer. The machines'
  parameters are stacked tensors W (M, 10, 784) and bias (M, 10); a step is one ``baddbmm``
  (computed as (W x^T)^T, which gives the weight gradient in W's layout: the faster form), the
  per-machine mean cross-entropy summed over machines, gradients by autograd
  (``torch.autograd.grad``), then w <- w - lr g and x <- lerp(x, w, c_{t+1}) with
  c_{t+1} = alpha_{t+1} / alpha_{0:t+1} = 2 / (t + 3); every K steps x and w are replaced by their
  mean over the machines. The goal is judged against this loop. A second variant computes the same
  gradient in closed form ((softmax - onehot) / b and one ``bmm``), for reference.
* Lightning: what ``python -m lit_slowcal fit`` runs, minus loggers and evaluation: a ``Trainer``
  with ``PeriodicAveragingStrategy(sync_every=K)``, ``MachinesModel(method="slowcal")`` and
  ``ProblemDataModule``, one epoch.

Both read the same ``ProblemDataModule`` stream (set up once, rewound before every run), so they see
the same samples in the same order. Timed is the training epoch: from Lightning's
``on_train_epoch_start`` to ``on_train_epoch_end`` (a callback), and the same loop over the stream
on the minimal side; drawing the epoch's sample indices and gathering each round's batch is inside
both. Loading and partitioning MNIST is timed once, separately; the whole ``trainer.fit`` is
reported too. After one warm-up run of each, the runs alternate (minimal, closed form, Lightning,
...) so that a busy spell on a shared machine hits all of them; figures are medians.

Correctness: after the epoch the minimal loop's x must equal the Lightning model's parameters
(``machines.weight``, ``machines.bias``) to 1e-5; the largest absolute difference is printed.

Scale: the Lightning path at M = 1024, K = 16 (R = 4) runs in fresh processes, one per repeat. Each
runs two fits: the first as a user would (a fresh process), the second warm; it reports both epoch
times and its peak resident memory (``ru_maxrss``) after the first fit and at the end. Goal: < 4 GB.

``--profile`` adds a cProfile of one Lightning epoch, summed per source file (µs per step).

Device: ``--device cpu`` (the default) or ``--device cuda``. On CUDA both sides keep the model on the
GPU and move each round's batch there (the minimal loop with ``.to``, Lightning through its
accelerator); every clock is read after ``torch.cuda.synchronize()``, so the times cover the
kernels, not only their launch. It also reports peak GPU memory (``torch.cuda.max_memory_allocated``)
of each side, and of each fresh process of the scale run; peak RSS stays the host memory.

Threads: torch's default (the CPUs this process may use) unless ``--threads`` is given; the
subprocesses use the same number.

    python benchmarks/bench_local_training.py [--num-machines 64] [--local-steps 64] [--batch-size 1]
        [--repeats 7] [--large-machines 1024] [--large-local-steps 16] [--threads N] [--profile]
        [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR = 0.01
GOAL_RATIO = 2.0
GOAL_MEMORY_GB = 4.0
TOLERANCE = 1e-5
# The environment before any Trainer ran: Lightning exports its rendezvous (MASTER_PORT,
# WORLD_SIZE, ...) into os.environ, and a child process must not reuse it.
_ENV_AT_START = dict(os.environ)


def make_data(num_machines: int, local_steps: int, batch_size: int, root: str):
    """An ProblemDataModule set up as a single-process Trainer would, and the seconds that took."""
    from lit_slowcal.experiments.data.datamodule import ProblemDataModule

    start = time.perf_counter()
    data = ProblemDataModule(
        root=root,
        num_machines=num_machines,
        batch_size=batch_size,
        steps_per_round=local_steps,
        dirichlet_alpha=0.1,
        split="balanced",
        seed=1,
    )
    data.setup("fit")
    return data, time.perf_counter() - start


def _sync(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA runs asynchronously), so that a clock read after it is fair."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def minimal_epoch(data, local_steps: int, lr: float = LR, closed_form: bool = False, device: str = "cpu"):
    """One epoch of SLowcal-SGD on stacked tensors; returns (seconds, steps, W, bias) with x = (W, bias)."""
    device = torch.device(device)
    streams = data.train_dataloader()
    streams.epoch = 0  # rewind: every run sees epoch 0's samples
    m = data.num_machines
    W = torch.zeros(m, 10, 784, device=device)  # x: the query points, where gradients are taken
    bias = torch.zeros(m, 10, device=device)
    w_W, w_bias = W.clone(), bias.clone()  # w: the SGD iterates, w_0 = x_0
    t = 0
    _sync(device)
    start = time.perf_counter()
    for xs, ys in streams:  # one round: (K, m, b, 784), (K, m, b)
        if device.type != "cpu":
            xs, ys = xs.to(device), ys.to(device)
        for k in range(len(xs)):
            x, y = xs[k], ys[k]
            b = y.shape[1]
            if closed_form:
                logits = torch.baddbmm(bias.unsqueeze(1), x, W.transpose(1, 2))  # (m, b, 10)
                delta = logits.softmax(-1)
                delta.scatter_add_(-1, y.unsqueeze(-1), torch.full(y.shape + (1,), -1.0, device=device))
                delta.div_(b)  # d(machine i's mean CE) / d(logits)
                g_W = torch.bmm(delta.transpose(1, 2), x)  # (m, 10, 784)
                g_bias = delta.sum(1)
            else:
                W.requires_grad_(True)
                bias.requires_grad_(True)
                # (W x^T)^T: the weight gradient comes out in W's layout (the faster of the two forms)
                logits = torch.baddbmm(bias.unsqueeze(-1), W, x.transpose(1, 2)).transpose(1, 2)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(m, b).mean(1).sum()
                g_W, g_bias = torch.autograd.grad(loss, (W, bias))
                W.requires_grad_(False)
                bias.requires_grad_(False)
            c = 2.0 / (t + 3)  # c_{t+1} = alpha_{t+1} / alpha_{0:t+1} = (t + 2) / ((t + 2)(t + 3) / 2)
            w_W.add_(g_W, alpha=-lr)
            w_bias.add_(g_bias, alpha=-lr)
            W.lerp_(w_W, c)
            bias.lerp_(w_bias, c)
            t += 1
            if t % local_steps == 0:  # the parameter server averages x and w over the machines
                for tensor in (W, bias, w_W, w_bias):
                    tensor.copy_(tensor.mean(0, keepdim=True).expand_as(tensor))
    _sync(device)
    return time.perf_counter() - start, t, W.cpu(), bias.cpu()


def _epoch_timer(device: torch.device):
    """A Lightning callback recording the training epoch's wall time in ``.seconds``."""
    import lightning.pytorch as pl

    class EpochTimer(pl.Callback):
        seconds = float("nan")

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            _sync(device)
            self._start = time.perf_counter()

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            _sync(device)
            self.seconds = time.perf_counter() - self._start

    return EpochTimer()


def lightning_epoch(data, local_steps: int, lr: float = LR, device: str = "cpu"):
    """One epoch through Trainer.fit; returns (epoch seconds, fit seconds, steps, W, bias)."""
    from lightning.pytorch import Trainer

    from lit_slowcal.experiments.train.model import MachinesModel
    from lit_slowcal.strategy import PeriodicAveragingStrategy

    device = torch.device(device)
    data.train_dataloader().epoch = 0  # rewind: every run sees epoch 0's samples
    timer = _epoch_timer(device)
    trainer = Trainer(
        strategy=PeriodicAveragingStrategy(sync_every=local_steps),
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[timer],
    )
    model = MachinesModel(method="slowcal", num_machines=data.num_machines, lr=lr)
    _sync(device)
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    _sync(device)
    fit_seconds = time.perf_counter() - start
    # Manual optimization: global_step counts optimizer.step() calls, one per local step.
    weight, bias = model.machines.weight.detach().cpu(), model.machines.bias.detach().cpu()
    return timer.seconds, fit_seconds, trainer.global_step, weight, bias


def _reset_peak_gpu_memory(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gpu_gb(device: str) -> float:
    """Peak GPU memory allocated by tensors since the last reset, in GB (0 on CPU)."""
    if torch.device(device).type != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated(device) / 1e9


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


def _child(args: argparse.Namespace) -> None:
    """In a fresh process: two Lightning fits (cold, then warm); print the figures as JSON."""
    data, setup_seconds = make_data(args.num_machines, args.local_steps, args.batch_size, args.root)
    cold, cold_fit, steps, _, _ = lightning_epoch(data, args.local_steps, device=args.device)
    rss_one_fit = peak_rss_gb()
    gpu_one_fit = peak_gpu_gb(args.device)
    warm, _, _, _, _ = lightning_epoch(data, args.local_steps, device=args.device)
    print(
        json.dumps(
            {
                "setup": setup_seconds,
                "cold": cold,
                "cold_fit": cold_fit,
                "warm": warm,
                "steps": steps,
                "rss_one_fit": rss_one_fit,
                "rss_end": peak_rss_gb(),
                "gpu_one_fit": gpu_one_fit,
                "gpu_end": peak_gpu_gb(args.device),
            }
        )
    )


def _quiet() -> None:
    """Silence Lightning's banners and warnings (it sets its loggers' levels when first imported)."""
    import logging

    import lightning.pytorch  # noqa: F401

    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _profile(data, local_steps: int, steps: int, device: str = "cpu") -> None:
    """cProfile one Lightning epoch; print own time summed per source file (builtins by name)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    epoch = lightning_epoch(data, local_steps, device=device)[0]
    profiler.disable()
    totals: dict[str, float] = {}
    for (filename, _, name), (_, _, own, _, _) in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        if filename == "~":
            key = name  # a C function: a torch kernel or a builtin
        elif filename.startswith(ROOT + os.sep):
            key = os.path.relpath(filename, ROOT)  # lit_slowcal/...
        elif "site-packages" + os.sep in filename:
            key = filename.split("site-packages" + os.sep, 1)[1]  # torch/..., lightning/...
        else:
            key = os.path.basename(filename)  # the standard library
        totals[key] = totals.get(key, 0.0) + own
    total = sum(totals.values())
    print(f"cProfile of one Lightning epoch ({epoch:.3f} s under the profiler, {steps} steps), own time per step:")
    for key, own in sorted(totals.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {own / steps * 1e6:8.1f} us  {100 * own / total:5.1f}%  {key}")


def _scale_run(args: argparse.Namespace) -> None:
    """The Lightning path at M = --large-machines in fresh processes: epoch times and peak memory."""
    M, K, b = args.large_machines, args.large_local_steps, args.batch_size
    data, _ = make_data(M, K, b, args.root)
    minimal_epoch(data, K, device=args.device)  # warm-up
    _reset_peak_gpu_memory(args.device)
    minimal = statistics.median(minimal_epoch(data, K, device=args.device)[0] for _ in range(args.repeats))
    minimal_gpu = peak_gpu_gb(args.device)
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        "--num-machines",
        str(M),
        "--local-steps",
        str(K),
        "--batch-size",
        str(b),
        "--root",
        args.root,
        "--threads",
        str(torch.get_num_threads()),
        "--device",
        args.device,
    ]
    results = []
    for _ in range(args.repeats):
        done = subprocess.run(command, env=_ENV_AT_START, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"the M={M} run failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    steps = results[0]["steps"]
    cold, cold_fit, warm, setup = (
        statistics.median(r[key] for r in results) for key in ("cold", "cold_fit", "warm", "setup")
    )
    rss = max(r["rss_one_fit"] for r in results)
    per_process = " ".join(f"{r['rss_one_fit']:.2f}" for r in results)
    print(
        f"M={M} K={K} b={b}: R={data.shape().rounds} rounds, {steps} steps; data setup {setup:.2f} s; "
        f"median of {args.repeats} fresh processes:"
    )
    print(
        f"  Lightning, training epoch, first fit in the process {cold:7.3f} s  {cold / steps * 1e3:6.1f} ms/step"
        f"   (whole trainer.fit {cold_fit:.3f} s)"
    )
    print(f"  Lightning, training epoch, second fit               {warm:7.3f} s  {warm / steps * 1e3:6.1f} ms/step")
    print(
        f"  minimal loop (autograd, warm, this process)         {minimal:7.3f} s  {minimal / steps * 1e3:6.1f} ms/step"
        f"   Lightning (second fit) / minimal = {warm / minimal:.2f}x"
    )
    print(
        f"  peak RSS of the Lightning process after one fit: {rss:.2f} GB (largest of {per_process}; "
        f"after two fits {max(r['rss_end'] for r in results):.2f})"
    )
    print(f"  goal < {GOAL_MEMORY_GB:g} GB: {'met' if rss < GOAL_MEMORY_GB else 'NOT met'}")
    if torch.device(args.device).type == "cuda":
        gpu = " ".join(f"{r['gpu_one_fit']:.3f}" for r in results)
        print(
            f"  peak GPU memory (max_memory_allocated): Lightning after one fit "
            f"{max(r['gpu_one_fit'] for r in results):.3f} GB (per process {gpu}; after two fits "
            f"{max(r['gpu_end'] for r in results):.3f}), minimal loop {minimal_gpu:.3f} GB"
        )


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-machines", type=int, default=64, help="M (default 64)")
    parser.add_argument("--local-steps", type=int, default=64, help="K (default 64)")
    parser.add_argument("--batch-size", type=int, default=1, help="b (default 1)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each (default 7)")
    parser.add_argument("--large-machines", type=int, default=1024, help="M of the scale run, 0: skip (default 1024)")
    parser.add_argument("--large-local-steps", type=int, default=16, help="K of the scale run (default 16)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--profile", action="store_true", help="also cProfile one Lightning epoch")
    parser.add_argument("--root", default=os.path.join(ROOT, "data"), help="folder holding MNIST/raw/")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to train (default cpu)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch.cuda.is_available() is False")
    _quiet()
    if args.child:
        _child(args)
        return

    import lightning

    M, K, b = args.num_machines, args.local_steps, args.batch_size
    data, setup_seconds = make_data(M, K, b, args.root)
    threads = "--threads" if args.threads is not None else "torch default"
    print(
        f"torch {torch.__version__}, lightning {lightning.__version__}, {torch.get_num_threads()} torch threads "
        f"({threads}), {len(os.sched_getaffinity(0))} CPUs; {_load()}"
    )
    on_cuda = args.device == "cuda"
    if on_cuda:
        props = torch.cuda.get_device_properties(0)
        print(
            f"device cuda: {props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}; "
            "clocks read after torch.cuda.synchronize()"
        )
    print(
        f"M={M} K={K} b={b}: R={data.shape().rounds} rounds, {data.shape().rounds * K} steps; "
        f"data setup (load + partition, not timed below) {setup_seconds:.2f} s"
    )

    dev = args.device
    minimal_epoch(data, K, device=dev)  # warm-up: first-call costs, allocator
    minimal_epoch(data, K, closed_form=True, device=dev)
    lightning_epoch(data, K, device=dev)
    times: dict[str, list[float]] = {"minimal": [], "closed": [], "lightning": [], "fit": []}
    peak_gpu = {"minimal": 0.0, "closed": 0.0, "lightning": 0.0}  # GB, the largest over the runs
    for _ in range(args.repeats):
        _reset_peak_gpu_memory(dev)
        seconds, steps, W, bias = minimal_epoch(data, K, device=dev)
        peak_gpu["minimal"] = max(peak_gpu["minimal"], peak_gpu_gb(dev))
        times["minimal"].append(seconds)
        _reset_peak_gpu_memory(dev)
        seconds, _, W_cf, bias_cf = minimal_epoch(data, K, closed_form=True, device=dev)
        peak_gpu["closed"] = max(peak_gpu["closed"], peak_gpu_gb(dev))
        times["closed"].append(seconds)
        _reset_peak_gpu_memory(dev)
        epoch, fit, l_steps, l_W, l_bias = lightning_epoch(data, K, device=dev)
        peak_gpu["lightning"] = max(peak_gpu["lightning"], peak_gpu_gb(dev))
        times["lightning"].append(epoch)
        times["fit"].append(fit)

    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"median of {args.repeats} alternating runs, after one warm-up run of each:")
    for label, key in (
        ("minimal loop (autograd)", "minimal"),
        ("minimal loop (closed form)", "closed"),
        ("Lightning, training epoch", "lightning"),
        ("Lightning, whole trainer.fit", "fit"),
    ):
        runs = " ".join(f"{s:.3f}" for s in times[key])
        print(f"  {label:29s} {med[key]:7.3f} s/epoch  {med[key] / steps * 1e3:6.3f} ms/step   (runs: {runs})")
    ratio = med["lightning"] / med["minimal"]
    verdict = "met" if ratio <= GOAL_RATIO else "NOT met"
    print(f"Lightning / minimal (autograd) = {ratio:.2f}x   goal <= {GOAL_RATIO:g}x: {verdict}")
    print(f"Lightning / minimal (closed form) = {med['lightning'] / med['closed']:.2f}x")
    if on_cuda:
        print(
            f"peak GPU memory (max_memory_allocated, largest over the runs): minimal (autograd) "
            f"{peak_gpu['minimal'] * 1e3:.1f} MB, minimal (closed form) {peak_gpu['closed'] * 1e3:.1f} MB, "
            f"Lightning {peak_gpu['lightning'] * 1e3:.1f} MB"
        )

    diff = max((W - l_W).abs().max().item(), (bias - l_bias).abs().max().item())
    diff_cf = max((W_cf - l_W).abs().max().item(), (bias_cf - l_bias).abs().max().item())
    scale = max(l_W.abs().max().item(), l_bias.abs().max().item())
    same = max(diff, diff_cf) <= TOLERANCE and steps == l_steps
    print(
        f"cross-check, final x after {steps} steps (minimal) and {l_steps} (Lightning): "
        f"max |x_minimal - x_Lightning| = {diff:.2e} (autograd), {diff_cf:.2e} (closed form), max |x| = {scale:.3f}: "
        f"{'same' if same else 'DIFFERENT'} (tolerance {TOLERANCE:g})"
    )
    if args.profile:
        _profile(data, K, steps, device=dev)

    if args.large_machines > 0:
        _scale_run(args)
    print(f"done; {_load()}")


if __name__ == "__main__":
    main()
