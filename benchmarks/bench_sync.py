"""One synchronisation against one all-reduce of the same bytes, on 2 gloo processes (1 thread each).

Each process holds a model of a few large ``nn.Linear`` layers with biases and a ``LayerNorm`` between
them (so small tensors share buckets with large ones, as in real models), stepped once by
``SlowcalSGD`` so that its averaged state w exists, and a ``PeriodicAverager`` over it; and a second copy
of the same model and state with ``PeriodicAverager(..., bucket_views=True)``. Per size, in a shuffled
order every rep after a warm-up, each process times (a) ``averager.sync()`` (x and w averaged, the
schedule check on, as shipped), (b) the same with ``bucket_views=True``, and (c) ``dist.all_reduce`` of
one flat float32 tensor of the same bytes, each after a barrier, so that none includes the ranks' skew;
and, for the record, (d) the ``bucket_views`` sync without the schedule check (``check_schedule=False``:
its small all-gather left out), (e) the shipped sync's own all-reduces alone: one tensor per bucket
of its layout, all in flight at once, without the copies, the division or the check, and (f) the floor
of any exact average of those bytes: (c) followed by the division of its result by 2. A rep's time is
the slower rank's; the table gives the medians, and each ratio is the median of the reps' ratios to
that rep's all-reduce (the host's drift cancels). Goal: (b)'s ratio <= 1.1.

``--digest`` prints, per size, a digest of rank 0's parameters and state after the timed syncs (the
ranks start from different models, so the first sync is a real average): two versions of the code
that average alike print the same digests.

    python benchmarks/bench_sync.py [--sizes 1M,10M,50M] [--reps 15] [--digest]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

GOAL = 1.1


def _parse_size(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def build_model(numel: int) -> nn.Module:
    """Four square ``nn.Linear`` layers (with biases) and a ``LayerNorm``: about ``numel`` parameters."""
    d = round(math.sqrt(numel / 4))
    return nn.Sequential(nn.Linear(d, d), nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, d))


def slower_ranks_medians(times: dict[str, list[float]], base: str) -> dict[str, Any]:
    """Every case's reps, the slower of the two ranks' at each (one all-gather a case, on every rank); on rank 0 each
    case's median time and the median of its reps' ratios to the same rep of ``base``, else ``{}``."""
    slower: dict[str, list[float]] = {}
    for name, mine in times.items():
        everyone = [torch.zeros(len(mine), dtype=torch.float64) for _ in range(2)]
        dist.all_gather(everyone, torch.tensor(mine, dtype=torch.float64))
        slower[name] = [float(v) for v in torch.stack(everyone).max(0).values]
    if dist.get_rank() != 0:
        return {}
    line: dict[str, Any] = {"reps": len(slower[base])}
    for name, each in slower.items():  # the median time, and the median of the reps' ratios
        line[name] = statistics.median(each)
        line[name + "_ratio"] = statistics.median(a / b for a, b in zip(each, slower[base]))
    return line


def _worker(rank: int, port: int, sizes: list[int], reps: int, digest: bool, in_place: int, chunk: int, queue) -> None:
    from lit_slowcal import PeriodicAverager, SlowcalSGD, _communication

    if in_place:
        _communication.IN_PLACE_BYTES = in_place
    if chunk:
        _communication.IN_PLACE_CHUNK_BYTES = chunk

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def build(numel: int, bucket_views: bool, check: bool = True) -> tuple[nn.Module, SlowcalSGD, PeriodicAverager]:
        torch.manual_seed(rank)  # every process starts elsewhere: the first average is not trivial
        model = build_model(numel)
        optimizer = SlowcalSGD(model.parameters(), lr=0.1)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()  # creates w
        averager = PeriodicAverager(model, optimizer, sync_every=1, bucket_views=bucket_views, check_schedule=check)
        return model, optimizer, averager

    for numel in sizes:
        model, optimizer, averager = build(numel, False)
        views = build(numel, True)  # the same model and state, synchronised with bucket_views=True
        unchecked = build(numel, True, check=False)  # and again, without the schedule check
        n = sum(p.numel() for p in model.parameters())
        flat = torch.randn(2 * n)  # the same bytes as x and w, one tensor
        alone = getattr(_communication, "IN_PLACE_BYTES", None)  # a version of the code without it: no argument
        layout = _communication.buckets(
            averager._tensors(), averager.options.bucket_cap_bytes, *[alone] if alone else []
        )
        own = [torch.randn(sum(t.numel() for t, _ in b)) for b in layout]  # one tensor per all-reduce of the sync
        floor = torch.randn(2 * n)  # the least an exact average of those bytes does: all-reduce, then divide
        names = ("sync", "all_reduce", "views", "unchecked", "own", "floor")
        times: dict[str, list[float]] = {name: [] for name in names}
        warmup = 2
        order = list(times)
        shuffle = random.Random(numel)  # the same order on both ranks
        for i in range(warmup + (reps if n < 20_000_000 else max(5, reps // 2))):
            shuffle.shuffle(order)  # no measurement always follows the same one
            for name in order:
                dist.barrier()
                start = time.perf_counter()
                if name == "all_reduce":
                    dist.all_reduce(flat)
                elif name == "floor":
                    dist.all_reduce(floor)
                    floor.div_(2)
                elif name == "own":
                    for work in [dist.all_reduce(t, async_op=True) for t in own]:
                        work.wait()
                elif name == "sync":
                    averager.sync()
                elif name == "unchecked":
                    unchecked[2].sync()
                else:
                    views[2].sync()
                seconds = time.perf_counter() - start
                if i >= warmup:
                    times[name].append(seconds)
            for t in (flat, *own):
                t.mul_(0.5)  # bounded values, outside the timing
        medians = slower_ranks_medians(times, "all_reduce")
        if rank == 0:
            line: dict[str, Any] = {"size": n, "buckets": len(layout), **medians}
            if digest:
                for key, (m, o) in {"digest": (model, optimizer), "views_digest": views[:2]}.items():
                    h = hashlib.sha256()
                    for p in m.parameters():
                        h.update(p.detach().numpy().tobytes())
                        h.update(o.state[p]["w"].numpy().tobytes())
                    line[key] = h.hexdigest()[:16]
            queue.put(line)
        del model, optimizer, averager, flat, own, views, unchecked, floor
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1M,10M,50M", help="parameter counts, comma-separated (1M, 10M, 50M)")
    p.add_argument("--reps", type=int, default=15, help="timed reps per size after 2 warm-ups (half above 20M)")
    p.add_argument("--digest", action="store_true", help="print a digest of rank 0's model and state after the syncs")
    p.add_argument(
        "--in-place-bytes",
        default="",
        help="reduce tensors of at least this many bytes alone (default the library's IN_PLACE_BYTES)",
    )
    p.add_argument(
        "--chunk-bytes", default="", help="pieces of the tensors reduced in place (default IN_PLACE_CHUNK_BYTES)"
    )
    args = p.parse_args()
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(
        _worker,
        args=(
            port,
            sizes,
            args.reps,
            args.digest,
            _parse_size(args.in_place_bytes) if args.in_place_bytes else 0,
            _parse_size(args.chunk_bytes) if args.chunk_bytes else 0,
            queue,
        ),
        nprocs=2,
        start_method="spawn",
    )
    print("one sync of SlowcalSGD (x and w) vs one all_reduce of the same bytes, 2 gloo processes, 1 thread each")
    print(
        "(medians of the slower rank; ratio: the median of the reps' ratios to the rep's all_reduce; 'sync': as "
        "shipped; 'bucket_views': PeriodicAverager(bucket_views=True); 'unchecked': bucket_views with "
        "check_schedule=False; 'its all-reduces': the shipped sync's buckets (how many) all-reduced alone, no copy, "
        "division or check; 'floor': the all_reduce followed by its division by 2, the least an exact average does)"
    )
    print(
        f"{'parameters':>12} {'MB/process':>10} {'reps':>5} {'all_reduce ms':>13} {'sync ms':>8} {'ratio':>6} "
        f"{'bucket_views ms':>15} {'ratio':>6}  {'goal':<20} {'unchecked ms':>12} {'ratio':>6} "
        f"{'its all-reduces ms':>18} {'ratio':>6} {'floor ms':>8} {'ratio':>6}"
    )
    while not queue.empty():
        r = queue.get()
        met = "met" if r["views_ratio"] <= GOAL else "NOT met"
        digests = ""
        if "digest" in r:
            same = "the same" if r["digest"] == r["views_digest"] else "DIFFERENT: " + r["views_digest"]
            digests = f"  digest {r['digest']} (bucket_views: {same})"
        print(
            f"{r['size']:>12,} {8 * r['size'] / 1e6:>10.0f} {r['reps']:>5} {r['all_reduce'] * 1e3:>13.1f} "
            f"{r['sync'] * 1e3:>8.1f} {r['sync_ratio']:>6.3f} {r['views'] * 1e3:>15.1f} {r['views_ratio']:>6.3f}  "
            f"{f'<= {GOAL}x: {met}':<20} {r['unchecked'] * 1e3:>12.1f} {r['unchecked_ratio']:>6.3f} "
            f"{r['own'] * 1e3:>11.1f} ({r['buckets']:>3}) {r['own_ratio']:>6.3f} {r['floor'] * 1e3:>8.1f} "
            f"{r['floor_ratio']:>6.3f}" + digests
        )
    sys.exit(0)


if __name__ == "__main__":
    main()
