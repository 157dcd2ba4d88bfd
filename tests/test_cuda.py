"""The core and the main job on a CUDA device, checked against the same computation on the CPU.

Every test here is marked ``cuda``: without a CUDA device they are skipped and counted (see
conftest.py); with one they must pass. Run them alone with ``pytest -m cuda tests/test_cuda.py``
(``benchmarks/gpu_check.sh`` does). Each test records its figures (largest differences, accuracy,
wall times) with ``record_property``; ``--junitxml`` writes them out, and gpu_check.sh prints them.
"""

import re
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import REPO, Batches, subprocess_env
from torch import nn

from lit_slowcal import PeriodicAverager, PeriodicAveragingStrategy, SimulatedMachines, SlowcalSGD

pytestmark = pytest.mark.cuda

M, D = 4, 3

# The main job on the CPU (configs/slowcal.yaml, README): final test accuracy and loss.
CPU_TEST_ACC, CPU_TEST_LOSS = 0.9124, 0.3059
# float32 on the GPU sums in another order than on the CPU: a few of the 10,000 test images flip.
ACC_TOLERANCE, LOSS_TOLERANCE = 0.003, 0.01


@pytest.fixture(autouse=True)
def _exact_float32_matmul():
    """IEEE float32 matmuls (no TF32), whatever an earlier test or import chose; restored afterwards."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def machine_batches(steps: int, b: int = 5, seed: int = 0, dtype=torch.float32) -> list[tuple[torch.Tensor, ...]]:
    """Per-step CPU batches (M, b, D), (M, b, 1); every machine has its own linear target."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randn(M, D, 1, generator=g, dtype=torch.float64)
    out = []
    for _ in range(steps):
        x = torch.randn(M, b, D, generator=g, dtype=torch.float64)
        out.append((x.to(dtype), (x @ targets).to(dtype)))
    return out


def make_machines(kind: str) -> SimulatedMachines:
    """M machines of nn.Linear (the batched-matmul path) or of a small MLP (the vmap path), float64."""
    torch.manual_seed(0)
    module = nn.Linear(D, 1) if kind == "linear" else nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 1))
    return SimulatedMachines(module, M).double()


def per_machine_loss(machines: SimulatedMachines, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Machine i's mean squared error in slice i; summed, its gradient in slice i is machine i's alone."""
    return ((machines(x) - y) ** 2).mean(dim=(1, 2))


def train_slowcal(device: str, kind: str, foreach: bool, steps: int = 50):
    machines = make_machines(kind).to(device)
    optimizer = SlowcalSGD(machines.parameters(), lr=0.05, foreach=foreach)
    for x, y in machine_batches(steps, dtype=torch.float64):
        optimizer.zero_grad()
        per_machine_loss(machines, x.to(device), y.to(device)).sum().backward()
        optimizer.step()
    params = {name: p.detach().cpu() for name, p in machines.named_parameters()}
    ws = {name: optimizer.state[p]["w"].cpu() for name, p in machines.named_parameters()}
    steps_done = {optimizer.state[p]["step"] for p in machines.parameters()}
    return params, ws, steps_done


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "single-tensor"])
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_slowcal_on_simulated_machines_cuda_equals_cpu_in_float64(kind, foreach, record_property):
    cpu_params, cpu_ws, cpu_steps = train_slowcal("cpu", kind, foreach)
    gpu_params, gpu_ws, gpu_steps = train_slowcal("cuda", kind, foreach)
    assert cpu_steps == gpu_steps == {50}
    pairs = ((gpu_params, cpu_params), (gpu_ws, cpu_ws))
    diff = max((gpu[n] - cpu[n]).abs().max().item() for gpu, cpu in pairs for n in cpu)
    record_property("max_abs_diff_cuda_cpu", f"{diff:.3e}")
    for name, expected in cpu_params.items():
        assert expected.shape[0] == M and expected.dtype == torch.float64
        # The machines trained on different data: the comparison is not one of identical slices.
        assert not torch.equal(expected, expected[:1].expand_as(expected))
        torch.testing.assert_close(gpu_params[name], expected, rtol=0, atol=1e-10)
        torch.testing.assert_close(gpu_ws[name], cpu_ws[name], rtol=0, atol=1e-10)
        # x moved away from x_0 (the test would pass trivially with lr = 0).
        assert (expected - make_machines(kind).get_parameter(name).detach()).abs().max() > 1e-3


def test_periodic_averager_on_cuda_simulated_machines_averages_exactly(record_property):
    K, steps = 4, 14
    machines = make_machines("linear").to("cuda")
    optimizer = SlowcalSGD(machines.parameters(), lr=0.05)
    params = list(machines.parameters())
    before: list[dict[str, list[torch.Tensor]]] = []
    largest = 0.0  # the largest |machine slice after a sync - mean of the slices before it|

    def record(*_):  # registered first, so it runs after the update and before the averager's hook
        before.append({
            "x": [p.detach().clone() for p in params],
            "w": [optimizer.state[p]["w"].clone() for p in params],
        })  # fmt: skip

    optimizer.register_step_post_hook(record)
    averager = PeriodicAverager(machines, optimizer, sync_every=K).attach()
    assert averager.machines_per_process == M and averager.num_machines == M and averager.world_size == 1
    for step, (x, y) in enumerate(machine_batches(steps, dtype=torch.float64), start=1):
        optimizer.zero_grad()
        per_machine_loss(machines, x.cuda(), y.cuda()).sum().backward()
        optimizer.step()
        synced = step % K == 0
        assert averager.steps == step and averager.num_syncs == step // K
        now = {"x": params, "w": [optimizer.state[p]["w"] for p in params]}
        for what in ("x", "w"):
            for t_before, t_now in zip(before[-1][what], now[what]):
                assert t_now.device.type == "cuda" and t_now.dtype == torch.float64
                # Between syncs the machines drift apart; the sync is what makes them equal.
                assert not torch.equal(t_before, t_before[:1].expand_as(t_before))
                if synced:
                    mean = t_before.mean(0)
                    for i in range(M):
                        torch.testing.assert_close(t_now[i], mean, rtol=0, atol=1e-12)
                    largest = max(largest, (t_now - mean).abs().max().item())
                else:
                    assert torch.equal(t_now, t_before), f"step {step}: {what} changed without a sync"
    averager.detach()
    # Per machine per sync: x and w of nn.Linear(D, 1), D weights and 1 bias each.
    assert averager.num_syncs == steps // K == 3
    assert averager.floats_per_sync() == 2 * (D + 1)
    assert averager.floats_communicated == 3 * 2 * (D + 1)
    record_property("max_abs_diff_to_mean", f"{largest:.3e}")
    record_property("floats_communicated", averager.floats_communicated)


class Regression(pl.LightningModule):
    """M simulated machines fitting their own linear target; one SlowcalSGD step per batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.machines = SimulatedMachines(nn.Linear(D, 1), M)
        self.devices_seen: set[str] = set()  # where the parameters and batches were while training

    def training_step(self, batch, batch_idx):
        self.devices_seen.update(t.device.type for t in (*batch, self.machines.weight))
        return per_machine_loss(self.machines, *batch).sum()

    def configure_optimizers(self):
        return SlowcalSGD(self.parameters(), lr=0.05)


def _destroy_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def lightning_fit(accelerator: str, steps: int = 20, sync_every: int = 4):
    """A fit as in a fresh process: Lightning reuses a process group left by an earlier Trainer, so
    the GPU fit would run on a CPU fit's gloo group (and the reverse on NCCL); none is left behind."""
    _destroy_process_group()
    module = Regression()
    strategy = PeriodicAveragingStrategy(sync_every=sync_every)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(module, train_dataloaders=Batches(machine_batches(steps)))
    finally:
        _destroy_process_group()
    # Lightning moves the module back to the CPU at the end of fit: what counts is where it trained.
    params = {name: p.detach().cpu() for name, p in module.machines.named_parameters()}
    return params, module.devices_seen, trainer.global_step, strategy.num_syncs, strategy.floats_communicated


def test_lightning_fit_on_gpu_equals_the_same_fit_on_cpu(record_property):
    gpu, gpu_devices, gpu_steps, gpu_syncs, gpu_floats = lightning_fit("gpu")
    cpu, cpu_devices, cpu_steps, cpu_syncs, cpu_floats = lightning_fit("cpu")
    assert gpu_devices == {"cuda"} and cpu_devices == {"cpu"}
    assert gpu_steps == cpu_steps == 20
    assert gpu_syncs == cpu_syncs == 5
    assert gpu_floats == cpu_floats == 5 * 2 * (D + 1)
    record_property("max_abs_diff_gpu_cpu", f"{max((gpu[n] - cpu[n]).abs().max().item() for n in cpu):.3e}")
    for name, expected in cpu.items():
        assert expected.dtype == torch.float32
        # The fit ended on a sync: every machine holds the same x.
        assert torch.equal(expected, expected[:1].expand_as(expected))
        torch.testing.assert_close(gpu[name], expected, rtol=0, atol=1e-5)


def test_main_job_on_gpu_matches_the_cpu_figures(tmp_path, record_property):
    cmd = [
        sys.executable, "-m", "lit_slowcal", "fit", "--config", "configs/slowcal.yaml", "--wandb=false",
        "--trainer.accelerator=gpu", "--trainer.enable_progress_bar=false", "--run_dir", str(tmp_path / "runs"),
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    record_property("wall_s", f"{time.perf_counter() - start:.1f}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "lit_slowcal summary" in proc.stdout, out[-4000:]
    assert re.search(r"method slowcal\s+M=16\s+K=16\s+b=1\s+rounds 235/235", proc.stdout), out[-4000:]
    found = re.search(r"final test accuracy (\S+)\s+test loss (\S+)", proc.stdout)
    assert found, out[-4000:]
    acc, loss = float(found[1]), float(found[2])
    record_property("test_acc", f"{acc:.4f}")
    record_property("test_loss", f"{loss:.4f}")
    assert abs(acc - CPU_TEST_ACC) <= ACC_TOLERANCE, f"GPU test accuracy {acc}, CPU {CPU_TEST_ACC}"
    assert abs(loss - CPU_TEST_LOSS) <= LOSS_TOLERANCE, f"GPU test loss {loss}, CPU {CPU_TEST_LOSS}"


TORCH_LOOP = REPO / "examples" / "torch_loop.py"


def torch_loop(out: Path, processes: int, optimizer: str, machines: int = 4, steps: int = 32, sync_every: int = 4):
    """Runs examples/torch_loop.py (it spawns its own gloo processes); its final averaged parameters."""
    assert TORCH_LOOP.exists(), f"{TORCH_LOOP.relative_to(REPO)} is missing"
    cmd = [
        sys.executable, str(TORCH_LOOP), "--processes", str(processes), "--machines", str(machines),
        "--steps", str(steps), "--sync-every", str(sync_every), "--optimizer", optimizer, "--device", "cuda",
        "--out", str(out),
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    state = torch.load(out, map_location="cpu")
    assert isinstance(state, dict) and state, f"{out}: expected a non-empty dict of tensors, got {type(state)}"
    return state, seconds


@pytest.mark.parametrize("optimizer", ["slowcal", "sgd"])
def test_plain_torch_loop_two_processes_sharing_the_gpu_equal_one_process(tmp_path, optimizer, record_property):
    """M = 4 machines as 2 processes x 2 on one GPU (gloo) == 1 process x 4, to 1e-6."""
    one, one_s = torch_loop(tmp_path / "one.pt", 1, optimizer)
    two, two_s = torch_loop(tmp_path / "two.pt", 2, optimizer)
    record_property("wall_s_P1", f"{one_s:.1f}")
    record_property("wall_s_P2", f"{two_s:.1f}")
    assert sorted(two) == sorted(one)
    for name, expected in one.items():
        assert torch.is_tensor(expected) and expected.is_floating_point(), name
        assert torch.isfinite(expected).all(), name
        assert two[name].shape == expected.shape, name
    record_property("max_abs_diff_P2_P1", f"{max((two[n] - one[n]).abs().max().item() for n in one):.3e}")
    for name, expected in one.items():
        torch.testing.assert_close(two[name], expected, rtol=0, atol=1e-6)


# Stacked trials (sweep --stack) on a GPU: the model's figures within 1e-6 relative of the same grid
# stacked on the CPU (float32 sums in another order); the per-round diagnostics are norms of small
# differences of float32 parameters, whose relative error is larger; test accuracy may flip an image.
STACKED_RTOL = 1e-6
DIAGNOSTICS_RTOL = 1e-4
DIAGNOSTICS = ("dispersion", "query_step", "iterate_step")


def stacked_grid(tmp_path: Path, accelerator: str):
    """Every method x 2 lrs x K = 2 and 4, one seed, M = 4, 7 rounds (tests/experiments/sweep/test_stacked.py's
    grid), stacked on ``accelerator``; the trials with their outcomes and final parameters."""
    from test_stacked import grid_file

    from lit_slowcal.experiments import sweep as sw
    from lit_slowcal.experiments.sweep import stacked

    sweep = sw.load_sweep(
        grid_file(tmp_path / accelerator, seeds=(1,), ks=(2, 4), extra=(f"--trainer.accelerator={accelerator}",))
    )
    command_line = sw.CommandLine()
    trials = []
    for params in sw.expand_trials(sweep):
        args = sw.trial_args(sweep, params)
        trials.append(stacked.StackedTrial(params, args, command_line.parse(args).fit.as_dict()))
    groups = stacked.group_trials(trials, budget=2**30)
    assert all(stacked.stackable(t.config) is None for t in trials)
    for group in groups:
        stacked.run_group(group)
    return trials


def test_stacked_grid_on_cuda_equals_the_same_grid_on_cpu(tmp_path, monkeypatch, record_property):
    monkeypatch.chdir(REPO)
    torch.set_num_threads(1)
    start = time.perf_counter()
    gpu = stacked_grid(tmp_path, "gpu")
    record_property("wall_s_gpu", f"{time.perf_counter() - start:.1f}")
    cpu = stacked_grid(tmp_path, "cpu")
    worst: dict[str, float] = {}
    for g, c in zip(gpu, cpu):
        assert g.params == c.params and g.outcome["status"] == c.outcome["status"] == "finished", g.params
        assert set(g.outcome["metrics"]) == set(c.outcome["metrics"]), g.params
        for name, expected in c.final_state["params"].items():
            got = g.final_state["params"][name]
            scale = expected.abs().max().item()
            assert scale > 0 and got.dtype == expected.dtype == torch.float32
            worst["params"] = max(worst.get("params", 0.0), (got - expected).abs().max().item() / scale)
            torch.testing.assert_close(got, expected, rtol=0, atol=STACKED_RTOL * scale)
        for key, expected in c.outcome["metrics"].items():
            got = g.outcome["metrics"][key]
            rel = abs(got - expected) / max(abs(expected), 1e-30)
            worst[key] = max(worst.get(key, 0.0), rel)
            if key == "test_acc":
                assert abs(got - expected) <= 2e-4, (g.params, key, got, expected)  # at most two of 10,000 images
            else:
                assert rel <= (DIAGNOSTICS_RTOL if key in DIAGNOSTICS else STACKED_RTOL), (g.params, key, got, expected)
    for key, value in sorted(worst.items()):
        record_property(f"max_rel_diff_{key}", f"{value:.2e}")
    # The trials differ (the comparison is not of one run with itself).
    assert len({t.outcome["metrics"]["test_loss"] for t in cpu}) == len(cpu)


def _per_machine_worker(rank: int, init_file: str, out: str, kind: str = "cuda") -> None:
    """Two gloo processes sharing the GPU, AdamW on CUDA parameters, K = 3: 10 steps straight, and the
    same run saved at step 5 with ``gather_state_dict`` and resumed in a fresh model, optimizer and
    averager (the optimizer's state first, then the averager's)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    device = torch.device(kind, 0)
    g = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(8, D, generator=g).to(device), torch.randn(8, 1, generator=g).to(device)) for _ in range(10)
    ]

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 1)).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        return model, optimizer, PeriodicAverager(model, optimizer, sync_every=3)

    def train(model, optimizer, averager, steps):
        for x, y in steps:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            averager.step()

    model, optimizer, averager = build()
    train(model, optimizer, averager, batches[:5])
    averager.close_round()
    state = averager.gather_state_dict()  # every rank: the whole state on rank 0
    if rank == 0:
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "averager": state}, f"{out}/step5.pt"
        )
    dist.barrier()
    shared = [torch.load(f"{out}/step5.pt", map_location="cpu", weights_only=True)]  # rank 0's file, read by every rank
    at_save = {f"{i}.{k}": v.clone() for i, p in enumerate(model.parameters()) for k, v in optimizer.state[p].items()}
    train(model, optimizer, averager, batches[5:])
    averager.close_round()

    resumed, fresh, again = build()
    resumed.load_state_dict(shared[0]["model"])
    fresh.load_state_dict(shared[0]["optimizer"])
    again.load_state_dict(shared[0]["averager"])
    restored = {f"{i}.{k}": v.clone() for i, p in enumerate(resumed.parameters()) for k, v in fresh.state[p].items()}
    train(resumed, fresh, again, batches[5:])
    again.close_round()
    torch.save(
        {
            "restored": max((restored[k].double() - at_save[k].double()).abs().max().item() for k in at_save),
            "final": max((a - b).abs().max().item() for a, b in zip(model.parameters(), resumed.parameters())),
            "devices": sorted({str(v.device) for v in restored.values()}),
            "moments_differ": (at_save["0.exp_avg"] != shared[0]["optimizer"]["state"][0]["exp_avg"].to(device))
            .any()
            .item(),
        },
        f"{out}/rank{rank}.pt",
    )
    dist.barrier()
    dist.destroy_process_group()


def test_two_processes_on_the_gpu_resume_every_machines_adamw_state_exactly(tmp_path, record_property):
    import os
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_per_machine_worker, args=(os.path.join(tmp, "rendezvous"), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    record_property("max_abs_diff_resumed_vs_whole", max(r["final"] for r in ranks))
    assert ranks[1]["moments_differ"]  # rank 1's moments are not rank 0's: the file's optimizer state is not enough
    for r in ranks:
        assert r["devices"] == ["cuda:0"]
        assert r["restored"] == 0.0 and r["final"] == 0.0
