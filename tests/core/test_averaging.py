"""PeriodicAverager without a framework: plain torch loops (and the Trainer on their problem), the optimizer
protocol, buckets. The Fabric example: test_fabric.py."""

import os
import subprocess
import sys
import tempfile

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import REPO, Batches, subprocess_env
from torch import nn

from lit_slowcal import PeriodicAverager, PeriodicAveragingStrategy, SimulatedMachines, SlowcalSGD
from lit_slowcal import _communication as communication

sys.path.insert(0, str(REPO / "examples"))
import torch_loop  # noqa: E402

STEPS, K, M = 24, 4, 4


def run_example(script: str, tmp_path, *args: str) -> dict:
    out = tmp_path / f"{script}-{'-'.join(a.strip('-') for a in args)}.pt"
    cmd = [
        sys.executable,
        str(REPO / "examples" / script),
        *args,
        f"--steps={STEPS}",
        f"--sync-every={K}",
        "--out",
        str(out),
    ]
    # A crash prints the Python stack of every thread (faulthandler).
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=subprocess_env(PYTHONFAULTHANDLER="1"), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"stdout: {proc.stdout[-1000:]}\nstderr: {proc.stderr[-3000:]}"
    return torch.load(out)


def assert_close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k].double() - b[k].double()).abs().max().item()
        assert diff <= tol, f"{k}: max difference {diff:.3g} > {tol:g}"


class _LeastSquares(pl.LightningModule):
    """The example's problem through Lightning's Trainer: M machines simulated in one process."""

    def __init__(self, optimizer: str, lr: float = 0.02):
        super().__init__()
        self.machines = SimulatedMachines(torch_loop.initial_model(), M)
        self.optimizer_name, self.lr = optimizer, lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.machines(x) - y) ** 2).mean(dim=(1, 2)).sum()

    def configure_optimizers(self):
        return torch_loop.make_optimizer(self.optimizer_name, self.machines.parameters(), self.lr)


def lightning_run(optimizer: str) -> dict:
    x, y = torch_loop.make_data(M, STEPS, 4)
    model = _LeastSquares(optimizer)
    trainer = pl.Trainer(
        strategy=PeriodicAveragingStrategy(sync_every=K), accelerator="cpu", devices=1, max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, Batches(zip(x, y)))
    assert trainer.strategy.num_syncs == STEPS // K
    return {k: v.detach() for k, v in model.machines.averaged_state().items()}


@pytest.mark.parametrize("optimizer", ["slowcal", "sgd"])
@pytest.mark.slow
def test_plain_torch_loop_on_two_processes_equals_one_process_and_the_trainer(optimizer, tmp_path):
    two = run_example("torch_loop.py", tmp_path, "--processes=2", f"--machines={M}", f"--optimizer={optimizer}")
    one = run_example("torch_loop.py", tmp_path, "--processes=1", f"--machines={M}", f"--optimizer={optimizer}")
    assert_close(two, one, 1e-6)
    assert_close(two, lightning_run(optimizer), 1e-6)
    # The machines' data differ, so training moved x far from x_0: the comparison is not vacuous.
    assert (one["weight"] - torch_loop.initial_model().weight.detach()).abs().max() > 0.5


_TEARDOWN = """
import gc, os, sys, weakref
import torch
import torch.distributed as dist
import lit_slowcal  # before the process group, as a script imports it
dist.init_process_group("gloo", init_method="file://" + os.path.join(sys.argv[1], "rendezvous"), rank=0, world_size=1)
world = weakref.ref(dist.group.WORLD)
lit_slowcal.SlowcalSGD([torch.zeros(2, requires_grad=True)], lr=0.1)  # a first optimizer loads torch._dynamo
assert "torch._dynamo" in sys.modules
dist.destroy_process_group()
gc.collect()
print("default group alive after destroy_process_group:", world() is not None)
"""


@pytest.mark.slow
def test_destroy_process_group_frees_the_default_group_after_a_plain_loop_built_its_optimizer(tmp_path):
    """A process group created after ``import lit_slowcal`` is freed (its gloo threads joined) by
    destroy_process_group, even though torch imports torch.distributed.nn.functional (which binds
    group.WORLD as default arguments) on the first optimizer's construction. A group kept alive runs
    its threads into the interpreter's exit, where the process occasionally aborts. In a fresh
    interpreter: this test process loaded torch._dynamo long ago."""
    proc = subprocess.run(
        [sys.executable, "-c", _TEARDOWN, str(tmp_path)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "default group alive after destroy_process_group: False"


# -- the optimizer protocol ------------------------------------------------------------------


class ProtocolSGD(torch.optim.SGD):
    """SGD declaring the protocol: "shared" is averaged, "own" stays per machine; hooks are logged."""

    averaged_state = ("shared",)

    def __init__(self, params, log):
        super().__init__(params, lr=0.1)
        self.log = log

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state.setdefault("shared", torch.zeros_like(p)).add_(p)
                state.setdefault("own", torch.zeros_like(p)).add_(p)

    def pre_sync(self):
        p = self.param_groups[0]["params"][0]
        self.log.append(("pre", p.detach().clone()))

    def post_sync(self):
        p = self.param_groups[0]["params"][0]
        self.log.append(("post", p.detach().clone()))


def _machines(m=3, dtype=torch.float64):
    torch.manual_seed(0)
    machines = SimulatedMachines(nn.Linear(2, 1).to(dtype), m)
    machines.register_buffer("stat", torch.arange(m, dtype=dtype).reshape(m, 1))  # a floating buffer
    return machines


def _step(machines, optimizer, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(machines.num_machines, 3, 2, generator=g, dtype=torch.float64)
    optimizer.zero_grad()
    (machines(x) ** 2).sum().backward()
    optimizer.step()


def test_the_protocol_declares_what_is_averaged_and_hooks_run_around_the_average():
    # Once an SGD exists, torch has wrapped SGD.step with its hooks, so ProtocolSGD.step (which calls
    # super().step()) runs the step hooks twice per step: the averager must still count one step.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    log = []
    machines = _machines()
    optimizer = ProtocolSGD(machines.parameters(), log)
    averager = PeriodicAverager(machines, optimizer, sync_every=2).attach()
    _step(machines, optimizer, 0)
    assert log == [] and averager.num_syncs == 0
    _step(machines, optimizer, 1)
    before = {n: t.detach().clone() for n, t in machines.named_parameters()}
    assert [kind for kind, _ in log] == ["pre", "post"] and averager.num_syncs == 1
    w = machines.weight
    pre, post = log[0][1], log[1][1]
    assert not torch.equal(pre[0], pre[1])  # machines differed before the average
    assert torch.allclose(post, pre.mean(0, keepdim=True).expand_as(pre), atol=1e-15, rtol=0)
    assert torch.equal(before["weight"], w.detach())
    state = optimizer.state[w]
    assert torch.equal(state["shared"][0], state["shared"][1])  # declared: averaged
    assert not torch.equal(state["own"][0], state["own"][1])  # not declared: per machine
    assert torch.equal(machines.stat, torch.ones(3, 1, dtype=torch.float64))  # buffers averaged (mean of 0, 1, 2)
    # floats one machine sends per sync: weight 2 + bias 1, "shared" 2 + 1, buffer 1
    assert averager.floats_per_sync() == 7 and averager.floats_communicated == 7


def test_torch_sgd_and_slowcal_need_no_special_case():
    machines = _machines()
    sgd = torch.optim.SGD(machines.parameters(), lr=0.1, momentum=0.9)
    PeriodicAverager(machines, sgd, sync_every=1).attach()
    _step(machines, sgd, 0)
    buf = sgd.state[machines.weight]["momentum_buffer"]
    assert not torch.equal(buf[0], buf[1])  # SGD declares nothing: momentum stays local
    PeriodicAverager(machines, sgd, sync_every=1, average_state=["momentum_buffer"]).sync()
    assert torch.equal(buf[0], buf[1])  # unless asked for

    machines = _machines()
    slowcal = SlowcalSGD(machines.parameters(), lr=0.1)
    averager = PeriodicAverager(machines, slowcal, sync_every=1).attach()
    _step(machines, slowcal, 0)
    w = slowcal.state[machines.weight]["w"]
    assert torch.equal(w[0], w[2]) and torch.equal(machines.weight[0], machines.weight[2])
    assert averager.floats_per_sync() == 2 * 3 + 1  # x and w of 3 floats each, the buffer


def test_state_dict_resume_and_bad_values():
    machines = _machines()
    optimizer = torch.optim.SGD(machines.parameters(), lr=0.1)
    averager = PeriodicAverager(machines, optimizer, sync_every=4)
    for _ in range(10):
        averager.step()
    other = PeriodicAverager(machines, optimizer, sync_every=4, start_step=10)
    # SGD without momentum keeps no state of its own on a machine: the schedule alone. A sync carries 4
    # float64 values (32 bytes); among P = 3 a machine sends 2 * 2/3 * 32 bytes on the ring in 4 hops.
    link_counts = {"syncs": 2, "payload_bytes": 64, "ring_bytes": 2 * 128 / 3, "ring_hops": 8, "check_bytes": 0}
    saved = averager.state_dict()
    assert other.state_dict() == saved and saved.pop("configuration") == {
        "compression": "None", "error_feedback": "False", "optimizer": "SGD",
        "optimizer options": {k: repr(v) for k, v in sorted(optimizer.defaults.items())
                              if k not in ("lr", "foreach", "fused", "capturable", "differentiable")},
    }  # fmt: skip
    assert saved == {
        "steps": 10, "num_syncs": 2, "last_sync_step": 8, "floats_communicated": 8, "bytes_communicated": 64,
        "link_counts": link_counts,
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"Invalid sync_every: 0 \(must be an integer >= 1\)"):
        PeriodicAverager(machines, optimizer, sync_every=0)
    with pytest.raises(ValueError, match=r"Invalid bucket_cap_mb: -1"):
        PeriodicAverager(machines, optimizer, sync_every=1, bucket_cap_mb=-1)
    with pytest.raises(TypeError, match="Invalid optimizer"):
        PeriodicAverager(machines, object(), sync_every=1)


@pytest.mark.parametrize("bad", [1, "yes", 0.5])
def test_bucket_views_refused_unless_a_bool(bad):
    model = nn.Linear(2, 2)
    message = rf"^Invalid bucket_views: {bad!r} \(True or False"
    with pytest.raises(ValueError, match=message):
        PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=1), 1, bucket_views=bad)
    with pytest.raises(ValueError, match=message):  # before any fit
        PeriodicAveragingStrategy(sync_every=2, bucket_views=bad)


def test_bucket_views_refused_with_fragments():
    model = nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match=r"^Invalid bucket_views: True with fragments=2 \(those rounds send a fragment or a snapshot"
    ):
        PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=1), 2, fragments=2, bucket_views=True)
    with pytest.raises(
        ValueError, match=r"^Invalid bucket_views: True with fragments=2 \(those rounds send a fragment or a snapshot"
    ):
        PeriodicAveragingStrategy(sync_every=2, fragments=2, bucket_views=True)  # before any fit


def test_a_pool_homes_tensors_in_one_buffer_keeps_them_there_and_homes_them_again_when_they_move():
    """``FlatPool.home`` (``bucket_views``): the same tensor objects, with the same values, become views of
    one buffer, in order; the next call copies nothing; a tensor that moved (a new storage) is homed again."""
    model = nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4))
    tensors = [*model.parameters(), *(torch.randn(3) for _ in range(2))]
    values = [t.detach().clone() for t in tensors]
    pool = communication.FlatPool(bucket_views=True)
    flat = pool.home(tensors)
    assert [t is u for t, u in zip(tensors, [*model.parameters()])] == [True] * 4  # rebound, not replaced
    assert all(torch.equal(t, v) for t, v in zip(tensors, values))
    sizes = [t.numel() for t in tensors]
    assert flat.numel() == sum(sizes) and all(t.untyped_storage().data_ptr() == flat.data_ptr() for t in tensors)
    assert [t.storage_offset() for t in tensors] == [sum(sizes[:i]) for i in range(len(tensors))]
    assert torch.equal(flat, torch.cat([v.reshape(-1) for v in values]))
    with torch.no_grad():
        model[0].weight.mul_(2)  # written through the parameter: the buffer holds it
    assert pool.home(tensors) is flat and torch.equal(flat[:20], 2 * values[0].reshape(-1))
    assert model[0].weight.requires_grad and model(torch.randn(2, 5)).sum().backward() is None
    tensors[-1].data = torch.full((3,), 7.0)  # moved, as a loaded optimizer state or a model moved to a device
    again = pool.home(tensors)
    assert again is not flat and all(t.untyped_storage().data_ptr() == again.data_ptr() for t in tensors)
    assert torch.equal(again[-3:], torch.full((3,), 7.0)) and torch.equal(again[:20], 2 * values[0].reshape(-1))
    pool.keep_used()
    assert len(pool.homes) == 1
    pool.keep_used()  # an average that homed nothing: the pool lets its buffer go (the tensors keep it)
    assert not pool.homes and torch.equal(tensors[-1], torch.full((3,), 7.0))


def test_buckets_group_by_dtype_and_respect_the_cap():
    a32, b32, c32 = torch.zeros(100), torch.zeros(300), torch.zeros(50)
    d64 = torch.zeros(10, dtype=torch.float64)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1)
    averager = PeriodicAverager(nn.Linear(1, 1), optimizer, 1, bucket_cap_mb=1600 / 2**20)  # 400 float32
    buckets = communication.buckets(
        [(a32, False), (d64, False), (b32, False), (c32, False)], averager.options.bucket_cap_bytes
    )
    assert [[t.numel() for t, _ in b] for b in buckets] == [[100, 300], [50], [10]]


def _bucket_worker(rank, world, init_file, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(rank)  # every process starts elsewhere: the average is not trivial
    big = nn.Linear(1000, 300)  # 300,300 floats = 1.2 MB, more than the cap below
    small = SimulatedMachines(nn.Linear(3, 2), 2)
    with torch.no_grad():
        small.weight.add_(torch.arange(2.0).view(2, 1, 1) + 10 * rank)
    model = nn.ModuleList([big, small])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    sizes, in_place = [], []
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        sizes.append(tensor.numel() * tensor.element_size())
        in_place.append(tensor.data_ptr() == big.weight.data_ptr())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    PeriodicAverager(model, optimizer, sync_every=1, bucket_cap_mb=0.5).sync()
    dist.all_reduce = all_reduce
    gathered = [None] * world
    dist.all_gather_object(gathered, before)
    if rank == 0:
        torch.save(
            {
                "sizes": sizes,
                "in_place": in_place,
                "before": gathered,
                "after": [p.detach() for p in model.parameters()],
            },
            out,
        )
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_average_in_bounded_buckets(tmp_path):
    out = str(tmp_path / "buckets.pt")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_bucket_worker, args=(2, os.path.join(tmp, "rendezvous"), out), nprocs=2, join=True)
    result = torch.load(out)
    cap = int(0.5 * 2**20)
    # The big weight (1.2 MB) is reduced in place; everything else fits in buckets under the cap.
    assert result["in_place"].count(True) == 1
    assert all(size <= cap for size, whole in zip(result["sizes"], result["in_place"]) if not whole)
    assert len(result["sizes"]) == 2  # big.weight alone, then one bucket for the rest
    before0, before1 = result["before"]
    for i, after in enumerate(result["after"]):
        # mean over machines inside each process, then over the processes
        mine = [b[i].mean(0) if b[i].dim() == 3 else b[i] for b in (before0, before1)]
        expected = (mine[0] + mine[1]) / 2
        expected = expected.expand_as(after) if after.dim() == 3 else expected
        assert torch.allclose(after, expected, atol=1e-6, rtol=0), i


def test_sync_pre_hooks_see_the_machines_after_the_last_step_before_anything_is_averaged():
    log = []
    machines = _machines()
    optimizer = ProtocolSGD(machines.parameters(), log)
    averager = PeriodicAverager(machines, optimizer, sync_every=2).attach()
    seen = []
    handle = averager.register_sync_pre_hook(lambda a: seen.append((a, machines.weight.detach().clone(), len(log))))
    reference = _machines()  # the same run without the hook: the result must be bitwise the same
    ref_optimizer = ProtocolSGD(reference.parameters(), [])
    ref_averager = PeriodicAverager(reference, ref_optimizer, sync_every=2).attach()
    for seed in range(4):
        _step(machines, optimizer, seed)
        _step(reference, ref_optimizer, seed)
        if seed == 1:
            assert len(seen) == 1 and seen[0][0] is averager and seen[0][2] == 0  # before optimizer.pre_sync
            assert torch.equal(seen[0][1], log[0][1])  # what pre_sync saw: nothing averaged yet
            assert not torch.equal(seen[0][1][0], seen[0][1][1])
            handle.remove()
    assert len(seen) == 1 and averager.num_syncs == ref_averager.num_syncs == 2
    for p, q in zip(machines.parameters(), reference.parameters()):
        assert torch.equal(p, q)


# -- a plain loop's checkpoint holds every process's per-machine state ----------------------------

_RESUME = """
import os, sys

import torch
import torch.distributed as dist
from torch import nn

from lit_slowcal import PeriodicAverager

rank, folder, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
STEPS, SAVE_AT = 12, 6  # K = 4: the checkpoint is mid-round
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + os.path.join(folder, mode + "-rendezvous"), rank=rank, world_size=2)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
averager = PeriodicAverager(model, optimizer, sync_every=4)
averager.broadcast()
g = torch.Generator().manual_seed(1 + rank)  # every machine its own data
data = [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g) + 3 * rank) for _ in range(STEPS)]
path = os.path.join(folder, "checkpoint.pt")
start = 0
if mode == "resumed":
    saved = torch.load(path, weights_only=True)  # plain data
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])  # rank 0's per-machine state, on every rank
    averager.load_state_dict(saved["averager"])  # then each rank's own
    torch.save(optimizer.state_dict()["state"], os.path.join(folder, f"loaded{rank}.pt"))
    start = SAVE_AT
with averager:
    for step in range(start, STEPS):
        optimizer.zero_grad()
        x, y = data[step]
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()
        if mode == "whole" and step + 1 == SAVE_AT:  # a checkpoint as the docs say
            averager.close_round()
            state = averager.gather_state_dict()  # on every rank
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "averager": state}, path)
            torch.save(optimizer.state_dict()["state"], os.path.join(folder, f"saved{rank}.pt"))
averager.close_round()
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()["state"]}, os.path.join(folder, f"{mode}{rank}.pt"))
dist.barrier()
dist.destroy_process_group()
"""


def run_ranks(script: str, *args: str, world: int = 2, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """``script`` in ``world`` fresh processes (argv: the rank, then ``args``), each ended after ``timeout`` s."""
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(rank), *args], env=subprocess_env(PYTHONFAULTHANDLER="1"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(world)
    ]  # fmt: skip
    done = []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"rank {rank} still ran after {timeout} s") from None
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def _tensors(state) -> dict:
    """Every tensor of a (nested) state, by its path."""
    if isinstance(state, torch.Tensor):
        return {(): state}
    return {
        (k, *path): t
        for k, v in state.items()
        if isinstance(v, (dict, torch.Tensor))
        for path, t in _tensors(v).items()
    }


def assert_equal(a, b, what: str) -> None:
    a, b = _tensors(a), _tensors(b)
    assert a.keys() == b.keys() and a, what
    for k in a:
        assert torch.equal(a[k], b[k]), (
            f"{what}: {k} differs by {(a[k].double() - b[k].double()).abs().max().item():.3g}"
        )


@pytest.mark.slow
def test_plain_torch_loop_resume_on_two_processes_restores_every_machines_adamw_state_bit_identically(tmp_path):
    """AdamW in a plain loop on 2 processes, a checkpoint mid-round of close_round() and gather_state_dict()
    (on every rank; rank 0 saves), resumed in fresh processes (optimizer.load_state_dict, then the
    averager's): each rank gets its own moments back (they differ between the ranks), and the resumed
    run ends bit-identical to the uninterrupted one, on every rank."""
    for mode in ("whole", "resumed"):
        for proc in run_ranks(_RESUME, str(tmp_path), mode):
            assert proc.returncode == 0, f"{mode}: {proc.stderr[-3000:]}"
    saved = [torch.load(tmp_path / f"saved{rank}.pt") for rank in (0, 1)]
    assert not torch.equal(saved[0][0]["exp_avg"], saved[1][0]["exp_avg"])  # per machine indeed
    assert_resumed_exactly(tmp_path, saved, loaded="loaded{rank}.pt", resumed="resumed{rank}.pt", what="")


def assert_resumed_exactly(tmp_path, saved: list, *, loaded: str, resumed: str, what: str) -> None:
    """Each rank's optimizer state right after the resume (file ``loaded``) is what it held at the save, and
    its final model and optimizer state (file ``resumed``) are the uninterrupted run's (``whole{rank}.pt``)."""
    for rank in (0, 1):
        after = torch.load(tmp_path / loaded.format(rank=rank))
        assert_equal(saved[rank], after, f"{what}rank {rank}'s optimizer state after the resume")
    for rank in (0, 1):
        whole, end = torch.load(tmp_path / f"whole{rank}.pt"), torch.load(tmp_path / resumed.format(rank=rank))
        assert_equal(whole["model"], end["model"], f"{what}rank {rank}'s final model")
        assert_equal(whole["optimizer"], end["optimizer"], f"{what}rank {rank}'s final optimizer state")


_RESUME_EDGES = """
import os, sys

import torch
import torch.distributed as dist
from torch import nn

from lit_slowcal import PeriodicAverager

rank, folder = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + os.path.join(folder, "rendezvous"), rank=rank, world_size=2)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.side = nn.Linear(3, 2), nn.Linear(3, 1)


def run(mode):
    torch.manual_seed(0)
    model = TwoHeads()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    averager = PeriodicAverager(model, optimizer, sync_every=4)
    path, start = os.path.join(folder, "checkpoint.pt"), 0
    if mode != "whole":
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])
        if mode == "averager first":  # the other order: the same state
            averager.load_state_dict(saved["averager"])
            optimizer.load_state_dict(saved["optimizer"])
        else:
            optimizer.load_state_dict(saved["optimizer"])
            averager.load_state_dict(saved["averager"])
        torch.save(optimizer.state_dict()["state"], os.path.join(folder, f"{mode} loaded{rank}.pt"))
        start = 6
    for step in range(start, 10):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(5, 3, generator=g)
        optimizer.zero_grad()
        loss = (model.body(x) - 3 * rank).pow(2).mean()
        if rank == 0 or step >= 6:  # the side head gets no gradient on rank 1 before the checkpoint
            loss = loss + model.side(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        averager.step()
        if mode == "whole" and step == 5:
            averager.close_round()
            state = averager.gather_state_dict()
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "averager": state}, path)
            torch.save(optimizer.state_dict()["state"], os.path.join(folder, f"saved{rank}.pt"))
    averager.close_round()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()["state"]}, os.path.join(folder, f"{mode}{rank}.pt"))
    dist.barrier()


for mode in ("whole", "resumed", "averager first"):  # the resumes with fresh objects: all they know is the file
    run(mode)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_resume_restores_no_state_where_a_machine_held_none_and_either_load_order_works(tmp_path):
    """Rank 1's side head got no gradient before the checkpoint, so its AdamW held no state there (rank 0's
    did): after the resume it holds none either (the optimizer's own load gave it rank 0's), and the run
    ends bit-identical. Loading the averager's state before the optimizer's gives the same state."""
    for proc in run_ranks(_RESUME_EDGES, str(tmp_path)):
        assert proc.returncode == 0, proc.stderr[-3000:]
    saved = [torch.load(tmp_path / f"saved{rank}.pt") for rank in (0, 1)]
    assert 3 in saved[0] and 3 not in saved[1]  # side.weight: state on rank 0 only
    for mode in ("resumed", "averager first"):
        assert_resumed_exactly(
            tmp_path, saved, loaded=mode + " loaded{rank}.pt", resumed=mode + "{rank}.pt", what=f"{mode}: "
        )


_GATHER_ON_RANK_0 = """
import os, sys

import torch
import torch.distributed as dist
from torch import nn

from lit_slowcal import PeriodicAverager

rank, folder = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method="file://" + os.path.join(folder, "rendezvous"), rank=rank, world_size=2)
model = nn.Linear(3, 1)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
averager = PeriodicAverager(model, optimizer, sync_every=2)
averager.check_every = 1  # rank 1's next round checks (a round without the check: test_check_schedule.py)
try:
    for step in range(4):
        optimizer.zero_grad()
        model(torch.randn(5, 3)).pow(2).mean().backward()
        optimizer.step()
        averager.step()
        if step == 2 and rank == 0:  # the mistake: a collective called on rank 0 only
            averager.gather_state_dict()
except RuntimeError as e:
    print(e)
# Both ranks left the same all-gather: end the group together (alive at exit, gloo's threads may abort the process).
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_gather_state_dict_on_one_rank_only_is_one_line_on_every_rank(tmp_path):
    """gather_state_dict() on rank 0 alone, while rank 1 goes on to its next synchronisation, one that checks
    (``check_every = 1``): one line on each rank naming the two collectives (it aborted rank 0 in gloo, and rank 1
    read the gather's bytes as a set-up that differed)."""
    for rank, proc in enumerate(run_ranks(_GATHER_ON_RANK_0, str(tmp_path), timeout=60)):
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout == (
            "PeriodicAverager: the ranks are in different collectives (rank 0: gather_state_dict(), rank 1: a synchronisation); "
            "every rank calls each of them (gather_state_dict() too: on every rank, then rank 0 saves what it returns), "
            "and nothing was averaged or gathered.\n"
        ), f"rank {rank}"
