"""SLowcal-SGD on an FSDP2-sharded character-level transformer: 2 machines of 2 shards, 4 gloo processes.

The processes form a 2 x 2 device mesh ``("replicate", "shard")``: the two processes along ``shard``
are one machine and shard its model with ``fully_shard`` (each block, then the root); the two
machines each take their own stream of batches from the repository's README.md and docs, step
``SlowcalSGD`` locally, and ``PeriodicAverager`` averages their shards (x and w) over the replicate
group every K steps. Each shard process takes half of its machine's batch (FSDP2 averages the
gradients). At the end every process checks that all four hold the same full parameters::

    python examples/sharded_lm.py --steps 160 --sync-every 8

prints the training loss (the mean over both machines' batches and a round's steps) every few rounds,
the first and last round's loss, and the agreement; it exits non-zero if anything fails.
"""

from __future__ import annotations

import argparse
import math
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn

from lit_slowcal import PeriodicAverager, SlowcalSGD

REPO = Path(__file__).resolve().parents[1]
VOCAB = [chr(c) for c in range(32, 127)] + ["\n"]  # printable ASCII and newline; anything else reads as "?"
WORLD = 4  # 2 machines (replicate) x 2 shards


def load_text() -> Tensor:
    """README.md and docs/*.md but sharded.md (which records this example's output), concatenated, as
    character ids."""
    paths = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "sharded.md")]
    text = "\n".join(p.read_text(encoding="utf-8") for p in paths)
    index = {c: i for i, c in enumerate(VOCAB)}
    unknown = index["?"]
    return torch.tensor([index.get(c, unknown) for c in text], dtype=torch.long)


class CausalBlock(nn.Module):
    """A pre-norm transformer block with causal self-attention."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class CharLM(nn.Module):
    """Character embeddings and learned positions, causal blocks, a linear head over the vocabulary: the
    logits of every position, ``(batch * length, vocabulary)``."""

    def __init__(self, context: int, width: int = 32, heads: int = 2, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), width)
        self.position = nn.Parameter(0.02 * torch.randn(context, width))
        self.blocks = nn.ModuleList(CausalBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, len(VOCAB))

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids) + self.position[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).flatten(0, 1))  # 2-D: a view out of the root would escape FSDP2's hooks


def batches(text: Tensor, args: argparse.Namespace, replica: int, shard: int):
    """This process's half of its machine's batches: windows of ``context + 1`` characters at offsets
    drawn from the machine's own generator, so both shard processes of a machine draw the same."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + replica)
    half = args.batch // 2
    for _ in range(args.steps):
        starts = torch.randint(0, len(text) - args.context - 1, (args.batch,), generator=g)
        windows = torch.stack([text[s : s + args.context + 1] for s in starts[shard * half : (shard + 1) * half]])
        yield windows[:, :-1], windows[:, 1:]


def full_parameters(model: nn.Module) -> Tensor:
    """Every parameter gathered whole (``full_tensor()``, a collective over the shard group), flattened."""
    from torch.distributed.tensor import DTensor

    whole = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return torch.cat([p.detach().flatten().double() for p in whole])


def train(rank: int, port: int, args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120)
    )
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replica, shard = mesh["replicate"].get_local_rank(), mesh["shard"].get_local_rank()

    torch.manual_seed(args.seed)  # the same x_0 everywhere; broadcast() makes sure of it
    model = CharLM(args.context)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = SlowcalSGD(model.parameters(), lr=args.lr)
    averager = PeriodicAverager(
        model, optimizer, sync_every=args.sync_every, process_group=mesh["replicate"].get_group()
    )
    averager.broadcast()

    text = load_text()
    losses: list[float] = []  # each round's loss, the mean over both machines' batches and the round's steps
    round_sum = torch.zeros(())
    for step, (x, y) in enumerate(batches(text, args, replica, shard), start=1):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y.flatten())
        loss.backward()
        optimizer.step()
        averager.step()
        round_sum += loss.detach()
        if step % args.sync_every == 0 or step == args.steps:
            dist.all_reduce(round_sum)  # over all four processes: both machines, both halves of each batch
            steps_in_round = (step - 1) % args.sync_every + 1
            losses.append(round_sum.item() / (WORLD * steps_in_round))
            round_sum.zero_()
            if rank == 0 and (len(losses) % args.print_every == 0 or step == args.steps):
                print(f"round {len(losses):3d}  step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    averager.close_round()  # every machine holds the same model

    params = full_parameters(model)
    gathered = [torch.empty_like(params) for _ in range(WORLD)]
    dist.all_gather(gathered, params)
    differences = [float((other - gathered[0]).abs().max()) for other in gathered]
    if rank == 0:
        print(f"parameters: {params.numel()}, {averager.num_syncs} synchronisations")
        print("checksums: " + " ".join(f"{float(p.sum()):.10f}" for p in gathered))
        print(f"max difference from rank 0: {max(differences):.3g}")
        print(f"first loss {losses[0]:.4f}  last loss {losses[-1]:.4f}")
    dist.barrier()  # no process tears gloo down while a peer still talks to it
    dist.destroy_process_group()
    if any(d != 0 for d in differences) or not all(map(math.isfinite, losses)):  # NaN differs too
        raise RuntimeError(f"rank {rank}: the processes disagree ({max(differences):.3g}) or the loss diverged")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, default=160, help="optimizer steps of every machine")
    p.add_argument("--sync-every", type=int, default=8, help="K")
    p.add_argument("--lr", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--batch", type=int, default=16, help="sequences in a machine's batch (even: each shard process takes half)"
    )
    p.add_argument("--context", type=int, default=64, help="characters a sequence")
    p.add_argument("--print-every", type=int, default=4, help="rounds between printed losses")
    p.add_argument("--port", type=int, default=0, help="the rendezvous port (default: a free one)")
    args = p.parse_args(argv)
    if args.batch % 2 or args.steps < 1:
        p.error("--batch must be even and --steps positive")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    mp.spawn(train, args=(args.port or free_port(), args), nprocs=WORLD, join=True)
    print(f"{args.steps} steps on {WORLD} processes in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    try:
        main()
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:  # a process raised, or died
        sys.exit(f"sharded_lm: a process failed:\n{err}")
