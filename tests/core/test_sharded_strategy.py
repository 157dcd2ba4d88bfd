"""``ShardedAveragingStrategy`` in Lightning's Trainer: four gloo processes, a 2 (replicate) x 2 (shard) mesh, the
model of test_sharded.py (dimension 0 sharded unevenly), SGD with per-machine momentum under DiLoCo's outer
Nesterov in float64, K = 2 for R = 3 rounds.

Run A fits 6 steps (two epochs of 3) with a validation and a checkpoint after step 3 (mid-round: the round is
closed there);
run B resumes from that checkpoint (a distributed-checkpoint directory with each process's averager state
beside it). Every rank's gathered parameters after A equal test_sharded.py's unsharded reference with a
synchronisation after step 3 too (1e-12), B's equal A's bit for bit, the all-reduces over the replicate
group carry the local shard's bytes, and the refusals are one line each. Run C fits as A with participation
S = 1 of the M = 2 replicas: every rank ends at the reference whose rounds take the drawn replica's model. Run D
(two processes, a 2 x 1 mesh) resumes a checkpoint missing one process's file: both ranks stop on the same line."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import finish_rank, rendezvous_here, spawn_ranks
from lightning.pytorch.callbacks import ModelCheckpoint
from test_server import participants
from test_sharded import CASES, LOCAL_NUMEL, ROWS, _max_difference, _model, _reference
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lit_slowcal import ShardedAveragingStrategy
from lit_slowcal._averagers import CHECKPOINT_KEY

CASE = "diloco_momentum_f64"
K, STEPS, STEPS_PER_EPOCH = 2, 6, 3  # the validation and the checkpoint at the end of epoch 0 close the round
CLOSED_AT = STEPS_PER_EPOCH
WORLD, PER_RANK = 4, 4  # processes; rows a process takes a step (a replica's batch of 8 over its 2 shards)
SEED = 6  # run C's participation_seed: replicas 1, 0, 0, 1 drawn in its 4 rounds (the first not rank 0's)


def _data() -> TensorDataset:
    """The rows every process draws its batches from (Lightning's sampler deals them out)."""
    g = torch.Generator().manual_seed(7)
    dtype = CASES[CASE][0]
    n = WORLD * PER_RANK * STEPS_PER_EPOCH
    return TensorDataset(torch.randn(n, 7, generator=g, dtype=dtype), torch.randn(n, 3, generator=g, dtype=dtype))


def _sampler(data: TensorDataset, **where: Any) -> DistributedSampler:
    """A process's part of the rows: each epoch the same (Lightning's own sampler reshuffles by an epoch
    count that a resumed run need not share)."""
    return DistributedSampler(data, shuffle=False, **where)


def _replica_batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Replica r's batch at every step: its two shard processes' batches (rank q = 2 r + s)."""
    data = _data()
    ranks = [list(_sampler(data, num_replicas=WORLD, rank=q)) for q in range(WORLD)]
    out: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[], []]
    for r in range(2):
        for step in range(STEPS):
            t = step % STEPS_PER_EPOCH
            rows = [i for q in (2 * r, 2 * r + 1) for i in ranks[q][PER_RANK * t : PER_RANK * (t + 1)]]
            out[r].append((data.tensors[0][rows], data.tensors[1][rows]))
    return out


class Sharded(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _model(CASES[CASE][0])
        self.at_validation: list[list[torch.Tensor]] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        strategy = self.trainer.strategy
        assert isinstance(strategy, ShardedAveragingStrategy)
        fully_shard(self.net, mesh=strategy.shard_mesh)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def validation_step(self, batch: Any, _: int) -> None:
        x, y = batch
        self.net(x)

    def train_dataloader(self) -> DataLoader:
        # The strategy's part for this process: world_size parts, one a process.
        data = _data()
        strategy = self.trainer.strategy
        assert isinstance(strategy, ShardedAveragingStrategy)
        return DataLoader(data, PER_RANK, sampler=_sampler(data, **strategy.distributed_sampler_kwargs))

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()

    def on_validation_epoch_start(self) -> None:
        self.at_validation.append(full(self))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return CASES[CASE][1](list(self.parameters()))


def full(module: Sharded) -> list[torch.Tensor]:
    """The full parameters, gathered (the shards: an evaluation leaves the root's parameters unsharded)."""
    module.net.reshard()
    return [p.full_tensor().detach().clone() for p in module.parameters()]  # type: ignore[attr-defined]


def _fit(root: str, ckpt_path: str | None = None, **strategy: Any) -> Any:
    strategy.setdefault("replicate_size", 2)
    strategy.setdefault("shard_size", 2)
    model = Sharded()
    callbacks: list[pl.Callback] = (
        [] if ckpt_path else [ModelCheckpoint(root, "{epoch}", save_top_k=-1, save_on_train_epoch_end=True)]
    )
    trainer = pl.Trainer(
        strategy=ShardedAveragingStrategy(sync_every=K, outer_optimizer=CASES[CASE][3], **strategy),
        accelerator="cpu", devices=WORLD, max_steps=STEPS, limit_val_batches=1,
        num_sanity_val_steps=0, callbacks=callbacks, enable_checkpointing=not ckpt_path, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def _environment(rank: int) -> None:
    """A spawned process as Lightning's one node of four devices sees it."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="4")
    torch.set_num_threads(1)


def _worker(rank: int, init_file: str, out: str) -> None:
    _environment(rank)
    results: dict[str, Any] = {}
    sent: list[int] = []
    all_reduce = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        if group is not None and sorted(dist.get_process_group_ranks(group)) in ([0, 2], [1, 3]):  # replicate groups
            sent.append(tensor.numel() * tensor.element_size())
        return all_reduce(tensor, *args, group=group, **kwargs)  # type: ignore[call-overload]

    dist.all_reduce = counted
    try:
        trainer, model = _fit(out)
    finally:
        dist.all_reduce = all_reduce
    strategy = trainer.strategy
    results["a"] = full(model)
    results["at_validation"] = model.at_validation[0]
    results["local_shapes"] = [tuple(p.to_local().shape) for p in model.parameters()]
    results["num_syncs"] = strategy.num_syncs
    results["bytes"] = strategy.bytes_communicated
    results["sent"] = sum(sent)
    checkpoint = os.path.join(out, "epoch=0.ckpt")
    results["files"] = sorted(os.listdir(checkpoint))
    trainer, model = _fit(os.path.join(out, "b"), checkpoint)
    results["b"] = full(model)
    results["b_num_syncs"] = trainer.strategy.num_syncs
    finish_rank(results, out, rank)


def _participation_worker(rank: int, init_file: str, out: str) -> None:
    _environment(rank)
    trainer, model = _fit(out, participation=1, participation_seed=SEED)
    (averager,) = trainer.strategy.averagers.values()
    weights = [averager.participant_weights(r) for r in range(averager.num_syncs)]
    finish_rank({"c": full(model), "weights": weights}, out, rank)


def _spawn(worker: Any, out: str) -> list[Any]:
    """``worker`` on the four processes of Lightning's rendezvous at a free port of this host."""
    with rendezvous_here():
        return spawn_ranks(worker, WORLD, out)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _spawn(_worker, str(tmp_path_factory.mktemp("sharded_strategy")))


@pytest.mark.slow
def test_the_fit_ends_at_the_unsharded_reference_on_every_rank(ranks):
    reference = _reference(CASE, closed_at=(CLOSED_AT,), batches=_replica_batches())
    for rank, results in enumerate(ranks):
        a, b = ROWS[rank % 2]
        assert results["local_shapes"] == [(a, 7), (a,), (b, 5), (b,)]  # uneven shards
        difference = _max_difference(results["a"], reference)
        print(f"rank {rank}: max |A - unsharded reference| = {difference:.3g}")
        assert difference <= 1e-12, (rank, difference)


@pytest.mark.slow
def test_the_validation_mid_round_sees_one_averaged_model(ranks):
    first = ranks[0]["at_validation"]
    for results in ranks:
        assert _max_difference(results["at_validation"], first) == 0


@pytest.mark.slow
def test_the_resume_from_the_mid_round_checkpoint_is_bit_identical(ranks):
    for rank, results in enumerate(ranks):
        assert f"{CHECKPOINT_KEY}.rank{rank}.pt" in results["files"] and "meta.pt" in results["files"]
        assert all(torch.equal(x, y) for x, y in zip(results["b"], results["a"])), (
            rank,
            _max_difference(results["b"], results["a"]),
        )
        assert results["b_num_syncs"] == results["num_syncs"] == STEPS // K + 1  # the closed round counted


@pytest.mark.slow
def test_bytes_sent_per_sync_are_the_local_shard(ranks):
    for rank, results in enumerate(ranks):
        shard_bytes = LOCAL_NUMEL[rank % 2] * CASES[CASE][0].itemsize
        syncs = STEPS // K + 1
        assert results["bytes"] == syncs * shard_bytes
        assert results["sent"] == syncs * shard_bytes  # counted at the all-reduces over the replicate group


@pytest.mark.slow
def test_partial_participation_takes_the_drawn_replicas_model_on_every_rank(tmp_path):
    """S = 1 of M = 2: each round's average is the drawn replica's model (the documented draw, seeded
    with participation_seed * 1,000,003 + round), DiLoCo's outer step is taken on it, and both replicas,
    the other included, start the next round there; each keeps its own momentum."""
    ranks = _spawn(_participation_worker, str(tmp_path))
    drawn = [participants(r, 1, SEED, machines=2) for r in range(STEPS // K + 1)]
    assert drawn == [[1], [0], [0], [1]]  # both replicas drawn, replica 1 first
    reference = _reference(CASE, closed_at=(CLOSED_AT,), batches=_replica_batches(), participants=drawn.__getitem__)
    full_participation = _reference(CASE, closed_at=(CLOSED_AT,), batches=_replica_batches())
    assert _max_difference(reference, full_participation) > 1e-3  # the two semantics far apart
    for rank, results in enumerate(ranks):
        assert [w.tolist() for w in results["weights"]] == [[float(i in d) for i in range(2)] for d in drawn]
        difference = _max_difference(results["c"], reference)
        print(f"rank {rank}: max |C - participation reference| = {difference:.3g}")
        assert difference <= 1e-12, (rank, difference)


def test_registered_by_name():
    trainer = pl.Trainer(strategy="sharded_averaging", accelerator="cpu", devices=1, logger=False)
    assert type(trainer.strategy) is ShardedAveragingStrategy


@pytest.mark.parametrize(
    "options, message",
    [
        ({"fragments": 2, "sync_every": 2}, "Invalid options for an FSDP2-sharded model: fragments=2 (fragments cut"),
        ({"bucket_views": True}, "Invalid options for an FSDP2-sharded model: bucket_views=True (fragments cut"),
        ({"save_distributed_checkpoint": False}, "Invalid save_distributed_checkpoint: False"),
        ({"data_parallel_size": 2}, "ShardedAveragingStrategy sets data_parallel_size itself;"),
        ({"replicate_size": 0}, "Invalid replicate_size: 0"),
    ],
)
def test_unsupported_options_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError) as err:
        ShardedAveragingStrategy(**options)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_a_resume_on_another_mesh_is_refused_in_one_line(tmp_path):
    strategy = ShardedAveragingStrategy(replicate_size=2, shard_size=2)
    saved = {CHECKPOINT_KEY: {"mesh": {"replicate": 4, "shard": 1}}}
    with pytest.raises(ValueError, match=r"^Cannot resume the averagers' states of a 4 x 1 mesh on a 2 x 2 mesh"):
        strategy._take_schedules(saved, tmp_path)


def _missing_state_worker(rank: int, init_file: str, out: str) -> None:
    """Two replicas of one process each fit 2 steps and save; one process's averager state file is then
    deleted, and both resume from the checkpoint: what each rank raises, or None."""
    import datetime

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)

    def fit(root: str, ckpt_path: str | None = None) -> pl.Trainer:
        strategy = ShardedAveragingStrategy(
            sync_every=K, replicate_size=2, shard_size=1, timeout=datetime.timedelta(seconds=30)
        )
        trainer = pl.Trainer(
            strategy=strategy, accelerator="cpu", devices=2, max_steps=2, limit_val_batches=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=root, use_distributed_sampler=False,
        )  # fmt: skip
        trainer.fit(Sharded(), ckpt_path=ckpt_path)
        return trainer

    checkpoint = os.path.join(out, "last.ckpt")
    fit(out).save_checkpoint(checkpoint)
    if rank == 0:
        os.remove(os.path.join(checkpoint, f"{CHECKPOINT_KEY}.rank1.pt"))
    dist.barrier()
    error: Any = None
    try:
        fit(os.path.join(out, "b"), checkpoint)
    except Exception as err:
        error = (type(err).__name__, str(err))
    finish_rank({"error": error, "checkpoint": checkpoint}, out, rank)


@pytest.mark.slow
def test_a_missing_process_state_file_is_refused_in_one_line_on_every_rank(tmp_path):
    """The resume of a checkpoint whose ``periodic_averaging.rank1.pt`` is gone: every rank stops with the same
    line naming that file and what to do, before any collective of the resume (none hangs or times out)."""
    with rendezvous_here():
        ranks = spawn_ranks(_missing_state_worker, 2, str(tmp_path))
    missing = os.path.join(ranks[0]["checkpoint"], f"{CHECKPOINT_KEY}.rank1.pt")
    for rank, results in enumerate(ranks):
        assert results["error"] is not None, rank
        kind, message = results["error"]
        assert kind == "FileNotFoundError" and "\n" not in message, (rank, kind, message)
        assert message.startswith(f"Cannot resume from {ranks[0]['checkpoint']}: {missing} is missing"), message
    assert ranks[0]["error"] == ranks[1]["error"]
