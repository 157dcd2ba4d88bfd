"""The Fabric example (``lit_slowcal.fabric``, PeriodicAveragingFabricStrategy) on two processes equals the
plain torch loop."""

import pytest
import torch
from test_averaging import assert_close, assert_equal, run_example


@pytest.mark.slow
def test_fabric_example_on_two_processes_equals_the_plain_loop(tmp_path):
    fabric = run_example("fabric_loop.py", tmp_path, "--processes=2", "--dtype=float64")
    plain = run_example("torch_loop.py", tmp_path, "--processes=1", "--machines=2", "--dtype=float64")
    assert_close(fabric, plain, 1e-12)


_FABRIC_RESUME = """
import sys

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lit_slowcal import PeriodicAveragingFabricStrategy

folder, overlap_delay, bucket_views = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "views"
STEPS, SAVE_AT = 12, 6  # K = 4: the checkpoint is mid-round (with overlap_delay=3, the round of step 4 in flight)
torch.set_num_threads(1)


def run(mode):
    diloco = lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
    strategy = PeriodicAveragingFabricStrategy(
        sync_every=4, outer_optimizer=diloco, overlap_delay=overlap_delay, bucket_views=bucket_views,
        process_group_backend="gloo",
    )
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    rank = fabric.global_rank
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    g = torch.Generator().manual_seed(1 + rank)  # every machine its own data
    data = [(torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g) + 3 * rank) for _ in range(STEPS)]
    start = 0
    if mode == "resumed":
        fabric.load(f"{folder}/checkpoint.pt", {"model": model, "optimizer": optimizer})
        torch.save(optimizer.state_dict()["state"], f"{folder}/loaded{rank}.pt")
        start = SAVE_AT
    for step in range(start, STEPS):
        optimizer.zero_grad()
        x, y = data[step]
        fabric.backward(((model(x) - y) ** 2).mean())
        optimizer.step()
        if mode == "whole" and step + 1 == SAVE_AT:
            fabric.save(f"{folder}/checkpoint.pt", {"model": model, "optimizer": optimizer})
            torch.save(optimizer.state_dict()["state"], f"{folder}/saved{rank}.pt")
    strategy.close_rounds()
    storages = len({p.untyped_storage().data_ptr() for p in model.parameters()})  # 1: one buffer (bucket_views)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()["state"], "storages": storages}
    torch.save(state, f"{folder}/{mode}{rank}.pt")
    fabric.barrier()


run("whole")
run("resumed")  # a fresh Fabric, strategy, model and optimizer: all they know comes from the checkpoint
torch.distributed.destroy_process_group()
"""


@pytest.mark.parametrize("overlap_delay, layout", [(0, "copies"), (3, "copies"), (0, "views")])
@pytest.mark.slow
def test_fabric_resume_on_two_processes_restores_every_machines_adamw_state_bit_identically(
    tmp_path, overlap_delay, layout
):
    """DiLoCo (AdamW inner, Nesterov SGD outer) on 2 Fabric processes, fabric.save mid-round (step 6 of 12,
    K = 4), then fabric.load in a fresh Fabric (strategy, model, optimizer): each rank resumes its own AdamW moments, and the resumed
    run ends bit-identical to the uninterrupted one (model and optimizer state, on each rank); with overlapped
    rounds too (tau = 3: fabric.save lands the round in flight first), and with ``bucket_views`` (the parameters
    views of one buffer: saved, loaded into fresh parameters, homed again at the first round)."""
    import subprocess
    import sys

    from helpers import subprocess_env

    script = tmp_path / "fabric_resume.py"
    script.write_text(_FABRIC_RESUME)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(overlap_delay), layout], cwd=tmp_path, env=subprocess_env(PYTHONFAULTHANDLER="1"),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = [torch.load(tmp_path / f"saved{rank}.pt") for rank in (0, 1)]
    # The moments are per machine: the two ranks held different ones when the checkpoint was written.
    assert not torch.equal(saved[0][0]["exp_avg"], saved[1][0]["exp_avg"])
    for rank in (0, 1):
        assert_equal(
            saved[rank], torch.load(tmp_path / f"loaded{rank}.pt"), f"rank {rank}'s optimizer state after fabric.load"
        )
    for rank in (0, 1):
        whole, resumed = torch.load(tmp_path / f"whole{rank}.pt"), torch.load(tmp_path / f"resumed{rank}.pt")
        assert_equal(whole["model"], resumed["model"], f"rank {rank}'s final model")
        assert_equal(whole["optimizer"], resumed["optimizer"], f"rank {rank}'s final optimizer state")
        assert whole["storages"] == resumed["storages"] == (1 if layout == "views" else 4)
