"""LastCheckpoint (``lit_slowcal.experiments.run.last_checkpoint``) keeps last.ckpt only, written at the last step."""

import torch

from lit_slowcal.experiments.run.last_checkpoint import LastCheckpoint


def quiet_trainer(tmp_path, every_n_train_steps):
    """A one-epoch CPU Trainer whose only callback is a ``LastCheckpoint`` into ``tmp_path / "ckpt"``."""
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        callbacks=[LastCheckpoint(every_n_train_steps=every_n_train_steps, dirpath=tmp_path / "ckpt")],
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )


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

    trainer = quiet_trainer(tmp_path, every_n_train_steps=2)
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

    trainer = quiet_trainer(tmp_path, every_n_train_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Manual(), train_dataloaders=DataLoader(torch.ones(3, 2), batch_size=1))
    assert not [w for w in caught if "manual optimization" in str(w.message)]
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 3
