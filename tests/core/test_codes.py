"""A code of one's own on the compression seam: a sparse code written against ``lit_slowcal.compression.Code``
alone (docs/communication.md, "A code of your own"), exact against a float64 hand reference, resumed exactly,
and the same on 2 processes as on simulated machines."""

import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lit_slowcal import PeriodicAverager, SimulatedMachines
from lit_slowcal.compression import Code
from tests.helpers import finish_rank, spawn_ranks


def _docs_code():
    """docs/communication.md's sparse code, run as it stands there."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "communication.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- sparse-code -->\n```python\n(.*?)```\n<!-- /sparse-code -->", text, re.S)
    assert block, "docs/communication.md: no sparse-code block"
    namespace: dict = {}
    exec(compile(block.group(1), "docs/communication.md", "exec"), namespace)
    assert issubclass(namespace["Sparse"], Code)
    return namespace["Sparse"]


Sparse = _docs_code()


M, D, K, ROUNDS, LR, TOP = 4, 6, 3, 4, 0.05, 2


def _data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(M, 5, D, generator=g, dtype=torch.float64), torch.randn(
        M, 5, 1, generator=g, dtype=torch.float64
    )


def _run(steps, state=None, machines=None, feedback=None):
    """``steps`` SGD steps of M simulated machines on their own least squares, a Sparse round every K steps."""
    torch.manual_seed(0)
    if machines is None:
        machines = SimulatedMachines(nn.Linear(D, 1, bias=False), M).double()
    optimizer = torch.optim.SGD(machines.parameters(), lr=LR)
    averager = PeriodicAverager(machines, optimizer, K, compression=Sparse(TOP), error_feedback=feedback)
    averager.broadcast()  # anchors: every round sparse
    if state is not None:
        averager.load_state_dict(state)
    a, b = _data()
    with averager:
        for _ in range(steps):
            optimizer.zero_grad()
            (0.5 * (machines(a) - b).square().sum()).backward()
            optimizer.step()
    return machines, averager


def _reference(feedback=True):
    """The same run by hand in float64: local gradient steps, and every K steps each machine's top-k of its change
    plus its error feedback, the error kept, the sum of the sent values in machine order over M."""
    torch.manual_seed(0)
    w0 = nn.Linear(D, 1, bias=False).double().weight.detach().reshape(D)
    a, b = _data()
    w = w0.repeat(M, 1)
    anchor, error = w0.clone(), torch.zeros(M, D, dtype=torch.float64)
    for step in range(1, K * ROUNDS + 1):
        for i in range(M):
            w[i] -= LR * (a[i].T @ (a[i] @ w[i] - b[i, :, 0]))
        if step % K:
            continue
        total = torch.zeros(D, dtype=torch.float64)
        for i in range(M):
            change = w[i] - anchor + error[i]
            top = torch.argsort(change.abs(), descending=True, stable=True)[:TOP]
            sent = torch.zeros(D, dtype=torch.float64)
            sent[top] = change[top]
            error[i] = change - sent if feedback else 0.0
            total += sent
        anchor = anchor + total / M
        w = anchor.repeat(M, 1)
    return w, error


def test_a_sparse_code_of_ones_own_is_exact_against_a_float64_hand_reference_with_error_feedback():
    machines, averager = _run(K * ROUNDS)
    want, error = _reference()
    got = machines.weight.detach().reshape(M, D)
    assert (got - want).abs().max().item() < 1e-12
    kept = averager.compressed.errors["param 0"].reshape(M, D)
    assert (kept - error).abs().max().item() < 1e-12 and error.abs().sum() > 0  # error feedback did something
    assert averager.num_syncs == ROUNDS
    message = TOP * 8 + TOP * 8  # int64 indices and float64 values, one tensor
    assert averager.bytes_per_sync() == message and averager.bytes_communicated == ROUNDS * message
    # The ring model's gather: every machine's message to each of the other M - 1.
    assert averager.link_counts.ring_bytes == ROUNDS * (M - 1) * message
    # Error feedback off: what a message lost is dropped, as the reference without it does.
    off = _run(K * ROUNDS, feedback=False)[0].weight.detach().reshape(M, D)
    want_off, _ = _reference(feedback=False)
    assert (off - want_off).abs().max().item() < 1e-12 and (off - got).abs().max().item() > 1e-6


def test_a_sparse_run_resumed_from_its_state_continues_bit_for_bit():
    whole, _ = _run(K * ROUNDS)
    first, averager = _run(K * 2 + 1)  # mid-round: after the second round and one step
    state = averager.state_dict()
    assert state["compression"]["ranks"][0]["errors"][0] is not None
    weights = first.weight.detach().clone()
    machines = SimulatedMachines(nn.Linear(D, 1, bias=False), M).double()
    with torch.no_grad():
        machines.weight.copy_(weights)
    resumed_machines, resumed = _run(K * ROUNDS - (K * 2 + 1), state=state, machines=machines)
    assert torch.equal(resumed_machines.weight, whole.weight)


def _two_process_worker(rank, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    a, b = _data()
    mine = slice(2 * rank, 2 * rank + 2)
    machines = SimulatedMachines(nn.Linear(D, 1, bias=False), 2).double()
    optimizer = torch.optim.SGD(machines.parameters(), lr=LR)
    averager = PeriodicAverager(machines, optimizer, K, compression=Sparse(TOP))
    averager.broadcast()
    with averager:
        for _ in range(K * ROUNDS):
            optimizer.zero_grad()
            (0.5 * (machines(a[mine]) - b[mine]).square().sum()).backward()
            optimizer.step()
    finish_rank(
        {"weight": machines.weight.detach().clone(), "bytes": averager.bytes_communicated,
         "ring": averager.link_counts.ring_bytes, "hops": averager.link_counts.ring_hops},
        out, rank,
    )  # fmt: skip


@pytest.mark.slow
def test_a_sparse_code_on_two_processes_gives_the_simulated_machines_bits_and_counts_a_gather(tmp_path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results = spawn_ranks(_two_process_worker, 2, str(tmp_path))
    simulated, _ = _run(K * ROUNDS)
    for got in results:
        assert torch.equal(got["weight"], simulated.weight[:2])
        message = TOP * 16
        assert got["bytes"] == ROUNDS * message
        # A gather among the 4 machines' processes: every participant's message to each of the other M - 1.
        assert got["ring"] == ROUNDS * 3 * message and got["hops"] == ROUNDS * 3
