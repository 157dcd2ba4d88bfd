"""Round boundaries, schedules and options in one process: close_round, buffer ownership, the floats
counted, Fabric at parity with the Trainer strategy, K set by name from LightningCLI."""

import sys

import pytest
import torch
from torch import nn

from lit_slowcal import LinkCounts, PeriodicAverager, PeriodicAveragingFabricStrategy, SimulatedMachines, SlowcalSGD
from lit_slowcal._averager_state import configuration
from lit_slowcal.averaging import buffer_owners


def _machines(m: int = 4) -> SimulatedMachines:
    torch.manual_seed(0)
    return SimulatedMachines(nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)), m)


def _steps(machines, optimizer, n: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(machines.num_machines, 5, 3, generator=g) + torch.arange(machines.num_machines).view(-1, 1, 1)
        optimizer.zero_grad()
        machines(x).pow(2).mean(dim=(1, 2)).sum().backward()
        optimizer.step()


def test_close_round_averages_mid_round_and_keeps_the_schedule():
    machines = _machines()
    optimizer = SlowcalSGD(machines.parameters(), lr=0.1)
    averager = PeriodicAverager(machines, optimizer, sync_every=4).attach()
    _steps(machines, optimizer, 3)
    assert averager.in_round and averager.num_syncs == 0
    before = {k: v.double().clone() for k, v in machines.state_dict().items() if v.is_floating_point()}
    w_before = [optimizer.state[p]["w"].double().clone() for p in machines.parameters()]
    assert averager.close_round()
    for name, value in machines.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(
                value.double(), before[name].mean(0, keepdim=True).expand_as(value), rtol=0, atol=1e-6
            )
    for p, w in zip(machines.parameters(), w_before):
        torch.testing.assert_close(
            optimizer.state[p]["w"].double(), w.mean(0, keepdim=True).expand_as(w), rtol=0, atol=1e-6
        )
    assert not averager.in_round and not averager.close_round()  # nothing to close twice
    # x and w of 12 parameters and 4 running statistics: 28 float32 values, 112 bytes; among P = 4 a
    # machine sends 2 * 3/4 * 112 = 168 bytes on the ring in 6 hops.
    state = averager.state_dict()
    assert state.pop("configuration")["optimizer"] == "SlowcalSGD"  # what the state means (checked at load)
    assert state == {
        "steps": 3,
        "num_syncs": 1,
        "last_sync_step": 3,
        "floats_communicated": 28,
        "bytes_communicated": 112,
        "link_counts": {"syncs": 1, "payload_bytes": 112, "ring_bytes": 168.0, "ring_hops": 6, "check_bytes": 0},
    }
    _steps(machines, optimizer, 1, seed=1)  # the 4th step: the schedule's own sync, still at K
    assert averager.num_syncs == 2 and averager.last_sync_step == 4
    _steps(machines, optimizer, 4, seed=2)
    assert averager.num_syncs == 3 and averager.last_sync_step == 8
    averager.remove_hooks()


def test_state_without_last_sync_step_loads_as_a_k_step_schedule():
    machines = _machines()
    averager = PeriodicAverager(machines, torch.optim.SGD(machines.parameters(), lr=0.1), sync_every=4)
    averager.load_state_dict({"steps": 10, "num_syncs": 2, "floats_communicated": 0})
    assert averager.last_sync_step == 8 and averager.in_round


def test_one_machine_sends_nothing():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = SlowcalSGD(model.parameters(), lr=0.1)
    averager = PeriodicAverager(model, optimizer, sync_every=2).attach()
    for _ in range(4):
        optimizer.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
    assert averager.num_syncs == 2
    assert averager.floats_per_sync() == 0 and averager.floats_communicated == 0
    machines = _machines(2)  # two machines simulated in one process do send
    averager = PeriodicAverager(machines, SlowcalSGD(machines.parameters(), lr=0.1), sync_every=1)
    averager.sync()
    # x (the weights, and BatchNorm's affine; no w before the first step) and the running statistics
    assert averager.floats_communicated == averager.floats_per_sync() == (3 * 2 + 2 + 2 * 2) + 2 * 2


class _GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
        self.d = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, affine=False), nn.Linear(3, 1))
        self.register_buffer("shared", torch.zeros(2))  # claimed by nobody: the first optimizer's
        self.register_buffer("count", torch.zeros(1, dtype=torch.long))  # not floating: never averaged


def test_buffer_owners_give_each_buffer_to_one_optimizer():
    model = _GAN()
    g_opt, d_opt = torch.optim.SGD(model.g.parameters(), lr=0.1), torch.optim.SGD(model.d.parameters(), lr=0.1)
    g_buffers, d_buffers = buffer_owners(model, [g_opt, d_opt])
    assert [id(b) for b in g_buffers] == [id(model.shared), id(model.g[1].running_mean), id(model.g[1].running_var)]
    # The affine-free BatchNorm has no parameters: its statistics go with the submodule's optimizer.
    assert [id(b) for b in d_buffers] == [id(model.d[1].running_mean), id(model.d[1].running_var)]
    (everything,) = buffer_owners(model, [torch.optim.SGD(model.parameters(), lr=0.1)])
    assert len(everything) == 5  # one optimizer owns every floating buffer


@pytest.fixture
def one_process_group(monkeypatch):
    """Fabric's one-process DDP sets up a process group and rendezvous variables: both gone afterwards
    (a process forked later by another test would otherwise inherit a live group)."""
    import os

    import torch.distributed as dist

    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, os.environ[name]) if name in os.environ else monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _fabric(strategy):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    model, optimizer = fabric.setup(model, SlowcalSGD(model.parameters(), lr=0.1))
    return fabric, model, optimizer


def _fabric_steps(fabric, model, optimizer, n):
    for _ in range(n):
        optimizer.zero_grad()
        fabric.backward(model(torch.ones(2, 3)).pow(2).mean())
        optimizer.step()


def test_fabric_applies_k_changed_mid_run_refuses_a_bad_k_and_saves_schedules(tmp_path, one_process_group):
    with pytest.raises(ValueError, match=r"Invalid sync_every: 0 \(must be an integer >= 1\)"):
        PeriodicAveragingFabricStrategy(sync_every=0)
    strategy = PeriodicAveragingFabricStrategy(sync_every=8, process_group_backend="gloo")
    fabric, model, optimizer = _fabric(strategy)
    _fabric_steps(fabric, model, optimizer, 6)
    strategy.sync_every = 4  # applies to the averager already running
    with pytest.raises(ValueError, match=r"Invalid sync_every: 0"):
        strategy.sync_every = 0
    _fabric_steps(fabric, model, optimizer, 4)  # steps 7..10: a sync after step 8
    assert strategy.num_syncs == 1
    fabric.save(tmp_path / "state.ckpt", {"model": model, "optimizer": optimizer})  # closes the round at 10
    assert strategy.num_syncs == 2 and strategy.floats_communicated == 0  # one machine sends nothing
    assert strategy.bytes_communicated == 0 and strategy.link_counts == LinkCounts() == strategy.ddp_counts()
    saved = torch.load(tmp_path / "state.ckpt", weights_only=True)
    assert saved["periodic_averaging"] == [
        {"steps": 10, "num_syncs": 2, "last_sync_step": 10, "floats_communicated": 0, "bytes_communicated": 0,
         "link_counts": LinkCounts().state_dict(), "configuration": configuration(next(iter(strategy.averagers.values())))}
    ]  # fmt: skip

    other = PeriodicAveragingFabricStrategy(sync_every=4, process_group_backend="gloo")
    fabric2, model2, optimizer2 = _fabric(other)
    remainder = fabric2.load(tmp_path / "state.ckpt", {"model": model2, "optimizer": optimizer2})
    assert "periodic_averaging" not in remainder
    assert [a.state_dict() for a in other.averagers.values()] == saved["periodic_averaging"]
    _fabric_steps(fabric2, model2, optimizer2, 2)  # steps 11, 12: the schedule's sync at 12
    assert other.num_syncs == 3
    _fabric_steps(fabric2, model2, optimizer2, 1)
    assert other.close_rounds() and other.num_syncs == 4


def test_fabric_save_lands_a_round_in_flight_first(tmp_path, one_process_group):
    strategy = PeriodicAveragingFabricStrategy(sync_every=4, overlap_delay=2, process_group_backend="gloo")
    fabric, model, optimizer = _fabric(strategy)
    _fabric_steps(fabric, model, optimizer, 5)  # the round started at step 4 lands at 6
    assert strategy.num_syncs == 1
    fabric.save(tmp_path / "state.ckpt", {"model": model, "optimizer": optimizer})  # lands it, then closes at 5
    (saved,) = torch.load(tmp_path / "state.ckpt", weights_only=True)["periodic_averaging"]
    assert (saved["steps"], saved["num_syncs"], saved["last_sync_step"], saved["settled_step"]) == (5, 2, 5, 5)


def test_lightning_cli_sets_k_by_the_registered_name_and_by_class_path(tmp_path, monkeypatch):
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    import lit_slowcal  # noqa: F401  (registers the names; the order of the imports does not matter)

    def strategy_of(*args):
        monkeypatch.setattr(sys, "argv", ["prog", *args])
        cli = LightningCLI(
            BoringModel,
            BoringDataModule,
            run=False,
            trainer_defaults={"accelerator": "cpu", "devices": 1, "logger": False},
        )
        return cli.trainer.strategy

    from lit_slowcal import PeriodicAveragingStrategy

    by_name = strategy_of("--trainer.strategy=periodic_averaging", "--trainer.strategy.sync_every=8")
    assert isinstance(by_name, PeriodicAveragingStrategy) and by_name.sync_every == 8
    by_path = strategy_of("--trainer.strategy=lit_slowcal.PeriodicAveragingStrategy", "--trainer.strategy.sync_every=5")
    assert isinstance(by_path, PeriodicAveragingStrategy) and by_path.sync_every == 5
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: periodic_averaging\n    init_args:\n      sync_every: 16\n"
    )
    from_yaml = strategy_of(f"--config={config}")
    assert isinstance(from_yaml, PeriodicAveragingStrategy) and from_yaml.sync_every == 16
    spawn = strategy_of("--trainer.strategy=periodic_averaging_spawn", "--trainer.strategy.sync_every=4")
    assert type(spawn).__name__ == "periodic_averaging_spawn" and spawn.sync_every == 4
    alone = strategy_of("--trainer.strategy=periodic_averaging")  # the registry's name: K = 1 unless set
    assert isinstance(alone, PeriodicAveragingStrategy) and alone.sync_every == 1


def test_a_one_process_validate_leaves_no_process_group_behind():
    """validate/test in one process set up a gloo group (Lightning syncs the module states through it);
    the strategy destroys it at teardown, so a process forked later inherits no live group."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lit_slowcal import PeriodicAveragingStrategy

    assert not dist.is_initialized()
    trainer = pl.Trainer(
        strategy=PeriodicAveragingStrategy(sync_every=2, process_group_backend="gloo"), accelerator="cpu", devices=1,
        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2, limit_test_batches=2,
    )  # fmt: skip
    for run in (trainer.validate, trainer.test):
        run(BoringModel())
        assert not dist.is_initialized()
