"""The server's side of a round: outer optimizers (DiLoCo, FedAvgM, FedAdam) and partial participation,
against float64 references written here by hand (plain loops over machines, the optimizers' update
rules spelled out), on heterogeneous quadratics; simulated machines in one process and 2 gloo processes."""

import math
import subprocess
import sys

import pytest
import torch
from helpers import REPO, Quadratics, subprocess_env
from torch import nn

from lit_slowcal import PeriodicAverager, Scaffold, SimulatedMachines

F64 = torch.float64
M, DIM, K, ROUNDS = 4, 3, 5, 6


# -- the references ------------------------------------------------------------------------------


def inner_sgd(lr):
    def step(x, g, state):
        return x - lr * g

    return step


def inner_adam(lr, b1=0.9, b2=0.999, eps=1e-8):
    def step(x, g, state):
        t = state["t"] = state.get("t", 0) + 1
        state["m"] = b1 * state.get("m", torch.zeros_like(x)) + (1 - b1) * g
        state["v"] = b2 * state.get("v", torch.zeros_like(x)) + (1 - b2) * g * g
        m_hat, v_hat = state["m"] / (1 - b1**t), state["v"] / (1 - b2**t)
        return x - lr * m_hat / (v_hat.sqrt() + eps)

    return step


def outer_sgd(lr, momentum=0.0, nesterov=False):
    """torch.optim.SGD's rule: b <- momentum b + g (b = g at the first step); the step is g + momentum b
    with Nesterov, b without."""

    def step(x, g, state):
        if momentum:
            state["b"] = g.clone() if "b" not in state else momentum * state["b"] + g
            g = g + momentum * state["b"] if nesterov else state["b"]
        return x - lr * g

    return step


def participants(r, S, seed, machines=M):
    """The documented sample: S of the M machines, from a generator seeded with seed * 1,000,003 + r."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + r)
    return sorted(torch.randperm(machines, generator=g)[:S].tolist())


def reference(problem, inner, outer=None, S=M, seed=0):
    """R rounds of K local steps; the server averages the S participants and (outer) steps on x_s - x_bar."""
    x = problem.x0.clone()
    inner_states = [{} for _ in range(M)]
    outer_state = {}
    for r in range(ROUNDS):
        xs = [x.clone() for _ in range(M)]
        for k in range(K):
            for i in range(M):
                xs[i] = inner(xs[i], problem.grad(i, xs[i], r * K + k), inner_states[i])
        chosen = participants(r, S, seed) if S < M else range(M)
        x_bar = sum(xs[i] for i in chosen) / len(chosen)
        x = x_bar if outer is None else outer(x, x - x_bar, outer_state)
    return x


# -- the averager on simulated machines ----------------------------------------------------------


class Point(nn.Module):
    def __init__(self, x0):
        super().__init__()
        self.x = nn.Parameter(x0.clone())


def simulated(problem, make_inner, make_outer=None, S=None, seed=0):
    machines = SimulatedMachines(Point(problem.x0), M)
    optimizer = make_inner(machines.parameters())
    averager = PeriodicAverager(
        machines, optimizer, sync_every=K, outer_optimizer=make_outer, participation=S, participation_seed=seed
    )
    for t in range(ROUNDS * K):
        machines.x.grad = problem.stacked_grad(machines.x.detach(), t)
        optimizer.step()
        averager.step()
    assert averager.num_syncs == ROUNDS
    return machines.x.detach(), averager


CASES = {
    "fedavg": (inner_sgd(0.05), None, lambda p: torch.optim.SGD(p, lr=0.05), None),
    "diloco_inner_sgd": (inner_sgd(0.05), outer_sgd(0.7, 0.9, True), lambda p: torch.optim.SGD(p, lr=0.05),
                         lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)),
    "diloco_inner_adam": (inner_adam(0.05), outer_sgd(0.7, 0.9, True), lambda p: torch.optim.Adam(p, lr=0.05),
                          lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)),
    "fedavgm": (inner_sgd(0.05), outer_sgd(1.0, 0.9), lambda p: torch.optim.SGD(p, lr=0.05),
                lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.9)),
    "fedadam": (inner_sgd(0.05), None, lambda p: torch.optim.SGD(p, lr=0.05), lambda p: torch.optim.Adam(p, lr=0.1, eps=1e-3)),
}  # fmt: skip


def _fedadam_reference(problem, S=M, seed=0):
    def adam(x, g, state, lr=0.1, b1=0.9, b2=0.999, eps=1e-3):
        return inner_adam(lr, b1, b2, eps)(x, g, state)

    return reference(problem, inner_sgd(0.05), adam, S, seed)


def expected(name, problem, S=M, seed=0):
    if name == "fedadam":
        return _fedadam_reference(problem, S, seed)
    inner, outer, _, _ = CASES[name]
    return reference(problem, inner, outer, S, seed)


@pytest.mark.parametrize("participation", [None, 2])
@pytest.mark.parametrize("name", sorted(CASES))
def test_outer_optimizers_and_participation_match_the_float64_reference(name, participation):
    problem = Quadratics(machines=M, dim=DIM, steps=ROUNDS * K, seed=1)
    _, _, make_inner, make_outer = CASES[name]
    got, averager = simulated(problem, make_inner, make_outer, S=participation, seed=7)
    want = expected(name, problem, S=participation or M, seed=7)
    deviation = (got - want).abs().max().item()
    assert deviation < 1e-12, f"{name}, participation {participation}: largest deviation {deviation:.3g}"
    if make_outer is not None:  # one copy of the parameters on the server, of one machine's shape
        assert [g.shape for g in averager.global_params] == [torch.Size([DIM])]


def test_plain_average_is_unchanged_bitwise_and_an_outer_sgd_at_rate_one_is_the_average():
    problem = Quadratics(machines=M, dim=DIM, steps=ROUNDS * K, seed=2)
    sgd = lambda p: torch.optim.SGD(p, lr=0.05)
    plain, _ = simulated(problem, sgd)
    full, _ = simulated(problem, sgd, S=M)  # S = M: the plain average, the same code path
    assert torch.equal(plain, full)
    unit, _ = simulated(problem, sgd, lambda p: torch.optim.SGD(p, lr=1.0))
    torch.testing.assert_close(unit, plain, rtol=0, atol=1e-13)


def test_participants_are_sampled_per_round_from_the_seed_and_counted_for_what_they_send():
    machines = SimulatedMachines(Point(torch.zeros(DIM, dtype=F64)), M)
    averager = PeriodicAverager(
        machines, torch.optim.SGD(machines.parameters(), lr=0.1), 1, participation=0.5, participation_seed=3
    )
    assert averager.participants == 2
    rounds = [averager.participant_weights(r) for r in range(20)]
    assert all(w.sum().item() == 1.0 and (w > 0).sum().item() == 2 for w in rounds)
    assert len({tuple(w.tolist()) for w in rounds}) > 1  # the sample changes from round to round
    assert [sorted(w.nonzero().flatten().tolist()) for w in rounds[:5]] == [participants(r, 2, 3) for r in range(5)]
    averager.sync()
    assert averager.floats_communicated == DIM * 2 / M  # per machine: the 2 participants' uploads over 4


def test_bad_server_options_are_refused():
    machines = SimulatedMachines(Point(torch.zeros(DIM, dtype=F64)), M)
    sgd = torch.optim.SGD(machines.parameters(), lr=0.1)
    for bad, message in (
        (0, r"Invalid participation: 0 \(must be an integer >= 1\)"),
        (1.5, r"Invalid participation: 1.5"),
        (0.0, "Invalid participation: 0.0"),
    ):
        with pytest.raises(ValueError, match=message):
            PeriodicAverager(machines, sgd, 1, participation=bad)
    with pytest.raises(ValueError, match=r"Invalid participation: 8 \(must be <= M = 4"):
        PeriodicAverager(machines, sgd, 1, participation=8).sync()
    with pytest.raises(TypeError, match="Invalid outer_optimizer"):
        PeriodicAverager(machines, sgd, 1, outer_optimizer=lambda p: None)
    with pytest.raises(ValueError, match="Invalid participation: 2 \\(Scaffold keeps per-machine state"):
        PeriodicAverager(machines, Scaffold(machines.parameters(), lr=0.1), 1, participation=2)


def test_scaffold_server_step_is_the_outer_sgd_special_case():
    """SCAFFOLD with eta_g != 1: the averager's outer SGD at eta_g; against x <- x + eta_g (ybar - x) by hand."""
    problem = Quadratics(machines=M, dim=DIM, steps=ROUNDS * K, seed=3)
    machines = SimulatedMachines(Point(problem.x0), M)
    optimizer = Scaffold(machines.parameters(), lr=0.05, server_lr=0.5)
    averager = PeriodicAverager(machines, optimizer, sync_every=K)
    assert averager.outer is not None and averager.outer.param_groups[0]["lr"] == 0.5
    for t in range(ROUNDS * K):
        machines.x.grad = problem.stacked_grad(machines.x.detach(), t)
        optimizer.step()
        averager.step()
    x, c, c_local = problem.x0.clone(), torch.zeros(DIM, dtype=F64), [torch.zeros(DIM, dtype=F64) for _ in range(M)]
    for r in range(ROUNDS):
        ys = [x.clone() for _ in range(M)]
        for k in range(K):
            for i in range(M):
                ys[i] = ys[i] - 0.05 * (problem.grad(i, ys[i], r * K + k) - c_local[i] + c)
        deltas = []
        for i in range(M):
            new = c_local[i] - c + (x - ys[i]) / (K * 0.05)
            deltas.append(new - c_local[i])
            c_local[i] = new
        x = x + 0.5 * (sum(ys) / M - x)
        c = c + sum(deltas) / M
    deviation = (machines.x.detach() - x).abs().max().item()
    assert deviation < 1e-12, deviation


def test_outer_state_resumes_exactly():
    problem = Quadratics(machines=M, dim=DIM, steps=ROUNDS * K, seed=4)
    make_outer = CASES["diloco_inner_sgd"][3]
    whole, _ = simulated(problem, CASES["diloco_inner_sgd"][2], make_outer)
    machines = SimulatedMachines(Point(problem.x0), M)
    optimizer = torch.optim.SGD(machines.parameters(), lr=0.05)
    averager = PeriodicAverager(machines, optimizer, sync_every=K, outer_optimizer=make_outer)
    half = ROUNDS // 2 * K
    for t in range(half):
        machines.x.grad = problem.stacked_grad(machines.x.detach(), t)
        optimizer.step()
        averager.step()
    saved = averager.state_dict()
    assert set(saved["outer"]) == {"round_start", "optimizer"}
    resumed = PeriodicAverager(
        machines, torch.optim.SGD(machines.parameters(), lr=0.05), sync_every=K, outer_optimizer=make_outer
    )
    with torch.no_grad():
        resumed.global_params[0].zero_()  # whatever it held: the state restores it
    resumed.load_state_dict(saved)
    for t in range(half, ROUNDS * K):
        machines.x.grad = problem.stacked_grad(machines.x.detach(), t)
        resumed.optimizer.step()
        resumed.step()
    assert torch.equal(machines.x.detach(), whole)


@pytest.mark.slow
def test_two_processes_match_the_reference(tmp_path):
    """2 gloo processes x 2 simulated machines: DiLoCo (inner Adam), FedAdam and FedAvg with 2 of 4 machines a round."""
    out = tmp_path / "result.pt"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "server_side_run.py"), str(out)],
        cwd=tmp_path, env=subprocess_env(PYTHONFAULTHANDLER="1"), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = torch.load(out)
    problem = Quadratics(machines=M, dim=DIM, steps=ROUNDS * K, seed=5)
    for name, S in (("diloco_inner_adam", M), ("fedadam", M), ("fedavg", 2)):
        want = expected(name, problem, S=S, seed=11)
        for rank in (0, 1):
            got = results[name][rank]
            assert got.shape == (2, DIM)
            for j in range(2):
                deviation = (got[j] - want).abs().max().item()
                assert deviation < 1e-12, f"{name}, rank {rank}: largest deviation {deviation:.3g}"
    assert math.isclose(results["fedavg_floats"], ROUNDS * DIM * 2 / M)


class _QuadraticMachines:
    """A LightningModule whose machine i's loss has the gradient Quadratics.grad(i, x, t)."""

    @staticmethod
    def build(problem, make_inner):
        import lightning.pytorch as pl

        class Module(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.machines = SimulatedMachines(Point(problem.x0), M)

            def training_step(self, batch, batch_idx):
                x = self.machines.x
                loss = 0.0
                for i in range(M):
                    d = x[i] - problem.b[i]
                    loss = loss + 0.5 * d @ problem.A[i] @ d + problem.noise[batch_idx, i] @ x[i]
                return loss

            def configure_optimizers(self):
                return make_inner(self.parameters())

        return Module()


@pytest.mark.parametrize("name", ["diloco_inner_adam", "fedadam"])
def test_trainer_and_fabric_strategies_take_the_server_options(name, tmp_path):
    """The Trainer strategy (1 process, 4 simulated machines, 2 of them a round) and the reference agree."""
    import lightning.pytorch as pl
    from helpers import Batches

    from lit_slowcal import PeriodicAveragingFabricStrategy, PeriodicAveragingStrategy

    problem = Quadratics(machines=M, dim=DIM, steps=ROUNDS * K, seed=6)
    _, _, make_inner, make_outer = CASES[name]
    module = _QuadraticMachines.build(problem, make_inner)
    strategy = PeriodicAveragingStrategy(
        sync_every=K, outer_optimizer=make_outer, participation=2, participation_seed=5
    )
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=ROUNDS * K, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, Batches([0] * (ROUNDS * K)))
    want = expected(name, problem, S=2, seed=5)
    deviation = (module.machines.x.detach() - want).abs().max().item()
    assert deviation < 1e-12, deviation
    fabric_strategy = PeriodicAveragingFabricStrategy(sync_every=K, outer_optimizer=make_outer, participation=2)
    options = fabric_strategy.options
    assert (options.outer_optimizer, options.participation, options.participation_seed) == (make_outer, 2, 0)


@pytest.mark.slow
def test_the_app_takes_diloco_server_options_participation_and_non_linear_models(tmp_path):
    """``fit --method=diloco --participation=0.5 --model.arch=mlp``: the run's averager takes DiLoCo's outer
    Nesterov step over half the machines a round; the stacked engine runs such trials one at a time, saying why."""
    from lit_slowcal.experiments.sweep.stacked import stackable
    from lit_slowcal.experiments.train.model import MachinesModel

    base = {"trainer": {"max_epochs": 1, "devices": 1, "accelerator": "cpu", "strategy": "periodic_averaging"}}
    assert stackable({**base, "method": "slowcal", "model": {}}) is None
    assert (
        stackable({**base, "method": "diloco", "model": {}})
        == "it takes a server step (diloco, model.outer; stacking takes the plain average)"
    )
    assert (
        stackable({**base, "model": {"outer": "adam"}})
        == "it takes a server step (diloco, model.outer; stacking takes the plain average)"
    )
    assert stackable({**base, "model": {"arch": "cnn"}}) == "model.arch is cnn (stacking trains the linear model only)"
    assert (
        stackable({**base, "model": {}, "participation": 4})
        == "participation is set (stacking averages every machine every round)"
    )
    for arch, shapes in (
        ("mlp", [(4, 64, 784), (4, 64), (4, 10, 64), (4, 10)]),
        ("cnn", [(4, 8, 1, 5, 5), (4, 8), (4, 16, 8, 5, 5), (4, 16), (4, 10, 784), (4, 10)]),
    ):
        model = MachinesModel(num_machines=4, arch=arch, init="default")
        model.configure_model()
        assert [tuple(p.shape) for p in model.machines.parameters()] == shapes
        assert model.machines(torch.randn(4, 2, 784)).shape == (4, 2, 10)
    with pytest.raises(ValueError, match=r"Invalid model.arch: 'resnet' \(allowed: linear, mlp, cnn, transformer\)"):
        MachinesModel(arch="resnet", init="default")
    with pytest.raises(ValueError, match=r"Invalid model.init: 'zeros' with model.arch=mlp"):
        MachinesModel(arch="mlp")
    proc = subprocess.run(
        [sys.executable, "-m", "lit_slowcal", "fit", "--config", str(REPO / "configs" / "slowcal.yaml"), "--wandb=false",
         "--method=diloco", "--participation=0.5", "--model.arch=mlp", "--model.init=default", "--trainer.limit_train_batches=3",
         "--trainer.enable_progress_bar=false", f"--run_dir={tmp_path}", f"--data.root={REPO / 'data'}"],
        cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "method diloco   M=16  K=16  b=1   rounds 3/235" in proc.stdout
    refused = subprocess.run(
        [sys.executable, "-m", "lit_slowcal", "fit", "--config", str(REPO / "configs" / "slowcal.yaml"), "--wandb=false",
         "--method=scaffold", "--participation=4", f"--run_dir={tmp_path}", f"--data.root={REPO / 'data'}"],
        cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "Invalid participation: 4 with method scaffold (Scaffold keeps per-machine state" in refused.stderr
