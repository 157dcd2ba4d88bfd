"""What the round-boundary and schedule guarantees cost: per step on the paper's main job, per sync on 2 processes.

1. The main job's training epoch (SLowcal-SGD, M = 16, K = 16, b = 1: 3,760 steps in one process,
   through ``Trainer`` + ``PeriodicAveragingStrategy`` + the app's model, as
   ``benchmarks/bench_local_training.py`` times it), with the strategy as shipped against a baseline
   strategy that drops everything the guarantees added on this path: the gradient hook that counts
   backward passes, and the round closes at validation, checkpoints and the end of fit (the
   schedule check itself never runs with one process). The runs alternate; medians and the ratio
   are printed, and both must end with bit-identical parameters. Goal: < 2% slower.
2. The check of the ranks' counts at every synchronisation (one all-gather of two integers) on 2
   gloo processes: ``averager.sync()`` with ``check_schedule`` on and off, for the CNN of
   ``examples/lightning_cnn.py`` (18,244 floats a sync) and a 10M-float model.

    python benchmarks/bench_boundaries.py [--repeats 5] [--syncs 200]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_local_training import ROOT, _quiet, lightning_epoch, make_data  # noqa: E402

from lit_slowcal import PeriodicAverager  # noqa: E402
from lit_slowcal.strategy import PeriodicAveragingStrategy  # noqa: E402


class _Unguarded(PeriodicAveragingStrategy):
    """The strategy without the guarantees' per-step and per-boundary work (the baseline)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, check_schedule=False, **kwargs)

    def _create_averagers(self) -> None:
        super()._create_averagers()
        for averager in self.averagers.values():
            averager.remove_hooks()

    def close_rounds(self) -> bool:
        return False


def main_job(repeats: int) -> None:
    data, _ = make_data(16, 16, 1, os.path.join(ROOT, "data"))
    times: dict[str, list[float]] = {"shipped": [], "baseline": []}
    finals = {}
    import lit_slowcal.strategy as strategy_module

    for i in range(repeats + 1):
        for name, cls in (("shipped", PeriodicAveragingStrategy), ("baseline", _Unguarded)):
            strategy_module.PeriodicAveragingStrategy = cls  # what lightning_epoch builds
            try:
                seconds, _, steps, weight, bias = lightning_epoch(data, 16)
            finally:
                strategy_module.PeriodicAveragingStrategy = PeriodicAveragingStrategy
            if i:  # the first round is a warm-up
                times[name].append(seconds / steps * 1e6)
            finals[name] = (weight, bias)
    same = all(torch.equal(a, b) for a, b in zip(finals["shipped"], finals["baseline"]))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"main job epoch ({steps} steps, {repeats} runs each, medians): shipped {med['shipped']:.2f} us/step, "
          f"baseline {med['baseline']:.2f} us/step, ratio {med['shipped'] / med['baseline']:.4f} (goal < 1.02); "
          f"final parameters bit-identical: {same}")  # fmt: skip


def _sync_worker(rank: int, port: int, syncs: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for label, numel in (("CNN, 18,244 floats", 18244), ("10M floats", 10_000_000)):
        averagers = {}
        for check in (True, False):  # the same model twice: with the check in every round, and without it
            torch.manual_seed(0)
            model = torch.nn.Linear(numel, 1, bias=False)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            averagers[check] = PeriodicAverager(model, optimizer, sync_every=1, check_schedule=check)
            averagers[check].check_every = 1
        n = syncs if numel < 1e6 else max(5, syncs // 20)
        result = {}
        for _ in range(3):  # alternate, keep each side's best of three
            for check in (True, False):
                averager = averagers[check]
                dist.barrier()
                start = time.perf_counter()
                for _ in range(n):
                    averager.sync()
                result.setdefault(check, []).append((time.perf_counter() - start) / n * 1e6)
        if rank == 0:
            on, off = min(result[True]), min(result[False])
            queue.put(
                f"sync on 2 gloo processes, {label}: with the check {on:.0f} us, without {off:.0f} us, ratio {on / off:.3f}"
            )
    dist.destroy_process_group()


def per_sync(syncs: int) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_sync_worker, args=(port, syncs, queue), nprocs=2, start_method="spawn")
    while not queue.empty():
        print(queue.get())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--syncs", type=int, default=200)
    args = p.parse_args()
    _quiet()
    main_job(args.repeats)
    per_sync(args.syncs)


if __name__ == "__main__":
    main()
