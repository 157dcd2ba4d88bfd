"""AdaptiveSlowcal: against a float64 reference written by hand, against schedule-free AdamW's update where
their definitions meet, its two kernels, an exact resume, and averaged over simulated machines."""

import io

import pytest
import torch
from helpers import Quadratics, ref_adaptive_slowcal
from torch import nn

from lit_slowcal import AdaptiveSlowcal, PeriodicAverager, SimulatedMachines

F64 = torch.float64


class Point(nn.Module):
    def __init__(self, x0):
        super().__init__()
        self.x = nn.Parameter(x0.clone())


def one_machine(q, steps, grad=None, **options):
    """``steps`` steps of AdaptiveSlowcal from ``q.x0`` on machine 0's gradients: y, and the state."""
    y = nn.Parameter(q.x0.clone())
    opt = AdaptiveSlowcal([y], **options)
    for t in range(steps):
        y.grad = (grad or (lambda p, s: q.grad(0, p, s)))(y.detach(), t)
        opt.step()
    return y.detach(), opt.state[y]


def max_deviation(y, state, want):
    got = {"param": y, **{k: v for k, v in state.items() if isinstance(v, torch.Tensor)}}
    return max((got[k] - want[k].reshape(got[k].shape)).abs().max().item() for k in got)


@pytest.mark.parametrize("beta", [1.0, 0.7])
@pytest.mark.parametrize("weights", ["slowcal", "schedule_free"])
@pytest.mark.parametrize("second_moment", ["adam", "adagrad"])
@pytest.mark.parametrize("foreach", [True, False])
def test_steps_match_the_float64_reference_by_hand(beta, weights, second_moment, foreach):
    q = Quadratics(machines=1, dim=4, steps=30)
    options = dict(beta=beta, weights=weights, second_moment=second_moment, weight_power=1.5, weight_decay=0.01)
    y, state = one_machine(q, 30, lr=0.05, foreach=foreach, **options)
    want = ref_adaptive_slowcal(
        q, 0.05, 1, 30, beta=beta, power=1.5, weights=weights, second_moment=second_moment, weight_decay=0.01
    )
    assert set(state) == {"step", "w", "v", "alpha_sum", "alpha_sum_error"} | ({"x"} if beta < 1 else set())
    assert state["step"] == 30
    assert max_deviation(y, state, want) <= 1e-12
    assert (y - q.x0).abs().max() > 0.3  # it moved


def ref_schedule_free_adamw(q, lr, steps, beta1, beta2=0.999, eps=1e-8, r=0.0, weight_lr_power=2.0, weight_decay=0.0):
    """AdamWScheduleFree's step (facebookresearch/schedule_free, warmup_steps = 0, a constant lr), by hand in its own
    form: the parameters hold y, the state z and v; x = (y - (1 - beta1) z) / beta1 is never stored."""
    y, z = q.x0.clone(), q.x0.clone()
    v = torch.zeros_like(y)
    weight_sum, lr_max = 0.0, -1.0
    for k in range(steps):
        g = q.grad(0, y, k)
        lr_max = max(lr, lr_max)
        weight = (k + 1) ** r * lr_max**weight_lr_power
        weight_sum += weight
        ckp1 = weight / weight_sum
        v = beta2 * v + (1 - beta2) * g * g
        denom = (v / (1 - beta2 ** (k + 1))).sqrt() + eps
        grad_normalized = g / denom + weight_decay * y  # weight decay at y
        y = (1 - ckp1) * y + ckp1 * z  # y.lerp_(z, ckp1)
        y = y + lr * (beta1 * (1 - ckp1) - 1) * grad_normalized
        z = z - lr * grad_normalized
    return y, z, v


@pytest.mark.parametrize("r", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("beta", [0.9, 1.0])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_one_machine_is_schedule_free_adamw_where_their_definitions_meet(r, beta, weight_decay):
    """weights="schedule_free", weight_power = r, beta = beta1, a constant lr, no warmup: the same y, z (w) and v."""
    q = Quadratics(machines=1, dim=5, steps=40, seed=3)
    y, state = one_machine(
        q, 40, lr=0.1, beta=beta, weights="schedule_free", weight_power=r, weight_decay=weight_decay, beta2=0.99
    )
    want_y, want_z, want_v = ref_schedule_free_adamw(q, 0.1, 40, beta, beta2=0.99, r=r, weight_decay=weight_decay)
    for got, want in ((y, want_y), (state["w"], want_z), (state["v"], want_v)):
        assert (got - want).abs().max().item() <= 1e-12
    # SLowcal's weights are another average: x_0 weighted, c_{t+1} = 2 / (t + 3) at p = 1.
    y_slowcal, _ = one_machine(q, 40, lr=0.1, beta=beta, weight_power=r, weight_decay=weight_decay, beta2=0.99)
    assert (y_slowcal - want_y).abs().max() > 1e-4


def run_float32(foreach, steps=7, **options):
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(shape, generator=g)) for shape in ((3, 4), (5,), (2, 2, 2))]
    opt = AdaptiveSlowcal(params, lr=0.03, foreach=foreach, **options)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


@pytest.mark.parametrize(
    "options",
    [{}, {"beta": 0.8, "weight_decay": 0.1}, {"second_moment": "adagrad", "weights": "schedule_free", "beta": 0.5}],
)
def test_foreach_and_single_tensor_paths_agree_bit_for_bit(options):
    a, opt_a = run_float32(True, **options)
    b, opt_b = run_float32(False, **options)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        for key in ("w", "v", "x"):
            if key in opt_a.state[p]:
                assert torch.equal(opt_a.state[p][key], opt_b.state[q][key])


@pytest.mark.parametrize("options", [{"beta": 1.0}, {"beta": 0.8, "weight_decay": 0.1, "weights": "schedule_free"}])
def test_resume_from_state_dict_mid_run_is_bit_identical(options):
    whole, _ = run_float32(True, steps=9, **options)
    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(shape, generator=g)) for shape in ((3, 4), (5,), (2, 2, 2))]
    opt = AdaptiveSlowcal(params, lr=0.03, **options)
    for step in range(9):
        if step == 4:  # a new process: fresh parameters and optimizer, loaded from the saved bytes
            buffer = io.BytesIO()
            torch.save(([p.detach() for p in params], opt.state_dict()), buffer)
            buffer.seek(0)
            saved, state = torch.load(buffer)
            params = [nn.Parameter(torch.zeros_like(p)) for p in saved]
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)
            opt = AdaptiveSlowcal(params, lr=0.03, **options)
            opt.load_state_dict(state)
            assert all(type(opt.state[p]["step"]) is int for p in params)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    for p, q in zip(params, whole):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"beta": 0.7, "weight_decay": 0.01},
        {"average_second_moment": True},
        {"second_moment": "adagrad", "weights": "schedule_free", "beta": 0.5, "average_second_moment": True},
    ],
)
def test_averaged_over_simulated_machines_matches_the_float64_reference(options):
    M, K, ROUNDS = 4, 5, 6
    q = Quadratics(M, 3, steps=K * ROUNDS, seed=1)
    machines = SimulatedMachines(Point(q.x0), M)
    opt = AdaptiveSlowcal(machines.parameters(), lr=0.1, **options)
    averager = PeriodicAverager(machines, opt, sync_every=K)
    p = machines.x
    for t in range(K * ROUNDS):
        p.grad = q.stacked_grad(p.detach(), t)
        opt.step()
        averager.step()
    assert averager.num_syncs == ROUNDS
    # d floats for y (the parameters), and d for each averaged state tensor
    assert averager.floats_communicated == ROUNDS * 3 * (1 + len(opt.averaged_state))
    want = ref_adaptive_slowcal(
        q, 0.1, ROUNDS, K, beta=options.get("beta", 1.0), weights=options.get("weights", "slowcal"),
        second_moment=options.get("second_moment", "adam"), weight_decay=options.get("weight_decay", 0.0),
        average_v=options.get("average_second_moment", False),
    )  # fmt: skip
    state = opt.state[p]
    for key, value in {"param": p.detach(), **{k: state[k] for k in ("w", "v", "x") if k in state}}.items():
        expected = want[key] if key == "v" else want[key].expand_as(value)
        assert (value - expected).abs().max().item() <= 1e-10, key
    # Not vacuous: the machines' second moments differ, unless averaged.
    spread = (state["v"][0] - state["v"][1]).abs().max()
    assert spread == 0 if options.get("average_second_moment") else spread > 1e-3


def test_averaged_state_swap_output_and_post_sync():
    assert AdaptiveSlowcal([torch.zeros(1)], lr=0.1).averaged_state == ("w",)
    assert AdaptiveSlowcal([torch.zeros(1)], lr=0.1, beta=0.5, average_second_moment=True).averaged_state == (
        "w",
        "x",
        "v",
    )
    y = nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = AdaptiveSlowcal([y], lr=0.5, beta=0.25)
    y.grad = torch.tensor([1.0, -1.0])
    opt.step()
    x, w = opt.state[y]["x"].clone(), opt.state[y]["w"].clone()
    assert torch.allclose(y.detach(), 0.25 * x + 0.75 * w)
    before = y.detach().clone()
    opt.swap_output()
    assert torch.equal(y.detach(), x) and torch.equal(opt.state[y]["x"], before)
    opt.swap_output()
    assert torch.equal(y.detach(), before)
    with torch.no_grad():
        opt.state[y]["x"].fill_(4.0)
        opt.state[y]["w"].fill_(8.0)
    opt.post_sync()  # the query point of the averaged x and w
    assert torch.equal(y.detach(), torch.full((2,), 7.0))


def test_param_without_grad_is_skipped_and_its_step_does_not_advance():
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt = AdaptiveSlowcal([a, b], lr=0.1)
    a.grad = torch.ones(2)
    opt.step()
    assert opt.state[a]["step"] == 1 and b not in opt.state and torch.equal(b.detach(), torch.ones(2))


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("lr", -1.0, r"Invalid lr: -1.0 \(must be a finite number >= 0\)"),
        ("lr", True, r"Invalid lr: True \(must be a finite number >= 0\)"),  # a bool was taken as 1.0
        ("lr", "0.1", r"Invalid lr: '0.1' \(must be a finite number >= 0\)"),
        ("beta", 1.5, r"Invalid beta: 1.5 \(must be in \[0, 1\]; 1 is SLowcal's query point x\)"),
        ("beta2", 1.0, r"Invalid beta2: 1.0 \(must be in \[0, 1\)\)"),
        ("eps", 0.0, r"Invalid eps: 0.0 \(must be a finite number > 0\)"),
        ("weights", "uniform", r"Invalid weights: 'uniform' \(allowed: slowcal, schedule_free\)"),
        ("second_moment", "rms", r"Invalid second_moment: 'rms' \(allowed: adam, adagrad\)"),
        ("average_second_moment", 1, r"Invalid average_second_moment: 1 \(True or False\)"),
    ],
)
def test_invalid_options_are_refused_naming_argument_and_value(name, value, message):
    kwargs = {"lr": 0.1, name: value}
    with pytest.raises(ValueError, match=message):
        AdaptiveSlowcal([torch.zeros(1)], **kwargs)


def test_optimizer_wide_options_are_refused_in_a_group():
    with pytest.raises(ValueError, match=r"Invalid beta: 0.5 in a parameter group \(one value for the whole"):
        AdaptiveSlowcal([{"params": [torch.zeros(1)]}, {"params": [torch.zeros(1)], "beta": 0.5}], lr=0.1)
    opt = AdaptiveSlowcal([{"params": [torch.zeros(1)]}, {"params": [torch.zeros(1)], "lr": 0.5}], lr=0.1)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
