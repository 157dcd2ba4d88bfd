"""Ranks that read unequal numbers of batches an epoch (each its own shard, ``use_distributed_sampler=False``):
two gloo processes under Lightning's Trainer, rank 0 with 12 batches and rank 1 with 10, K = 4, a validation at
the end of the epoch. Every rank raises the same one line naming each rank's count, before the first step where
the lengths are known; an iterable of unknown length is caught at the batch where the first rank's data ends. A short process-group timeout turns a hang into a failure of the test, not of the suite."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from functools import partial
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.multiprocessing as mp
from helpers import rendezvous_here
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lit_slowcal import PeriodicAveragingStrategy, ShardedAveragingStrategy

pytestmark = pytest.mark.slow

WORLD, K, B = 2, 4, 2
BATCHES = (12, 10)  # rank r's training batches an epoch
TIMEOUT = timedelta(seconds=20)  # a collective waiting longer fails (a hang without the check)
DEADLINE = 240.0  # seconds for the whole spawn


def _rows(rank: int) -> TensorDataset:
    g = torch.Generator().manual_seed(rank)
    n = BATCHES[rank] * B
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g))


class _Stream(IterableDataset):
    """Rank ``rank``'s rows one batch at a time, with no ``__len__``: Lightning cannot know the epoch's length."""

    def __init__(self, rank: int) -> None:
        self.rows = _rows(rank).tensors

    def __iter__(self):
        x, y = self.rows
        return iter([(x[i : i + B], y[i : i + B]) for i in range(0, len(x), B)])


class Regression(pl.LightningModule):
    def __init__(self, stream: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(3, 1)
        self.stream = stream

    def configure_model(self) -> None:  # ModelParallelStrategy asks for it; S = 1: nothing to shard
        pass

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def validation_step(self, batch: Any, _: int) -> None:
        x, y = batch
        self.log("val", ((self.net(x) - y) ** 2).mean(), sync_dist=True)

    def train_dataloader(self) -> Any:
        rank = self.trainer.global_rank
        return DataLoader(_Stream(rank), batch_size=None) if self.stream else DataLoader(_rows(rank), batch_size=B)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_rows(0), batch_size=B)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _strategy(name: str) -> Any:
    if name == "sharded":
        return ShardedAveragingStrategy(sync_every=K, replicate_size=WORLD, shard_size=1, timeout=TIMEOUT)
    return PeriodicAveragingStrategy(sync_every=K, timeout=TIMEOUT)


def _worker(strategy: str, stream: bool, rank: int, init_file: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    trainer = pl.Trainer(
        strategy=_strategy(strategy), accelerator="cpu", devices=WORLD, max_epochs=2, limit_val_batches=1,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, default_root_dir=out,
    )  # fmt: skip
    result: dict[str, Any] = {}
    try:
        trainer.fit(Regression(stream))
    except Exception as error:  # what each rank raised, compared by the test
        result = {"type": type(error).__name__, "message": str(error)}
    result["steps"] = trainer.global_step
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))  # no barrier: the ranks may be out of step
    os._exit(0)  # gloo's threads of a broken group may block the interpreter's exit


def _spawn(strategy: str, stream: bool, out: str) -> list[dict[str, Any]]:
    """Both ranks' results; every process killed when they are not all in within ``DEADLINE``."""
    with rendezvous_here():
        context = mp.spawn(partial(_worker, strategy, stream), args=("", out), nprocs=WORLD, join=False)
        deadline = time.monotonic() + DEADLINE
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                break
    files = [os.path.join(out, f"rank{r}.pt") for r in range(WORLD)]
    missing = [f for f in files if not os.path.exists(f)]
    assert not missing, f"ranks still running after {DEADLINE} s (hung): {missing}"
    return [torch.load(f, weights_only=False) for f in files]


@pytest.mark.parametrize("strategy", ["periodic", "sharded"])
def test_unequal_epochs_are_refused_on_every_rank_before_the_first_step(tmp_path, strategy):
    ranks = _spawn(strategy, False, str(tmp_path))
    expected = (
        "the ranks read unequal numbers of training batches this epoch (trainer.num_training_batches: "
        f"rank 0: {BATCHES[0]}, rank 1: {BATCHES[1]});"
    )
    for rank, result in enumerate(ranks):
        assert result.get("type") == "RuntimeError", (rank, result)
        message = result["message"]
        assert expected in message and "\n" not in message, (rank, message)
        assert result["steps"] == 0, (rank, result)  # before anything was trained
    assert ranks[0]["message"] == ranks[1]["message"]


@pytest.mark.parametrize("strategy", ["periodic", "sharded"])
def test_an_unknown_length_is_refused_at_the_batch_where_the_first_rank_s_data_ends(tmp_path, strategy):
    """Lengths unknown (no ``__len__``): at every batch the ranks compare whether their data has ended, so at batch
    10 (rank 1's last) both raise the same line naming rank 1's 10 and rank 0's "more than 10", before batch 10 is
    trained; without the comparison rank 1 closes its round while rank 0 goes on, and (Lightning 2.6's per-step
    broadcast) both wait until the process group's timeout, each naming only its own steps."""
    ranks = _spawn(strategy, True, str(tmp_path))
    name = {"periodic": "PeriodicAveragingStrategy", "sharded": "ShardedAveragingStrategy"}[strategy]
    expected = (
        f"{name}: the ranks' training data ended at different batches this epoch (a loader "
        f"without __len__; batches: rank 0: more than {BATCHES[1]}, rank 1: {BATCHES[1]}); "
    )
    for rank, result in enumerate(ranks):
        assert result.get("type") == "RuntimeError", (rank, result)
        message = result["message"]
        assert message.startswith(expected) and "\n" not in message, (rank, message)
        assert f"the run stops before batch {BATCHES[1]} on every rank" in message, (rank, message)
        assert result["steps"] == BATCHES[1] - 1, (rank, result)
    assert ranks[0]["message"] == ranks[1]["message"]
