"""A user's project on two gloo processes, as the tests in this folder run it; each rank records what it saw.

    python tests/library/user_project.py cnn OUT -- <examples/lightning_cnn.py arguments>
    python tests/library/user_project.py gan OUT --max-epochs 2 [--ckpt-path C]
    python tests/library/user_project.py gradscaler OUT

Every rank writes ``OUT/rank{r}.pt``: the models it held at each validation and in each checkpoint,
the model and optimizer state it ends with, and the strategy's schedules.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "examples"), str(REPO / "tests")]
import lightning_cnn  # noqa: E402
from helpers import Batches  # noqa: E402

from lit_slowcal import PeriodicAverager, PeriodicAveragingStrategy, SlowcalSGD  # noqa: E402


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        for key, value in optimizer.state.get(p, {}).items():
            out[f"{i}.{key}"] = value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
    return out


class Recorder(Callback):
    """What this rank's model was at the start of fit, at every validation and in every checkpoint."""

    def __init__(self) -> None:
        self.start = None
        self.validated: list[tuple[int, dict]] = []
        self.saved: list[tuple[int, dict, list]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = snapshot(pl_module)

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.validated.append((trainer.global_step, snapshot(pl_module)))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        state = {k: v.detach().clone() for k, v in checkpoint["state_dict"].items()}
        self.saved.append((trainer.global_step, state, [a.state_dict() for a in trainer.strategy.averagers.values()]))


def write(out: Path, rank: int, trainer: L.Trainer, module: nn.Module, recorder: Recorder, **extra) -> None:
    strategy = trainer.strategy
    torch.save(
        {
            "world_size": trainer.world_size,
            "start": recorder.start,
            "validated": recorder.validated,
            "saved": recorder.saved,
            "final": snapshot(module),
            "optimizers": [optimizer_tensors(o) for o in trainer.optimizers],
            "averagers": [strategy.averagers[id(o)].state_dict() for o in trainer.optimizers],
            "num_syncs": strategy.num_syncs,
            "floats_communicated": strategy.floats_communicated,
            "link_counts": strategy.link_counts.state_dict(),
            "ddp_counts": strategy.ddp_counts().state_dict(),
            "best_model_path": trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else None,
            **extra,
        },
        out / f"rank{rank}.pt",
    )


def cnn(out: Path, argv: list[str]) -> None:
    recorder = Recorder()
    trainer, model = lightning_cnn.main([*argv, "--no-progress-bar"], callbacks=[recorder])
    storages = len({t.untyped_storage().data_ptr() for t in model.parameters()})  # 1 with --bucket-views
    write(out, trainer.global_rank, trainer, model, recorder, storages=storages)


class GAN(L.LightningModule):
    """Two optimizers under manual optimization, each half with its own BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        real, z = batch
        g_opt, d_opt = self.optimizers()
        fake = self.generator(z)
        g_opt.zero_grad()
        self.manual_backward(F.softplus(-self.discriminator(fake)).mean())
        g_opt.step()
        d_opt.zero_grad()
        d_loss = F.softplus(-self.discriminator(real)).mean() + F.softplus(self.discriminator(fake.detach())).mean()
        self.manual_backward(d_loss)
        d_opt.step()

    def configure_optimizers(self):
        return SlowcalSGD(self.generator.parameters(), lr=0.05), SlowcalSGD(self.discriminator.parameters(), lr=0.05)


class GANData(L.LightningDataModule):
    """10 batches an epoch, this rank's own, drawn from the (rank, epoch) seed: a resumed epoch gets the same."""

    def train_dataloader(self):
        rank, epoch = self.trainer.global_rank, self.trainer.current_epoch
        g = torch.Generator().manual_seed(1000 * rank + epoch)
        real = torch.randn(10, 8, 8, generator=g) + rank
        z = torch.randn(10, 8, 4, generator=g)
        return Batches(zip(real, z))


def gan(out: Path, argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-epochs", type=int, default=2)
    p.add_argument("--ckpt-path")
    p.add_argument("--sync-every", type=int, default=6)
    args = p.parse_args(argv)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_epochs=args.max_epochs,
        strategy=PeriodicAveragingStrategy(sync_every=args.sync_every, process_group_backend="gloo"),
        callbacks=[recorder, ModelCheckpoint(dirpath=out / "checkpoints", filename="{epoch}", save_top_k=-1)],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, reload_dataloaders_every_n_epochs=1,
    )  # fmt: skip
    model = GAN()
    trainer.fit(model, GANData(), ckpt_path=args.ckpt_path)
    write(out, trainer.global_rank, trainer, model, recorder)


def _scaled_loop(rank: int, out: str, port: int) -> None:
    """8 iterations, K = 4, a real GradScaler; rank 1's loss is inf at iteration 1, so its scaler skips that step."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    result = {}
    for pattern in ("explicit", "attached"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        optimizer = SlowcalSGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        averager = PeriodicAverager(model, optimizer, sync_every=4)
        averager.broadcast()
        g = torch.Generator().manual_seed(rank)
        try:
            if pattern == "attached":
                averager.attach()  # the README's `with averager:`
            for it in range(8):
                x = torch.randn(8, 3, generator=g)
                loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
                if rank == 1 and it == 1:
                    loss = loss * float("inf")
                optimizer.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                if pattern == "explicit":
                    averager.step()  # once per iteration, skipped or not
            averager.close_round()
            result[pattern] = {
                "final": snapshot(model),
                "w": optimizer_tensors(optimizer),
                "state": averager.state_dict(),
                "scale": scaler.get_scale(),
            }
        except RuntimeError as err:
            result[pattern] = {"error": str(err)}
        finally:
            averager.remove_hooks()
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def gradscaler(out: Path, argv: list[str]) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_scaled_loop, args=(str(out), port), nprocs=2, start_method="fork")


class CharLM(L.LightningModule):
    """A small character-level transformer (embedding, one encoder layer, tied-free head) with an inner
    optimizer that keeps state per machine: AdamW (plain or DiLoCo), SGD with momentum, or SCAFFOLD."""

    def __init__(self, inner: str) -> None:
        super().__init__()
        self.inner = inner
        torch.manual_seed(0)
        self.embed = nn.Embedding(12, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 12)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.block(self.embed(x))).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        from lit_slowcal import Scaffold

        if self.inner in ("adamw", "diloco"):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        if self.inner == "momentum":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return Scaffold(self.parameters(), lr=0.05)


class CharData(L.LightningDataModule):
    """6 batches of 4 sequences of 9 characters an epoch, this rank's own (its characters skewed by the
    rank), drawn from the (rank, epoch) seed: a resumed epoch gets the same."""

    def train_dataloader(self):
        rank, epoch = self.trainer.global_rank, self.trainer.current_epoch
        g = torch.Generator().manual_seed(1000 * rank + epoch)
        weights = torch.arange(1, 13, dtype=torch.float64) ** (1.0 if rank == 0 else -1.0)
        text = torch.multinomial(weights, 6 * 4 * 10, replacement=True, generator=g).view(6, 4, 10)
        return Batches((t[:, :-1], t[:, 1:]) for t in text)


class StateRecorder(Callback):
    """This rank's optimizer state when each checkpoint is written, and at the first step of the fit
    (after the strategy restored a resumed run's state)."""

    def __init__(self) -> None:
        self.saved: dict[int, dict] = {}
        self.first_step = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.saved[trainer.global_step] = optimizer_tensors(trainer.optimizers[0])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.first_step is None:
            self.first_step = optimizer_tensors(trainer.optimizers[0])


def per_machine(out: Path, argv: list[str]) -> None:
    """For each inner optimizer: a fit of 3 epochs (K = 5, 6 steps an epoch, a checkpoint at every
    epoch's end: steps 6 and 12, both mid-round), and the same fit resumed from step 6, in one launch."""
    result = {}
    for inner in argv:
        outer = (
            (lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)) if inner == "diloco" else None
        )
        for name, ckpt in (("whole", None), ("resumed", out / inner / "whole" / "epoch=0.ckpt")):
            recorder = StateRecorder()
            trainer = L.Trainer(
                accelerator="cpu", devices=2, max_epochs=3,
                strategy=PeriodicAveragingStrategy(sync_every=5, outer_optimizer=outer, process_group_backend="gloo"),
                callbacks=[recorder, ModelCheckpoint(dirpath=out / inner / name, filename="{epoch}", save_top_k=-1)],
                logger=False, enable_progress_bar=False, enable_model_summary=False,
                use_distributed_sampler=False, reload_dataloaders_every_n_epochs=1,
            )  # fmt: skip
            model = CharLM(inner)
            trainer.fit(model, CharData(), ckpt_path=ckpt)
            result[inner, name] = {
                "final": snapshot(model),
                "optimizer": optimizer_tensors(trainer.optimizers[0]),
                "saved": recorder.saved,
                "first_step": recorder.first_step,
                "global_step": trainer.global_step,
            }
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


def different_k(out: Path, argv: list[str]) -> None:
    """K = 10 on rank 0 and 20 on rank 1: the fit must stop on both ranks with one error, not hang."""
    import os
    import time

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    start = time.monotonic()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_epochs=1,
        strategy=PeriodicAveragingStrategy(sync_every=10 if rank == 0 else 20, process_group_backend="gloo", timeout=timedelta(seconds=60)),
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    try:
        trainer.fit(CharLM("momentum"), CharData())
        outcome = ("finished", "")
    except RuntimeError as err:
        outcome = ("RuntimeError", str(err))
    torch.save(
        {"outcome": outcome, "seconds": time.monotonic() - start, "global_step": trainer.global_step},
        out / f"rank{rank}.pt",
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    scenario, out, rest = sys.argv[1], Path(sys.argv[2]), [a for a in sys.argv[3:] if a != "--"]
    out.mkdir(parents=True, exist_ok=True)
    try:
        {"cnn": cnn, "gan": gan, "gradscaler": gradscaler, "per_machine": per_machine, "different_k": different_k}[
            scenario
        ](out, rest)
    finally:
        # Lightning leaves its process group to the script: a gloo group still alive at the interpreter's
        # exit occasionally aborts the process ("terminate called without an active exception").
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
