"""Checkpoint files (``lit_slowcal.checkpoint_io``, AtomicCheckpointIO) are whole or absent."""

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lit_slowcal import AtomicCheckpointIO


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
