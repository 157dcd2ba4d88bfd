"""The sweep's worker processes: SIGTERM (the pool's ``terminate()``, the sweep's exit) ends a worker at once,
also in the middle of a Lightning fit, whose own SIGTERM handler only flags the signal."""

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_slowcal.experiments.sweep import workers


def _fit_until_ended(marker: str) -> None:
    """In a worker: a Lightning fit whose first training step writes ``marker`` (the worker's pid), then sleeps."""
    import lightning.pytorch as pl

    class Sleeper(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            Path(marker).write_text(str(os.getpid()))
            time.sleep(60)
            return (self.w**2).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=1)

    trainer = pl.Trainer(
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(Sleeper())


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended and not yet reaped by its pool, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the sweep forks its workers on Linux")
def test_sigterm_ends_a_worker_at_once_in_the_middle_of_a_lightning_fit(tmp_path):
    marker = tmp_path / "pid"
    with workers.worker_pool(1, 1) as pool:
        pool.apply_async(_fit_until_ended, (str(marker),))
        deadline = time.monotonic() + 60
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < deadline, "the worker's fit did not reach its first step"
            time.sleep(0.05)
        pid = int(marker.read_text())
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the worker went on after SIGTERM (Lightning's handler only flags it)"
