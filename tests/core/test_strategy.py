"""PeriodicAveragingStrategy: the sync schedule, what is averaged, process layouts, collective counts."""

import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import REPO, Batches, subprocess_env
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import nn

from lit_slowcal import Link, LinkCounts, PeriodicAveragingStrategy, SimulatedMachines, SlowcalSGD
from lit_slowcal.link import compare

M, D = 4, 3


def machine_data(steps: int, b: int = 2, seed: int = 0) -> Batches:
    """Per-step batches (m, b, D), (m, b, 1) with a different linear target on every machine."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randn(M, D, 1, generator=g)
    batches = []
    for _ in range(steps):
        x = torch.randn(M, b, D, generator=g)
        batches.append((x, x @ targets))
    return Batches(batches)


class Regression(pl.LightningModule):
    """M simulated machines fitting their own linear target; automatic optimization, one step per batch."""

    def __init__(self, optimizer: str = "slowcal", lr: float = 0.1, momentum: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.machines = SimulatedMachines(nn.Linear(D, 1), M)
        self.optimizer, self.lr, self.momentum = optimizer, lr, momentum

    def training_step(self, batch, batch_idx):
        x, y = batch
        per_machine = ((self.machines(x) - y) ** 2).mean(dim=(1, 2))
        return per_machine.sum()

    def configure_optimizers(self):
        if self.optimizer == "slowcal":
            return SlowcalSGD(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class RecordingStrategy(PeriodicAveragingStrategy):
    """Records, after every optimizer step, whether all machines hold the same x and the same w."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.records = []

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        inner = optimizer._optimizer if hasattr(optimizer, "_optimizer") else optimizer
        params = list(self.lightning_module.machines.parameters())
        same_x = all(torch.equal(p, p[:1].expand_as(p)) for p in params)
        ws = [inner.state[p]["w"] for p in params if "w" in inner.state[p]]
        same_w = all(torch.equal(w, w[:1].expand_as(w)) for w in ws)
        self.records.append((same_x, same_w, self.num_syncs))
        return out


def fit(module: pl.LightningModule, strategy: PeriodicAveragingStrategy, data) -> pl.Trainer:
    """Fits on ``data``: a Batches iterable, or a number of steps of machine_data."""
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=machine_data(data) if isinstance(data, int) else data)
    return trainer


def test_registered_under_its_own_name_without_clobbering_ddp():
    assert StrategyRegistry["periodic_averaging"]["strategy"] is PeriodicAveragingStrategy
    assert StrategyRegistry["periodic_averaging_spawn"]["init_params"] == {"start_method": "spawn"}
    assert StrategyRegistry["ddp"]["strategy"] is DDPStrategy
    trainer = pl.Trainer(strategy="periodic_averaging", accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is PeriodicAveragingStrategy
    assert trainer.strategy.sync_every == 1


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "8"])
def test_sync_every_refused(bad):
    with pytest.raises(ValueError, match=f"sync_every: {bad!r}"):
        PeriodicAveragingStrategy(sync_every=bad)


def test_post_local_sgd_arguments_refused():
    with pytest.raises(ValueError, match="model_averaging_period"):
        PeriodicAveragingStrategy(sync_every=2, model_averaging_period=4)


@pytest.mark.parametrize("optimizer", ["slowcal", "sgd"])
def test_machines_agree_right_after_each_sync_and_differ_between(optimizer):
    K, steps = 3, 10
    strategy = RecordingStrategy(sync_every=K)
    fit(Regression(optimizer), strategy, steps)
    assert len(strategy.records) == steps
    for step, (same_x, same_w, num_syncs) in enumerate(strategy.records, start=1):
        assert num_syncs == step // K
        synced = step % K == 0
        assert same_x == synced, f"step {step}: machines' x equal={same_x}, expected {synced}"
        if optimizer == "slowcal":
            assert same_w == synced, f"step {step}: machines' w equal={same_w}, expected {synced}"


def test_minibatch_sgd_by_parameter_averaging_is_one_step_on_the_averaged_gradient():
    lr = 0.1
    module = Regression("sgd", lr=lr).double()
    x0 = {k: v[0].detach().clone() for k, v in module.machines.stacked_parameters().items()}
    ((x, y),) = machine_data(1).batches
    x, y = x.double(), y.double()
    # Closed form: the gradient of machine i's mean squared error at the common point x0.
    w0, b0 = x0["weight"], x0["bias"]
    residual = x @ w0.T + b0 - y  # (M, b, 1)
    grad_w = (2 * residual * x).mean(dim=1)  # (M, D)
    grad_b = (2 * residual).mean(dim=1)  # (M, 1)
    expected_w = w0 - lr * grad_w.mean(0, keepdim=True)
    expected_b = b0 - lr * grad_b.mean(0)

    fit(module, PeriodicAveragingStrategy(sync_every=1), Batches([(x, y)]))
    params = module.machines.stacked_parameters()
    for i in range(M):
        torch.testing.assert_close(params["weight"][i], expected_w, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(params["bias"][i], expected_b, rtol=1e-12, atol=1e-12)


def test_momentum_buffers_averaged_only_on_request():
    def run(average_state):
        strategy = PeriodicAveragingStrategy(sync_every=2, average_state=average_state)
        module = Regression("sgd", lr=0.05, momentum=0.9)
        trainer = fit(module, strategy, 4)
        opt = trainer.optimizers[0]
        return [opt.state[p]["momentum_buffer"] for p in module.machines.parameters()]

    averaged = run(["momentum_buffer"])
    assert all(torch.equal(buf, buf[:1].expand_as(buf)) for buf in averaged)
    local = run([])
    assert not any(torch.equal(buf, buf[:1].expand_as(buf)) for buf in local)


def test_plain_module_one_machine_per_process_is_left_as_is_with_one_process():
    class Plain(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(D, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x[0]), y[0])

        def configure_optimizers(self):
            return SlowcalSGD(self.parameters(), lr=0.1)

    strategy = PeriodicAveragingStrategy(sync_every=2)
    module = Plain()
    fit(module, strategy, 5)
    assert strategy.num_syncs == 3  # after steps 2 and 4, and the round closed when fit ends at step 5
    assert strategy.num_machines == 1
    assert strategy.floats_communicated == 0  # one machine in all: nothing is sent


def test_the_strategy_counts_bytes_for_the_link_model_and_the_ddp_reference():
    strategy = PeriodicAveragingStrategy(sync_every=3)
    fit(Regression(), strategy, 10)
    assert strategy.num_syncs == 4  # after steps 3, 6 and 9, and the round closed at step 10
    # x and w of nn.Linear(3, 1): 8 float32 values, 32 bytes a sync; among M = 4 a machine sends
    # 2 * 3/4 * 32 = 48 bytes on the ring in 6 hops.
    assert strategy.link_counts == LinkCounts(syncs=4, payload_bytes=128, ring_bytes=192.0, ring_hops=24)
    assert strategy.bytes_communicated == 128 and strategy.floats_communicated == 32
    # DDP: 10 steps of 4 float32 gradients (16 bytes) among 4: 24 bytes and 6 hops a step.
    assert strategy.ddp_counts() == LinkCounts(syncs=10, payload_bytes=160, ring_bytes=240.0, ring_hops=60)
    link = Link.parse("1Gbit/s,10ms")
    assert compare(strategy.link_counts, strategy.ddp_counts(), link) == pytest.approx(
        (240 / 192, (60 * 0.01 + 240 / 1.25e8) / (24 * 0.01 + 192 / 1.25e8)), rel=1e-12
    )


def test_the_trainer_strategy_s_set_up_anchors_so_its_first_round_is_coded():
    """PeriodicAveragingStrategy(compression="int8") with SLowcal-SGD on Linear(3, 1): the first round codes x's
    weight (3 + 4 bytes: codes and one float32 scale) and sends w exactly (16 bytes); the second codes both
    weights. A bias goes exactly in every round: its int8 message (1 + 4 bytes) is no smaller than it (4)."""
    strategy = PeriodicAveragingStrategy(sync_every=3, compression="int8")
    fit(Regression(), strategy, 6)
    coded = (3 + 4) + 4  # a weight coded, a bias exact
    assert strategy.num_syncs == 2
    assert strategy.bytes_communicated == (coded + 16) + 2 * coded == 49  # a first round sent all exact: 54


class ProcessGroupProbe(pl.Callback):
    """Records, after every training batch, whether torch.distributed has a process group."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(torch.distributed.is_initialized())


def test_one_process_fits_without_a_process_group_and_still_syncs():
    if torch.distributed.is_initialized():  # left by another test in this process
        torch.distributed.destroy_process_group()
    K, steps = 3, 10
    probe, strategy = ProcessGroupProbe(), RecordingStrategy(sync_every=K)
    module = Regression()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=machine_data(steps))
    assert probe.seen == [False] * steps
    assert not torch.distributed.is_initialized()
    assert strategy.num_syncs == steps // K + 1  # and the round that fit ends in (10 is not a multiple of 3) closed
    assert [r[2] for r in strategy.records] == [step // K for step in range(1, steps + 1)]
    assert all(same_x == (step % K == 0) for step, (same_x, _, _) in enumerate(strategy.records, 1))
    # Lightning's collectives are the identity without a process group.
    t = torch.arange(3.0)
    strategy.barrier("no group")
    assert strategy.broadcast({"a": 1}) == {"a": 1}
    assert torch.equal(strategy.reduce(t), t) and torch.equal(strategy.all_gather(t), t)
    assert strategy.reduce_boolean_decision(True) is True


class ManualRegression(Regression):
    """Regression under manual optimization: zero_grad, manual_backward, step."""

    def __init__(self, optimizer: str = "slowcal") -> None:
        super().__init__(optimizer)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()


class StepHooks(pl.Callback):
    """Counts the hooks Lightning calls around each backward and optimizer step."""

    def __init__(self):
        self.calls = {"on_before_backward": 0, "on_after_backward": 0, "on_before_optimizer_step": 0}

    def on_before_backward(self, trainer, pl_module, loss):
        self.calls["on_before_backward"] += 1

    def on_after_backward(self, trainer, pl_module):
        self.calls["on_after_backward"] += 1

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.calls["on_before_optimizer_step"] += 1


@pytest.mark.parametrize("optimizer", ["slowcal", "sgd"])
def test_steps_skip_unimplemented_hooks_and_run_implemented_ones_with_the_same_result(optimizer, monkeypatch):
    """Without step hooks the strategy calls backward and the optimizer directly (Lightning's
    precision plugin is not involved); a callback implementing them gets every call. Same x either way."""
    pre_backward = Precision.pre_backward
    dispatched = []

    def counting(self, tensor, module):
        dispatched.append(1)
        return pre_backward(self, tensor, module)

    monkeypatch.setattr(Precision, "pre_backward", counting)
    K, steps = 3, 10

    def run(callbacks):
        module, strategy = ManualRegression(optimizer), PeriodicAveragingStrategy(sync_every=K)
        trainer = pl.Trainer(
            strategy=strategy, accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        )  # fmt: skip
        trainer.fit(module, train_dataloaders=machine_data(steps))
        assert trainer.global_step == steps and strategy.num_syncs == steps // K + 1  # + the closing sync
        return {k: v.detach().clone() for k, v in module.machines.named_parameters()}

    direct = run([])
    assert dispatched == []
    hooks = StepHooks()
    hooked = run([hooks])
    assert hooks.calls == dict.fromkeys(hooks.calls, steps)
    assert len(dispatched) == steps
    for name, value in direct.items():
        assert torch.equal(value, hooked[name]), name


def run_cli(out: Path, *args: str, **env_vars: str) -> list[dict]:
    env = subprocess_env(WANDB_MODE="disabled", **env_vars)
    cmd = [sys.executable, str(REPO / "tests" / "run_cli.py"), str(out), "fit", *args]
    proc = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(p) for p in sorted(out.glob("rank*.pt"))]


@pytest.mark.parametrize("method", ["slowcal", "accel_minibatch_sgd", "scaffold"])
@pytest.mark.slow
def test_two_processes_match_one_process_and_sync_once_per_round(tmp_path, method):
    """2 gloo processes x 2 simulated machines == 1 process x 4 machines, one all-reduce per round,
    and the initial weights are rank 0's on every rank; for SLowcal-SGD, AC-SA (one step a round)
    and SCAFFOLD (its per-machine control variates stay with their machines)."""
    common = [
        f"--data.root={REPO / 'data'}",
        "--wandb=false",
        "--trainer.enable_progress_bar=false",
        f"--method={method}",
        "--num_machines=4",
        "--local_steps=16",
        "--batch_size=64",  # R = ceil(60000 / (4 * 16 * 64)) = 15 rounds: a whole epoch
        "--model.init=default",
        f"--run_dir={tmp_path / 'runs'}",
    ]
    (one,) = run_cli(tmp_path / "one", *common)
    # Rank 1 starts from other weights: the broadcast at setup must give it rank 0's.
    two = run_cli(tmp_path / "two", *common, "--trainer.devices=2", INIT_NOISE_RANK="1")
    assert [s["world_size"] for s in two] == [2, 2]
    for name, expected in one["params"].items():
        assert expected.shape[0] == 4
        for rank, state in enumerate(two):
            got = state["params"][name]
            assert got.shape[0] == 2
            torch.testing.assert_close(got, expected[2 * rank : 2 * rank + 2], rtol=0, atol=1e-5)
            for key, value in one["state"][name].items():
                if isinstance(value, torch.Tensor):  # w; x, x_ag; x, c, c_local, delta_c
                    want = value[2 * rank : 2 * rank + 2]
                    torch.testing.assert_close(state["state"][name][key], want, rtol=0, atol=1e-5)
                else:
                    assert state["state"][name][key] == value
    assert one["num_rounds"] == 15
    for state in two:
        assert state["num_syncs"] == 15
        # Through the backend: per round one all-reduce (the average), and one all-gather of the ranks'
        # step and backward counts before the first round's average (the check runs in every 16th round:
        # of these 15, the first), nothing else.
        assert state["collectives"] == {"all_reduce": 15, "all_gather": 1}
    assert one["collectives"] == {}  # a single process needs no collective at all
    assert abs(one["metrics"]["test_acc"] - two[0]["metrics"]["test_acc"]) < 1e-3


@pytest.mark.slow
def test_a_compressed_fit_on_two_processes_checkpoints_and_equals_one_process(tmp_path):
    """int8 rounds with error feedback through the Trainer on 2 gloo processes x 2 simulated machines: the fit's
    checkpoints (which gather every process's compression state) are written, and the machines end where those of
    1 process x 4 machines do (as the exact rounds above: the steps' float32 sums differ in their last bits between
    the two layouts, and a code may round the other way, so within a quantum of the largest block, not bit for bit)."""
    common = [
        f"--data.root={REPO / 'data'}",
        "--wandb=false",
        "--trainer.enable_progress_bar=false",
        "--num_machines=4",
        "--local_steps=16",
        "--batch_size=64",
        "--trainer.limit_train_batches=4",  # 4 rounds: the first exact (no anchor yet), three compressed
        "--compression=int8",
        "--checkpoint_every=2",
        "--model.init=default",
        f"--run_dir={tmp_path / 'runs'}",
    ]
    (one,) = run_cli(tmp_path / "one", *common)
    two = run_cli(tmp_path / "two", *common, "--trainer.devices=2")
    for name, expected in one["params"].items():
        for rank, state in enumerate(two):
            got, want = state["params"][name], expected[2 * rank : 2 * rank + 2]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # 1.4e-5 here
    # The two-process run (version_1) saved both processes' anchors and error feedback, each its own.
    checkpoint = torch.load(next((tmp_path / "runs").glob("*/version_1/checkpoints/last.ckpt")), weights_only=True)
    (averager,) = checkpoint["periodic_averaging"]
    coded = averager["compression"]
    assert coded["world_size"] == 2 and sorted(coded["ranks"]) == [0, 1]
    errors = [[e for e in coded["ranks"][r]["errors"] if e is not None] for r in (0, 1)]
    assert errors[0] and not all(torch.equal(a, b) for a, b in zip(*errors))
