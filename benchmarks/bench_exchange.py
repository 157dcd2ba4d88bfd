"""Two processes' sum of one tensor: gloo's all-reduce against an exchange (each process sends its values to the
other and adds what it receives), the choice behind ``lit_slowcal._communication.EXCHANGE_BYTES``.

2 gloo processes, 1 thread each, float32 tensors of the given sizes. Per size, interleaved reps (the order swapped
every rep), each after a barrier; the medians of rank 0's times and their ratio (exchange / all-reduce). Every rep
checks that the two sums have the same bits (a + b on one process, b + a on the other: the all-reduce's sum).

    python benchmarks/bench_exchange.py [--sizes 10K,100K,200K,400K,1M] [--reps 60]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _count(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _worker(rank: int, port: int, numel: int, reps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mine = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    received = torch.empty_like(mine)
    times: dict[str, list[float]] = {"all-reduce": [], "exchange": []}
    for rep in range(reps + 5):
        sums = {}
        for kind in ("all-reduce", "exchange") if rep % 2 else ("exchange", "all-reduce"):
            t = mine.clone()
            dist.barrier()
            start = time.perf_counter()
            if kind == "all-reduce":
                dist.all_reduce(t)
            else:
                works = [dist.isend(t, 1 - rank), dist.irecv(received, 1 - rank)]
                for work in works:
                    work.wait()
                t.add_(received)
            if rep >= 5:
                times[kind].append(time.perf_counter() - start)
            sums[kind] = t
        assert torch.equal(sums["all-reduce"], sums["exchange"]), "the two sums differ"
    if rank == 0:
        ring, exchange = (statistics.median(times[k]) * 1e3 for k in ("all-reduce", "exchange"))
        print(f"{numel:>11,} {numel * 4 / 2**20:>8.2f} {ring:>10.3f} {exchange:>10.3f} {exchange / ring:>6.2f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10K,100K,200K,400K,1M", help="float32 values, comma-separated")
    parser.add_argument("--reps", type=int, default=60, help="timed reps per size after 5 warm-ups")
    args = parser.parse_args()
    print(f"{'values':>11} {'MiB':>8} {'ring ms':>10} {'exch. ms':>10} {'ratio':>6}   (same bits in every rep)")
    for size in args.sizes.split(","):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_worker, args=(port, _count(size), args.reps), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
