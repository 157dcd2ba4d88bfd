"""One blocking exact sync of parameters (SGD) against torch's own averager, on 2 gloo processes (1 thread each).

Each process holds copies of ``bench_sync.py``'s model (four square ``nn.Linear`` layers and a ``LayerNorm``),
each stepped by ``torch.optim.SGD`` (no state: the sync averages the parameters alone): (a) "ours",
``PeriodicAverager(model, SGD, sync_every=1).sync()`` with the default options, as shipped (bucket views on, since
no optimizer state is averaged; the schedule check in the rounds that ``check_every`` = 16 divides: round 0's an
all-gather, the later ones carried in the round's own message: at 100k an exchange), and (b)
torch's ``torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager(period=1).average_parameters``
of its own copy (flatten, divide, all-reduce, the parameters rebound to views of the flat result).
Per size, in a shuffled order every rep after a warm-up, each process times each after a barrier;
a rep's time is the slower rank's. The table gives the medians and, per contender, the median of
the reps' ratios to the same rep's torch averager (the host's drift cancels). Goal: (a) <= 1.0x.
With ``--parts`` (where the time goes), also: the default with the check's all-gather in every round (``check_every = 1``),
with ``check_schedule=False``, with ``bucket_views=False`` (the layout without views: tensors of 512 KiB or more
reduced in place, the others flattened), the same with every tensor flattened, and one bare ``all_reduce`` of
the same bytes. ``--runs 3``: three runs in fresh processes, and per size the min / median / max of their medians.

``--digest`` prints, per size, a digest of rank 0's parameters after the syncs of every contender: they average
alike (2 processes: a / 2 + b / 2 == (a + b) / 2 in binary floating point, away from subnormals), so the digests
are equal.

    python benchmarks/bench_vs_torch.py [--sizes 100K,1M,10M] [--reps 30] [--runs 1] [--parts] [--digest]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import socket
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sync import _parse_size, build_model, slower_ranks_medians  # noqa: E402

GOAL = 1.0


def _worker(rank: int, port: int, sizes: list[int], reps: int, parts: bool, digest: bool, in_place: int, queue) -> None:
    import warnings

    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    from lit_slowcal import PeriodicAverager, _communication

    if in_place:
        _communication.IN_PLACE_BYTES = in_place
    warnings.filterwarnings("ignore", "When period is 1")  # torch's advice to use DDP instead
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def build(numel: int) -> tuple[torch.nn.Module, torch.optim.SGD]:
        torch.manual_seed(rank)  # every process starts elsewhere: the first average is not trivial
        model = build_model(numel)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for p in model.parameters():
            p.grad = torch.randn_like(p)  # torch's averager averages the parameters that have a gradient
        optimizer.step()
        return model, optimizer

    for numel in sizes:
        kept: list[Any] = []  # every contender's model, for the digests and until the size is done

        def averager(**settings: Any) -> PeriodicAverager:
            model, optimizer = build(numel)
            kept.append(model)
            return PeriodicAverager(model, optimizer, sync_every=1, **settings)

        ours = averager()
        tmodel, _ = build(numel)
        theirs = PeriodicModelAverager(period=1, warmup_steps=0)
        n = sum(p.numel() for p in tmodel.parameters())
        flat = torch.randn(n)
        run = {"ours": ours.sync, "torch": lambda m=tmodel, a=theirs: a.average_parameters(m.parameters())}
        models = {"ours": ours.modules[0], "torch": tmodel}
        if parts:
            checked_every_round = averager()
            checked_every_round.check_every = 1
            run["checked"] = checked_every_round.sync
            run["unchecked"] = averager(check_schedule=False).sync
            no_views = averager(bucket_views=False)
            run["no_views"] = no_views.sync
            models["no_views"] = no_views.modules[0]
            flattened = averager(bucket_views=False)

            def flat_sync(a=flattened) -> None:  # every tensor into the flattened buckets, none reduced in place
                was, _communication.IN_PLACE_BYTES = _communication.IN_PLACE_BYTES, 2**62
                try:
                    a.sync()
                finally:
                    _communication.IN_PLACE_BYTES = was

            run["flattened"] = flat_sync
            models["flattened"] = flattened.modules[0]

            def bare(t: torch.Tensor = flat) -> None:
                dist.all_reduce(t)

            run["all_reduce"] = bare
        times: dict[str, list[float]] = {name: [] for name in run}
        warmup = 3
        order = list(run)
        shuffle = random.Random(numel)  # the same order on both ranks
        for i in range(warmup + reps):
            shuffle.shuffle(order)
            for name in order:
                dist.barrier()
                start = time.perf_counter()
                run[name]()
                seconds = time.perf_counter() - start
                if i >= warmup:
                    times[name].append(seconds)
            flat.mul_(0.5)
        medians = slower_ranks_medians(times, "torch")
        if rank == 0:
            line: dict[str, Any] = {"size": n, **medians}
            if digest:
                for key, m in models.items():
                    h = hashlib.sha256()
                    for p in m.parameters():
                        h.update(p.detach().numpy().tobytes())
                    line[key + "_digest"] = h.hexdigest()[:16]
            queue.put(line)
        kept.clear()
        del models, tmodel, ours, flat, run
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100K,1M,10M", help="parameter counts, comma-separated")
    p.add_argument("--reps", type=int, default=30, help="timed reps per size after 3 warm-ups")
    p.add_argument("--runs", type=int, default=1, help="independent runs (fresh processes each)")
    p.add_argument("--parts", action="store_true", help="also time the sync without the check and a bare all_reduce")
    p.add_argument(
        "--in-place-bytes", default="", help="reduce tensors of at least this many bytes alone (default the library's)"
    )
    p.add_argument("--digest", action="store_true", help="print a digest of rank 0's parameters after the syncs")
    args = p.parse_args()
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    in_place = _parse_size(args.in_place_bytes) if args.in_place_bytes else 0
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(
        "one blocking exact sync of SGD's parameters vs torch's PeriodicModelAverager.average_parameters, 2 gloo "
        "processes, 1 thread each (medians of the slower rank; ratio: the median of the reps' ratios to the same "
        "rep's torch averager; 'ours': PeriodicAverager as shipped"
        + (
            "; 'checked': with the schedule check in every round (check_every = 1); 'unchecked': "
            "check_schedule=False; 'no_views': bucket_views=False (the layout without bucket views); 'flattened': "
            "bucket_views=False with every tensor flattened into a bucket; 'all_reduce': one bare all_reduce of "
            "the same bytes)"
            if args.parts
            else ")"
        )
    )
    print(f"{'run':>3} {'parameters':>12} {'reps':>5} {'torch ms':>9} {'ours ms':>8} {'ratio':>6} {'goal':<16}")
    ratios: dict[int, list[tuple[float, float, float]]] = {}
    for run in range(args.runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(
            _worker,
            args=(port, sizes, args.reps, args.parts, args.digest, in_place, queue),
            nprocs=2,
            start_method="spawn",
        )
        while not queue.empty():
            r = queue.get()
            ratios.setdefault(r["size"], []).append((r["ours"], r["torch"], r["ours_ratio"]))
            met = "met" if r["ours_ratio"] <= GOAL else "NOT met"
            text = (
                f"{run + 1:>3} {r['size']:>12,} {r['reps']:>5} {r['torch'] * 1e3:>9.2f} {r['ours'] * 1e3:>8.2f} "
                f"{r['ours_ratio']:>6.3f} {f'<= {GOAL}x: {met}':<16}"
            )
            if args.parts:
                text += "".join(
                    f"  {name} {r[name] * 1e3:.2f} ms {r[name + '_ratio']:.3f}"
                    for name in ("checked", "unchecked", "no_views", "flattened", "all_reduce")
                )
            if args.digest:
                digests = {key[: -len("_digest")]: value for key, value in r.items() if key.endswith("_digest")}
                same = len(set(digests.values())) == 1
                text += f"  digest {r['ours_digest']} ({'all the same' if same else f'DIFFERENT: {digests}'})"
            print(text, flush=True)
    if args.runs > 1:
        print(f"over {args.runs} runs (each run's medians): min / median / max")
        for size, each in ratios.items():
            ours, theirs, ratio = ([e[i] for e in each] for i in range(3))
            spread = lambda v, scale=1.0: "/".join(f"{f(v) * scale:.3g}" for f in (min, statistics.median, max))  # noqa: E731
            print(
                f"{size:>12,} parameters: ours {spread(ours, 1e3)} ms, torch {spread(theirs, 1e3)} ms, "
                f"ratio {spread(ratio)} ({'all <= ' if max(ratio) <= GOAL else 'NOT all <= '}{GOAL}x)"
            )


if __name__ == "__main__":
    main()
