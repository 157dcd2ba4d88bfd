"""The methods registry: every method, built from its entry and run by the averager on simulated
machines, against an independent float64 reference of its published update (plain loops over
machines), and what each machine uploads."""

from types import SimpleNamespace

import pytest
import torch
from helpers import Quadratics, ref_adaptive_slowcal
from torch import nn

from lit_slowcal import PeriodicAverager, SimulatedMachines
from lit_slowcal.experiments.train.methods import METHODS, TABLE1_METHODS, get_method, server_step

M, DIM, K, ROUNDS = 4, 3, 5, 6
LR = 0.05
SERVER_LR = 0.7  # SCAFFOLD's eta_g, not 1: the server step is tested too


def mean(vectors):
    return sum(vectors) / len(vectors)


# -- the references: the published updates, one plain loop over the machines ---------------------


def ref_local_sgd(q):
    x, t = q.x0.clone(), 0
    for _ in range(ROUNDS):
        ys = []
        for i in range(M):
            y = x.clone()
            for k in range(K):
                y = y - LR * q.grad(i, y, t + k)
            ys.append(y)
        x, t = mean(ys), t + K
    return {"param": x}


def ref_minibatch_sgd(q):
    x = q.x0.clone()
    for r in range(ROUNDS):  # one step per round on the machines' averaged gradient
        x = x - LR * mean([q.grad(i, x, r) for i in range(M)])
    return {"param": x}


def ref_slowcal(q):
    """Algorithm 2 with alpha_t = t + 1 and the authors' constant step (w_{t+1} = w_t - eta g_t)."""
    x, w, t = q.x0.clone(), q.x0.clone(), 0
    for _ in range(ROUNDS):
        xs, ws = [], []
        for i in range(M):
            xi, wi = x.clone(), w.clone()
            for k in range(K):
                s = t + k
                wi = wi - LR * q.grad(i, xi, s)
                alpha_next, alpha_sum = s + 2, (s + 2) * (s + 3) / 2  # alpha_{s+1}, alpha_{0:s+1}
                xi = (1 - alpha_next / alpha_sum) * xi + alpha_next / alpha_sum * wi
            xs.append(xi)
            ws.append(wi)
        x, w, t = mean(xs), mean(ws), t + K
    return {"param": x, "w": w}


def ref_accel_minibatch_sgd(q):
    """AC-SA (Lan 2012) on the averaged gradient, beta_s = (s+1)/2, gamma_s = (s+1)/2 gamma."""
    x, x_ag = q.x0.clone(), q.x0.clone()
    for s in range(1, ROUNDS + 1):
        beta_inv = 2 / (s + 1)
        x_md = beta_inv * x + (1 - beta_inv) * x_ag
        g = mean([q.grad(i, x_md, s - 1) for i in range(M)])
        x = x - (s + 1) / 2 * LR * g
        x_ag = beta_inv * x + (1 - beta_inv) * x_ag
    beta_inv = 2 / (ROUNDS + 2)
    return {"param": beta_inv * x + (1 - beta_inv) * x_ag, "x": x, "x_ag": x_ag}


def ref_scaffold(q):
    """Karimireddy et al. 2020, Algorithm 1, all clients, option II control variates."""
    x, t = q.x0.clone(), 0
    c_local = [torch.zeros(DIM, dtype=torch.float64) for _ in range(M)]
    c = torch.zeros(DIM, dtype=torch.float64)
    for _ in range(ROUNDS):
        ys, new_c = [], []
        for i in range(M):
            y = x.clone()
            for k in range(K):
                y = y - LR * (q.grad(i, y, t + k) - c_local[i] + c)
            ys.append(y)
            new_c.append(c_local[i] - c + (x - y) / (K * LR))
        x = x + SERVER_LR * (mean(ys) - x)
        c_local, c, t = new_c, mean(new_c), t + K
    return {"param": x, "c": c, "c_local": torch.stack(c_local)}


def ref_diloco(q, lr=LR, b1=0.9, b2=0.999, eps=1e-8):
    """DiLoCo: AdamW on every machine (its moments kept by the machine across rounds; no weight decay
    here), then the outer SGD with Nesterov momentum (lr 0.7, momentum 0.9) on x - mean(y_i)."""
    x, t = q.x0.clone(), 0
    moments = [(torch.zeros_like(x), torch.zeros_like(x)) for _ in range(M)]
    buf = None
    for _ in range(ROUNDS):
        ys = []
        for i in range(M):
            y, (m, v) = x.clone(), moments[i]
            for k in range(K):
                g, n = q.grad(i, y, t + k), t + k + 1
                m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
                y = y - lr * (m / (1 - b1**n)) / ((v / (1 - b2**n)).sqrt() + eps)
            moments[i] = (m, v)
            ys.append(y)
        delta = x - mean(ys)
        buf = delta.clone() if buf is None else 0.9 * buf + delta
        x, t = x - 0.7 * (delta + 0.9 * buf), t + K
    return {"param": x}


def ref_adaptive(q):
    """AdaptiveSlowcal at the registry's defaults: gradients at x (beta = 1), Adam's second moment kept per
    machine, SLowcal's weights (the float64 reference of tests/helpers.py)."""
    want = ref_adaptive_slowcal(q, LR, ROUNDS, K)
    return {"param": want["param"], "w": want["w"], "v": want["v"]}


REFERENCES = {
    "slowcal": ref_slowcal,
    "local_sgd": ref_local_sgd,
    "minibatch_sgd": ref_minibatch_sgd,
    "accel_minibatch_sgd": ref_accel_minibatch_sgd,
    "scaffold": ref_scaffold,
    "diloco": ref_diloco,
    "adaptive_slowcal": ref_adaptive,
}


# -- the same through the registry, the averager and SimulatedMachines ---------------------------


class Point(nn.Module):
    def __init__(self, x0):
        super().__init__()
        self.x = nn.Parameter(x0.clone())


def hparams(**overrides):
    h = dict(lr=LR, weight_decay=0.0, weight_power=1.0, scale_lr_by_weight=False, gamma=None, server_lr=SERVER_LR)
    return SimpleNamespace(**{**h, **overrides})


def run_registry(name, q):
    entry = get_method(name)
    machines = SimulatedMachines(Point(q.x0), M)
    optimizer = entry.optimizer(machines.parameters(), hparams())
    averager = PeriodicAverager(machines, optimizer, sync_every=entry.sync_period(K))
    p = machines.x
    for t in range(ROUNDS * entry.steps_per_round(K)):
        p.grad = q.stacked_grad(p.detach(), t)
        optimizer.step()
        averager.step()
    assert averager.num_syncs == ROUNDS
    state = optimizer.state[p]
    got = {"param": p.detach()}
    got.update({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return got, averager, machines


def deviation(got, want):
    dev = 0.0
    for key, expected in want.items():
        value = got[key]
        if key not in ("c_local", "v"):  # everything else is the same on every machine after a round
            expected = expected.expand_as(value)
        dev = max(dev, (value - expected).abs().max().item())
    return dev


def test_the_registry_is_the_five_methods_of_table_1_diloco_and_the_adaptive_slowcal():
    assert list(METHODS) == [
        "slowcal", "local_sgd", "minibatch_sgd", "accel_minibatch_sgd", "scaffold", "diloco", "adaptive_slowcal",
    ]  # fmt: skip
    assert TABLE1_METHODS == ("slowcal", "local_sgd", "minibatch_sgd", "accel_minibatch_sgd", "scaffold")
    assert set(REFERENCES) == set(METHODS)
    with pytest.raises(ValueError, match=r"Invalid method: 'fedavg' \(allowed: slowcal, local_sgd, minibatch_sgd, "
                       r"accel_minibatch_sgd, scaffold, diloco, adaptive_slowcal\)"):  # fmt: skip
        get_method("fedavg")


@pytest.mark.parametrize("name", list(METHODS))
def test_each_method_matches_its_published_update_in_float64(name):
    q = Quadratics(M, DIM, steps=ROUNDS * K)
    got, _, _ = run_registry(name, q)
    want = REFERENCES[name](q)
    dev = deviation(got, want)
    assert dev <= 1e-10, f"{name}: max deviation {dev:.3g}"
    # Not vacuous: the run moved far from x_0, and the machines' minima differ (heterogeneous).
    # (Adam's steps move each coordinate by about lr a step, a third of that in the average x.)
    assert (want["param"] - q.x0).abs().max() > (0.3 if name == "adaptive_slowcal" else 0.5)
    assert max((q.b[i] - q.b[0]).abs().max() for i in range(M)) > 1


def test_the_methods_differ_on_this_problem():
    q = Quadratics(M, DIM, steps=ROUNDS * K)
    finals = {name: ref(q)["param"] for name, ref in REFERENCES.items()}
    names = list(finals)
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            assert (finals[names[a]] - finals[names[b]]).abs().max() > 1e-3, (names[a], names[b])


@pytest.mark.parametrize("name", list(METHODS))
def test_floats_communicated_is_what_each_method_uploads(name):
    q = Quadratics(M, DIM, steps=ROUNDS * K)
    _, averager, _ = run_registry(name, q)
    entry = METHODS[name]
    assert averager.floats_communicated == ROUNDS * entry.floats_per_round(DIM)
    assert entry.floats_per_round(DIM) == {"slowcal": 2, "scaffold": 2, "adaptive_slowcal": 2}.get(name, 1) * DIM


def test_round_shape_of_local_and_minibatch_methods():
    for name, entry in METHODS.items():
        local = name in ("slowcal", "local_sgd", "scaffold", "diloco", "adaptive_slowcal")
        assert entry.steps_per_round(16) == entry.sync_period(16) == (16 if local else 1)
        assert entry.per_step_batch(16, 2) == (2 if local else 32)
    with pytest.raises(ValueError, match="Invalid local_steps: 0"):
        METHODS["scaffold"].steps_per_round(0)


def test_server_options_of_the_local_methods():
    """model.outer on a local method declares the outer optimizer the averager runs; refused where the
    method's synchronisation is its own step."""
    params = [torch.zeros(2, requires_grad=True)]
    sgd = METHODS["local_sgd"].optimizer(params, hparams(outer="nesterov", outer_lr=0.5, outer_momentum=0.8))
    outer = sgd.outer_optimizer([torch.zeros(2)])
    assert (
        type(outer) is torch.optim.SGD
        and outer.defaults["lr"] == 0.5
        and outer.defaults["momentum"] == 0.8
        and outer.defaults["nesterov"]
    )
    assert (
        type(
            METHODS["slowcal"].optimizer(params, hparams(outer="adam", outer_lr=0.01)).outer_optimizer([torch.zeros(2)])
        )
        is torch.optim.Adam
    )
    assert not hasattr(METHODS["slowcal"].optimizer(params, hparams()), "outer_optimizer")  # none: the plain average
    diloco = METHODS["diloco"].optimizer(params, hparams())
    assert type(diloco) is torch.optim.AdamW and diloco.outer_optimizer([torch.zeros(2)]).defaults["lr"] == 0.7
    assert server_step(hparams(outer="none")) is None
    with pytest.raises(ValueError, match=r"Invalid outer: 'momentum' \(allowed: none, sgd, nesterov, adam\)"):
        METHODS["local_sgd"].optimizer(params, hparams(outer="momentum"))
    with pytest.raises(ValueError, match=r"Invalid outer_lr: -1"):
        METHODS["local_sgd"].optimizer(params, hparams(outer="sgd", outer_lr=-1))
    with pytest.raises(
        ValueError,
        match=r"Invalid outer: 'sgd' with method scaffold \(SCAFFOLD's server step is SGD at model.server_lr\)",
    ):
        METHODS["scaffold"].optimizer(params, hparams(outer="sgd"))


# -- SLowcal's weight_power: the float64 weights (t+1)^p and their sum stay finite over the run ------


def _train(power: float, steps: int, scale: bool = False, lr: float = 0.01) -> tuple[float, bool]:
    """``steps`` SlowcalSGD steps at ``power``: its float64 sum of weights and whether x stayed finite."""
    from lit_slowcal.optimizer import SlowcalSGD

    x = torch.zeros(3, requires_grad=True)
    opt = SlowcalSGD([x], lr=lr, weight_power=power, scale_lr_by_weight=scale)
    for _ in range(steps):
        x.grad = torch.full((3,), 1e-30)
        opt.step()
    return opt.state[x]["alpha_sum"] + opt.state[x]["alpha_sum_error"], bool(torch.isfinite(x).all())


@pytest.mark.parametrize("power", [1e6, 1024.0, float("inf")])
def test_slowcal_sgd_refuses_a_weight_power_whose_first_weight_overflows(power):
    from lit_slowcal.optimizer import SlowcalSGD

    with pytest.raises(ValueError) as info:
        SlowcalSGD([torch.zeros(1, requires_grad=True)], lr=0.1, weight_power=power)
    assert str(info.value).startswith(
        f"Invalid weight_power: {power} (must be finite, >= 0 and < 1024: the first step's"
    )
    assert _train(1023.99, 1)[0] == 1 + 2.0**1023.99  # just below: the first step's sum is finite


@pytest.mark.parametrize(("steps", "scale", "lr", "bound"), [
    (2, False, 0.01, 646.06), (10, False, 0.01, 295.98), (256, False, 0.01, 127.71), (3760, False, 0.01, 85.75),
    (10, True, 0.01, 40.53), (256, True, 0.01, 16.83), (3760, True, 0.01, 11.33), (3760, True, 1e3, 9.93),
])  # fmt: skip
def test_max_weight_power_is_where_the_arithmetic_overflows(steps, scale, lr, bound):
    from lit_slowcal.experiments.train.methods import max_weight_power

    p = max_weight_power(steps, lr, scale)
    assert bound <= p < bound + 0.01
    total, finite = _train(p * (1 - 1e-12), steps, scale, lr)
    assert total < float("inf") and finite
    try:  # 0.05% above: the run's arithmetic fails, raising or leaving a non-finite sum or x
        total, finite = _train(p * 1.0005, steps, scale, lr)
        failed = not (total < float("inf") and finite)
    except (OverflowError, RuntimeError):
        failed = True
    assert failed
