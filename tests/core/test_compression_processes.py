"""Compressed synchronisation on several gloo processes: the same bits as the same machines simulated in
one process (the two-stage reduce's chunks, one per process, do not change a value), for int8 and bf16,
with and without partial participation and error feedback, with 2 and 3 processes (uneven chunks)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lit_slowcal import PeriodicAverager, SimulatedMachines, SlowcalSGD

pytestmark = pytest.mark.slow  # two and three processes

M_LOCAL = 2
ROUNDS = 4
K = 2


def _train(m: int, first: int, compression: str, participation, feedback: bool) -> list[torch.Tensor]:
    """Machines ``first .. first + m - 1`` of a SlowcalSGD run (every machine its own gradients), as
    simulated machines of this process; returns this process's parameters and w after the rounds."""
    torch.manual_seed(0)  # every machine starts from the same weights
    machines = SimulatedMachines(nn.Sequential(nn.Linear(700, 3), nn.Linear(3, 2)), m)
    optimizer = SlowcalSGD(machines.parameters(), lr=0.05)
    averager = PeriodicAverager(
        machines, optimizer, sync_every=K, compression=compression, error_feedback=feedback,
        participation=participation, participation_seed=3,
    )  # fmt: skip
    for p in machines.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates w; every machine still at the start
    averager.broadcast()  # the anchors: every round is compressed (an exact first round would mean in another order)
    gens = [torch.Generator().manual_seed(100 + first + i) for i in range(m)]
    for _ in range(ROUNDS * K):
        for p in machines.parameters():
            p.grad = torch.stack([torch.randn(p.shape[1:], generator=g) for g in gens])
        optimizer.step()
        averager.step()
    return [t.detach().clone() for t, _ in averager._tensors()] + [torch.tensor(averager.link_counts.payload_bytes)]


def _worker(rank: int, world: int, init_file: str, out: str, cases: list) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = [_train(M_LOCAL, rank * M_LOCAL, *case) for case in cases]
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


CASES = [("int8", None, True), ("bf16", None, True), ("int8", 2, True), ("int8", None, False)]


@pytest.mark.parametrize("world", [2, 3])
def test_processes_end_with_the_bits_of_the_simulated_machines(tmp_path, world):
    out = str(tmp_path / "run")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "rendezvous"), out, CASES), nprocs=world, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in range(world)]
    for c, case in enumerate(CASES):
        simulated = _train(world * M_LOCAL, 0, *case)
        for r in range(world):
            got = ranks[r][c]
            for k, (a, b) in enumerate(zip(got[:-1], simulated[:-1])):
                assert torch.equal(a, b[r * M_LOCAL : (r + 1) * M_LOCAL]), (case, r, k)
            assert int(got[-1]) == int(simulated[-1]), case  # the same bytes counted
