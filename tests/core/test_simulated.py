"""Tests for lit_slowcal.simulated: SimulatedMachines behaves exactly like m independent copies."""

import copy

import pytest
import torch
from torch import nn

from lit_slowcal import SlowcalSGD
from lit_slowcal.simulated import SimulatedMachines

F64 = torch.float64
M = 4


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(5, 3).double()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)).double()


MODULES = {"linear": _linear, "mlp": _mlp}


class ShiftedLinear(nn.Module):
    """A linear layer plus a floating buffer added to the output, and an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.register_buffer("shift", torch.tensor([1.0, -2.0]))
        self.register_buffer("count", torch.tensor(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.shift


def _perturb(machines: SimulatedMachines, seed: int = 1) -> None:
    """Move every machine's parameters (and floating buffers) by a different random amount."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tensors = list(machines.stacked_parameters().values())
        tensors += [b for b in machines.stacked_buffers().values() if b.is_floating_point()]
        for t in tensors:
            t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype))


def _copies(machines: SimulatedMachines, module: nn.Module) -> list[nn.Module]:
    """One plain deep copy of ``module`` per machine, loaded with that machine's slice."""
    copies = []
    for i in range(machines.num_machines):
        c = copy.deepcopy(module)
        state = {name: t[i].detach().clone() for name, t in machines.stacked_parameters().items()}
        state.update({name: t[i].clone() for name, t in machines.stacked_buffers().items()})
        c.load_state_dict(state)
        copies.append(c)
    return copies


def _mean_module(machines: SimulatedMachines, module: nn.Module) -> nn.Module:
    ref = copy.deepcopy(module)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(machines.stacked_parameters()[name].mean(0))
    return ref


@pytest.mark.parametrize("kind", MODULES)
def test_forward_and_gradients_equal_independent_copies(kind):
    module = MODULES[kind]()
    machines = SimulatedMachines(module, M)
    _perturb(machines)
    copies = _copies(machines, module)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(M, 6, 5, generator=g, dtype=F64)
    target = torch.randn(M, 6, 3, generator=g, dtype=F64)

    out = machines(x)
    assert out.shape == (M, 6, 3)
    for i, c in enumerate(copies):
        torch.testing.assert_close(out[i], c(x[i]), rtol=1e-12, atol=1e-12)

    # Machine i's loss depends on machine i's params only, so the gradient of the sum in slice i
    # is machine i's own gradient.
    losses = ((out - target) ** 2).mean(dim=(1, 2))
    losses.sum().backward()
    for i, c in enumerate(copies):
        ((c(x[i]) - target[i]) ** 2).mean().backward()
        for name, p in c.named_parameters():
            stacked = machines.stacked_parameters()[name]
            assert stacked.grad.shape == (M, *p.shape)
            torch.testing.assert_close(stacked.grad[i], p.grad, rtol=1e-12, atol=1e-12)
    # The perturbation made the machines differ, so the gradients differ too.
    grad = machines.stacked_parameters()[next(iter(machines.stacked_parameters()))].grad
    assert not torch.allclose(grad[0], grad[1])


def test_copies_start_identical_and_are_independent_of_the_wrapped_module():
    module = _mlp()
    original = {name: p.detach().clone() for name, p in module.named_parameters()}
    machines = SimulatedMachines(module, M)
    for name, p in original.items():
        stacked = machines.stacked_parameters()[name]
        assert stacked.shape == (M, *p.shape)
        for i in range(M):
            assert torch.equal(stacked[i], p)

    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    for name, p in original.items():
        assert torch.equal(machines.stacked_parameters()[name], p.expand(M, *p.shape))

    # And the other way round: training the machines leaves the wrapped module alone.
    _perturb(machines)
    for name, p in module.named_parameters():
        assert torch.equal(p, original[name] + 1.0)


@pytest.mark.parametrize("kind", MODULES)
def test_forward_averaged_and_averaged_module_use_the_mean(kind):
    module = MODULES[kind]()
    machines = SimulatedMachines(module, M)
    _perturb(machines)
    ref = _mean_module(machines, module)
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(3), dtype=F64)

    torch.testing.assert_close(machines.forward_averaged(x), ref(x), rtol=1e-12, atol=1e-12)

    state = machines.averaged_state()
    assert set(state) == {name for name, _ in module.named_parameters()}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-12, atol=1e-12)
        # Hand check on one entry: the mean of the four slices.
        stacked = machines.stacked_parameters()[name]
        flat = stacked.reshape(M, -1)[:, 0]
        assert state[name].reshape(-1)[0].item() == pytest.approx(flat.sum().item() / M, rel=1e-12)

    avg = machines.averaged_module()
    assert type(avg) is type(module)
    assert avg is not module
    params = dict(avg.named_parameters())
    assert set(params) == set(state)
    for name, p in params.items():
        assert isinstance(p, nn.Parameter)
        assert p.device == machines.stacked_parameters()[name].device == torch.device("cpu")
        assert p.dtype == F64
        assert torch.equal(p.detach(), state[name])
    torch.testing.assert_close(avg(x), ref(x), rtol=1e-12, atol=1e-12)

    # The exported module owns its data: changing it leaves the machines alone.
    before = {name: t.detach().clone() for name, t in machines.stacked_parameters().items()}
    with torch.no_grad():
        for p in avg.parameters():
            p.zero_()
    for name, t in machines.stacked_parameters().items():
        assert torch.equal(t, before[name])


def test_buffers_are_stacked_and_averaged():
    torch.manual_seed(0)
    module = ShiftedLinear().double()
    machines = SimulatedMachines(module, M)
    buffers = machines.stacked_buffers()
    assert set(buffers) == {"shift", "count"}
    assert buffers["shift"].shape == (M, 2)
    assert torch.equal(buffers["shift"], torch.tensor([[1.0, -2.0]] * M, dtype=F64))
    assert buffers["count"].dtype == torch.int64 and torch.equal(buffers["count"], torch.full((M,), 7))
    assert {"shift", "count"} <= set(machines.state_dict())

    with torch.no_grad():
        buffers["shift"].copy_(torch.tensor([[0.0, 0.0], [1.0, 2.0], [2.0, 4.0], [5.0, 2.0]], dtype=F64))
        buffers["count"].copy_(torch.tensor([3, 9, 9, 9]))

    # Every machine adds its own shift.
    x = torch.randn(M, 5, 3, generator=torch.Generator().manual_seed(4), dtype=F64)
    out = machines(x)
    base = torch.stack([module.lin(x[i]) for i in range(M)]).detach()
    torch.testing.assert_close(out - base, buffers["shift"][:, None, :].expand(M, 5, 2), rtol=1e-12, atol=1e-12)
    for i, c in enumerate(_copies(machines, module)):
        torch.testing.assert_close(out[i], c(x[i]), rtol=1e-12, atol=1e-12)

    state = machines.averaged_state()
    assert torch.equal(state["shift"], torch.tensor([2.0, 2.0], dtype=F64))  # (0+1+2+5)/4, (0+2+4+2)/4
    assert state["count"].dtype == torch.int64 and state["count"].item() == 3  # machine 0's

    avg = machines.averaged_module()
    assert torch.equal(avg.shift, torch.tensor([2.0, 2.0], dtype=F64))
    assert avg.count.item() == 3
    x0 = x[0]
    torch.testing.assert_close(machines.forward_averaged(x0), module.lin(x0) + torch.tensor([2.0, 2.0], dtype=F64))


def test_averaged_module_with_a_non_persistent_buffer():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.register_buffer("scale", torch.tensor([2.0, 3.0]), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    module = Scaled().double()
    machines = SimulatedMachines(module, 2)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(5), dtype=F64)
    expected = module(x).detach()
    torch.testing.assert_close(machines.forward_averaged(x), expected)
    avg = machines.averaged_module()
    assert torch.equal(avg.scale, torch.tensor([2.0, 3.0], dtype=F64))
    torch.testing.assert_close(avg(x), expected)


def test_averaged_module_with_tied_weights():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(2, 2)
            self.second = self.first  # the same layer applied twice

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(torch.tanh(self.first(x)))

    torch.manual_seed(0)
    module = Tied().double()
    machines = SimulatedMachines(module, 2)
    assert set(machines.stacked_parameters()) == {"first.weight", "first.bias"}
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(6), dtype=F64)
    avg = machines.averaged_module()
    assert avg.first is avg.second
    torch.testing.assert_close(avg(x), module(x).detach())


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_invalid_num_machines(bad):
    with pytest.raises(ValueError, match="num_machines"):
        SimulatedMachines(nn.Linear(5, 3), bad)


def test_input_with_wrong_leading_dimension():
    machines = SimulatedMachines(nn.Linear(5, 3), M)
    with pytest.raises(ValueError, match=r"number of machines \(4\)"):
        machines(torch.randn(3, 2, 5))
    with pytest.raises(ValueError, match="number of machines"):
        machines(torch.randn(2, 5))  # a batch without the machine dimension

    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(5, 3)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.lin(a) + b

    two = SimulatedMachines(TwoInputs(), M)
    assert two(torch.randn(M, 2, 5), torch.randn(M, 2, 3)).shape == (M, 2, 3)
    with pytest.raises(ValueError, match="input 1"):
        two(torch.randn(M, 2, 5), torch.randn(M + 1, 2, 3))


def test_stacked_parameter_names_and_shapes():
    module = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2, bias=False)))
    machines = SimulatedMachines(module, 3)
    stacked = machines.stacked_parameters()
    expected = [name for name, _ in module.named_parameters()]
    assert expected == ["0.weight", "0.bias", "2.0.weight", "2.0.bias", "2.1.weight"]
    assert list(stacked) == expected
    for name, p in module.named_parameters():
        assert stacked[name].shape == (3, *p.shape)
        assert isinstance(stacked[name], nn.Parameter)
    # The optimizer sees exactly these tensors: no hidden copy of the wrapped module.
    assert {id(p) for p in machines.parameters()} == {id(p) for p in stacked.values()}
    assert machines(torch.randn(3, 6, 5)).shape == (3, 6, 2)


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    "slowcal": lambda params: SlowcalSGD(params, lr=0.1, weight_power=1.0, weight_decay=0.01),
    "slowcal-scaled": lambda params: SlowcalSGD(params, lr=0.05, weight_power=1.0, scale_lr_by_weight=True),
}


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("kind", MODULES)
def test_optimizer_on_stacked_params_equals_independent_training(opt_name, kind):
    make_opt = OPTIMIZERS[opt_name]
    module = MODULES[kind]()
    machines = SimulatedMachines(module, M)
    copies = [copy.deepcopy(module) for _ in range(M)]
    opt = make_opt(machines.parameters())
    copy_opts = [make_opt(c.parameters()) for c in copies]
    steps = 5
    g = torch.Generator().manual_seed(7)
    x = torch.randn(steps, M, 8, 5, generator=g, dtype=F64)
    y = torch.randn(steps, M, 8, 3, generator=g, dtype=F64)

    for t in range(steps):
        opt.zero_grad()
        ((machines(x[t]) - y[t]) ** 2).mean(dim=(1, 2)).sum().backward()
        opt.step()
        for i, (c, c_opt) in enumerate(zip(copies, copy_opts)):
            c_opt.zero_grad()
            ((c(x[t, i]) - y[t, i]) ** 2).mean().backward()
            c_opt.step()

    start = dict(module.named_parameters())
    for name, stacked in machines.stacked_parameters().items():
        for i, c in enumerate(copies):
            torch.testing.assert_close(stacked[i], dict(c.named_parameters())[name], rtol=1e-10, atol=1e-12)
        # Training moved the machines, and apart from each other.
        assert not torch.allclose(stacked[0], start[name])
        assert not torch.allclose(stacked[0], stacked[1])
    if opt_name.startswith("slowcal"):
        for name, stacked in machines.stacked_parameters().items():
            for i, (c, c_opt) in enumerate(zip(copies, copy_opts)):
                p = dict(c.named_parameters())[name]
                assert opt.state[stacked]["step"] == c_opt.state[p]["step"] == steps
                torch.testing.assert_close(opt.state[stacked]["w"][i], c_opt.state[p]["w"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_fast_path_equals_the_vmap_path(bias):
    """nn.Linear takes a batched-matmul path; outputs and gradients equal the generic vmap path."""
    torch.manual_seed(0)
    linear = nn.Linear(7, 3, bias=bias).double()
    fast = SimulatedMachines(linear, 4)
    with torch.no_grad():
        for p in fast.parameters():
            p.add_(torch.randn_like(p))
    generic = SimulatedMachines(linear, 4)
    generic._linear = False  # force vmap + functional_call
    generic.load_state_dict(fast.state_dict())
    assert fast._linear and not generic._linear
    x = torch.randn(4, 5, 2, 7, dtype=torch.float64)  # extra batch dimensions, like nn.Linear allows
    out_fast, out_generic = fast(x), generic(x)
    assert out_fast.shape == (4, 5, 2, 3)
    torch.testing.assert_close(out_fast, out_generic, rtol=0, atol=1e-12)
    out_fast.square().sum().backward()
    out_generic.square().sum().backward()
    for p, q in zip(fast.parameters(), generic.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
        assert p.grad.stride() == p.stride()  # gradient in the parameter's own layout


def test_eval_reaches_the_wrapped_module_dropout_keeps_every_value_and_batchnorm_uses_its_running_stats():
    """``SimulatedMachines.eval()`` used to leave the wrapped module training: Dropout dropped and BatchNorm took
    the batch's statistics in ``forward`` and ``forward_averaged``."""
    torch.manual_seed(0)
    machines = SimulatedMachines(nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5)), 3)
    x = torch.randn(3, 5, 4)
    machines(x)  # training: the running statistics move
    machines.eval()
    assert not machines.template.training and all(not m.training for m in machines.template.modules())
    out = machines(x)
    stats = machines.stacked_buffers()
    w, b = machines.stacked_parameters()["0.weight"], machines.stacked_parameters()["0.bias"]
    gamma, beta = machines.stacked_parameters()["1.weight"], machines.stacked_parameters()["1.bias"]
    h = torch.einsum("mni,moi->mno", x, w) + b[:, None]
    mean, var = stats["1.running_mean"][:, None], stats["1.running_var"][:, None]
    want = (h - mean) / torch.sqrt(var + 1e-5) * gamma[:, None] + beta[:, None]
    assert torch.allclose(out, want, atol=1e-6) and torch.equal(machines(x), out)  # no dropout, no batch statistics
    averaged = machines.forward_averaged(x[0])
    assert torch.equal(averaged, machines.forward_averaged(x[0]))
    machines.train()
    assert machines.template.training and not torch.equal(machines(x), out)
