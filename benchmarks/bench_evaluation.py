"""Time the per-evaluation and per-step pieces a stacked sweep repeats, each against its former form in this process.

On MNIST's 10,000 test images, one torch thread, each timing the best of ``--repeats`` runs of ``--calls`` calls:

1. The test loss: ``rounds.cross_entropy`` (the classes along the first dimension) against ``F.cross_entropy``.
2. A training step's cross-entropy, forward and backward, for the rows of one stacked step: 240 (T = 15 trials
   of M = 16 machines, b = 1) and 3,072 (3 trials of Minibatch-SGD at M = 16, K = 64).
3. The test product (``objective.affine_rows``) per point: 64 points in one pass (a stacked group's evaluations
   waiting for their training objective) in blocks of 1,024 rows (the default), against 3 points a pass (the
   seeds of one K evaluated together, as before) in blocks of 2,048 (the former).

Each line gives both times, their ratio, and whether the two give the same values bit for bit (and, for the
cross-entropy, the same gradient and gradient layout).

    python benchmarks/bench_evaluation.py [--calls 50] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lit_slowcal.experiments.data.mnist import load_mnist  # noqa: E402
from lit_slowcal.experiments.measure.objective import affine_rows  # noqa: E402
from lit_slowcal.experiments.train.rounds import cross_entropy  # noqa: E402


def best_ms(fn, calls: int, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return min(times)


def line(name: str, new_ms: float, old_ms: float, same: bool) -> None:
    print(
        f"{name:<46} {new_ms:8.3f} ms  vs {old_ms:8.3f} ms  ratio {new_ms / old_ms:5.2f}  same bits: {same}", flush=True
    )


def with_grad(loss_fn, z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = z.detach().requires_grad_()
    loss = loss_fn(z, y)
    (grad,) = torch.autograd.grad(loss.sum(), z)
    return loss.detach(), grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _, _, test_x, test_y = load_mnist(ROOT / "data")
    g = torch.Generator().manual_seed(0)
    points = [(torch.randn(10, 784, generator=g) * 0.05, torch.randn(10, generator=g) * 0.1) for _ in range(64)]
    logits = torch.addmm(points[0][1], test_x, points[0][0].T)
    print(
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, one thread", flush=True
    )

    new = lambda: cross_entropy(logits, test_y)
    old = lambda: F.cross_entropy(logits, test_y)
    same = torch.equal(new(), old())
    line(
        "test loss, 10,000 samples",
        best_ms(new, args.calls, args.repeats),
        best_ms(old, args.calls, args.repeats),
        same,
    )

    for rows in (240, 3072):
        z, y = torch.randn(rows, 10, generator=g) * 3, torch.randint(0, 10, (rows,), generator=g)
        ours = lambda: with_grad(lambda a, b: cross_entropy(a, b, "none"), z, y)
        torchs = lambda: with_grad(lambda a, b: F.cross_entropy(a, b, reduction="none"), z, y)
        (a, ga), (b, gb) = ours(), torchs()
        same = torch.equal(a, b) and torch.equal(ga, gb) and ga.stride() == gb.stride()
        line(f"training step's loss and gradient, {rows} rows", best_ms(ours, args.calls, args.repeats),
             best_ms(torchs, args.calls, args.repeats), same)  # fmt: skip

    weights, biases = [w for w, _ in points], [b for _, b in points]
    now = lambda: affine_rows(test_x, weights, biases, rows=1024)

    def before() -> list[torch.Tensor]:
        return [
            z for i in range(0, 63, 3) for z in affine_rows(test_x, weights[i : i + 3], biases[i : i + 3], rows=2048)
        ]

    same = all(torch.equal(a, b) for a, b in zip(now()[:63], before()))
    calls = max(1, args.calls // 25)
    line("test product a point: 64 a pass vs 3 a pass", best_ms(now, calls, args.repeats) / 64,
         best_ms(before, calls, args.repeats) / 63, same)  # fmt: skip


if __name__ == "__main__":
    main()
