"""The link model against a shaped link: gloo processes in network namespaces, each link limited by ``tbf``.

For each P (``--procs``) and rate (``--rates``), ``shaped_link.py``'s namespaces are made (P processes, one a
namespace, every link shaped at the rate, both directions) and one worker runs in each, 1 thread; then the same
namespaces unshaped (``--rate none``: the veth pairs at the CPU's speed), to tell what the CPU costs of each case.
Per size (``--sizes``: parameters of ``bench_sync.py``'s model, four square ``nn.Linear`` layers and a
``LayerNorm``, stepped once by ``SlowcalSGD`` so that w exists), each worker times, after a barrier (a rep's
time is the slower rank's; one warm-up, then ``--reps``, the median):

- ``all_reduce``: ``dist.all_reduce`` of one float32 tensor of x's and w's bytes (8 bytes a parameter);
- ``exact``, ``bf16``, ``int8``: ``PeriodicAverager(model, optimizer, sync_every=1, compression=...).sync()``
  (x and w; after ``broadcast()``, which anchors both, so every timed round is coded; the machines' values
  moved apart before each, outside the timing), as shipped (the schedule check on).

and, with ``--training`` (default ``cnn,lm``), real training rounds of the app's models on their own data:
``cnn`` (the small CNN of docs/nonconvex.md, 11,274 parameters, on each process's MNIST shard, batch 32) and ``lm``
(the character transformer of ``configs/charlm.yaml``, 33,760 parameters, on each process's ``StdlibChars``
windows, batch 8): K = ``--local-steps`` SlowcalSGD steps, then the round's synchronisation through
``PeriodicAverager.step()`` (exact, and int8 as ``cnn_int8`` / ``lm_int8``); the sync is timed after a barrier
(the ranks' compute skew left out), and so is each round's compute. Each then also gives the round's time
(compute + sync, measured) against compute + the modelled sync, the time docs/time_to_accuracy.md models.

The model is the library's: the counts the averager added to its ``link_counts`` over the timed rounds
(``LinkCounts.of_syncs`` for the bare all-reduce), in seconds at ``Link(rate, latency)``, where the latency is
the link's own, measured in the same run: the median of a 4-byte ``all_reduce``, divided by its ring hops
2 (P - 1). The CPU's part is the unshaped run's time of the same case: where it is more than 20% of the
shaped time, the case is CPU-bound (the model of a link alone cannot be within 20% there). A case whose
modelled time is above ``--max-seconds`` a rep is left out (said so).

    python benchmarks/bench_shaped_link.py [--procs 2,4] [--rates 100mbit,1gbit] [--sizes 1M,10M] [--reps 3]
        [--training cnn,lm] [--local-steps 16] [--burst 256kb] [--no-slow-start-after-idle]

Needs root (network namespaces, ``tc``); anywhere else it refuses in one line (``shaped_link.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

from shaped_link import Plan, Refused, ShapedLink  # noqa: E402

from lit_slowcal.link import Link, LinkCounts, ring_hops  # noqa: E402

CASES = ("all_reduce", "exact", "bf16", "int8")
CPU_BOUND = 0.20  # the unshaped time's share of the shaped one above which the CPU, not the link, is the limit
GOAL = 0.20


def _parse_size(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def link_of(rate: str, latency: float = 0.0) -> Link:
    """The library's ``Link`` of a tc rate (``"100mbit"``, ``"1gbit"``, ``"500kbit"``: decimal bits, as tc's)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if match is None:
        raise ValueError(f"Invalid rate: {rate!r} (a tc rate in bits: 100mbit, 1gbit)")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match[2]]
    return Link(bandwidth=float(match[1]) * scale / 8, latency=latency)


# -- the worker, one in each namespace ------------------------------------------------------------------------


def _tx_bytes() -> int:
    """The bytes this namespace's end of its link has sent (frames: the TCP/IP and Ethernet headers included)."""
    return int(Path(f"/sys/class/net/{os.environ.get('GLOO_SOCKET_IFNAME', 'eth0')}/statistics/tx_bytes").read_text())


def _apart(tensors: list[Any], generator: Any) -> None:
    """The machines move apart (outside the timing), as a round of training would take them."""
    import torch

    with torch.no_grad():
        for t in tensors:
            t.add_(torch.randn(t.shape, generator=generator), alpha=1e-3)


def _training_setup(kind: str, rank: int, world: int) -> tuple[Any, Any, Any, int]:
    """The app's model of ``kind`` (``cnn`` or ``lm``), this process's share of its problem's training data and its
    loss, with the batch size of its docs (the CNN's 32, the LM's 8)."""
    import torch
    from torch.nn import functional

    from lit_slowcal.experiments.data.mnist import load_mnist
    from lit_slowcal.experiments.data.problems import VOCABULARY, StdlibChars
    from lit_slowcal.experiments.train.architectures import get_architecture

    torch.manual_seed(0)  # one initialisation on every machine, as the app's
    if kind == "cnn":
        x, y = load_mnist(ROOT / "data")[:2]
        model = get_architecture("cnn").build(784, 10)
        return model, (x[rank::world], y[rank::world]), functional.cross_entropy, 32
    data = StdlibChars().build(world, 1, None)
    shard = data.shards[rank]
    model = get_architecture("transformer").build(StdlibChars().input_dim, len(VOCABULARY))

    def next_token(logits: Any, targets: Any) -> Any:
        return functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return model, (data.train_x[shard], data.train_y[shard]), next_token, 8


def _training_rounds(
    kind: str, local_steps: int, rounds: int, rank: int, world: int, timed_sync: Any
) -> dict[str, Any]:
    """``rounds`` rounds of K local SlowcalSGD steps and their synchronisation: each round's compute and sync
    seconds (the slower rank's), and the library's counts of one round."""
    import time

    import torch

    from lit_slowcal import PeriodicAverager, SlowcalSGD

    name, _, code = kind.partition("_")
    model, (x, y), loss_fn, batch = _training_setup(name, rank, world)
    optimizer = SlowcalSGD(model.parameters(), lr=0.05)
    averager = PeriodicAverager(model, optimizer, sync_every=local_steps, compression=code or None)
    averager.broadcast()
    g = torch.Generator().manual_seed(rank)
    computes, syncs, before = [], [], None
    for r in range(rounds):
        start = time.perf_counter()
        for k in range(local_steps):
            rows = torch.randint(len(x), (batch,), generator=g)
            optimizer.zero_grad()
            loss_fn(model(x[rows]), y[rows]).backward()
            optimizer.step()
            if k < local_steps - 1:
                averager.step()
        computes.append(time.perf_counter() - start)
        if r == 1:
            before = averager.link_counts
        syncs.append(timed_sync(averager.step))  # the K-th step: the round's synchronisation
    added = averager.link_counts
    n = rounds - 1
    averager.remove_hooks()
    return {
        "case": kind, "size": sum(p.numel() for p in model.parameters()), "compute": computes[1:], "times": syncs[1:],
        "ring_bytes": (added.ring_bytes - before.ring_bytes) / n, "ring_hops": (added.ring_hops - before.ring_hops) // n,
        "bytes_per_sync": averager.bytes_per_sync(),
    }  # fmt: skip


def worker(
    out: Path,
    sizes: list[int],
    reps: int,
    rate: Optional[str],
    max_seconds: float,
    training: list[str],
    local_steps: int,
) -> None:
    import torch
    import torch.distributed as dist
    from bench_sync import build_model

    from lit_slowcal import PeriodicAverager, SlowcalSGD

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    bandwidth = link_of(rate).bandwidth if rate else None

    def slower(times: list[float]) -> list[float]:
        everyone = [torch.zeros(len(times), dtype=torch.float64) for _ in range(world)]
        dist.all_gather(everyone, torch.tensor(times, dtype=torch.float64))
        return torch.stack(everyone).max(0).values.tolist()

    def timed(fn: Any, n: int, before: Any = None) -> list[float]:
        times = []
        for _ in range(n):
            if before is not None:
                before()
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return slower(times)

    tiny = torch.ones(1)
    probe = timed(lambda: dist.all_reduce(tiny), 20)
    result: dict[str, Any] = {"procs": world, "rate": rate, "probe": statistics.median(probe), "cases": []}
    for numel in sizes:
        for case in CASES:
            torch.manual_seed(rank)  # every process starts elsewhere
            model = build_model(numel)
            n = sum(p.numel() for p in model.parameters())
            row: dict[str, Any] = {"case": case, "size": n}
            if case == "all_reduce":
                flat = torch.randn(2 * n)
                counts = LinkCounts.of_syncs(flat.numel() * 4, world)
                run, move = (lambda: dist.all_reduce(flat)), (lambda: flat.mul_(0.5))
            else:
                optimizer = SlowcalSGD(model.parameters(), lr=0.1)
                for p in model.parameters():
                    p.grad = torch.randn_like(p)
                optimizer.step()  # creates w
                compression = None if case == "exact" else case
                averager = PeriodicAverager(model, optimizer, sync_every=1, compression=compression)
                averager.broadcast()  # anchors x and w: every round below is coded
                counts = averager.engine.sent(averager._tensors(), world).link
                tensors = [*model.parameters(), *(optimizer.state[p]["w"] for p in model.parameters())]
                move = functools.partial(_apart, tensors, torch.Generator().manual_seed(rank))
                run = averager.sync
            modelled = counts.seconds(Link(bandwidth, 0.0)) if bandwidth else 0.0
            if modelled > max_seconds:
                row["skipped"] = modelled
                result["cases"].append(row)
                continue
            if case != "all_reduce":
                before = averager.link_counts
            sent = _tx_bytes()
            times = timed(run, 1 + reps, move)[1:]
            wire = slower([(_tx_bytes() - sent) / (1 + reps)])[0]  # what left the busiest end, a round
            if case != "all_reduce":  # the library's own counts, a round (the warm-up and the timed rounds alike)
                added = averager.link_counts
                syncs = added.syncs - before.syncs
                counts = LinkCounts(
                    syncs=1,
                    payload_bytes=(added.payload_bytes - before.payload_bytes) // syncs,
                    ring_bytes=(added.ring_bytes - before.ring_bytes) / syncs,
                    ring_hops=(added.ring_hops - before.ring_hops) // syncs,
                )
                row["bytes_per_sync"] = averager.bytes_per_sync()
                averager.remove_hooks()
            row.update(times=times, ring_bytes=counts.ring_bytes, ring_hops=counts.ring_hops, wire=wire)
            result["cases"].append(row)
    for kind in training:

        def one_sync(fn: Any) -> float:
            return timed(fn, 1)[0]

        sent = _tx_bytes()
        row = _training_rounds(kind, local_steps, 1 + reps, rank, world, one_sync)
        row["compute"] = slower(row["compute"])
        row["wire"] = slower([(_tx_bytes() - sent) / (1 + reps)])[0]  # a round's compute and sync traffic together
        result["cases"].append(row)
    if rank == 0:
        out.write_text(json.dumps(result))
    dist.destroy_process_group()


# -- the driver -----------------------------------------------------------------------------------------------


def measure(procs: int, rate: Optional[str], args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out = tmp / f"p{procs}-{rate or 'none'}.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "worker", str(out), args.sizes, str(args.reps)]
    argv += [rate or "none", str(args.max_seconds), args.training, str(args.local_steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    start = time.perf_counter()
    plan = Plan(procs, rate, burst=args.burst, slow_start_after_idle=not args.no_slow_start_after_idle)
    with ShapedLink(plan) as net:
        codes = net.run(argv, timeout=args.timeout, env=env)
    if any(codes):
        sys.exit(f"bench_shaped_link: the workers failed (P = {procs}, rate {rate}): exit statuses {codes}")
    result = json.loads(out.read_text())
    result["wall"] = time.perf_counter() - start
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        out, sizes, reps, rate, max_seconds, training, local_steps = sys.argv[2:9]
        worker(Path(out), [_parse_size(s) for s in sizes.split(",") if s], int(reps), None if rate == "none" else rate,
               float(max_seconds), [t for t in training.split(",") if t], int(local_steps))  # fmt: skip
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", default="2,4", help="numbers of processes, comma-separated (default 2,4)")
    p.add_argument("--rates", default="100mbit,1gbit", help="tc rates of every link, comma-separated")
    p.add_argument("--sizes", default="1M,10M", help="parameters, comma-separated (1M, 10M)")
    p.add_argument("--reps", type=int, default=3, help="timed reps per case after one warm-up (default 3)")
    p.add_argument("--max-seconds", type=float, default=2.5, help="leave out cases modelled above this a rep")
    p.add_argument("--training", default="cnn,lm", help="training rounds: cnn, lm, cnn_int8, lm_int8 ('' for none)")
    p.add_argument("--local-steps", type=int, default=16, help="K of the training rounds (default 16)")
    p.add_argument("--burst", default="256kb", help="tbf's burst (default 256kb)")
    p.add_argument(
        "--no-slow-start-after-idle",
        action="store_true",
        help="net.ipv4.tcp_slow_start_after_idle=0 in the processes' namespaces (default: the kernel's 1)",
    )
    p.add_argument("--timeout", type=float, default=300, help="seconds one P and rate may take (default 300)")
    args = p.parse_args()
    rates = args.rates.split(",")
    for rate in rates:
        link_of(rate)  # a rate the model cannot read is refused before anything is made
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for procs in [int(x) for x in args.procs.split(",")]:
                cpu = measure(procs, None, args, Path(tmp))
                unshaped = {(c["case"], c["size"]): c for c in cpu["cases"]}
                for rate in rates:
                    r = measure(procs, rate, args, Path(tmp))
                    latency = r["probe"] / ring_hops(procs)
                    link = link_of(rate, latency)
                    print(f"P = {procs}, {rate}: latency {latency * 1e6:.0f} us a hop (4-byte all_reduce {r['probe'] * 1e3:.2f} ms), "
                          f"{r['wall']:.0f} s in all; unshaped run {cpu['wall']:.0f} s", flush=True)  # fmt: skip
                    for c in r["cases"]:
                        rows.append((procs, rate, link, c, unshaped.get((c["case"], c["size"]))))
    except Refused as e:
        sys.exit(f"bench_shaped_link: refused: {e}")
    print()
    print(
        "one all_reduce / PeriodicAverager.sync() of SlowcalSGD (x and w) on P gloo processes, each in its own network"
    )
    print(
        "namespace on a link shaped by tbf (both directions), 1 thread each, medians of the slower rank; modelled: the"
    )
    print(
        "averager's link_counts of the timed rounds in seconds at Link(rate, the measured latency); unshaped: the same"
    )
    print(
        f"case on the same namespaces without tbf (the CPU's part); CPU-bound: unshaped > {CPU_BOUND:.0%} of measured;"
    )
    print("MB on ring: the model's bytes a process sends a round; on wire: what left its end of the link (the busiest")
    print("process's, a round, from the interface's tx_bytes); + CPU: modelled plus unshaped (the CPU's time and the")
    print("link's one after the other, as the time-to-accuracy model adds them), and the measured time against it")
    print(f"{'case':<11} {'params':>11} {'link':>8} {'P':>2} {'MB on ring':>10} {'MB on wire':>10} {'measured s':>10} {'modelled s':>10} "
          f"{'ratio':>6} {'unshaped s':>10} {'CPU-bound':>9} {'+ CPU s':>8} {'ratio':>6}  within {GOAL:.0%}")  # fmt: skip
    for procs, rate, link, c, cpu in rows:
        if "skipped" in c:
            print(
                f"{c['case']:<11} {c['size']:>11,} {rate:>8} {procs:>2}  left out: modelled {c['skipped']:.2f} s a rep"
            )
            continue
        counts = LinkCounts(syncs=1, ring_bytes=c["ring_bytes"], ring_hops=c["ring_hops"])
        got, modelled = statistics.median(c["times"]), counts.seconds(link)
        base = statistics.median(cpu["times"]) if cpu else float("nan")
        bound = base > CPU_BOUND * got
        met = "met" if abs(got / modelled - 1) <= GOAL else "NOT met"
        print(
            f"{c['case']:<11} {c['size']:>11,} {rate:>8} {procs:>2} {c['ring_bytes'] / 1e6:>10.2f} {c['wire'] / 1e6:>10.2f} {got:>10.3f} "
            f"{modelled:>10.3f} {got / modelled:>6.2f} {base:>10.3f} {'yes' if bound else 'no':>9} "
            f"{modelled + base:>8.3f} {got / (modelled + base):>6.2f}  {met}"
            + (" (CPU-bound)" if bound and met == "NOT met" else "")
        )
    rounds = [(procs, rate, link, c) for procs, rate, link, c, _ in rows if "compute" in c]
    if rounds:
        print()
        print("the training rounds whole: K steps' compute (measured) plus the sync, measured against compute plus the")
        print("modelled sync (the round time of docs/time_to_accuracy.md's model); medians, the slower rank's")
        print(f"{'case':<11} {'params':>11} {'link':>8} {'P':>2} {'compute s':>10} {'sync s':>10} {'round s':>10} {'modelled s':>10} {'ratio':>6}")  # fmt: skip
        for procs, rate, link, c in rounds:
            counts = LinkCounts(syncs=1, ring_bytes=c["ring_bytes"], ring_hops=c["ring_hops"])
            compute, sync = statistics.median(c["compute"]), statistics.median(c["times"])
            modelled = compute + counts.seconds(link)
            print(
                f"{c['case']:<11} {c['size']:>11,} {rate:>8} {procs:>2} {compute:>10.3f} {sync:>10.4f} "
                f"{compute + sync:>10.3f} {modelled:>10.3f} {(compute + sync) / modelled:>6.2f}"
            )


if __name__ == "__main__":
    main()
