"""Time one optimizer.step() of SlowcalSGD against torch.optim.SGD on a ~10M-parameter model (CPU).

Gradients are filled with random values once; only step() is timed. The optimizers are timed in
turn, round after round, so a slow spell on a shared machine hits all of them alike; the figure is
the median over rounds, after warm-up. Goal: SlowcalSGD at most 2.5x SGD (it moves two tensors, w
and x, where SGD moves one).

    python benchmarks/bench_optimizer.py [--layers large|small] [--threads N] [--rounds 50] [--warmup 5]
"""

import argparse
import os
import statistics
import time

import torch
from torch import nn

from lit_slowcal import SlowcalSGD


def build_model(layers: str) -> nn.Module:
    if layers == "large":
        # 2 * (2048 * 2048 + 2048) + (2048 * 1024 + 1024) + (1024 * 10 + 10) = 10,501,130 parameters in 8 tensors
        model = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 2048), nn.Linear(2048, 1024), nn.Linear(1024, 10))
    else:
        # 4000 * (50 * 50 + 50) = 10,200,000 parameters in 8000 tensors: per-tensor overhead shows
        model = nn.Sequential(*(nn.Linear(50, 50) for _ in range(4000)))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", choices=["large", "small"], default="large")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="default: the CPUs available")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    optimizers = {}
    for name, make in {
        "SlowcalSGD (foreach)": lambda ps: SlowcalSGD(ps, lr=args.lr, weight_decay=args.weight_decay, foreach=True),
        "SlowcalSGD (single-tensor)": lambda ps: SlowcalSGD(
            ps, lr=args.lr, weight_decay=args.weight_decay, foreach=False
        ),
        "SlowcalSGD (default)": lambda ps: SlowcalSGD(ps, lr=args.lr, weight_decay=args.weight_decay),
        "SGD (foreach)": lambda ps: torch.optim.SGD(
            ps, lr=args.lr, momentum=0.0, weight_decay=args.weight_decay, foreach=True
        ),
    }.items():
        model = build_model(args.layers)
        optimizers[name] = make(model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))

    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for round_ in range(args.warmup + args.rounds):
        for name, opt in optimizers.items():
            start = time.perf_counter()
            opt.step()
            elapsed = time.perf_counter() - start
            if round_ >= args.warmup:
                times[name].append(elapsed)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {n_params:,} parameters in {n_tensors} tensors, "
        f"lr={args.lr}, weight_decay={args.weight_decay}, median of {args.rounds} steps after {args.warmup} warm-up"
    )
    sgd = statistics.median(times["SGD (foreach)"])
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"{name:28s} {median * 1e3:8.3f} ms/step   {median / sgd:5.2f}x SGD")
    ratio = statistics.median(times["SlowcalSGD (default)"]) / sgd
    print(f"SlowcalSGD / SGD = {ratio:.2f} (goal <= 2.5: {'met' if ratio <= 2.5 else 'not met'})")


if __name__ == "__main__":
    main()
