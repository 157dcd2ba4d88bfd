"""Checkpoint files are whole or absent, and LastCheckpoint keeps last.ckpt only."""

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lit_slowcal import AtomicCheckpointIO
from lit_slowcal.experiments.last_checkpoint import LastCheckpoint


def test_save_replaces_the_file_whole(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "ckpts" / "last.ckpt"
    io.save_checkpoint({"round": 1, "x": torch.arange(3.0)}, path)
    io.save_checkpoint({"round": 2, "x": torch.arange(4.0)}, path)
    loaded = io.load_checkpoint(path)
    assert loaded["round"] == 2 and torch.equal(loaded["x"], torch.arange(4.0))
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]


def test_a_save_that_dies_half_way_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"round": 1}, path)

    def dies_half_way(self, checkpoint, target, storage_options=None):
        with open(target, "wb") as f:
            f.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt  # the job is killed while writing

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"round": 2}, path)
    monkeypatch.undo()
    assert io.load_checkpoint(path)["round"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left


def test_last_checkpoint_keeps_only_last():
    callback = LastCheckpoint(every_n_train_steps=16)
    assert callback.save_top_k == 0 and callback.save_last is True
    assert callback._every_n_train_steps == 16


def test_last_checkpoint_is_written_at_the_last_step(tmp_path):
    """Saving every 2 steps of a 3-step run: last.ckpt must still hold step 3 when training ends."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = LastCheckpoint(every_n_train_steps=2, dirpath=tmp_path / "ckpt")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, callbacks=[callback],
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    trainer.fit(Tiny(), train_dataloaders=DataLoader(torch.ones(3, 2), batch_size=1))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["last.ckpt"]
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 3


def test_no_warning_about_manual_optimization(tmp_path):
    """The app optimizes by hand; its round checkpoints hold the state after the round, as intended."""
    import warnings

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    class Manual(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(self.layer(batch).sum())
            optimizer.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    callback = LastCheckpoint(every_n_train_steps=1, dirpath=tmp_path / "ckpt")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, callbacks=[callback],
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Manual(), train_dataloaders=DataLoader(torch.ones(3, 2), batch_size=1))
    assert not [w for w in caught if "manual optimization" in str(w.message)]
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 3
