"""What a compressed synchronisation costs in time, against the exact one, on 2 gloo processes (1 thread each).

Each process holds four square ``nn.Linear`` layers (about N parameters) stepped once by ``SlowcalSGD`` (so
that w exists) and three ``PeriodicAverager``s over copies of it: exact, ``compression="bf16"`` and
``compression="int8"`` (error feedback on). After a first sync (exact: it sets the anchors) each is timed,
alternating, after a barrier; a rep's time is the slower rank's; the table gives the medians, the ratio to
the exact sync, and the bytes one machine sends on the ring per sync. On loopback the link is a memory copy:
the time is the encoding and the reduce's compute, which a slow link's transfer time saved would have to
outweigh (docs/communication.md); the bytes are what that link would carry.

    python benchmarks/bench_compression.py [--sizes 1M,10M] [--reps 9]
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import time

import torch
from torch import nn

CODES = (None, "bf16", "int8")


def _parse_size(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _worker(rank: int, port: int, sizes: list[int], reps: int, queue) -> None:
    import torch.distributed as dist

    from lit_slowcal import PeriodicAverager, SlowcalSGD

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for numel in sizes:
        d = round(math.sqrt(numel / 4))
        averagers = {}
        for code in CODES:
            torch.manual_seed(rank)
            model = nn.Sequential(*[nn.Linear(d, d) for _ in range(4)])
            optimizer = SlowcalSGD(model.parameters(), lr=0.1)
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            optimizer.step()
            averager = PeriodicAverager(model, optimizer, sync_every=1, compression=code)
            averager.sync()  # exact: the anchors
            averagers[code] = (model, averager)
        times: dict = {code: [] for code in CODES}
        sent: dict = {}
        for i in range(1 + reps):
            for code, (model, averager) in averagers.items():
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p), alpha=1e-3)  # a round's change
                before = averager.link_counts.ring_bytes
                dist.barrier()
                start = time.perf_counter()
                averager.sync()
                seconds = time.perf_counter() - start
                sent[code] = averager.link_counts.ring_bytes - before
                if i:
                    times[code].append(seconds)
        slower = {}
        for code, mine in times.items():
            everyone = [torch.zeros(len(mine), dtype=torch.float64) for _ in range(2)]
            dist.all_gather(everyone, torch.tensor(mine, dtype=torch.float64))
            slower[code] = statistics.median(torch.stack(everyone).max(0).values.tolist())
        if rank == 0:
            n = sum(p.numel() for p in averagers[None][0].parameters())
            queue.put({"size": n, "reps": reps, "seconds": slower, "sent": sent})
        del averagers
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1M,10M", help="parameter counts, comma-separated")
    p.add_argument("--reps", type=int, default=9, help="timed reps per size after a warm-up")
    args = p.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    mp.start_processes(_worker, args=(port, sizes, args.reps, queue), nprocs=2, start_method="spawn")
    print(
        "one sync of SlowcalSGD (x and w), exact vs compressed, 2 gloo processes, 1 thread each (slower rank, medians)"
    )
    print(f"{'parameters':>12} {'code':>6} {'sync ms':>9} {'x exact':>8} {'ring MB':>8} {'x exact':>8}")
    while not queue.empty():
        r = queue.get()
        base_s, base_b = r["seconds"][None], r["sent"][None]
        for code in CODES:
            s, b = r["seconds"][code], r["sent"][code]
            print(
                f"{r['size']:>12,} {code or 'exact':>6} {s * 1e3:>9.2f} {s / base_s:>8.2f} {b / 1e6:>8.2f} "
                f"{b / base_b:>8.3f}"
            )


if __name__ == "__main__":
    main()
