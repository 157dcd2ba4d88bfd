"""FSDP2-sharded models averaged over the replicate group: four gloo processes, a 2 (replicate) x 2 (shard)
mesh, a model whose dimension 0 shards unevenly. After R rounds of K steps every rank's full parameters
equal a reference computed here without sharding (the two replicas' models stepped in one process and
averaged by hand); ``broadcast()``, the byte counts and the refusals."""

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import finish_rank, spawn_ranks
from torch import nn

from lit_slowcal import AcceleratedSGD, PeriodicAverager, Scaffold, SlowcalSGD

pytestmark = pytest.mark.slow  # four processes

K, R = 2, 3  # steps a round, rounds
ROWS = {0: (3, 2), 1: (2, 1)}  # the local rows of the two Linear layers' weights and biases by shard coordinate
LOCAL_NUMEL = {s: a * 7 + a + b * 5 + b for s, (a, b) in ROWS.items()}  # 36 and 22 of the 58 parameters

# name: (dtype, optimizer factory, average_state, outer optimizer, tolerance)
CASES = {
    "slowcal_f64": (torch.float64, lambda ps: SlowcalSGD(ps, lr=0.1), (), None, 1e-12),
    # SGD's momentum averaged with the parameters (average_state): one momentum per replica after a round.
    "sgd_momentum_f64": (torch.float64, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), ("momentum_buffer",), None, 1e-12),
    # Not averaged: each replica keeps its own momentum, as AdamW its moments.
    "sgd_momentum_local_f32": (torch.float32, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), (), None, 1e-5),
    "adamw_f32": (torch.float32, lambda ps: torch.optim.AdamW(ps, lr=0.01), (), None, 1e-5),
    "diloco_f64": (
        torch.float64,
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        (),
        lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
        1e-12,
    ),
    # Per-machine momentum (not averaged) under DiLoCo's outer Nesterov: the Trainer strategy's case too.
    "diloco_momentum_f64": (
        torch.float64,
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        (),
        lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
        1e-12,
    ),
    # The outer optimizers of FedAvgM and FedAdam: outer state (momentum, Adam's moments) on the shards.
    "fedavgm_f64": (
        torch.float64, lambda ps: torch.optim.SGD(ps, lr=0.1), (), lambda ps: torch.optim.SGD(ps, lr=1.0, momentum=0.9), 1e-12,
    ),
    "fedadam_f64": (torch.float64, lambda ps: torch.optim.SGD(ps, lr=0.1), (), lambda ps: torch.optim.Adam(ps, lr=0.01), 1e-12),
    # The optimizers whose pre_sync/post_sync rebuild their state from the average: on DTensor state too.
    "accelerated_f64": (torch.float64, lambda ps: AcceleratedSGD(ps, lr=0.1), (), None, 1e-12),
    "scaffold_f64": (torch.float64, lambda ps: Scaffold(ps, lr=0.1), (), None, 1e-12),
}  # fmt: skip
BATCHNORM_STEPS = K * R + 1  # R rounds and a step, closed by close_round()
SYNC_EVERY = {"accelerated_f64": 1}  # the minibatch method: K = 1 (R rounds of one step); the others K
# Options compared with the same run unsharded, averaged over the replicate group by an unsharded averager.
TWIN_CASES: dict[str, dict[str, Any]] = {
    "overlap": {"overlap_delay": 1},
    "bf16": {"compression": "bf16"},
    "int8": {"compression": "int8"},
}


def _model(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)


def _batch(g: torch.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A replica's batch of 8: each of its two shard ranks takes 4 rows, FSDP averages their gradients."""
    return torch.randn(8, 7, generator=g, dtype=dtype), torch.randn(8, 3, generator=g, dtype=dtype)


def _evaluation_input() -> torch.Tensor:
    return torch.randn(6, 7, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def _reference(
    case: str, closed_at: tuple[int, ...] = (), batches: Any = None, participants: Any = None
) -> list[torch.Tensor]:
    """The two replicas unsharded, each stepping its own optimizer on its whole batch (``_batch``'s, or
    ``batches[r][t]`` for replica r's step t + 1); every K steps (and after the steps ``closed_at``, where a
    round was closed) the parameters (and the averaged state) replaced by hand by their mean, or DiLoCo's
    outer step on it, between the optimizer's own pre_sync and post_sync where it has them. With
    ``participants`` (round i -> the replicas taking part in it), the mean is theirs only and both replicas
    take it (partial participation)."""
    dtype, make, keys, outer, _ = CASES[case]
    k = SYNC_EVERY.get(case, K)
    steps = k * R if batches is None else len(batches[0])
    models = [_model(dtype) for _ in range(2)]
    optimizers = [make(list(m.parameters())) for m in models]
    keys = (*keys, *getattr(optimizers[0], "averaged_state", ()))
    gens = [torch.Generator().manual_seed(100 + r) for r in range(2)]
    start = [p.detach().clone() for p in models[0].parameters()]
    server = outer(start) if outer is not None else None
    rounds = 0
    for step in range(1, steps + 1):
        for r, (model, opt, g) in enumerate(zip(models, optimizers, gens)):
            opt.zero_grad()
            _loss(model, *(_batch(g, dtype) if batches is None else batches[r][step - 1])).backward()
            opt.step()
        if step % k and step not in closed_at:
            continue
        for opt in optimizers:
            if hasattr(opt, "pre_sync"):
                opt.pre_sync()
        chosen = (0, 1) if participants is None else participants(rounds)
        rounds += 1
        with torch.no_grad():
            pairs = list(zip(*(m.parameters() for m in models)))
            for p0, p1 in pairs:
                for key in keys:
                    s0, s1 = optimizers[0].state[p0][key], optimizers[1].state[p1][key]
                    s0.copy_(sum((s0, s1)[i] for i in chosen) / len(chosen))
                    s1.copy_(s0)
                mean = sum((p0, p1)[i] for i in chosen) / len(chosen)
                p0.copy_(mean)
                p1.copy_(mean)
            if server is not None:
                for x_s, (p0, _) in zip(start, pairs):
                    x_s.grad = x_s - p0  # the pseudo-gradient: the round's start minus the average
                server.step()
                for x_s, (p0, p1) in zip(start, pairs):
                    p0.copy_(x_s)
                    p1.copy_(x_s)
        for opt in optimizers:
            hook = getattr(opt, "post_sync", None)
            if hook is not None:
                hook()
    return [p.detach().clone() for p in models[0].parameters()]


def _batchnorm_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).to(torch.float64)


def _batchnorm_reference() -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """The BatchNorm model's two replicas of two shard processes, unsharded, in float64: each process's running
    statistics its own (from its 4 rows of the replica's batch), a replica's gradient the mean of its processes'
    (FSDP2's), SGD; every K steps and after the last (``close_round``) the parameters averaged over the replicas and
    the statistics over all four processes. The parameters, the statistics and the evaluation's output."""
    models = [_batchnorm_model() for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    stats = [[[b.clone() for b in models[0][1].buffers()] for _ in range(2)] for _ in range(2)]  # [replica][shard]
    gens = [torch.Generator().manual_seed(100 + r) for r in range(2)]
    for step in range(1, BATCHNORM_STEPS + 1):
        for r, (model, opt, g) in enumerate(zip(models, optimizers, gens)):
            x, y = _batch(g, torch.float64)
            opt.zero_grad()
            for s in range(2):  # the gradients of the two processes' losses accumulated: their mean
                for b, mine in zip(model[1].buffers(), stats[r][s]):
                    b.copy_(mine)
                (_loss(model, x[4 * s : 4 * s + 4], y[4 * s : 4 * s + 4]) / 2).backward()
                stats[r][s] = [b.clone() for b in model[1].buffers()]
            opt.step()
        if step % K and step != BATCHNORM_STEPS:
            continue
        with torch.no_grad():
            for p0, p1 in zip(*(m.parameters() for m in models)):
                p0.copy_((p0 + p1) / 2)
                p1.copy_(p0)
            for i in range(2):  # running_mean, running_var (num_batches_tracked, an integer, is not averaged)
                mean = torch.stack([stats[r][s][i] for r in range(2) for s in range(2)]).mean(0)
                for r in range(2):
                    for s in range(2):
                        stats[r][s][i] = mean.clone()
    model = models[0]
    with torch.no_grad():
        for b, mine in zip(model[1].buffers(), stats[0][0]):
            b.copy_(mine)
        evaluated = model.eval()(_evaluation_input())
    return [p.detach().clone() for p in model.parameters()], stats[0][0], evaluated


def _worker(rank: int, init_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=4, timeout=timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replica, shard = rank // 2, rank % 2
    group = mesh["replicate"].get_group()
    results: dict = {"refused": {}}

    def sharded(dtype: torch.dtype, seed: int = 0) -> nn.Module:
        model = _model(dtype, seed)
        fully_shard(model, mesh=mesh["shard"])
        return model

    def train(model: nn.Module, averager: PeriodicAverager, dtype: torch.dtype, rows: slice) -> None:
        g = torch.Generator().manual_seed(100 + replica)
        for _ in range(averager.sync_every * R):
            x, y = _batch(g, dtype)
            averager.optimizer.zero_grad()
            _loss(model, x[rows], y[rows]).backward()
            averager.optimizer.step()
            averager.step()

    def dtensors(model: nn.Module) -> list[DTensor]:
        return [p for p in model.parameters() if isinstance(p, DTensor)]

    def full(model: nn.Module) -> list[torch.Tensor]:
        return [p.full_tensor().detach().clone() for p in dtensors(model)]

    for case, (dtype, make, keys, outer, _) in CASES.items():
        model = sharded(dtype)
        averager = PeriodicAverager(
            model, make(list(model.parameters())), SYNC_EVERY.get(case, K), process_group=group, average_state=keys,
            outer_optimizer=outer,
        )  # fmt: skip
        train(model, averager, dtype, slice(4 * shard, 4 * shard + 4))
        results[case] = {
            "params": full(model),
            "local_shapes": [tuple(p.to_local().shape) for p in dtensors(model)],
            "num_machines": averager.num_machines,
            "floats": averager.floats_communicated,
            "bytes": averager.bytes_communicated,
            "link": averager.link_counts,
        }

    for case, options in TWIN_CASES.items():
        model, twin = sharded(torch.float32), _model(torch.float32)
        averagers = [
            PeriodicAverager(
                m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), K, process_group=group, **options
            )
            for m in (model, twin)
        ]
        train(model, averagers[0], torch.float32, slice(4 * shard, 4 * shard + 4))
        train(twin, averagers[1], torch.float32, slice(0, 8))
        results[case] = {"params": full(model), "twin": [p.detach().clone() for p in twin.parameters()]}

    # BatchNorm's running statistics: buffers that are not DTensors, each process's from its own rows.
    model = _batchnorm_model()
    fully_shard(model, mesh=mesh["shard"])
    averager = PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), K, process_group=group)
    g, sent, all_reduce = torch.Generator().manual_seed(100 + replica), [], dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        if group is not None and sorted(dist.get_process_group_ranks(group)) in ([0, 1], [2, 3]):  # shard groups
            sent.append(tensor.numel() * tensor.element_size())
        return all_reduce(tensor, *args, group=group, **kwargs)  # type: ignore[call-overload]

    dist.all_reduce = counted
    try:
        for _ in range(BATCHNORM_STEPS):
            x, y = _batch(g, torch.float64)
            averager.optimizer.zero_grad()
            _loss(model, x[4 * shard : 4 * shard + 4], y[4 * shard : 4 * shard + 4]).backward()
            averager.optimizer.step()
            averager.step()
        averager.close_round()
    finally:
        dist.all_reduce = all_reduce
    results["batchnorm"] = {
        "params": full(model), "buffers": [b.clone() for b in model[1].buffers()], "num_syncs": averager.num_syncs,
        "floats": averager.floats_communicated, "shard_group_bytes": sum(sent),
        "local_numel": sum(p.to_local().numel() for p in dtensors(model)),
    }  # fmt: skip
    with torch.no_grad():  # last: the root's parameters stay gathered
        results["batchnorm"]["evaluated"] = model.eval()(_evaluation_input())

    model = sharded(torch.float64, seed=replica)  # the replicas start apart
    averager = PeriodicAverager(model, SlowcalSGD(model.parameters(), lr=0.1), K, process_group=group)
    results["before_broadcast"] = full(model)
    averager.broadcast()
    results["broadcast"] = full(model)

    for name in ("sync", "broadcast"):  # after an evaluation: the root holds its full parameters gathered
        model = sharded(torch.float64, seed=replica)
        averager = PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), K, process_group=group)
        with torch.no_grad():
            model(_evaluation_input())
            getattr(averager, name)()
            results[f"evaluated_after_{name}"] = model(_evaluation_input())

    def attempt(name, fn):
        try:
            fn()
            results["refused"][name] = None
        except ValueError as err:
            results["refused"][name] = str(err)

    def tensor_parallel():
        model = parallelize_module(nn.Linear(4, 4), mesh["shard"], RowwiseParallel())
        PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), K, process_group=group)

    def shard_dimension():
        model = sharded(torch.float32)
        PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), K)  # the default group: all four ranks

    def hsdp():
        model = _model(torch.float32)
        fully_shard(model, mesh=mesh)  # 2-D: Replicate over replicate, Shard(0) over shard
        PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), K, process_group=group)

    def fragments():
        model = sharded(torch.float32)
        PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), K, process_group=group, fragments=2)

    def bucket_views():  # FSDP2 owns its shards' memory: they cannot become views of the averager's buffer
        model = sharded(torch.float32)
        PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), K, process_group=group, bucket_views=True)

    single = init_device_mesh("cpu", (4, 1), mesh_dim_names=("all", "alone"))["alone"]  # this process alone

    def two_meshes():  # BatchNorm's statistics: whose machine's shard processes would average them?
        model = _batchnorm_model()
        fully_shard(model[0], mesh=mesh["shard"])
        fully_shard(model[3], mesh=single)
        PeriodicAverager(model, torch.optim.SGD(model.parameters(), lr=0.1), K, process_group=group)

    attempt("two_meshes", two_meshes)
    for name, fn in [("tensor_parallel", tensor_parallel), ("shard_dimension", shard_dimension), ("hsdp", hsdp), ("fragments", fragments), ("bucket_views", bucket_views)]:  # fmt: skip
        attempt(name, fn)
    finish_rank(results, out, rank)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sharded"))
    return spawn_ranks(_worker, 4, out)


def _max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_ends_at_the_unsharded_reference(ranks, case):
    reference = _reference(case)
    tolerance = CASES[case][-1]
    for rank, results in enumerate(ranks):
        got = results[case]
        a, b = ROWS[rank % 2]
        assert got["local_shapes"] == [(a, 7), (a,), (b, 5), (b,)]  # uneven: the last shard holds fewer rows
        assert _max_difference(got["params"], reference) <= tolerance, (rank, _max_difference(got["params"], reference))


def test_the_counts_are_those_of_the_local_shard(ranks):
    for rank, results in enumerate(ranks):
        numel = LOCAL_NUMEL[rank % 2]
        for case, floats in [("slowcal_f64", 2 * numel), ("adamw_f32", numel), ("diloco_f64", numel)]:
            got = results[case]
            size = CASES[case][0].itemsize
            assert got["num_machines"] == 2
            assert got["floats"] == R * floats
            assert got["bytes"] == R * floats * size
            assert (got["link"].syncs, got["link"].payload_bytes) == (R, R * floats * size)
            assert got["link"].ring_bytes == R * floats * size  # 2 (P - 1) / P = 1 with P = 2


@pytest.mark.parametrize("case", list(TWIN_CASES))
def test_overlap_and_compression_match_the_unsharded_run(ranks, case):
    for results in ranks:
        got = results[case]
        difference = _max_difference(got["params"], got["twin"])
        assert difference <= (5e-3 if case == "int8" else 1e-5)  # int8: blocks of other bounds, difference


def test_batchnorm_statistics_are_averaged_over_every_process_of_every_machine(ranks):
    """A sharded BatchNorm's running statistics after R rounds and a closed one: equal on the four ranks (the two
    shard processes of a machine too) and the float64 reference's mean of the four processes' statistics; so is
    the evaluation that uses them. Each round all-reduces them (10 floats) within the machine as well."""
    params, stats, evaluated = _batchnorm_reference()
    first = ranks[0]["batchnorm"]
    for rank, results in enumerate(ranks):
        got = results["batchnorm"]
        assert all(torch.equal(b, b0) for b, b0 in zip(got["buffers"], first["buffers"])), (
            rank, [float((b - b0).abs().max()) for b, b0 in zip(got["buffers"][:2], first["buffers"][:2])],
        )  # fmt: skip
        assert torch.equal(got["evaluated"], first["evaluated"]), (
            rank,
            _max_difference([got["evaluated"]], [first["evaluated"]]),
        )
        assert _max_difference(got["buffers"][:2], stats) <= 1e-12, (rank, _max_difference(got["buffers"][:2], stats))
        assert int(got["buffers"][2]) == BATCHNORM_STEPS  # num_batches_tracked: one a forward, the same everywhere
        assert _max_difference(got["params"], params) <= 1e-12, (rank, _max_difference(got["params"], params))
        assert _max_difference([got["evaluated"]], [evaluated]) <= 1e-12
        assert got["num_syncs"] == R + 1
        assert got["floats"] == (R + 1) * (got["local_numel"] + 10)  # the local shards and the whole statistics
        assert got["shard_group_bytes"] == (R + 1) * 10 * 8


def test_broadcast_gives_every_rank_replica_0s_parameters(ranks):
    start = ranks[0]["before_broadcast"]
    assert _max_difference(ranks[2]["before_broadcast"], start) > 0.1  # the replicas started apart
    for results in ranks:
        assert _max_difference(results["broadcast"], start) == 0


@pytest.mark.parametrize("name", ["sync", "broadcast"])
def test_parameters_an_evaluation_gathered_do_not_outlive_sync_or_broadcast(ranks, name):
    """The replicas start apart, evaluate (FSDP2 leaves the root's full parameters gathered), then
    ``sync()`` (their mean) or ``broadcast()`` (replica 0's): the next evaluation uses those, not the
    parameters gathered before, as the same model unsharded does. (``broadcast()`` sends the gathered
    parameters too, so its case would hold without the reshard: it guards the behaviour, not the reshard.)"""
    models = [_model(torch.float64, seed=r) for r in range(2)]
    with torch.no_grad():
        if name == "sync":
            for p0, p1 in zip(*(m.parameters() for m in models)):
                p0.copy_((p0 + p1) / 2)
        expected = models[0](_evaluation_input())
    for rank, results in enumerate(ranks):
        got = results[f"evaluated_after_{name}"]
        assert float((got - expected).abs().max()) <= 1e-12, (rank, float((got - expected).abs().max()))


@pytest.mark.parametrize(
    "case, message",
    [
        ("tensor_parallel", "PeriodicAverager: 'weight' is a DTensor with placements (Shard(dim=1),) over a 1-D mesh"),
        (
            "hsdp",
            "PeriodicAverager: '0.weight' is a DTensor with placements (Replicate(), Shard(dim=0)) over a 2-D mesh",
        ),
        ("shard_dimension", "PeriodicAverager: '0.weight' is sharded with ranks"),
        ("two_meshes", "PeriodicAverager: the model's DTensors lie on shard meshes of different processes"),
        ("fragments", "Invalid options for an FSDP2-sharded model: fragments=2 (fragments cut by local bytes"),
        ("bucket_views", "Invalid options for an FSDP2-sharded model: bucket_views=True (fragments cut by local bytes"),
    ],
)
def test_unsupported_sharding_is_refused_in_one_line(ranks, case, message):
    for results in ranks:
        got = results["refused"][case]
        assert got is not None and "\n" not in got and got.startswith(message), got
