"""The training objective f, its float64 optimum (and cache), and G_*: against closed forms and an independent Newton solver."""

import numpy as np
import pytest
import torch

from lit_slowcal.experiments.data.problems import ProblemData, Quadratic, Synthetic
from lit_slowcal.experiments.measure import objective as objective_module
from lit_slowcal.experiments.measure import optimum as optimum_module
from lit_slowcal.experiments.measure.objective import Objective, heterogeneity
from lit_slowcal.experiments.measure.optimum import optimum, solve


def _weights(data):
    """Per-sample weight 1 / (M n_i), in numpy."""
    w = np.zeros(len(data.train_y))
    for s in data.shards:
        w[s.numpy()] = 1.0 / (len(data.shards) * len(s))
    return w


def quadratic_closed_form(data, lam):
    """theta* = H^-1 g, f*, H and G_* of f(theta) = sum_j w_j (a_j . theta - y_j)^2 / 2 + lam/2 ||theta||^2, theta = (W, b)."""
    x, y = data.train_x.double().numpy(), data.train_y.double().numpy()
    a = np.hstack([x, np.ones((len(y), 1))])
    w = _weights(data)
    h = a.T @ (w[:, None] * a) + lam * np.eye(a.shape[1])
    g = a.T @ (w * y)
    theta = np.linalg.solve(h, g)
    f_star = 0.5 * np.sum(w * y * y) - 0.5 * g @ theta
    grads = [a[s].T @ (a[s] @ theta - y[s]) / len(s) + lam * theta for s in (sh.numpy() for sh in data.shards)]
    g_star = np.sqrt(2 * np.mean([gi @ gi for gi in grads]))
    return theta, f_star, h, g_star


@pytest.mark.parametrize("lam", [0.0, 1e-3])
def test_quadratic_optimum_excess_loss_and_g_star_equal_their_closed_forms(lam):
    data = Quadratic(dim=6, heterogeneity=1.5, samples=40).build(5, seed=3)
    obj = Objective(data, "squared", lam)
    theta, f_star, h, g_star = quadratic_closed_form(data, lam)
    found = solve(obj, (1, 6), tol=1e-10)
    assert found.converged and found.grad_norm <= 1e-10
    assert (
        found.iterations == 1 and found.cg_iterations <= 7
    )  # f is quadratic: one Newton step, CG exact in 7 dimensions
    assert abs(found.value - f_star) <= 1e-9 * max(1.0, abs(f_star))
    np.testing.assert_allclose(np.r_[found.weight[0].numpy(), found.bias.numpy()], theta, atol=1e-9, rtol=0)
    assert abs(heterogeneity(obj, found.params) - g_star) <= 1e-9
    assert g_star > 1.0  # heterogeneous indeed: the machines' gradients at x* do not vanish
    # The excess loss at any x is (theta - theta*)^T H (theta - theta*) / 2.
    rng = np.random.default_rng(0)
    for _ in range(3):
        point = theta + rng.normal(0, 0.3, theta.shape)
        params = {"weight": torch.from_numpy(point[:-1]).reshape(1, -1), "bias": torch.from_numpy(point[-1:])}
        d = point - theta
        assert abs((obj(params) - found.value) - 0.5 * d @ h @ d) <= 1e-9


def newton_logistic(x, y, w, classes, lam, iters=30):
    """f* of weighted softmax regression + lam/2 ||(W, b)||^2 by Newton's method with the exact Hessian (numpy)."""
    a = np.hstack([x, np.ones((len(y), 1))])
    d = a.shape[1]
    theta = np.zeros((classes, d))
    onehot = np.eye(classes)[y]

    def value(t):
        z = a @ t.T
        zmax = z.max(1, keepdims=True)
        lse = zmax[:, 0] + np.log(np.exp(z - zmax).sum(1))
        return np.sum(w * (lse - z[np.arange(len(y)), y])) + 0.5 * lam * np.sum(t * t)

    for _ in range(iters):
        p = softmax(a @ theta.T)
        grad = ((w[:, None] * (p - onehot)).T @ a + lam * theta).reshape(-1)
        theta = theta - np.linalg.solve(softmax_hessian(a, p, w, lam), grad).reshape(classes, d)
    return theta, value(theta), np.linalg.norm(grad)


def softmax(z):
    p = np.exp(z - z.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True)


def softmax_hessian(a, p, w, lam):
    """The Hessian of sum_j w_j CE(theta a_j, y_j) + lam/2 ||theta||^2 in theta = (W | b), rows first (numpy)."""
    classes, d = p.shape[1], a.shape[1]
    hess = np.zeros((classes * d, classes * d))
    for c in range(classes):
        for k in range(classes):
            coef = w * p[:, c] * ((c == k) - p[:, k])
            hess[c * d : (c + 1) * d, k * d : (k + 1) * d] = a.T @ (coef[:, None] * a)
    return hess + lam * np.eye(classes * d)


def test_solver_on_a_small_logistic_problem_matches_newtons_method():
    data = Synthetic(alpha=0.5, beta=0.5, dim=5, num_classes=3).build(4, seed=2)
    lam = 1e-2
    obj = Objective(data, "cross_entropy", lam)
    found = solve(obj, (3, 5), tol=1e-9)
    theta, f_newton, _ = newton_logistic(data.train_x.double().numpy(), data.train_y.numpy(), _weights(data), 3, lam)
    assert found.converged and found.grad_norm <= 1e-9
    assert abs(found.value - f_newton) <= 1e-12
    # f is lam-strongly convex: ||x - x*|| <= ||grad f(x)|| / lam.
    distance = np.linalg.norm(np.hstack([found.weight.numpy(), found.bias.numpy()[:, None]]) - theta)
    assert distance <= found.grad_norm / lam
    # And the objective agrees with the independent one at another point.
    params = {
        "weight": torch.ones(3, 5, dtype=torch.float64) * 0.1,
        "bias": torch.tensor([0.3, -0.2, 0.0], dtype=torch.float64),
    }
    a = np.hstack([data.train_x.double().numpy(), np.ones((len(data.train_y), 1))])
    t = np.hstack([params["weight"].numpy(), params["bias"].numpy()[:, None]])
    z = a @ t.T
    lse = np.log(np.exp(z).sum(1))
    expected = np.sum(_weights(data) * (lse - z[np.arange(len(z)), data.train_y.numpy()])) + 0.5 * lam * np.sum(t * t)
    assert abs(obj(params) - expected) <= 1e-12


def test_the_solvers_hessian_and_hessian_vector_products_equal_the_independent_ones():
    data = Synthetic(alpha=1.0, beta=1.0, dim=4, num_classes=3).build(3, seed=5)
    lam = 1e-3
    obj = Objective(data, "cross_entropy", lam)
    model = optimum_module._Newton(obj, obj.x.double(), 3)
    theta = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    value, grad, p = model.evaluate(theta)
    a = np.hstack([data.train_x.double().numpy(), np.ones((len(data.train_y), 1))])
    hess = softmax_hessian(a, softmax(a @ theta.numpy().T), _weights(data), lam)
    np.testing.assert_allclose(model.hessian(p, drop=0.0).numpy(), hess, rtol=0, atol=1e-13)
    # Dropping the sample pairs with p_c p_k < drop changes it by at most drop C (C - 1) max ||x~||^2.
    drop = 1e-3
    dropped = np.linalg.norm(model.hessian(p, drop=drop).numpy() - hess, 2)
    assert 1e-9 < dropped <= drop * 3 * 2 * np.max(np.sum(a * a, 1))
    v = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    np.testing.assert_allclose(model.hvp(p, v).numpy().reshape(-1), hess @ v.numpy().reshape(-1), rtol=0, atol=1e-13)
    np.testing.assert_allclose(model.diagonal(p).numpy().reshape(-1), np.diag(hess), rtol=0, atol=1e-13)
    # f and its gradient: those of the Objective (autograd).
    value64, grads = obj.value_and_grad64({"weight": theta[:, :-1], "bias": theta[:, -1]})
    assert abs(value - float(value64)) <= 1e-14
    torch.testing.assert_close(grad, torch.cat([grads[0], grads[1][:, None]], 1), rtol=0, atol=1e-14)


def test_the_solver_is_deterministic_and_reports_the_true_gradient_norm():
    data = Synthetic(alpha=1.0, beta=1.0, dim=6, num_classes=4).build(4, seed=7)
    lam = 1e-3
    obj = Objective(data, "cross_entropy", lam)
    found = solve(obj, (4, 6), tol=1e-10)
    again = solve(obj, (4, 6), tol=1e-10)
    assert (
        torch.equal(found.weight, again.weight) and torch.equal(found.bias, again.bias) and found.value == again.value
    )
    # The reported gradient norm is that of f at the returned x*, computed independently (numpy).
    a = np.hstack([data.train_x.double().numpy(), np.ones((len(data.train_y), 1))])
    t = np.hstack([found.weight.numpy(), found.bias.numpy()[:, None]])
    p = softmax(a @ t.T)
    grad = (_weights(data)[:, None] * (p - np.eye(4)[data.train_y.numpy()])).T @ a + lam * t
    assert found.converged and found.grad_norm <= 1e-10
    assert abs(found.grad_norm - np.linalg.norm(grad)) <= 1e-14
    # The whole-Hessian preconditioner (taken after every step with refresh=0) reaches the same x*.
    hessian_path = solve(obj, (4, 6), tol=1e-10, refresh=0)
    assert hessian_path.converged and hessian_path.iterations <= found.iterations
    np.testing.assert_allclose(hessian_path.weight.numpy(), found.weight.numpy(), rtol=0, atol=2e-10 / lam)
    assert abs(hessian_path.value - found.value) <= 1e-14


def _exact_logits(x, weight, bias):
    """Correctly rounded logits of float32 inputs: each product of two float32 numbers is a float64 number, and
    math.fsum sums them exactly (an implementation independent of the blocked product)."""
    import math

    xs, ws, bs = x.double().tolist(), weight.double().tolist(), bias.double().tolist()
    return torch.tensor(
        [[math.fsum([*(a * b for a, b in zip(row, w)), c]) for w, c in zip(ws, bs)] for row in xs], dtype=torch.float64
    )


def _logit_bound(x, weight, bias, columns):
    """The float64 bound of a dot product of ``columns`` + 1 terms (``float64_product``'s docstring), per logit:
    gamma_(k+1) * (sum_j |x_j - c_j| |w_j| + |c . w + b|) <= gamma_(k+2) * (sum_j |x_j| |w_j| + 2 sum_j |c_j w_j| + |b|)."""
    u = 2.0**-53
    gamma = (columns + 2) * u / (1 - (columns + 2) * u)
    return gamma * (
        x.double().abs() @ weight.double().abs().T
        + 2 * x.double().abs().amax(0) @ weight.double().abs().T
        + bias.double().abs()
    )


def test_the_blocked_logits_are_within_their_float64_bound_of_the_correctly_rounded_ones():
    """The inputs as MNIST's: a common background value in most entries, float32; several points at once."""
    from lit_slowcal.experiments.measure.float64_product import BlockedInputs

    g = torch.Generator().manual_seed(5)
    n, d, outputs = 300, 40, 3
    background = torch.tensor(-0.4242129623889923)  # MNIST's normalised 0, a float32 number
    x = torch.where(torch.rand(n, d, generator=g) < 0.8, background, torch.rand(n, d, generator=g) * 3 - 0.4).float()
    inputs = BlockedInputs(x, rows=32)
    assert torch.equal(inputs.center, torch.full((d,), float(background), dtype=torch.float64))
    assert 0.2 < inputs.density < 1.0  # the blocks skip columns where every row holds the background
    weight, bias = torch.randn(4, outputs, d, generator=g) * 0.3, torch.randn(4, outputs, generator=g)
    z = torch.empty(n, 4, outputs, dtype=torch.float64)
    for start, stop, block in inputs.logits(weight, bias):
        z[start:stop] = block
    xs = x[inputs.order]
    for p in range(4):
        exact = _exact_logits(xs, weight[p], bias[p])
        error = (z[:, p] - exact).abs()
        assert (error <= _logit_bound(xs, weight[p], bias[p], d)).all()
        assert error.max() <= 1e-14 * exact.abs().max()
        # A point's logits alone in the pass equal those it gets among others, within the same bound.
        alone = torch.cat([block[:, 0].clone() for _, _, block in inputs.logits(weight[p : p + 1], bias[p : p + 1])])
        assert ((alone - z[:, p]).abs() <= 2 * _logit_bound(xs, weight[p], bias[p], d)).all()


def test_the_objective_is_float64_on_float32_inputs_and_reads_them_without_a_copy():
    data = Synthetic(dim=8, num_classes=4).build(3, seed=1)
    obj = Objective(data, "cross_entropy", 1e-3)
    assert data.train_x.dtype == torch.float32 and obj.x.data_ptr() == data.train_x.data_ptr()
    params = {"weight": torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), "bias": torch.zeros(4)}
    x64 = data.train_x.double()
    logits = x64 @ params["weight"].double().T
    expected = float(
        (torch.tensor(_weights(data)) * torch.nn.functional.cross_entropy(logits, data.train_y, reduction="none")).sum()
        + 0.5e-3 * params["weight"].double().square().sum()
    )
    assert abs(obj(params) - expected) <= 1e-14 * abs(expected)


def test_optimum_is_cached_by_its_inputs_and_the_second_call_does_not_solve(tmp_path, monkeypatch):
    data = Quadratic(dim=4, samples=30).build(3, seed=1)
    obj = Objective(data, "squared", 1e-3)
    identity = {"problem": "Quadratic(dim=4)", "num_machines": 3, "seed": 1}
    first, path, cached = optimum(obj, (1, 4), identity, tmp_path)
    assert not cached and path.exists() and path.parent == tmp_path / "optima"

    def no_solving(*args, **kwargs):
        raise AssertionError("solved again")

    monkeypatch.setattr(optimum_module, "solve", no_solving)
    again, path2, cached = optimum(obj, (1, 4), identity, tmp_path)
    assert cached and path2 == path
    assert again.value == first.value and torch.equal(again.weight, first.weight) and again.grad_norm == first.grad_norm
    # Another weight decay, another split or another problem setting is another key: solved anew.
    for other, ident in (
        (Objective(data, "squared", 2e-3), identity),
        (Objective(Quadratic(dim=4, samples=30).build(3, seed=2), "squared", 1e-3), identity),
        (obj, {**identity, "problem": "Quadratic(dim=4, noise=0.2)"}),
    ):
        with pytest.raises(AssertionError, match="solved again"):
            optimum(other, (1, 4), ident, tmp_path)


def test_a_cached_optimum_serves_looser_tolerances_and_starts_a_tighter_solve(tmp_path, monkeypatch):
    data = Synthetic(dim=4, num_classes=3).build(3, seed=4)
    obj = Objective(data, "cross_entropy", 1e-2)
    identity = {"problem": "Synthetic(dim=4)", "num_machines": 3, "seed": 4}
    rough, path, cached = optimum(obj, (3, 4), identity, tmp_path, tol=1e-3)
    assert not cached and 1e-9 < rough.grad_norm <= 1e-3
    assert optimum(obj, (3, 4), identity, tmp_path, tol=1e-2)[2]  # looser: served from the cache
    starts = []
    real_solve = optimum_module.solve

    def recording_solve(*args, start=None, **kwargs):
        starts.append(start)
        return real_solve(*args, start=start, **kwargs)

    monkeypatch.setattr(optimum_module, "solve", recording_solve)
    fine, path2, cached = optimum(obj, (3, 4), identity, tmp_path, tol=1e-9)
    assert not cached and path2 == path and fine.grad_norm <= 1e-9
    assert len(starts) == 1 and torch.equal(starts[0].weight, rough.weight)  # went on from the cached point
    assert fine.iterations > rough.iterations and abs(fine.value - rough.value) <= rough.grad_norm**2 / (2 * 1e-2)
    assert optimum(obj, (3, 4), identity, tmp_path, tol=1e-9)[0].value == fine.value  # the better one replaced it


def test_a_problem_with_samples_left_out_is_evaluated_on_its_used_rows_without_copying_its_inputs():
    """The split leaves samples out (as MNIST's official split may): f reads the input tensor as it is, on
    the used samples' rows."""
    full = Synthetic(dim=8, num_classes=4).build(3, seed=1)
    shards = tuple(s[: len(s) * 2 // 3] for s in full.shards)  # a third of every shard unused
    data = ProblemData(full.train_x, full.train_y, shards, full.test_x, full.test_y)
    obj = Objective(data, "cross_entropy", 1e-3)
    assert obj.x.data_ptr() == data.train_x.data_ptr()
    used = torch.cat(shards).sort().values
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        weight, bias = torch.randn(4, 8, generator=g), torch.randn(4, generator=g)
        logits = _exact_logits(data.train_x[used], weight, bias)  # the used rows alone, correctly rounded
        w = torch.tensor(_weights(data))[used]
        penalty = 0.5e-3 * (weight.double().square().sum() + bias.double().square().sum())
        expected = float(
            (w * torch.nn.functional.cross_entropy(logits, data.train_y[used], reduction="none")).sum() + penalty
        )
        assert abs(obj({"weight": weight, "bias": bias}) - expected) <= 1e-14 * expected
    assert torch.equal(obj.inputs64(), data.train_x[used].double())  # the solver's float64 inputs


def test_values_of_several_objectives_in_one_pass_equal_each_alone_within_1e_12():
    """Two objectives share their inputs (one split, two points), a third has its own split; weight decay on
    one. And affine_rows, the test set's product of every trial, is each trial's float32 addmm bit for bit."""
    problem = Synthetic(dim=12, num_classes=5)
    one, other = problem.build(4, seed=1), problem.build(4, seed=2)
    objectives = [
        Objective(one, "cross_entropy"),
        Objective(one, "cross_entropy", 1e-3),
        Objective(other, "cross_entropy"),
    ]
    assert objectives[0].x.dtype == torch.float32
    assert objectives[0].inputs()[0] is objectives[1].inputs()[0]  # one arrangement of the inputs for both
    g = torch.Generator().manual_seed(3)
    points = [{"weight": torch.randn(5, 12, generator=g), "bias": torch.randn(5, generator=g)} for _ in objectives]
    got = objective_module.values(objectives, points)
    alone = [o(p) for o, p in zip(objectives, points)]
    assert all(abs(a - b) <= 1e-12 * abs(b) for a, b in zip(got, alone))
    assert len(set(got)) == 3
    logits = objective_module.affine_rows(
        objectives[0].x, [p["weight"] for p in points], [p["bias"] for p in points], rows=100
    )
    for z, p in zip(logits, points):
        assert torch.equal(z, torch.addmm(p["bias"], objectives[0].x, p["weight"].T))


def test_a_cache_folder_that_cannot_hold_the_optimum_is_refused_before_the_solve(tmp_path, monkeypatch):
    data = Quadratic(dim=4, samples=30).build(3, seed=1)
    obj = Objective(data, "squared", 1e-3)
    identity = {"problem": "Quadratic(dim=4)", "num_machines": 3, "seed": 1}
    solves, said = [], []
    monkeypatch.setattr(optimum_module, "solve", lambda *a, **k: solves.append(1))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OSError) as err:
        optimum(obj, (1, 4), identity, tmp_path / "a_file", solving=said.append)
    assert str(err.value).startswith(
        f"--cache_dir {tmp_path / 'a_file'}: cannot create {tmp_path / 'a_file' / 'optima'}"
    )
    assert solves == [] and said == []

    monkeypatch.undo()
    found, path, cached = optimum(obj, (1, 4), identity, tmp_path / "cache", solving=said.append)
    assert said == [path] and not cached and path.exists()  # said before the solve, with where it goes


def test_objectives_of_one_split_share_their_samples_on_the_device():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 3, generator=g), torch.randint(0, 2, (12,), generator=g)

    def split(order):
        return ProblemData(x, y, (order[:5], order[5:]), x[:2], y[:2])

    a, b = Objective(split(torch.arange(12)), "cross_entropy"), Objective(split(torch.arange(12)), "cross_entropy")
    c = Objective(split(torch.arange(12).flip(0)), "cross_entropy")  # another split: its own weights
    point = {"weight": torch.randn(2, 3, generator=g), "bias": torch.randn(2, generator=g)}
    before = [o(point) for o in (a, b, c)]
    assert before[0] != before[2]
    shared = {}
    for o in (a, b, c):
        o.share_to(torch.device("cpu"), shared)
    assert len(shared) == 3  # the inputs once, and the labels and weights of each of the two splits
    assert a.x is b.x is c.x and a.y is b.y and a.weights is b.weights and c.weights is not a.weights
    assert a.inputs()[0] is c.inputs()[0]  # one arrangement of the inputs for every split
    assert [o(point) for o in (a, b, c)] == before


@pytest.mark.slow
def test_on_mnist_the_objective_of_many_points_in_one_pass_equals_each_alone_within_1e_12():
    """The paper's setting: MNIST, the official split over M = 16. Points as trained models are (about the
    size of the paper runs' weights); 20 in one pass, as the stacked trials compute them."""
    from lit_slowcal.experiments.data.datamodule import ProblemDataModule

    data = ProblemDataModule(root="data", num_machines=16, split="official", dirichlet_alpha=0.1)
    data.setup("fit")
    objective = Objective(data.problem_samples(), "cross_entropy", image=data.problem.image)
    inputs = objective.inputs()[0]
    assert 0.40 < inputs.density < 0.47  # the samples ordered by their digits' bounding boxes: 45% of the dense work
    from lit_slowcal.experiments.measure.float64_product import BlockedInputs

    assert 0.5 < BlockedInputs(objective.x).density < 0.56  # by their first and last ink pixel only: 53%
    g = torch.Generator().manual_seed(0)
    points = [
        {"weight": torch.randn(10, 784, generator=g) * 0.05, "bias": torch.randn(10, generator=g) * 0.1}
        for _ in range(20)
    ]
    together = objective_module.values([objective] * 20, points)
    x64 = objective.inputs64()  # the used samples' rows (the official split leaves some out)
    for point, value in zip(points, together):
        alone = objective(point)
        assert abs(value - alone) <= 1e-12 * alone
        # And both against a dense float64 product of the whole inputs (another summation order).
        logits = torch.addmm(point["bias"].double(), x64, point["weight"].double().T)
        dense = float(
            (objective.weights * torch.nn.functional.cross_entropy(logits, objective.y, reduction="none")).sum()
        )
        assert abs(alone - dense) <= 1e-13 * dense
