"""AcceleratedSGD (AC-SA, Lan 2012): the update against a float64 reference, the average over
machines against the server algorithm, the protocol, state and errors."""

import pytest
import torch
from helpers import Quadratics, reloaded
from torch import nn

from lit_slowcal import AcceleratedSGD, PeriodicAverager, SimulatedMachines

F64 = torch.float64


def ac_sa(grad, x0, gamma, steps):
    """Lan (2012), AC-SA with beta_s = (s+1)/2, gamma_s = (s+1)/2 gamma: [(x_md_s, x_{s+1}, x_ag_{s+1})]."""
    x, x_ag, out = x0.clone(), x0.clone(), []
    for s in range(1, steps + 1):
        x_md = (2 / (s + 1)) * x + (1 - 2 / (s + 1)) * x_ag
        x = x - gamma * (s + 1) / 2 * grad(x_md, s - 1)
        x_ag = (2 / (s + 1)) * x + (1 - 2 / (s + 1)) * x_ag
        out.append((x_md, x, x_ag))
    return out


def test_one_machine_matches_ac_sa_and_queries_the_middle_point():
    q = Quadratics(machines=1, dim=3, steps=30)
    p = nn.Parameter(q.x0.clone())
    opt = AcceleratedSGD([p], lr=0.05)
    want = ac_sa(lambda x, t: q.grad(0, x, t), q.x0, 0.05, 30)
    dev = 0.0
    for t, (x_md, x, x_ag) in enumerate(want):
        dev = max(dev, (p.detach() - x_md).abs().max().item())  # the gradient is taken at x_md
        p.grad = q.grad(0, p.detach(), t)
        opt.step()
        state = opt.state[p]
        dev = max(dev, (state["x"] - x).abs().max().item(), (state["x_ag"] - x_ag).abs().max().item())
    assert dev <= 1e-12, dev
    assert opt.state[p]["step"] == 30
    assert (want[-1][2] - q.x0).abs().max() > 0.5  # it moved


def test_first_step_by_hand():
    # f(x) = (x - 1)^2, x_0 = 0, gamma = 1/8. s = 1: beta = 1, x_md = 0, g = -2, gamma_1 = 1/8,
    # x_2 = 1/4 = x_ag_2; x_md_2 = 2/3 x_2 + 1/3 x_ag_2 = 1/4. s = 2: g = -3/2, gamma_2 = 3/16,
    # x_3 = 1/4 + 9/32 = 17/32, x_ag_3 = 2/3 * 17/32 + 1/3 * 1/4 = 7/16.
    p = nn.Parameter(torch.zeros(1, dtype=F64))
    opt = AcceleratedSGD([p], lr=1 / 8)
    for want_x, want_ag in ((1 / 4, 1 / 4), (17 / 32, 7 / 16)):
        opt.zero_grad()
        ((p - 1) ** 2).sum().backward()
        opt.step()
        assert opt.state[p]["x"].item() == want_x and opt.state[p]["x_ag"].item() == want_ag


def test_averaged_after_every_step_equals_the_server_algorithm_on_the_averaged_gradient():
    M, steps = 5, 25
    q = Quadratics(machines=M, dim=4, steps=steps, seed=3)
    machines = SimulatedMachines(_Point(q.x0), M)
    opt = AcceleratedSGD(machines.parameters(), lr=0.04)
    averager = PeriodicAverager(machines, opt, sync_every=1)
    want = ac_sa(lambda x, t: sum(q.grad(i, x, t) for i in range(M)) / M, q.x0, 0.04, steps)
    p, dev = machines.x, 0.0
    for t, (x_md, x, x_ag) in enumerate(want):
        dev = max(dev, (p.detach() - x_md).abs().max().item())
        p.grad = q.stacked_grad(p.detach(), t)  # every machine its own gradient at the common x_md
        opt.step()
        averager.step()
        state = opt.state[p]
        dev = max(dev, (state["x"] - x).abs().max().item(), (state["x_ag"] - x_ag).abs().max().item())
    assert dev <= 1e-12, dev
    # It communicates the parameters only (d floats per machine per round).
    assert averager.floats_communicated == steps * 4


def test_more_than_one_step_between_synchronisations_is_refused():
    machines = SimulatedMachines(_Point(torch.zeros(2)), 2)
    opt = AcceleratedSGD(machines.parameters(), lr=0.1)
    averager = PeriodicAverager(machines, opt, sync_every=2)
    machines.x.grad = torch.ones(2, 2)
    opt.step()
    assert not averager.step()
    opt.step()
    with pytest.raises(ValueError, match="AcceleratedSGD took 2 steps between synchronisations.*sync_every=1"):
        averager.step()


def test_swap_output_exchanges_the_query_point_and_x_ag_and_back():
    p = nn.Parameter(torch.zeros(3, dtype=F64))
    opt = AcceleratedSGD([p], lr=0.1)
    for _ in range(3):
        p.grad = torch.tensor([1.0, -2.0, 0.5], dtype=F64) + p.detach()
        opt.step()
    x_md, x_ag = p.detach().clone(), opt.state[p]["x_ag"].clone()
    assert not torch.equal(x_md, x_ag)
    opt.swap_output()
    assert torch.equal(p.detach(), x_ag) and torch.equal(opt.state[p]["x_ag"], x_md)
    opt.swap_output()
    assert torch.equal(p.detach(), x_md) and torch.equal(opt.state[p]["x_ag"], x_ag)


def test_state_dict_resumes_bitwise_mid_run():
    q = Quadratics(machines=3, dim=3, steps=20, seed=1)

    def run(split=None):
        machines = SimulatedMachines(_Point(q.x0), 3)
        opt = AcceleratedSGD(machines.parameters(), lr=0.05, weight_decay=0.01)
        averager = PeriodicAverager(machines, opt, sync_every=1)
        for t in range(20):
            if t == split:  # a new process: fresh objects loaded from the saved states
                machines, opt, averager = reloaded(
                    machines, opt, averager, lambda ps: AcceleratedSGD(ps, lr=0.05, weight_decay=0.01)
                )
            machines.x.grad = q.stacked_grad(machines.x.detach(), t)
            opt.step()
            averager.step()
        return machines.x.detach(), opt.state[machines.x]

    x, state = run()
    x2, state2 = run(split=11)
    assert torch.equal(x, x2)
    for key in ("x", "x_ag"):
        assert torch.equal(state[key], state2[key])
    assert state["step"] == state2["step"] == 20


def lan_gamma(c, horizon, gamma_max=None):
    """Lan (2012), Corollary 1's form: gamma = min{gamma_max, c (N+1)^(-3/2)}, in float64 Python arithmetic."""
    gamma = c * (horizon + 1) ** -1.5
    return gamma if gamma_max is None else min(gamma_max, gamma)


@pytest.mark.parametrize(("c", "horizon", "max_lr", "capped"), [
    (2.0, 15, None, False),     # gamma = 2 / 64 = 0.03125
    (40.0, 24, None, False),    # gamma = 40 / 125 = 0.32
    (40.0, 24, 0.1, True),      # the cap: gamma = 0.1 < 0.32
    (5.0, 24, 0.5, False),      # under the cap: gamma = 0.04
])  # fmt: skip
def test_horizon_aware_step_matches_lans_rule_on_the_averaged_gradient(c, horizon, max_lr, capped):
    M = 4
    q = Quadratics(machines=M, dim=3, steps=horizon, seed=5)
    gamma = lan_gamma(c, horizon, max_lr)
    assert (gamma == max_lr) is capped
    machines = SimulatedMachines(_Point(q.x0), M)
    opt = AcceleratedSGD(machines.parameters(), lr=c, horizon=horizon, max_lr=max_lr)
    assert opt.step_size(opt.param_groups[0]) == gamma
    averager = PeriodicAverager(machines, opt, sync_every=1)
    want = ac_sa(lambda x, t: sum(q.grad(i, x, t) for i in range(M)) / M, q.x0, gamma, horizon)
    p, dev = machines.x, 0.0
    for t, (x_md, x, x_ag) in enumerate(want):
        dev = max(dev, (p.detach() - x_md).abs().max().item())
        p.grad = q.stacked_grad(p.detach(), t)
        opt.step()
        averager.step()
        state = opt.state[p]
        dev = max(dev, (state["x"] - x).abs().max().item(), (state["x_ag"] - x_ag).abs().max().item())
    print(f"horizon-aware AC-SA, c={c}, N={horizon}, max_lr={max_lr}: largest deviation {dev:.1e}")
    assert dev <= 1e-12, dev
    assert (want[-1][2] - q.x0).abs().max() > 0.1  # it moved


def test_horizon_aware_step_by_hand():
    # c = 27, N = 8: gamma = 27 / 9**1.5 = 1. f(x) = (x - 1)^2 / 2, x_0 = 0. s = 1: g = -1, gamma_1 = 1,
    # x_2 = x_ag_2 = 1 (the minimiser), x_md_2 = 1; s = 2: g = 0, nothing moves.
    p = nn.Parameter(torch.zeros(1, dtype=F64))
    opt = AcceleratedSGD([p], lr=27.0, horizon=8)
    for _ in range(2):
        opt.zero_grad()
        (0.5 * (p - 1) ** 2).sum().backward()
        opt.step()
        assert opt.state[p]["x"].item() == 1.0 and opt.state[p]["x_ag"].item() == 1.0 and p.item() == 1.0


def test_one_c_gives_each_horizon_its_own_step():
    groups = [
        AcceleratedSGD([nn.Parameter(torch.zeros(1))], lr=100.0, horizon=n).param_groups[0] for n in (15, 59, 938)
    ]
    assert [AcceleratedSGD.step_size(g) for g in groups] == [100 / 16**1.5, 100 / 60**1.5, 100 / 939**1.5]
    # Without a horizon lr is gamma itself, as before the option existed (and for a state saved then).
    assert AcceleratedSGD.step_size({"lr": 0.01, "weight_decay": 0.0}) == 0.01


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"lr": 0}, "Invalid lr: 0"),
    ({"lr": float("nan")}, "Invalid lr: nan"),
    ({"lr": 0.1, "weight_decay": -1}, "Invalid weight_decay: -1"),
    ({"lr": 0.1, "horizon": 0}, r"Invalid horizon: 0 \(must be an integer >= 1\)"),
    ({"lr": 0.1, "horizon": 2.5}, r"Invalid horizon: 2.5 \(must be an integer >= 1\)"),
    ({"lr": 0.1, "horizon": 10, "max_lr": 0}, r"Invalid max_lr: 0 \(must be a finite number > 0\)"),
    ({"lr": 0.1, "max_lr": 0.5}, r"Invalid max_lr: 0.5 without horizon"),
])  # fmt: skip
def test_bad_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AcceleratedSGD([nn.Parameter(torch.zeros(1))], **kwargs)


class _Point(nn.Module):
    def __init__(self, x0):
        super().__init__()
        self.x = nn.Parameter(x0.clone())
