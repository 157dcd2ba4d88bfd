"""Your own Lightning project with SLowcal-SGD: a small CNN on MNIST, averaged every K steps.

A template: an ordinary LightningModule and LightningDataModule; the only lines that are about
periodic averaging are the strategy and the optimizer (``build_trainer`` and
``configure_optimizers``). Every process is one machine and trains on its own shard of the
training set (sorted by label, so the machines' data differ: a heterogeneous split); every
``--sync-every`` optimizer steps the strategy averages the model, the BatchNorm statistics and
SlowcalSGD's iterate w over the processes. Validation, checkpoints and the model ``fit`` returns
are the averaged model, the same on every process (docs/library.md, "Round boundaries")::

    python examples/lightning_cnn.py --devices 2 --sync-every 8 --max-steps 200
    python examples/lightning_cnn.py --devices 2 --sync-every 8 --max-steps 400 --ckpt-path runs/cnn/checkpoints/last.ckpt

It reads the MNIST files shipped in ``data/MNIST/raw`` (no download).
"""

from __future__ import annotations

import argparse
import gzip
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lit_slowcal import PeriodicAveragingStrategy, SlowcalSGD

ROOT = Path(__file__).resolve().parents[1] / "data" / "MNIST" / "raw"


def read_idx(path: Path) -> Tensor:
    """An MNIST idx file (gzipped) as a uint8 tensor of its declared shape."""
    data = gzip.open(path, "rb").read()
    ndim = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return torch.frombuffer(bytearray(data[4 + 4 * ndim :]), dtype=torch.uint8).reshape(shape)


class CNN(L.LightningModule):
    """Two convolutions (the first with BatchNorm) and a linear layer."""

    def __init__(self, lr: float = 0.05, optimizer: str = "slowcal") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(16 * 7 * 7, 10),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        # sync_dist: the mean over the processes' validation shards, of one and the same model.
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "slowcal":
            return SlowcalSGD(self.parameters(), lr=self.hparams.lr)  # SLowcal-SGD
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)  # Local-SGD


class ShardedMNIST(L.LightningDataModule):
    """Each process reads its own shard: the first ``train_size`` training images sorted by label,
    cut into ``num_shards`` pieces (so any number of processes up to ``num_shards`` sees shards of
    the same length). The split is the data module's own, hence ``use_distributed_sampler=False``
    in the Trainer (with it, Lightning would re-split every shard across the processes)."""

    def __init__(
        self, train_size: int = 2048, val_size: int = 512, batch_size: int = 32, num_shards: int = 2, root: Path = ROOT
    ) -> None:
        super().__init__()
        self.train_size, self.val_size, self.batch_size, self.num_shards, self.root = (
            train_size,
            val_size,
            batch_size,
            num_shards,
            Path(root),
        )

    def setup(self, stage: str) -> None:
        rank = self.trainer.global_rank if self.trainer is not None else 0
        if rank >= self.num_shards:
            raise ValueError(f"Invalid num_shards: {self.num_shards} (must be >= the number of processes)")
        x = read_idx(self.root / "train-images-idx3-ubyte.gz")[: self.train_size]
        y = read_idx(self.root / "train-labels-idx1-ubyte.gz")[: self.train_size].long()
        order = torch.sort(y, stable=True).indices  # label-sorted: heterogeneous shards
        shard = order.chunk(self.num_shards)[rank]
        self.train = TensorDataset(x[shard].unsqueeze(1).float() / 255.0, y[shard])
        vx = read_idx(self.root / "t10k-images-idx3-ubyte.gz")[: self.val_size]
        vy = read_idx(self.root / "t10k-labels-idx1-ubyte.gz")[: self.val_size].long()
        part = torch.arange(self.val_size).chunk(self.num_shards)[rank]
        self.val = TensorDataset(vx[part].unsqueeze(1).float() / 255.0, vy[part])

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.trainer.current_epoch if self.trainer else 0)
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, generator=generator, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=256)


def build_trainer(args: argparse.Namespace, callbacks: Sequence[Callback] = ()) -> L.Trainer:
    strategy = PeriodicAveragingStrategy(
        sync_every=args.sync_every, bucket_views=args.bucket_views, process_group_backend="gloo"
    )
    checkpoints = [
        ModelCheckpoint(
            dirpath=Path(args.run_dir) / "checkpoints", monitor="val_acc", mode="max", save_top_k=1, save_last=True
        ),
        ModelCheckpoint(dirpath=Path(args.run_dir) / "epochs", filename="{epoch}-{step}", save_top_k=-1),
    ]
    return L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        use_distributed_sampler=False,  # the data module gives every process its own shard
        reload_dataloaders_every_n_epochs=1,  # a new shuffle every epoch (seeded by the epoch)
        callbacks=[*checkpoints, *callbacks],
        logger=CSVLogger(args.run_dir, name="logs"),
        enable_progress_bar=args.progress_bar,
        enable_model_summary=False,
        log_every_n_steps=10,
    )


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2, help="processes, one machine each")
    p.add_argument("--sync-every", type=int, default=8, help="K: optimizer steps between averages")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--optimizer", choices=("slowcal", "sgd"), default="slowcal")
    p.add_argument("--train-size", type=int, default=2048, help="training images used, over all shards")
    p.add_argument("--val-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-shards", type=int, default=2, help="shards of the training set (>= devices)")
    p.add_argument("--run-dir", default="runs/cnn")
    p.add_argument("--ckpt-path", default=None, help="resume from this checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bucket-views",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the averaged tensors live in flat buffers, all-reduced with no copy (PeriodicAverager)",
    )
    p.add_argument("--progress-bar", action=argparse.BooleanOptionalAction, default=True)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None, callbacks: Sequence[Callback] = ()) -> tuple[L.Trainer, CNN]:
    args = parse(argv)
    L.seed_everything(args.seed, verbose=False)
    model = CNN(lr=args.lr, optimizer=args.optimizer)
    data = ShardedMNIST(args.train_size, args.val_size, args.batch_size, args.num_shards)
    trainer = build_trainer(args, callbacks)
    trainer.fit(model, data, ckpt_path=args.ckpt_path)
    strategy: Any = trainer.strategy
    if trainer.is_global_zero:
        print(
            f"done: {trainer.global_step} steps, {strategy.num_syncs} synchronisations of M = {strategy.num_machines} "
            f"machines, {strategy.floats_communicated:,} floats sent per machine; "
            f"val_acc {float(trainer.callback_metrics.get('val_acc', float('nan'))):.4f}"
        )
    return trainer, model


if __name__ == "__main__":
    main()
