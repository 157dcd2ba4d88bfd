"""Scaffold (SCAFFOLD, option II): control variates per machine and never averaged, the server step,
what is communicated, state and errors. Its float64 reference over several rounds is in
tests/experiments/train/test_methods.py (every method of the registry)."""

import pytest
import torch
from helpers import Quadratics, reloaded
from torch import nn

from lit_slowcal import PeriodicAverager, Scaffold, SimulatedMachines

M, DIM, K = 3, 4, 4


class _Point(nn.Module):
    def __init__(self, x0):
        super().__init__()
        self.x = nn.Parameter(x0.clone())


def setup(q, **options):
    machines = SimulatedMachines(_Point(q.x0), M)
    opt = Scaffold(machines.parameters(), lr=0.05, **options)
    return machines, opt, PeriodicAverager(machines, opt, sync_every=K)


def test_one_round_by_the_paper_with_per_machine_control_variates():
    q = Quadratics(M, DIM, steps=2 * K, seed=2)
    machines, opt, averager = setup(q, server_lr=0.5)
    p = machines.x
    for t in range(2 * K):
        p.grad = q.stacked_grad(p.detach(), t)
        opt.step()
        averager.step()
        if t == K - 1:
            # Round 1 (c = c_i = 0): y_i is K plain SGD steps; c_i = (x - y_i) / (K eta), one per machine.
            ys = []
            for i in range(M):
                y = q.x0.clone()
                for k in range(K):
                    y = y - 0.05 * q.grad(i, y, k)
                ys.append(y)
            state = opt.state[p]
            c_local = torch.stack([(q.x0 - y) / (K * 0.05) for y in ys])
            torch.testing.assert_close(state["c_local"], c_local, rtol=0, atol=1e-12)
            torch.testing.assert_close(state["c"], c_local.mean(0).expand(M, DIM), rtol=0, atol=1e-12)
            x = q.x0 + 0.5 * (sum(ys) / M - q.x0)
            torch.testing.assert_close(p.detach(), x.expand(M, DIM), rtol=0, atol=1e-12)
            torch.testing.assert_close(state["x"], x.expand(M, DIM), rtol=0, atol=1e-12)
            # The machines' control variates differ (heterogeneous data): they were not averaged.
            assert (c_local[0] - c_local[1]).abs().max() > 0.1
    # Invariant of full participation: c is the mean of the c_i after every round.
    state = opt.state[p]
    torch.testing.assert_close(state["c"], state["c_local"].mean(0).expand(M, DIM), rtol=0, atol=1e-12)


def test_averages_y_and_delta_c_only_2d_per_machine_per_round():
    q = Quadratics(M, DIM, steps=3 * K)
    machines, opt, averager = setup(q)
    for t in range(3 * K):
        machines.x.grad = q.stacked_grad(machines.x.detach(), t)
        opt.step()
        averager.step()
    assert averager.num_syncs == 3
    assert averager.floats_communicated == 3 * 2 * DIM
    assert [t.shape for t, _ in averager._tensors()] == [(M, DIM), (M, DIM)]  # y and delta_c


def test_server_lr_one_takes_the_average_of_the_local_models_exactly():
    q = Quadratics(M, DIM, steps=K)
    machines, opt, averager = setup(q)
    for t in range(K):
        machines.x.grad = q.stacked_grad(machines.x.detach(), t)
        opt.step()
        if t == K - 1:
            y_mean = machines.x.detach().mean(0)
        averager.step()
    assert torch.equal(machines.x.detach(), y_mean.expand(M, DIM))


def test_state_dict_resumes_bitwise_mid_round():
    q = Quadratics(M, DIM, steps=5 * K, seed=4)

    def run(split=None):
        machines, opt, averager = setup(q, server_lr=1.3, weight_decay=0.01)
        for t in range(5 * K):
            if t == split:  # a new process: fresh objects loaded from the saved states
                machines, opt, averager = reloaded(
                    machines, opt, averager, lambda ps: Scaffold(ps, lr=0.05, server_lr=1.3, weight_decay=0.01)
                )
            machines.x.grad = q.stacked_grad(machines.x.detach(), t)
            opt.step()
            averager.step()
        return machines.x.detach(), opt.state[machines.x]

    x, state = run()
    x2, state2 = run(split=2 * K + 1)  # mid round 3: the round's K so far travels too
    assert torch.equal(x, x2)
    for key in ("x", "c", "c_local", "delta_c"):
        assert torch.equal(state[key], state2[key]), key


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"lr": -1}, "Invalid lr: -1"),
    ({"lr": 0.1, "server_lr": 0}, "Invalid server_lr: 0"),
    ({"lr": 0.1, "weight_decay": float("inf")}, "Invalid weight_decay: inf"),
])  # fmt: skip
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Scaffold([nn.Parameter(torch.zeros(1))], **kwargs)
