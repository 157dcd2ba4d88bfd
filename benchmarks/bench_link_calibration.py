"""The ring model of a link against this machine: calibrate on gloo all-reduces, then predict real runs' syncs.

1. Two gloo processes (1 thread each) time ``dist.all_reduce`` of one float32 tensor at log-spaced
   sizes from 1 KB to 100 MB (each after a barrier, in increasing and decreasing order in turn; a rep's
   time is the slower rank's; medians), and
   fit the ring model for P = 2, ``t = 2 * latency + n / bandwidth``, by least squares on the
   relative error (so that the small sizes count as much as the large ones).
2. Two real 2-process runs, whose every synchronisation is timed on each rank from the averager's
   sync pre-hook (after the ranks' schedule check, which lines them up) to the end of ``sync()``: the
   average and the optimizer's pre/post-sync work; a sync's time is the slower rank's.
   (a) ``examples/lightning_cnn.py`` as its docstring runs it (``--devices 2 --sync-every 8 --max-steps 200``);
   (a') the same CNN's syncs alone, in spawned processes without the Trainer, a barrier before each;
   (b) a plain torch loop over a 10M-parameter model (``bench_sync.py``'s), SlowcalSGD, K = 2.
   Each run goes once per layout (``--layouts``): "copies", the averager as shipped, and "views",
   ``bucket_views=True`` (the example's ``--bucket-views``: the tensors live in flat buffers that the
   sync all-reduces where they lie).
   Each prediction is the fitted model's all-reduce of the bytes one sync sends: the sum over the
   averaged tensors of one machine's ``numel * element_size``. The whole ``sync()``, the schedule
   check included (and so any wait for the other rank), is printed beside it; the model leaves it out.
3. The floor at the same point of the same runs: every second sync, its pre-hook first times a bare
   ``dist.all_reduce`` of one float32 tensor of the sync's bytes and its division by 2 (the least any
   exact average of those bytes does), printed beside the prediction ("bare"); the syncs measured are
   the others, so that none follows it.

Goal: predicted within 20% of measured.

    python benchmarks/bench_link_calibration.py [--reps 15] [--layouts copies,views]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from lit_slowcal.link import Link

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIZES = [int(10 ** (3 + 5 * i / 8)) // 4 * 4 for i in range(9)]  # bytes, 1 KB ... 100 MB, log-spaced
GOAL = 0.20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ring_seconds(nbytes: float, participants: int, latency: float, bandwidth: float) -> float:
    """The all-reduce time of the ring model at the fitted link (``lit_slowcal.link.Link.all_reduce_seconds``)."""
    return Link(bandwidth=bandwidth, latency=latency).all_reduce_seconds(nbytes, participants)


def _slower(times: list[float]) -> list[float]:
    """Per rep, the slower of the two ranks' times (a collective)."""
    import torch.distributed as dist

    everyone = [torch.zeros(len(times), dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, torch.tensor(times, dtype=torch.float64))
    return torch.stack(everyone).max(0).values.tolist()


# -- 1. calibration ---------------------------------------------------------------------------


def _calibrate_worker(rank: int, port: int, reps: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensors = {n: torch.randn(n // 4) for n in SIZES}
    times: dict[int, list[float]] = {n: [] for n in SIZES}
    for i in range(2 + reps):  # the sizes alternate within every rep, up and down in turn; 2 warm-ups
        for n, t in list(tensors.items())[:: 1 if i % 2 else -1]:
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            seconds = time.perf_counter() - start
            t.mul_(0.5)
            if i >= 2:
                times[n].append(seconds)
    medians = {n: statistics.median(_slower(v)) for n, v in times.items()}
    if rank == 0:
        queue.put(medians)
    dist.destroy_process_group()


def calibrate(reps: int) -> dict[int, float]:
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_calibrate_worker, args=(_port(), reps, queue), nprocs=2, start_method="spawn")
    return queue.get()


def fit(measured: dict[int, float]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of ``t = 2 * latency + n / bandwidth`` minimising the relative error."""
    n = torch.tensor(list(measured), dtype=torch.float64)
    t = torch.tensor(list(measured.values()), dtype=torch.float64)
    a = torch.stack([torch.ones_like(n), n], 1) / t[:, None]  # (2 latency + n / bw) / t - 1
    coef = torch.linalg.lstsq(a, torch.ones_like(t)[:, None]).solution[:, 0]
    return float(coef[0]) / 2, 1 / float(coef[1])


# -- 2. real runs -----------------------------------------------------------------------------


def _time_syncs(record: list[tuple[float, float, Optional[float]]]) -> None:
    """Time every ``PeriodicAverager.sync()`` of this process: (from the pre-hook, whole, bare) seconds. Every
    second sync (the same ones on every rank), the pre-hook first times the floor at that point of the run:
    a bare ``dist.all_reduce`` of one float32 tensor of the sync's bytes and its division ("bare"; ``None``
    on the others); such a sync's own times are left out of the sync's figures."""
    import torch.distributed as dist

    from lit_slowcal import PeriodicAverager

    original = PeriodicAverager.sync
    bare: dict[int, Tensor] = {}  # per size, the bare all-reduce's tensor

    def sync(self: PeriodicAverager) -> None:
        marks: list[float] = []
        floor: list[float] = []

        def pre_hook(averager: PeriodicAverager) -> None:
            if len(record) % 2:
                n = _sync_bytes(averager) // 4
                flat = bare.setdefault(n, torch.zeros(n))
                begin = time.perf_counter()
                dist.all_reduce(flat)
                flat.div_(2)
                floor.append(time.perf_counter() - begin)
            marks.append(time.perf_counter())

        handle = self.register_sync_pre_hook(pre_hook)
        start = time.perf_counter()
        try:
            original(self)
        finally:
            handle.remove()
        end = time.perf_counter()
        record.append((end - marks[0], end - start, floor[0] if floor else None))

    PeriodicAverager.sync = sync  # type: ignore[method-assign]


def _sync_bytes(averager) -> int:
    """Bytes one machine sends in one sync: its slice of every averaged tensor, ``numel * element_size``."""
    return sum((t[0] if s else t).numel() * t.element_size() for t, s in averager._tensors())


def _write(out: Path, rank: int, record: list, nbytes: int, name: str = "rank") -> None:
    (out / f"{name}{rank}.json").write_text(json.dumps({"syncs": record, "bytes": nbytes}))


def cnn_run(out: Path, layout: str) -> None:
    """Rank r of ``examples/lightning_cnn.py`` (Lightning launches the other rank with the same command);
    ``layout`` "views": with ``--bucket-views``."""
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "examples"))
    import lightning_cnn
    from lightning.pytorch.callbacks import Callback

    record: list[tuple[float, float, Optional[float]]] = []
    _time_syncs(record)
    found: list = []

    class Bytes(Callback):
        def on_train_batch_end(self, trainer, *args) -> None:  # the strategy's averagers exist by now
            if not found:
                found.extend(trainer.strategy.averagers.values())

    argv = ["--devices", "2", "--sync-every", "8", "--max-steps", "200", "--run-dir", str(out / "run")]
    argv += ["--bucket-views"] if layout == "views" else []
    trainer, _ = lightning_cnn.main([*argv, "--no-progress-bar"], callbacks=[Bytes()])
    _write(out, trainer.global_rank, record, sum(_sync_bytes(a) for a in found))


def _loop_worker(rank: int, port: int, out: Path, layouts: list[str]) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(HERE))
    from bench_sync import build_model

    from lit_slowcal import PeriodicAverager, SlowcalSGD

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    record: list[tuple[float, float, Optional[float]]] = []
    _time_syncs(record)
    # (a') the CNN's syncs alone: no Trainer, no training between them, a barrier before each.
    sys.path.insert(0, str(ROOT / "examples"))
    import lightning_cnn

    for layout in layouts:
        views = layout == "views"
        cnn = lightning_cnn.CNN()
        cnn_optimizer = SlowcalSGD(cnn.parameters(), lr=0.01)
        for p in cnn.parameters():
            p.grad = torch.zeros_like(p)
        cnn_optimizer.step()  # creates w
        cnn_averager = PeriodicAverager(cnn, cnn_optimizer, sync_every=1, bucket_views=views)
        for _ in range(90):
            dist.barrier()
            cnn_averager.sync()
        _write(out, rank, record[10:], _sync_bytes(cnn_averager), f"alone-{layout}")  # after 10 warm-ups
        cnn_averager.remove_hooks()
        record.clear()
        torch.manual_seed(0)
        model = build_model(10_000_000)
        d = model[0].in_features
        optimizer = SlowcalSGD(model.parameters(), lr=0.01)
        averager = PeriodicAverager(model, optimizer, sync_every=2, bucket_views=views)
        averager.broadcast()
        g = torch.Generator().manual_seed(rank)
        with averager:
            for _ in range(40):
                x = torch.randn(16, d, generator=g)
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), x).backward()
                optimizer.step()
        _write(out, rank, record, _sync_bytes(averager), f"loop-{layout}")
        record.clear()
        del model, optimizer, averager
    dist.destroy_process_group()


def _measured(out: Path, name: str = "rank") -> tuple[int, list[float], list[float], list[float]]:
    """(bytes, the syncs' times from the pre-hook, their whole times, the bare all-reduces' times): per
    sync the slower rank's; the syncs with a bare all-reduce before them give only that."""
    ranks = [json.loads((out / f"{name}{r}.json").read_text()) for r in range(2)]
    assert len(ranks[0]["syncs"]) == len(ranks[1]["syncs"]) and ranks[0]["bytes"] == ranks[1]["bytes"]
    pairs = list(zip(ranks[0]["syncs"], ranks[1]["syncs"]))
    plain = [(a, b) for a, b in pairs if a[2] is None]
    average = [max(a[0], b[0]) for a, b in plain]
    whole = [max(a[1], b[1]) for a, b in plain]
    bare = [max(a[2], b[2]) for a, b in pairs if a[2] is not None]
    return ranks[0]["bytes"], average, whole, bare


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15, help="timed all-reduces per size after 2 warm-ups")
    p.add_argument(
        "--layouts",
        default="copies,views",
        help="the syncs measured: 'copies' (as shipped), 'views' (bucket_views=True), or both, comma-separated",
    )
    p.add_argument("mode", nargs="?", default="all", help=argparse.SUPPRESS)  # "cnn OUT LAYOUT": one rank of run (a)
    p.add_argument("out", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("layout", nargs="?", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode == "cnn":
        cnn_run(Path(args.out), args.layout)
        return
    layouts = args.layouts.split(",")
    if not layouts or set(layouts) - {"copies", "views"}:
        sys.exit(f"Invalid --layouts: {args.layouts!r} (copies, views, or both, comma-separated)")
    os.environ["OMP_NUM_THREADS"] = "1"
    measured = calibrate(args.reps)
    latency, bandwidth = fit(measured)
    print(
        "gloo all-reduce, 2 processes, 1 thread each: measured (medians) vs the fitted ring model t = 2 latency + n / bw"
    )
    print(f"{'bytes':>12} {'measured ms':>12} {'model ms':>10} {'error':>7}")
    for n, t in measured.items():
        model = ring_seconds(n, 2, latency, bandwidth)
        print(f"{n:>12,} {t * 1e3:>12.3f} {model * 1e3:>10.3f} {(model - t) / t:>+7.1%}")
    print(
        f"fit: latency {latency * 1e6:.1f} us, bandwidth {bandwidth / 1e9:.3f} GB/s ({bandwidth * 8 / 1e9:.2f} Gbit/s)"
    )

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        for layout in layouts:
            out = Path(tmp) / f"cnn-{layout}"
            out.mkdir()
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "cnn", str(out), layout],
                cwd=tmp, env=env, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            if proc.returncode:
                sys.exit(f"the CNN run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            rows.append((f"(a) examples/lightning_cnn.py, K = 8, 200 steps; {layout}", *_measured(out)))
        out = Path(tmp) / "loop"
        out.mkdir()
        import torch.multiprocessing as mp

        mp.start_processes(_loop_worker, args=(_port(), out, layouts), nprocs=2, start_method="spawn")
        for layout in layouts:
            rows.append((f"(a') the same CNN, 80 syncs alone; {layout}", *_measured(out, f"alone-{layout}")))
        for layout in layouts:
            rows.append((f"(b) 10M parameters, loop, K = 2, 40 steps; {layout}", *_measured(out, f"loop-{layout}")))
    print()
    print(
        "syncs of real 2-process runs (SlowcalSGD: x and w): predicted by the fit vs measured (medians, slower rank);"
    )
    print("'bare': a dist.all_reduce of one float32 tensor of the same bytes and its division, timed at the same point")
    print("of the same run (every second sync, before it; those syncs are left out of the sync's figures)")
    print(f"{'run':<58} {'bytes/sync':>12} {'syncs':>5} {'predicted ms':>13} {'measured ms':>12} {'error':>7}  "
          f"{'whole sync ms':>13} {'bare ms':>8} {'error':>7} {'sync/bare':>9}  goal")  # fmt: skip
    for name, nbytes, average, whole, bare in rows:
        predicted = ring_seconds(nbytes, 2, latency, bandwidth)
        got, floor = statistics.median(average), statistics.median(bare)
        error = (predicted - got) / got
        met = "met" if abs(error) <= GOAL else "NOT met"
        print(
            f"{name:<58} {nbytes:>12,} {len(average):>5} {predicted * 1e3:>13.3f} {got * 1e3:>12.3f} {error:>+7.1%}  "
            f"{statistics.median(whole) * 1e3:>13.3f} {floor * 1e3:>8.3f} {(predicted - floor) / floor:>+7.1%} "
            f"{got / floor:>9.2f}  within {GOAL:.0%}: {met}"
        )


if __name__ == "__main__":
    main()
