"""Tests for lit_slowcal.optimizer: the update, its invariants, both kernels, state and errors."""

import copy
import io
import math

import lightning as L
import pytest
import torch
from torch import nn

import lit_slowcal.optimizer as optimizer_module
from lit_slowcal import SlowcalSGD
from lit_slowcal.optimizer import _averaging_weight

F64 = torch.float64


def _quadratic_run(steps: int, **options) -> tuple[list[float], list[float]]:
    """Run SlowcalSGD on f(x) = 0.5 * a * (x - b)^2 with a = 2, b = 1, x_0 = 0, lr = 1/4."""
    a, b = 2.0, 1.0
    x = nn.Parameter(torch.zeros(1, dtype=F64))
    opt = SlowcalSGD([x], lr=0.25, **options)
    xs, ws = [], []
    for _ in range(steps):
        opt.zero_grad()
        (0.5 * a * (x - b) ** 2).sum().backward()
        opt.step()
        xs.append(x.item())
        ws.append(opt.state[x]["w"].item())
    return xs, ws


# Worked by hand: g_t = 2 (x_t - 1), w_{t+1} = w_t - eta_t g_t, x_{t+1} = x_t + c_{t+1} (w_{t+1} - x_t),
# eta_t = 1/4 or (t+1)^p / 4 (scaled), c_{t+1} = 1/(t+2) for p = 0, 2/(t+3) for p = 1, 1/2 with gamma = 1/2.
# E.g. constant, p = 1: w_1 = 0 + 1/4 * 2 = 1/2, x_1 = 2/3 * 1/2 = 1/3; g_1 = -4/3,
# w_2 = 1/2 + 1/3 = 5/6, x_2 = (1/3 + 5/6) / 2 = 7/12.
QUADRATIC_CASES = {
    "scaled-p0": (
        {"weight_power": 0.0, "scale_lr_by_weight": True},
        [1 / 4, 11 / 24, 121 / 192, 493 / 640, 20341 / 23040],
        [1 / 2, 7 / 8, 55 / 48, 511 / 384, 5551 / 3840],
    ),
    "scaled-p1": (
        {"weight_power": 1.0, "scale_lr_by_weight": True},
        [1 / 3, 3 / 4, 16 / 15, 85 / 72, 67 / 60],
        [1 / 2, 7 / 6, 37 / 24, 169 / 120, 689 / 720],
    ),
    "constant-p0": (
        {"weight_power": 0.0},
        [1 / 4, 11 / 24, 121 / 192, 493 / 640, 20341 / 23040],
        [1 / 2, 7 / 8, 55 / 48, 511 / 384, 5551 / 3840],
    ),
    "constant-p1": (
        {"weight_power": 1.0},
        [1 / 3, 7 / 12, 23 / 30, 323 / 360, 1243 / 1260],
        [1 / 2, 5 / 6, 25 / 24, 139 / 120, 871 / 720],
    ),
    "gamma-p0": (
        {"weight_power": 0.0, "gamma": 0.5},
        [1 / 4, 9 / 16, 53 / 64, 257 / 256, 1117 / 1024],
        [1 / 2, 7 / 8, 35 / 32, 151 / 128, 603 / 512],
    ),
    "gamma-p1": (
        {"weight_power": 1.0, "gamma": 0.5},
        [1 / 4, 9 / 16, 53 / 64, 257 / 256, 1117 / 1024],
        [1 / 2, 7 / 8, 35 / 32, 151 / 128, 603 / 512],
    ),
    "gamma-scaled-p1": (  # eta_t = (t+1) / 4
        {"weight_power": 1.0, "scale_lr_by_weight": True, "gamma": 0.5},
        [1 / 4, 3 / 4, 19 / 16, 39 / 32, 123 / 128],
        [1 / 2, 5 / 4, 13 / 8, 5 / 4, 45 / 64],
    ),
}


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("case", list(QUADRATIC_CASES))
def test_five_steps_on_a_quadratic_match_the_hand_computation(case, foreach):
    options, expected_x, expected_w = QUADRATIC_CASES[case]
    xs, ws = _quadratic_run(5, foreach=foreach, **options)
    assert xs == pytest.approx(expected_x, rel=1e-14)
    assert ws == pytest.approx(expected_w, rel=1e-14)


def _least_squares(seed: int, n: int = 64, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(n, d, generator=g, dtype=F64)
    y = A @ torch.randn(d, generator=g, dtype=F64) + 0.5 * torch.randn(n, generator=g, dtype=F64)
    return A, y


@pytest.mark.parametrize("scale_lr_by_weight", [False, True])
@pytest.mark.parametrize("p", [0.0, 1.0, 2.0])
def test_x_is_the_alpha_weighted_average_of_the_w_sequence(p, scale_lr_by_weight):
    A, y = _least_squares(seed=0)
    x = nn.Parameter(torch.randn(A.shape[1], generator=torch.Generator().manual_seed(1), dtype=F64))
    # Algorithm 2's step eta * alpha_t grows like t^p: keep it stable over 1,000 steps.
    lr = 1e-2 / 1000**p if scale_lr_by_weight else 1e-2
    opt = SlowcalSGD([x], lr=lr, weight_power=p, scale_lr_by_weight=scale_lr_by_weight)
    batches = torch.randint(len(y), (1000, 4), generator=torch.Generator().manual_seed(2))
    ws = [x.detach().clone()]  # w_0 = x_0
    for idx in batches:
        opt.zero_grad()
        (0.5 * (A[idx] @ x - y[idx]) ** 2).mean().backward()
        opt.step()
        ws.append(opt.state[x]["w"].clone())

    alphas = torch.arange(1, len(ws) + 1, dtype=F64) ** p  # alpha_t = (t+1)^p, t = 0..1000
    average = (alphas[:, None] * torch.stack(ws)).sum(0) / alphas.sum()
    assert opt.state[x]["step"] == 1000
    assert not torch.allclose(ws[-1], ws[0])  # the iterate moved, so the check has teeth
    torch.testing.assert_close(x.detach(), average, rtol=1e-6, atol=0)


def _build_model(seed: int) -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "matrix": (4, 3),
        "bias": (4,),
        "scalar": (),
        "stacked": (3, 4, 5),  # one (4, 5) copy per simulated machine
        "vector": (7,),
        "skipper": (6,),  # gets a gradient every other step only
        "frozen": (2,),  # never gets a gradient
    }
    return {name: nn.Parameter(torch.randn(shape, generator=g, dtype=F64)) for name, shape in shapes.items()}


def _param_groups(model: dict[str, nn.Parameter]) -> list[dict]:
    return [
        {"params": [model["matrix"], model["bias"], model["scalar"], model["frozen"]], "weight_decay": 1e-2},
        {"params": [model["stacked"]], "lr": 0.05, "weight_power": 0.0, "scale_lr_by_weight": True},
        {
            "params": [model["vector"]],
            "lr": 1e-6,  # eta * alpha_t = 1e-6 * (t+1)^2 stays below 0.01 over 100 steps
            "weight_power": 2.0,
            "scale_lr_by_weight": True,
            "gamma": 0.3,
        },
        {"params": [model["skipper"]], "weight_power": 0.5},
    ]


def _model_loss(model: dict[str, nn.Parameter], step: int) -> torch.Tensor:
    loss = sum((0.5 * (p - 0.1 * step) ** 2 + 0.01 * p**4).sum() for n, p in model.items() if n != "frozen")
    return loss + model["matrix"].sum() * model["bias"].sum()


def _train_model(model, opt, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        opt.zero_grad()
        _model_loss(model, step).backward()
        if step % 2:
            model["skipper"].grad = None
        opt.step()


def test_foreach_and_single_tensor_paths_agree():
    models, opts = [], []
    for foreach in (False, True):
        model = _build_model(seed=0)
        models.append(model)
        opts.append(SlowcalSGD(_param_groups(model), lr=0.1, foreach=foreach))
        _train_model(model, opts[-1], steps=100)

    for name in models[0]:
        assert torch.isfinite(models[0][name]).all()
        torch.testing.assert_close(models[0][name], models[1][name], rtol=1e-7, atol=1e-12)
        if name != "frozen":
            w0, w1 = opts[0].state[models[0][name]]["w"], opts[1].state[models[1][name]]["w"]
            torch.testing.assert_close(w0, w1, rtol=1e-7, atol=1e-12)
    for model, opt in zip(models, opts):
        assert model["frozen"] not in opt.state
        assert opt.state[model["skipper"]]["step"] == 50
        assert opt.state[model["stacked"]]["step"] == 100
        assert opt.state[model["stacked"]]["w"].shape == (3, 4, 5)
        assert opt.state[model["scalar"]]["w"].shape == ()


def test_default_kernel_on_cpu_is_the_multi_tensor_one(monkeypatch):
    calls = []
    multi = optimizer_module._multi_tensor_slowcal_sgd

    def counting_multi(*args, **kwargs):
        calls.append(1)
        multi(*args, **kwargs)

    monkeypatch.setattr(optimizer_module, "_multi_tensor_slowcal_sgd", counting_multi)
    x = nn.Parameter(torch.ones(3))
    opt = SlowcalSGD([x], lr=0.1)
    x.grad = torch.ones(3)
    opt.step()
    assert calls == [1]
    # w_1 = 1 - 0.1, c_1 = 2/3: x_1 = 1 + 2/3 * (0.9 - 1)
    torch.testing.assert_close(x.detach(), torch.full((3,), 1 - 0.2 / 3))


def test_param_without_grad_is_skipped_and_its_step_does_not_advance():
    a, b = nn.Parameter(torch.ones(2, dtype=F64)), nn.Parameter(torch.ones(2, dtype=F64))
    opt = SlowcalSGD([a, b], lr=0.5, weight_power=0.0)
    a.grad = torch.ones(2, dtype=F64)
    opt.step()
    assert b not in opt.state
    b.grad = torch.ones(2, dtype=F64)
    opt.step()
    # a: t = 1, w_2 = 0, c_2 = 1/3, x_2 = 2/3 * 0.75; b: t = 0, w_1 = 0.5, c_1 = 1/2, x_1 = 0.75
    assert opt.state[a]["step"] == 2 and opt.state[b]["step"] == 1
    torch.testing.assert_close(a.detach(), torch.full((2,), 0.5, dtype=F64))
    torch.testing.assert_close(b.detach(), torch.full((2,), 0.75, dtype=F64))


def _resume_setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    data = [(torch.randn(8, 6), torch.randn(8, 1)) for _ in range(100)]
    return model, data


def _resume_optimizer(model: nn.Module) -> SlowcalSGD:
    return SlowcalSGD(
        [
            {"params": model[0].parameters(), "weight_decay": 1e-3},
            {"params": model[2].parameters(), "gamma": 0.2, "scale_lr_by_weight": True, "lr": 0.01},
        ],
        lr=0.05,
    )


def _fit(model, opt, batches) -> None:
    for inputs, targets in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        opt.step()


def test_save_and_resume_continues_bitwise():
    model, data = _resume_setup()
    straight = copy.deepcopy(model)
    _fit(straight, _resume_optimizer(straight), data)

    opt = _resume_optimizer(model)
    _fit(model, opt, data[:50])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=True)  # what Lightning's checkpoints need

    resumed, _ = _resume_setup()
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt = _resume_optimizer(resumed)
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    state = resumed_opt.state[resumed[0].weight]
    assert type(state["step"]) is int and state["step"] == 50
    _fit(resumed, resumed_opt, data[50:])

    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def _stochastic_least_squares_gap(seed: int, p: float, steps: int = 500, lr: float = 0.01):
    """f(x_T) - f* and f(x_0) - f* for SlowcalSGD on a noisy least-squares problem, batch size 1."""
    g = torch.Generator().manual_seed(seed)
    n, d = 200, 10
    A = torch.randn(n, d, generator=g, dtype=F64)
    y = A @ torch.randn(d, generator=g, dtype=F64) + 0.5 * torch.randn(n, generator=g, dtype=F64)
    minimiser = torch.linalg.lstsq(A, y.unsqueeze(1)).solution.squeeze(1)

    def f(x):
        return 0.5 * ((A @ x - y) ** 2).mean().item()

    x = nn.Parameter(torch.zeros(d, dtype=F64))
    opt = SlowcalSGD([x], lr=lr, weight_power=p)
    for i in torch.randint(n, (steps,), generator=torch.Generator().manual_seed(seed + 1000)):
        opt.zero_grad()
        (0.5 * (A[i] @ x - y[i]) ** 2).backward()
        opt.step()
    return f(x.detach()) - f(minimiser), f(torch.zeros(d, dtype=F64)) - f(minimiser)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_converges_and_linear_weights_beat_uniform_weights(seed):
    # With stochastic gradients and a constant lr, uniform weights keep the early iterates in the
    # average (bias ~ D^2 / (eta T)), linear weights discount them (~ D^2 / (eta T^2)): the paper's
    # appendix "Necessity of Non-uniform Weights". Here p = 1 won on 30 of 30 seeds (0..29), with
    # f(x_T) - f* at most 1.2% of f(x_0) - f* and p = 0's gap at least 1.36x p = 1's.
    gap_linear, initial_gap = _stochastic_least_squares_gap(seed, p=1.0)
    gap_uniform, _ = _stochastic_least_squares_gap(seed, p=0.0)
    assert gap_linear < 0.02 * initial_gap
    assert gap_uniform > 1.2 * gap_linear


def _exact_alpha_sum(n: int, p: float) -> float:
    """alpha_{0:n-1} = sum_{k=1}^{n} k^p, exactly (integer p) or to ~1e-16 relative (p = 1/2)."""
    if p == 0.5:
        # Euler-Maclaurin; zeta(-1/2) = -0.2078862249773545...; the next term is O(n^(-5/2)).
        return 2 / 3 * n**1.5 + n**0.5 / 2 - 0.20788622497735457 + n**-0.5 / 24
    return float({0: n, 1: n * (n + 1) // 2, 2: n * (n + 1) * (2 * n + 1) // 6, 3: (n * (n + 1) // 2) ** 2}[int(p)])


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 2.0, 3.0])
def test_averaging_weight_is_exact_at_ten_million_steps(p):
    t = 10**7
    c, alpha_sum, alpha_sum_error = _averaging_weight(t, _exact_alpha_sum(t + 1, p), 0.0, p)
    expected_c = {0.0: 1 / (t + 2), 1.0: 2 / (t + 3)}.get(p, (t + 2) ** p / _exact_alpha_sum(t + 2, p))
    assert c == pytest.approx(expected_c, rel=1e-12)
    assert alpha_sum + alpha_sum_error == pytest.approx(_exact_alpha_sum(t + 2, p), rel=1e-15)


@pytest.mark.parametrize("p", [0.5, 2.0])
def test_running_alpha_sum_does_not_drift(p):
    # A plain float sum is off by 1.1e-12 (relative) here for p = 2; the compensated one is exact.
    alpha_sum, alpha_sum_error = 1.0, 0.0  # alpha_{0:0}
    for t in range(10**6 - 1):
        c, alpha_sum, alpha_sum_error = _averaging_weight(t, alpha_sum, alpha_sum_error, p)
    exact = _exact_alpha_sum(10**6, p)
    assert alpha_sum + alpha_sum_error == pytest.approx(exact, rel=1e-15)
    assert c == pytest.approx((10**6) ** p / exact, rel=1e-15)


def test_step_at_ten_million_uses_the_exact_weight():
    x = nn.Parameter(torch.zeros(3, dtype=F64))
    opt = SlowcalSGD([x], lr=1.0, weight_power=1.0)
    x.grad = torch.zeros(3, dtype=F64)
    opt.step()  # creates the state
    t = 10**7
    opt.state[x].update(step=t, alpha_sum=_exact_alpha_sum(t + 1, 1.0), alpha_sum_error=0.0)
    x.grad = -torch.ones(3, dtype=F64)  # w_{t+1} = 0 + 1 = 1, x_{t+1} = c_{t+1} = 2 / (t + 3)
    opt.step()
    torch.testing.assert_close(x.detach(), torch.full((3,), 2 / (t + 3), dtype=F64), rtol=1e-14, atol=0)
    assert opt.state[x]["step"] == t + 1


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("lr", -0.1),
        ("lr", math.inf),
        ("lr", math.nan),
        ("weight_power", -1.0),
        ("weight_power", math.inf),
        ("gamma", 0.0),
        ("gamma", 1.5),
        ("gamma", -0.2),
        ("weight_decay", -1e-4),
    ],
)
def test_invalid_options_are_refused_naming_argument_and_value(name, value):
    options = {"lr": 0.1, name: value}
    with pytest.raises(ValueError, match=f"Invalid {name}: {value}"):
        SlowcalSGD([nn.Parameter(torch.ones(2))], **options)
    # The same check applies to a group's overrides, and the bad group is not added.
    opt = SlowcalSGD([nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(ValueError, match=f"Invalid {name}: {value}"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2))], name: value})
    assert len(opt.param_groups) == 1


def test_sparse_gradients_are_refused():
    embedding = nn.Embedding(10, 3, sparse=True)
    opt = SlowcalSGD(embedding.parameters(), lr=0.1)
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="SlowcalSGD does not support sparse gradients"):
        opt.step()


def test_closure_is_evaluated_with_grad_and_its_loss_returned():
    x = nn.Parameter(torch.tensor([3.0], dtype=F64))
    opt = SlowcalSGD([x], lr=0.25, weight_power=0.0)

    def closure():
        opt.zero_grad()
        loss = (x**2).sum()  # gradient 2 x = 6
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.item() == 9.0
    # w_1 = 3 - 0.25 * 6 = 1.5, c_1 = 1/2, x_1 = 2.25
    assert x.item() == 2.25 and opt.state[x]["w"].item() == 1.5


def test_stacked_parameter_matches_separate_copies():
    m, d = 4, 5
    g = torch.Generator().manual_seed(0)
    init = torch.randn(m, d, generator=g, dtype=F64)
    targets = torch.randn(m, d, generator=g, dtype=F64)
    options = {"lr": 0.1, "weight_power": 1.0, "weight_decay": 1e-2}

    stacked = nn.Parameter(init.clone())
    stacked_opt = SlowcalSGD([stacked], **options)
    copies = [nn.Parameter(init[i].clone()) for i in range(m)]
    copy_opts = [SlowcalSGD([c], **options) for c in copies]
    for _ in range(20):
        stacked_opt.zero_grad()
        torch.log(torch.cosh(stacked - targets)).sum().backward()
        stacked_opt.step()
        for i, (c, opt) in enumerate(zip(copies, copy_opts)):
            opt.zero_grad()
            torch.log(torch.cosh(c - targets[i])).sum().backward()
            opt.step()

    copy_xs = torch.stack([c.detach() for c in copies])
    torch.testing.assert_close(stacked.detach(), copy_xs, rtol=1e-15, atol=0)
    stacked_w = stacked_opt.state[stacked]["w"]
    copy_ws = torch.stack([opt.state[c]["w"] for c, opt in zip(copies, copy_opts)])
    torch.testing.assert_close(stacked_w, copy_ws, rtol=1e-15, atol=0)
    assert not torch.allclose(stacked.detach(), init)


def test_averaged_state_names_the_iterate():
    x = nn.Parameter(torch.ones(2))
    opt = SlowcalSGD([x], lr=0.1)
    x.grad = torch.ones(2)
    opt.step()
    assert getattr(opt, "averaged_state", ()) == ("w",)
    assert all(isinstance(opt.state[x][name], torch.Tensor) for name in opt.averaged_state)


class _Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 1)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return nn.functional.mse_loss(self.linear(inputs), targets)

    def configure_optimizers(self):
        return SlowcalSGD(self.parameters(), lr=0.1, weight_power=1.0)


def test_trains_a_lightning_module_for_one_epoch():
    torch.manual_seed(0)
    inputs = torch.randn(512, 5)
    targets = inputs @ torch.tensor([[1.0], [-2.0], [0.5], [3.0], [-1.0]]) + 0.5
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=16)
    model = _Regression()

    def full_loss():
        with torch.no_grad():
            return nn.functional.mse_loss(model.linear(inputs), targets).item()

    before = full_loss()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    after = full_loss()
    assert trainer.global_step == 32
    assert after < 0.1 * before


@pytest.mark.parametrize("scale", [False, True])
def test_weights_that_overflow_mid_run_are_one_line_not_a_float_error(scale):
    """p = 100 passes the constructor's bound (2^p is finite) but (t+1)^p overflows float64 after 1,179
    steps, and lr (t+1)^p the float32 range after 2: one line naming the step and weight_power."""
    p = torch.nn.Parameter(torch.zeros(2))
    optimizer = SlowcalSGD([p], lr=0.01, weight_power=100.0, scale_lr_by_weight=scale)
    message = (
        r"the step size lr \(t\+1\)\^p = 5.15e\+45 at step t = 2"
        if scale
        else r"overflows float64 at step t = 1179 with weight_power p = 100.0"
    )
    with pytest.raises(OverflowError, match=message):
        for _ in range(2000):
            p.grad = torch.ones(2)
            optimizer.step()
    assert optimizer.state[p]["step"] == (2 if scale else 1178)  # the failing step changed nothing
