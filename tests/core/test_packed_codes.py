"""The packed codes (``Int4``, ``Int2``: int8's block code with 4 and 2 bits, packed two and four to a byte) and the
sparse ``TopK(fraction, bits)``: every round bit for bit against a float64 hand reference written here from the
documented steps, the bytes in closed form, a resume mid-run bit for bit, and 2 gloo processes with the bits and
counts of the same machines simulated in one process (the packed bytes being what the collectives carry)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_slowcal import PeriodicAverager, SimulatedMachines
from lit_slowcal.compression import Int2, Int4, TopK
from tests.helpers import finish_rank, spawn_ranks

M, K, ROUNDS, B = 4, 2, 4, 256
DIN, DOUT = 150, 3  # a weight of 450 values (blocks of 256 and 194) and a bias of 3 (one short block)


def _build(compression, m: int = M):
    torch.manual_seed(0)
    machines = SimulatedMachines(nn.Linear(DIN, DOUT), m).double()
    optimizer = torch.optim.SGD(machines.parameters(), lr=0.1)
    averager = PeriodicAverager(machines, optimizer, sync_every=K, compression=compression)
    averager.broadcast()  # the anchors: every round coded
    return machines, optimizer, averager


def _steps(machines, optimizer, averager, gens: list[torch.Generator], n: int) -> None:
    """n steps, every machine its own gradients (machine i from ``gens[i]``)."""
    for _ in range(n):
        for p in machines.parameters():
            p.grad = torch.stack([torch.randn(p.shape[1:], generator=g, dtype=torch.float64) for g in gens])
        optimizer.step()
        averager.step()


def _gens(first: int, m: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(100 + first + i) for i in range(m)]


def _values(machines: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in machines.parameters()]


# ---------------------------------------------------------------------- the hand-written references


def _symmetric(v: Tensor, levels: int) -> Tensor:
    """v (float64) as the documented symmetric code, decoded: scale float32(max |v| / levels), round half to even,
    clamp to [-levels, levels]; a v whose max is 0: zeros."""
    scale = (v.abs().max() / levels).to(torch.float32).double()
    if scale == 0:
        return torch.zeros_like(v)
    return torch.round(v / scale).clamp(-levels, levels) * scale


def _blockwise(v: Tensor, levels: int) -> Tensor:
    return torch.cat([_symmetric(v[i : i + B], levels) for i in range(0, v.numel(), B)])


def _block_round(changes: list[Tensor], errors: list[Tensor], owner: Tensor, levels: int):
    """One two-stage round of one tensor: every machine's code of change + error, the float64 mean in machine
    order, the owner's code of mean + its error. Returns the applied mean and the new errors."""
    sent, new = [], []
    for d, e in zip(changes, errors):
        x = d + e
        dec = _blockwise(x, levels)
        sent.append(dec)
        new.append(x - dec)
    mean = sent[0].clone()
    for s in sent[1:]:
        mean = mean + s
    y = mean / len(sent) + owner
    applied = _blockwise(y, levels)
    return applied, new, y - applied


def _topk_sent(x: Tensor, fraction: float, bits: int) -> Tensor:
    """x's top k = max(1, ceil(fraction n)) by magnitude (ties: the lower index), their values in ``bits``."""
    k = max(1, math.ceil(fraction * x.numel()))
    top = torch.argsort(x.abs(), descending=True, stable=True)[:k]
    values = x[top]
    if bits == 32:
        values = values.to(torch.float32).double()
    elif bits == 16:
        values = values.to(torch.bfloat16).double()
    else:
        values = _symmetric(values, 2 ** (bits - 1) - 1)
    out = torch.zeros_like(x)
    out[top] = values
    return out


CODES = {"int4": (Int4(), 7), "int2": (Int2(), 1)}


@pytest.mark.parametrize("name", list(CODES))
def test_a_packed_code_is_the_two_stage_reduce_of_the_float64_hand_reference_bit_for_bit(name):
    code, levels = CODES[name]
    machines, optimizer, averager = _build(name)
    before: list[list[Tensor]] = []
    averager.register_sync_pre_hook(lambda a: before.append(_values(machines)))
    anchor = [p[0].detach().clone().reshape(-1) for p in machines.parameters()]
    errors = [[torch.zeros_like(a) for _ in range(M)] for a in anchor]
    owner = [torch.zeros_like(a) for a in anchor]
    gens = _gens(0, M)
    for _ in range(ROUNDS):
        _steps(machines, optimizer, averager, gens, K)
        for k, p in enumerate(machines.parameters()):
            values = before[-1][k].reshape(M, -1)
            changes = [values[i] - anchor[k] for i in range(M)]
            applied, errors[k], owner[k] = _block_round(changes, errors[k], owner[k], levels)
            anchor[k] = anchor[k] + applied
            assert all(torch.equal(p[i].reshape(-1), anchor[k]) for i in range(M))
    state = averager.compressed
    for k, name_k in enumerate(["param 0", "param 1"]):
        assert torch.equal(state.errors[name_k].reshape(M, -1), torch.stack(errors[k]))
        assert torch.equal(state.owner_errors[name_k].reshape(-1), owner[k])
    assert any(bool(e.any()) for e in errors[0]) and bool(owner[0].any())  # lossy: error feedback kept something
    # The codes that travel: packed, 8 / bits to a byte; a tensor's last block's codes as many bytes as its values need.
    codes, scales = code.encode(torch.zeros(1, 2, B, dtype=torch.float64))
    bits = {"int4": 4, "int2": 2}[name]
    assert codes.dtype == torch.uint8 and codes.shape == (1, 2, B * bits // 8) and scales.dtype == torch.float32
    weight = math.ceil(256 * bits / 8) + math.ceil(194 * bits / 8) + 2 * 4
    bias = math.ceil(3 * bits / 8) + 4
    message = weight + bias  # int4: 225 + 8 + 2 + 4 = 239; int2: 113 + 8 + 1 + 4 = 126 (float64: 3,624)
    assert averager.bytes_per_sync() == message and averager.bytes_communicated == ROUNDS * message
    counts = averager.link_counts
    assert counts.payload_bytes == ROUNDS * message and counts.ring_hops == ROUNDS * 2 * (M - 1)
    assert math.isclose(counts.ring_bytes, ROUNDS * (M - 1) / M * 2 * message)


@pytest.mark.parametrize("bits", [2, 4, 8, 16, 32])
def test_topk_is_the_float64_hand_reference_bit_for_bit(bits):
    fraction = 0.05  # k = 23 of the weight's 450, 1 of the bias's 3
    machines, optimizer, averager = _build(TopK(fraction, bits))
    before: list[list[Tensor]] = []
    averager.register_sync_pre_hook(lambda a: before.append(_values(machines)))
    anchor = [p[0].detach().clone().reshape(-1) for p in machines.parameters()]
    errors = [torch.zeros(M, a.numel(), dtype=torch.float64) for a in anchor]
    gens = _gens(0, M)
    for _ in range(ROUNDS):
        _steps(machines, optimizer, averager, gens, K)
        for k, p in enumerate(machines.parameters()):
            values = before[-1][k].reshape(M, -1)
            total = torch.zeros_like(anchor[k])
            for i in range(M):
                x = values[i] - anchor[k] + errors[k][i]
                sent = _topk_sent(x, fraction, bits)
                errors[k][i] = x - sent
                total = total + sent
            anchor[k] = anchor[k] + total / M
            assert all(torch.equal(p[i].reshape(-1), anchor[k]) for i in range(M)), (k, bits)
    for k, name in enumerate(["param 0", "param 1"]):
        assert torch.equal(averager.compressed.errors[name].reshape(M, -1), errors[k])
    # The bytes: k indices of one byte (bias: numel 3) or two (weight: 450 > 256), the values in bits (+ a scale).
    values = (lambda k: k * bits // 8) if bits >= 16 else (lambda k: math.ceil(k * bits / 8) + 4)
    message = 23 * 2 + values(23) + 1 * 1 + values(1)
    assert averager.bytes_per_sync() == message and averager.bytes_communicated == ROUNDS * message
    assert averager.link_counts.ring_bytes == ROUNDS * (M - 1) * message  # a gather: to each of the other M - 1
    sent = TopK(fraction, bits).encode(torch.randn(450, dtype=torch.float64))
    assert sum(t.numel() * t.element_size() for t in sent) == 23 * 2 + values(23)  # the message is its bytes


def test_topk_sends_a_tensor_it_does_not_shrink_exactly():
    """TopK(1.0, 32) of a float32 tensor: n indices and n float32 values, more bytes than its 4 n: averaged exactly
    (counted so); of a float64 tensor (8 n bytes) the same message is smaller: coded."""
    machines = SimulatedMachines(nn.Linear(DIN, DOUT), M)
    averager = PeriodicAverager(machines, torch.optim.SGD(machines.parameters(), lr=0.1), K, compression="topk:1:32")
    averager.broadcast()
    assert averager.bytes_per_sync() == (DIN * DOUT + DOUT) * 4
    machines, optimizer, averager = _build(TopK(1.0, 32))
    assert averager.bytes_per_sync() == DIN * DOUT * (2 + 4) + DOUT * (1 + 4)


@pytest.mark.parametrize("compression", ["int4", "int2", "topk:0.05:2"])
def test_a_resume_mid_round_continues_bit_for_bit(compression):
    machines, optimizer, averager = _build(compression)
    gens = _gens(0, M)
    _steps(machines, optimizer, averager, gens, ROUNDS * K)
    reference = _values(machines)
    machines, optimizer, averager = _build(compression)
    gens = _gens(0, M)
    stop = 2 * K + 1
    _steps(machines, optimizer, averager, gens, stop)
    saved = {"model": machines.state_dict(), "opt": optimizer.state_dict(), "avg": averager.state_dict(),
             "gens": [g.get_state() for g in gens]}  # fmt: skip
    assert any(bool(e.any()) for e in saved["avg"]["compression"]["ranks"][0]["errors"])  # error feedback held
    machines, optimizer, averager = _build(compression)
    machines.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["opt"])
    averager.load_state_dict(saved["avg"])
    for g, kept in zip(gens, saved["gens"]):
        g.set_state(kept)
    _steps(machines, optimizer, averager, gens, ROUNDS * K - stop)
    assert all(torch.equal(a, b) for a, b in zip(_values(machines), reference))


# ---------------------------------------------------------------------- two processes

TWO = ["int8", "int4", "int2", "topk:0.05:2"]


def _two_process_worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    sent: list[int] = []
    all_to_all = dist.all_to_all_single

    def counted(output, input, *args, **kwargs):  # what the block codes' collectives carry
        sent.append(input.numel() * input.element_size())
        return all_to_all(output, input, *args, **kwargs)

    dist.all_to_all_single = counted
    results = {}
    for compression in TWO:
        sent.clear()
        machines, optimizer, averager = _build(compression, m=2)
        _steps(machines, optimizer, averager, _gens(2 * rank, 2), ROUNDS * K)
        results[compression] = {
            "values": _values(machines), "bytes": averager.bytes_communicated, "ring": averager.link_counts.ring_bytes,
            "hops": averager.link_counts.ring_hops, "all_to_all": sum(sent), "stages": averager.stage_bytes(),
        }  # fmt: skip
    dist.all_to_all_single = all_to_all
    finish_rank(results, out, rank)


@pytest.mark.slow
def test_two_processes_give_the_simulated_machines_bits_and_counts(tmp_path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ranks = spawn_ranks(_two_process_worker, 2, str(tmp_path))
    for compression in TWO:
        machines, optimizer, averager = _build(compression)
        _steps(machines, optimizer, averager, _gens(0, M), ROUNDS * K)
        simulated = _values(machines)
        for rank, results in enumerate(ranks):
            got = results[compression]
            for a, b in zip(got["values"], simulated):
                assert torch.equal(a, b[2 * rank : 2 * rank + 2]), compression
            assert got["bytes"] == averager.bytes_communicated and got["hops"] == averager.link_counts.ring_hops
            assert got["ring"] == averager.link_counts.ring_bytes
        if compression.startswith("int"):
            # The packed codes and scales travel: per round each process's 2 machines' first-stage messages to the
            # all-to-all, and 2 copies of its chunk's second-stage codes to the all-gather; all ranks: M x first + 2
            # x second (each stage the full message), the self-addressed parts included.
            first, second = ranks[0][compression]["stages"]
            assert sum(r[compression]["all_to_all"] for r in ranks) == ROUNDS * (M * first + 2 * second)


def test_topk_takes_only_integer_bits_and_numpys_fractions_as_floats():
    """``TopK(0.1, 4.0)`` was accepted and failed in the first round (a float message size); ``np.float32(0.1)``
    was refused while ``np.float64(0.1)`` was kept as numpy's (its saved record then refused ``TopK(0.1)``)."""
    import numpy as np

    with pytest.raises(ValueError, match=r"^Invalid TopK bits: 4.0 \(one of 2, 4, 8, 16, 32\)$"):
        TopK(0.1, 4.0)
    for fraction in (np.float32(0.25), np.float64(0.25)):
        code = TopK(fraction, np.int64(4))
        assert (type(code.fraction), type(code.bits)) == (float, int) and code == TopK(0.25, 4)
        assert repr(code) == "TopK(bits=4, fraction=0.25)"


@pytest.mark.parametrize("compression", ["int8", "int4", "int2", "bf16", "topk:0.5", "topk:0.5:16", "topk:0.5:2"])
def test_a_float64_change_beyond_float32s_range_saturates_and_stays_finite(compression):
    """A float64 change of 1e300 overflowed the float32 scale (or bfloat16 value): 0 x inf decoded as NaN on every
    machine. Now it travels as float32's (bfloat16's) largest, error feedback keeping the rest."""
    machines, optimizer, averager = _build(compression)
    weight = next(machines.parameters())  # [M, DOUT, DIN]
    with torch.no_grad():
        weight[0, 0, 0] += 1e300  # machine 0's change
    averager.sync()
    assert torch.isfinite(weight).all() and torch.equal(weight[0], weight[1])
    top = torch.finfo(torch.bfloat16 if "16" in compression or compression == "bf16" else torch.float32).max
    assert 0 < weight[0, 0, 0] <= 127 * top  # saturated (at most the codes' largest level times it), and moved
