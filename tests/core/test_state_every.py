"""``state_every``: the optimizer state averaged in every n-th scheduled round, parameters and buffers in every
round, everything in a closing round; float64 hand references, closed-form counts, an exact resume across a
round that skipped the state, int8 anchors of the state kept at their last common value."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from lit_slowcal import PeriodicAverager, SimulatedMachines
from tests.helpers import int8_mean

M, K, N, LR, MU = 3, 2, 3, 0.1, 0.9  # machines, sync_every, state_every, SGD's lr and momentum
A = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)  # machine i's gradient: A[i] x + its noise


def _noise(steps: int) -> list[list[Tensor]]:
    """Every step's noise, per parameter (a stacked weight (M, 1, 2) and bias (M, 1)), float64."""
    g = torch.Generator().manual_seed(7)
    return [[torch.randn(M, 1, 2, generator=g, dtype=torch.float64), torch.randn(M, 1, generator=g, dtype=torch.float64)]
            for _ in range(steps)]  # fmt: skip


def _build(seed: int = 0, **options) -> tuple[SimulatedMachines, torch.optim.SGD, PeriodicAverager]:
    torch.manual_seed(seed)
    machines = SimulatedMachines(nn.Linear(2, 1), M).double()
    optimizer = torch.optim.SGD(machines.parameters(), lr=LR, momentum=MU)
    settings = {"sync_every": K, "state_every": N, **options}
    averager = PeriodicAverager(machines, optimizer, average_state=("momentum_buffer",), **settings)
    return machines, optimizer, averager


def _steps(machines, optimizer, averager, noise: list[list[Tensor]], start: int, stop: int) -> None:
    """Steps ``start + 1 .. stop``: machine i's gradient A[i] x + noise, then the averager's count."""
    for t in range(start, stop):
        for p, e in zip(machines.parameters(), noise[t]):
            p.grad = A.view(-1, *[1] * (p.dim() - 1)) * p.detach() + e
        optimizer.step()
        averager.step()


def _mean(t: Tensor) -> Tensor:
    return t.mean(0, keepdim=True).expand_as(t).clone()


def test_the_state_goes_every_n_rounds_against_a_float64_hand_reference_and_counts_in_closed_form():
    machines, optimizer, averager = _build()
    x = [p.detach().clone() for p in machines.parameters()]
    noise = _noise(15)
    # The hand reference: SGD with momentum per machine; x averaged every K steps, the buffers every N K steps.
    bufs: list = [None, None]
    spread = {}  # after each round: whether the machines' buffers differ
    for t in range(1, 16):
        for j in range(2):
            g = A.view(-1, *[1] * (x[j].dim() - 1)) * x[j] + noise[t - 1][j]
            bufs[j] = g.clone() if bufs[j] is None else bufs[j] * MU + g
            x[j] = x[j] - LR * bufs[j]
        if t % K == 0:
            x = [_mean(v) for v in x]
            if (t // K) % N == 0:
                bufs = [_mean(b) for b in bufs]
            spread[t // K] = any(not torch.equal(b, _mean(b)) for b in bufs)
    assert spread == {1: True, 2: True, 3: False, 4: True, 5: True, 6: False, 7: True}
    counted = []
    for t in range(15):
        _steps(machines, optimizer, averager, noise, t, t + 1)
        counted.append(averager.bytes_communicated)
    params = list(machines.parameters())
    close = lambda got, want: torch.testing.assert_close(got, want, rtol=0, atol=1e-14)  # noqa: E731 (SGD's fused ops)
    for p, want in zip(params, x):
        close(p.detach(), want)
    for p, want in zip(params, bufs):
        close(optimizer.state[p]["momentum_buffer"], want)
        buf = optimizer.state[p]["momentum_buffer"]
        assert not torch.equal(buf, _mean(buf))  # round 7 skipped them: the machines' differ
    # One machine's 3 float64 parameters: 24 bytes a round, 48 with the buffers (rounds 3 and 6).
    assert [counted[2 * r - 1] for r in range(1, 8)] == [24, 48, 96, 120, 144, 192, 216]
    assert averager.bytes_per_sync() == (48 + (N - 1) * 24) / N == 32
    assert averager.floats_per_sync() == (6 + (N - 1) * 3) / N == 4
    assert averager.bytes_per_sync() * 6 == counted[11]  # after whole periods of N K steps
    assert averager.in_round  # step 15, and the buffers differ since round 6
    assert averager.close_round()
    for b in bufs:
        b.copy_(_mean(b))
    for p, xp, b in zip(params, x, bufs):
        close(p.detach(), _mean(xp))
        close(optimizer.state[p]["momentum_buffer"], b)
        assert torch.equal(p.detach(), _mean(p.detach()))  # one model and one state on every machine
        assert torch.equal(optimizer.state[p]["momentum_buffer"], _mean(optimizer.state[p]["momentum_buffer"]))
    assert (averager.num_syncs, averager.bytes_communicated, averager.floats_communicated) == (8, 216 + 48, 33)
    assert averager.link_counts.syncs == 8 and averager.link_counts.payload_bytes == 264


def test_a_round_that_skipped_the_state_leaves_the_round_open_and_a_closing_round_averages_it():
    machines, optimizer, averager = _build()
    _steps(machines, optimizer, averager, _noise(2), 0, 2)  # round 1: parameters only
    assert averager.in_round  # the buffers differ: close_round() averages them
    assert averager.close_round() and not averager.in_round and averager.bytes_communicated == 24 + 48
    keys = {"state_every": N, "average_state": ("momentum_buffer",)}
    assert PeriodicAverager(*_build()[:2], K, **keys, start_step=8).in_round  # round 4 skipped the state
    assert not PeriodicAverager(*_build()[:2], K, **keys, start_step=6).in_round  # round 3 carried it
    plain = nn.Linear(2, 1)  # no state averaged: every round is whole
    assert not PeriodicAverager(
        plain, torch.optim.SGD(plain.parameters(), lr=0.1), K, state_every=N, start_step=8
    ).in_round


@pytest.mark.parametrize("saved_at", [8, 9])  # right after round 4 (no state), one step into period 5
def test_a_resume_across_a_round_that_skipped_the_state_is_exact(saved_at):
    noise = _noise(15)
    straight = _build()
    _steps(*straight, noise, 0, 15)
    first = _build()
    _steps(*first, noise, 0, saved_at)
    saved = copy.deepcopy([first[0].state_dict(), first[1].state_dict(), first[2].state_dict()])
    resumed = _build(seed=1)
    resumed[0].load_state_dict(saved[0])
    resumed[1].load_state_dict(saved[1])
    resumed[2].load_state_dict(saved[2])
    # resume(steps) recounts the same rounds: 1 with the buffers and 3 without by step 8 or 9 (the state loaded).
    recount = PeriodicAverager(*resumed[:2], K, state_every=N, average_state=("momentum_buffer",), start_step=saved_at)
    assert recount.bytes_communicated == first[2].bytes_communicated == 48 + 3 * 24
    assert recount.link_counts == first[2].link_counts
    _steps(*resumed, noise, saved_at, 15)
    for (p, q), (pa, qa) in zip(
        zip(straight[0].parameters(), resumed[0].parameters()),
        zip(straight[1].param_groups[0]["params"], resumed[1].param_groups[0]["params"]),
    ):
        assert torch.equal(p, q)
        assert torch.equal(straight[1].state[pa]["momentum_buffer"], resumed[1].state[qa]["momentum_buffer"])
    for name in ("num_syncs", "bytes_communicated", "floats_communicated", "in_round"):
        assert getattr(straight[2], name) == getattr(resumed[2], name), name
    assert straight[2].link_counts == resumed[2].link_counts


def test_fragments_take_the_state_in_the_period_they_fall_in_and_a_resume_recounts_them():
    """K = 4, F = 2: fragment 1's round after step 2 and fragment 0's after step 4 are period 1's, without the
    buffers (n = 2); those after steps 6 and 8, period 2's, with them."""
    machines, optimizer, averager = _build(state_every=2, fragments=2, sync_every=4)
    per_round = []
    noise = _noise(8)
    for t in range(0, 8, 2):
        before = averager.bytes_communicated
        _steps(machines, optimizer, averager, noise, t, t + 2)
        per_round.append(averager.bytes_communicated - before)
    assert per_round == [8, 16, 16, 32]  # the bias (8 bytes) and the weight (16), each with its buffer in period 2
    again = PeriodicAverager(machines, optimizer, 4, state_every=2, fragments=2, average_state=("momentum_buffer",),
                             start_step=8)  # fmt: skip
    assert (again.bytes_communicated, again.floats_communicated) == (averager.bytes_communicated, 9) == (72, 9)
    assert again.link_counts == averager.link_counts
    assert again.bytes_per_sync() == averager.bytes_per_sync() == (24 + 48) / 2 / 2


# ---------------------------------------------------------------------- int8: the state's anchors


def test_with_int8_the_state_keeps_its_anchor_across_a_skipped_round_and_is_coded_from_it():
    """n = 2, K = 2, 4 machines, error feedback off: the buffers appear at the first step and go exactly in round 2
    (no anchor yet), keep that average as their anchor through round 3, and round 4 codes their change from it."""
    machines_n = 4
    torch.manual_seed(0)
    machines = SimulatedMachines(nn.Linear(300, 2), machines_n)
    optimizer = torch.optim.SGD(machines.parameters(), lr=0.05, momentum=MU)
    averager = PeriodicAverager(machines, optimizer, 2, average_state=("momentum_buffer",), state_every=2,
                                compression="int8", error_feedback=False)  # fmt: skip
    averager.broadcast()
    params = list(machines.parameters())
    before: list[list[Tensor]] = []
    averager.register_sync_pre_hook(
        lambda a: before.append([optimizer.state[p]["momentum_buffer"].clone() for p in params])
    )
    g = torch.Generator().manual_seed(1)
    sent = []
    for _ in range(4):
        start = averager.bytes_communicated
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            optimizer.step()
            averager.step()
        sent.append(averager.bytes_communicated - start)
        if len(sent) == 2:
            common = [optimizer.state[p]["momentum_buffer"][0].clone() for p in params]
    coded = (600 + 4 * 3) + (2 + 4)  # one machine's int8 message of the weight (3 blocks) and the bias (1 block)
    assert sent == [coded, coded + 602 * 4, coded, 2 * coded]  # round 2 sends the buffers exactly, round 4 coded
    anchors = averager.compressed.anchors
    for i, (p, anchor) in enumerate(zip(params, common)):
        buf = optimizer.state[p]["momentum_buffer"].reshape(machines_n, -1)
        want = anchor.reshape(-1) + int8_mean(before[3][i].reshape(machines_n, -1) - anchor.reshape(-1))
        assert all(torch.equal(buf[k], want) for k in range(machines_n)), i
        assert torch.equal(anchors[f"param {i} momentum_buffer"].reshape(-1), want)


def test_slowcal_sgd_averages_x_every_round_and_w_every_n_th():
    from lit_slowcal import SlowcalSGD

    torch.manual_seed(0)
    machines = SimulatedMachines(nn.Linear(3, 1), 2)
    optimizer = SlowcalSGD(machines.parameters(), lr=0.1)
    averager = PeriodicAverager(machines, optimizer, 1, state_every=2).attach()
    same = lambda t: torch.equal(t, _mean(t))  # noqa: E731
    for step in (1, 2):
        optimizer.zero_grad()
        machines(torch.randn(2, 4, 3)).square().sum().backward()
        optimizer.step()
        assert all(same(p.detach()) for p in machines.parameters())
        assert all(same(optimizer.state[p]["w"]) for p in machines.parameters()) == (step == 2)
    assert averager.bytes_communicated == 4 * 4 + 8 * 4  # round 1: x (4 float32s), round 2: x and w
