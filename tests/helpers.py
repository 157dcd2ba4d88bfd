"""Shared by the tests that start the CLI in a subprocess, and by those that spawn gloo ranks."""

import contextlib
import os
import socket
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]

# Rendezvous variables that in-process trainers of other tests leave in os.environ; a subprocess
# inheriting them would join a process group that no longer exists.
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def subprocess_env(**extra: str) -> dict[str, str]:
    """os.environ for a clean launch: no rendezvous, W&B or test-hook variables, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCH_VARS and not k.startswith(("WANDB_", "LIT_SLOWCAL_")) and k not in ("KILL", "FAIL")
    }
    env.update(extra)
    return env


class Batches:
    """An iterable of ready batches (a list would be read as several dataloaders)."""

    def __init__(self, batches):
        self.batches = list(batches)

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


class Quadratics:
    """A small heterogeneous problem in float64: machine i minimises 0.5 (x - b_i)^T A_i (x - b_i),
    with its own SPD A_i and minimum b_i, and sees at its t-th gradient a fixed noise xi_{t,i}."""

    def __init__(self, machines: int = 4, dim: int = 3, steps: int = 64, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        f64 = torch.float64
        self.machines, self.dim = machines, dim
        q = torch.randn(machines, dim, dim, generator=g, dtype=f64)
        self.A = [q[i] @ q[i].T / dim + 0.3 * torch.eye(dim, dtype=f64) for i in range(machines)]
        self.b = [3 * torch.randn(dim, generator=g, dtype=f64) for _ in range(machines)]
        self.noise = 0.1 * torch.randn(steps, machines, dim, generator=g, dtype=f64)
        self.x0 = torch.randn(dim, generator=g, dtype=f64)

    def grad(self, i: int, x, t: int):
        """Machine i's t-th stochastic gradient at x."""
        return self.A[i] @ (x - self.b[i]) + self.noise[t, i]

    def stacked_grad(self, xs, t: int):
        """The gradients of all machines at their own points, stacked: ``(M, dim)``."""
        import torch

        return torch.stack([self.grad(i, xs[i], t) for i in range(self.machines)])


def ref_adaptive_slowcal(
    q,
    lr,
    rounds,
    k,
    *,
    beta=1.0,
    beta2=0.999,
    eps=1e-8,
    power=1.0,
    weights="slowcal",
    second_moment="adam",
    weight_decay=0.0,
    average_v=False,
):
    """AdaptiveSlowcal written out by hand in float64 (plain loops over machines, steps and coordinates' vectors):
    ``rounds`` rounds of ``k`` steps on each of ``q.machines`` machines of ``Quadratics`` ``q``, every round ending
    with the average of x and w (and v with ``average_v``); y = beta x + (1 - beta) w. Returns y, x, w and every
    machine's v ``(M, dim)``."""
    import torch

    m = q.machines
    x, w = q.x0.clone(), q.x0.clone()
    vs = [torch.zeros_like(x) for _ in range(m)]
    alpha = (lambda t: (t + 1.0) ** power) if weights == "slowcal" else (lambda t: float(t) ** power if t else 0.0)
    t = 0
    for _ in range(rounds):
        xs, ws = [], []
        for i in range(m):
            xi, wi, v = x.clone(), w.clone(), vs[i]
            for j in range(k):
                s = t + j
                y = beta * xi + (1 - beta) * wi
                g = q.grad(i, y, s)
                if second_moment == "adam":
                    v = beta2 * v + (1 - beta2) * g * g
                    denom = (v / (1 - beta2 ** (s + 1))).sqrt() + eps
                else:
                    v = v + g * g
                    denom = v.sqrt() + eps
                wi = wi - lr * (g / denom + weight_decay * y)
                c = alpha(s + 1) / sum(alpha(r) for r in range(s + 2))
                xi = (1 - c) * xi + c * wi
            xs.append(xi)
            ws.append(wi)
            vs[i] = v
        x, w, t = sum(xs) / m, sum(ws) / m, t + k
        if average_v:
            vs = [sum(vs) / m] * m
    return {"param": beta * x + (1 - beta) * w, "x": x, "w": w, "v": torch.stack(vs)}


def resumed(build: Callable[[], tuple[Any, Any, Any]], machines, optimizer, averager, generator):
    """``build()``'s fresh (machines, optimizer, averager) with the given ones' states loaded, and a generator in
    ``generator``'s state: what a run resumed from a checkpoint taken now holds."""
    saved = (machines.state_dict(), optimizer.state_dict(), averager.state_dict(), generator.get_state())
    machines, optimizer, averager = build()
    machines.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    averager.load_state_dict(saved[2])
    generator = torch.Generator()
    generator.set_state(saved[3])
    return machines, optimizer, averager, generator


def reloaded(machines, optimizer, averager, make_optimizer):
    """New machines, optimizer and averager restored from the states of the given ones, as a resumed
    process would have them: the module's parameters zeroed first, then every state loaded."""
    import copy

    import torch

    from lit_slowcal import PeriodicAverager

    saved = copy.deepcopy((machines.state_dict(), optimizer.state_dict(), averager.state_dict()))
    machines = copy.deepcopy(machines)
    with torch.no_grad():
        for p in machines.parameters():
            p.zero_()
    machines.load_state_dict(saved[0])
    optimizer = make_optimizer(machines.parameters())
    optimizer.load_state_dict(saved[1])
    averager = PeriodicAverager(machines, optimizer, sync_every=averager.sync_every)
    averager.load_state_dict(saved[2])
    return machines, optimizer, averager


# Both processes start together: each says it is ready, and waits for the other.
BARRIER = textwrap.dedent(
    """
    import pathlib, sys, time
    here = pathlib.Path(sys.argv[-1])
    (here / f"ready.{sys.argv[-2]}").touch()
    while len(list(here.glob("ready.*"))) < 2:
        time.sleep(0.002)
    """
)


@contextlib.contextmanager
def rendezvous_here() -> Iterator[None]:
    """``MASTER_ADDR`` and ``MASTER_PORT`` set to a free port of this host while the block runs (Lightning's
    rendezvous of spawned ranks), restored after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = pytest.MonkeyPatch()
    env.setenv("MASTER_ADDR", "127.0.0.1")
    env.setenv("MASTER_PORT", str(port))
    try:
        yield
    finally:
        env.undo()


def spawn_ranks(worker: Callable[..., None], nprocs: int, out: str) -> list[Any]:
    """Run ``worker(rank, rendezvous_file, out)`` on ``nprocs`` spawned processes; every rank's results, in
    rank order, as each saved them with ``finish_rank``."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(os.path.join(tmp, "rendezvous"), out), nprocs=nprocs, join=True)
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(nprocs)]


def finish_rank(results: Any, out: str, rank: int) -> None:
    """Save a spawned rank's ``results`` for ``spawn_ranks``, then end the process group once every rank saved."""
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


#: Test modules that import no Lightning, directly or through the helpers they import: marked ``torch_only``
#: (tests/conftest.py), left out of ``.ci/run``'s pass with the oldest Lightning.
TORCH_ONLY = (
    "test_accelerated", "test_adaptive", "test_average_layout", "test_compression", "test_compression_processes",
    "test_compression_state", "test_machine_state", "test_protocol", "test_scaffold", "test_sharded", "test_simulated",
)  # fmt: skip


# -- the int8 code of lit_slowcal.compression, written again from its documentation ---------------

INT8_BLOCK = 256  # Int8's default block


def int8_decoded(v: torch.Tensor) -> torch.Tensor:
    """A float32 block through the documented int8 code: scale max|v|/127 (float32), round half to even."""
    scale = (v.abs().max() / 127).to(torch.float32)
    if scale == 0:
        return torch.zeros_like(v)
    return torch.round(v / scale).clamp(-127, 127) * scale


def int8_blocks(v: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor through the int8 code, block by block."""
    return torch.cat([int8_decoded(v[i : i + INT8_BLOCK]) for i in range(0, v.numel(), INT8_BLOCK)])


def int8_mean(changes: torch.Tensor) -> torch.Tensor:
    """The two-stage int8 mean without error feedback of ``changes`` (one row a machine): each machine's code, the
    float32 sum in machine order divided by the machines, coded again."""
    total = int8_blocks(changes[0])
    for i in range(1, changes.shape[0]):
        total = total + int8_blocks(changes[i])
    return int8_blocks(total / changes.shape[0])
