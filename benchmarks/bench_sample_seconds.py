"""The compute time of one sample on one machine, for the time-to-target figures (``report --sample_seconds``).

``python benchmarks/bench_sample_seconds.py``: for each architecture of the app (the paper's linear model, the small
CNN), one machine alone (a plain ``nn.Module``, one torch thread) takes SGD steps of b = 1 MNIST-shaped sample:
forward, cross-entropy, backward and the step. Prints the median over 5 repeats of the mean time of a step of 2,000
(the linear model), 300 (the CNN) or 100 (the linear model 1,000 times larger, 784 -> 10,000), with the parameters'
count.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from lit_slowcal.experiments.train.architectures import ARCHITECTURES


def step_seconds(arch: str, steps: int) -> tuple[float, int]:
    """The mean seconds of one SGD step of b = 1 of ``arch``, and its parameters' count."""
    torch.manual_seed(0)
    # "x1000": the linear model with 1,000 times its parameters (784 -> 10,000), the time-to-target's larger model.
    model = nn.Linear(784, 10_000) if arch == "linear x1000" else ARCHITECTURES[arch].build(784, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    classes = 10_000 if arch == "linear x1000" else 10
    x, y = torch.randn(max(steps, 20), 1, 784), torch.randint(0, classes, (max(steps, 20), 1))
    for i in range(20):  # warm-up
        opt.zero_grad()
        F.cross_entropy(model(x[i]), y[i]).backward()
        opt.step()
    start = time.perf_counter()
    for i in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x[i]), y[i]).backward()
        opt.step()
    return (time.perf_counter() - start) / steps, sum(p.numel() for p in model.parameters())


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'model':<12} {'parameters':>10}  seconds a sample (median of 5)  torch {torch.__version__}")
    for arch, steps in (("linear", 2000), ("cnn", 300), ("linear x1000", 100)):
        times = [step_seconds(arch, steps)[0] for _ in range(5)]
        print(
            f"{arch:<12} {step_seconds(arch, 10)[1]:>10,}  {statistics.median(times):.3g} (min {min(times):.3g}, max {max(times):.3g})"
        )


if __name__ == "__main__":
    main()
