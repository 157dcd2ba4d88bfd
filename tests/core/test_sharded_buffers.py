"""A sharded model's buffers in Lightning's Trainer: four gloo processes, a 2 (replicate) x 2 (shard) mesh, a model
with BatchNorm (running statistics: buffers that are not DTensors, each shard process computing them from its
part of the machine's batch) in float64, ``configure_model`` as docs/sharded.md writes it (read from the page).

Run A fits 6 steps (two epochs of 3, K = 2) with a validation and a checkpoint after each epoch (the first
mid-round), then validates and tests with the same Trainer (``configure_model`` called again); run B resumes
from the step-3 checkpoint. Every validation and test sees the same buffers and loss on every rank (one
averaged model), and B ends with A's parameters and buffers bit for bit."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import finish_rank
from lightning.pytorch.callbacks import ModelCheckpoint
from test_sharded_strategy import PER_RANK, STEPS, STEPS_PER_EPOCH, WORLD, _data, _environment, _sampler, _spawn
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lit_slowcal import ShardedAveragingStrategy

pytestmark = pytest.mark.slow  # four processes

K = 2
DOCS = Path(__file__).resolve().parents[2] / "docs" / "sharded.md"


def _documented_model() -> type:
    """docs/sharded.md's ``Model``: its Trainer recipe's imports and class, executed as written up to its ``...``."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    found = next((re.match(r"(.*?)\n    \.\.\.\n", b, re.S) for b in blocks if "class Model(" in b), None)
    assert found is not None, "docs/sharded.md: the Trainer recipe's class Model not found"
    namespace: dict[str, Any] = {}
    exec(found.group(1), namespace)
    return namespace["Model"]


def _evaluation() -> TensorDataset:
    """One batch of 8 rows, the same on every rank: equal models give equal losses."""
    g = torch.Generator().manual_seed(11)
    return TensorDataset(
        torch.randn(8, 7, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)
    )


class BatchNormModel(_documented_model()):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(7, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).to(torch.float64)
        self.seen: list[tuple[str, torch.Tensor, list[torch.Tensor]]] = []  # (stage, loss, buffers) per evaluation

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def _evaluate(self, batch: Any, stage: str) -> None:
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean().detach().clone()
        self.seen.append((stage, loss, [b.detach().clone() for b in self.net[1].buffers()]))

    def validation_step(self, batch: Any, _: int) -> None:
        self._evaluate(batch, "validate")

    def test_step(self, batch: Any, _: int) -> None:
        self._evaluate(batch, "test")

    def train_dataloader(self) -> DataLoader:
        data = _data()
        return DataLoader(data, PER_RANK, sampler=_sampler(data, **self.trainer.strategy.distributed_sampler_kwargs))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_evaluation(), 8)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(_evaluation(), 8)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _state(model: BatchNormModel) -> list[torch.Tensor]:
    """The full parameters (gathered) and the BatchNorm's buffers."""
    model.net.reshard()  # type: ignore[operator]
    return [p.full_tensor().detach().clone() for p in model.parameters()] + [
        b.detach().clone() for b in model.net[1].buffers()
    ]


def _trainer(root: str, resumed: bool) -> pl.Trainer:
    callbacks: list[pl.Callback] = (
        [] if resumed else [ModelCheckpoint(root, "{epoch}", save_top_k=-1, save_on_train_epoch_end=True)]
    )
    return pl.Trainer(
        strategy=ShardedAveragingStrategy(sync_every=K, replicate_size=2, shard_size=2),
        accelerator="cpu", devices=WORLD, max_steps=STEPS, limit_val_batches=1, num_sanity_val_steps=0,
        callbacks=callbacks, enable_checkpointing=not resumed, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, use_distributed_sampler=False,
    )  # fmt: skip


def _worker(rank: int, init_file: str, out: str) -> None:
    _environment(rank)
    results: dict[str, Any] = {}
    trainer, model = _trainer(out, resumed=False), BatchNormModel()
    trainer.fit(model)
    results["a"] = _state(model)
    for stage in ("validate", "test"):  # the same Trainer: configure_model again
        try:
            getattr(trainer, stage)(model)
            results[stage] = None
        except Exception as err:  # reported per rank, compared in the test
            results[stage] = f"{type(err).__name__}: {err}"
    results["seen"] = model.seen
    trainer, model = _trainer(os.path.join(out, "b"), resumed=True), BatchNormModel()
    trainer.fit(model, ckpt_path=os.path.join(out, "epoch=0.ckpt"))
    results["b"] = _state(model)
    results["b_seen"] = model.seen
    finish_rank(results, out, rank)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _spawn(_worker, str(tmp_path_factory.mktemp("sharded_buffers")))


def test_validate_and_test_after_fit_run_with_the_documented_configure_model(ranks):
    for rank, results in enumerate(ranks):
        assert (results["validate"], results["test"]) == (None, None), rank
        assert [stage for stage, _, _ in results["seen"]] == ["validate"] * 3 + ["test"]  # 2 in fit, then one each


def test_every_evaluation_sees_one_model_on_every_rank(ranks):
    """The buffers and the loss of every validation (mid-round, at the end of fit, after it) and of the test
    are equal on the four ranks: the shard processes of a machine too."""
    first = ranks[0]["seen"]
    assert len({tuple(b.tolist()) for _, _, buffers in first for b in buffers[:1]}) > 1  # the statistics moved
    for rank, results in enumerate(ranks):
        for (stage, loss, buffers), (_, loss0, buffers0) in zip(results["seen"], first):
            assert torch.equal(loss, loss0), (rank, stage, float(loss), float(loss0))
            assert all(torch.equal(b, b0) for b, b0 in zip(buffers, buffers0)), (
                rank,
                stage,
                max(float((b - b0).abs().max()) for b, b0 in zip(buffers[:2], buffers0[:2])),
            )


def test_the_resume_from_the_mid_round_checkpoint_is_exact_for_the_buffers_too(ranks):
    for rank, results in enumerate(ranks):
        differences = [float((x.double() - y.double()).abs().max()) for x, y in zip(results["b"], results["a"])]
        assert all(torch.equal(x, y) for x, y in zip(results["b"], results["a"])), (
            f"rank {rank}: {', '.join(f'{d:.2g}' for d in differences)}"
        )
        (_, loss, _) = results["b_seen"][-1]
        assert torch.equal(loss, results["seen"][STEPS // STEPS_PER_EPOCH - 1][1]), rank  # the end of fit's validation
