"""The sweep's worker processes: the pool's end ends every worker, also one in the middle of a Lightning fit,
whose own SIGTERM handler only flags the signal (the pool's ``terminate()`` alone would wait for it forever)."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lit_slowcal.experiments.sweep import workers

# A sweep process: a worker of worker_pool(1, 1) in a Lightning fit whose first training step writes the worker's
# pid to a file and sleeps; the pool's block is left then, and the seconds its end took are printed.
SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from lit_slowcal.experiments.sweep import workers

    def fit_until_ended(marker):
        import lightning.pytorch as pl

        class Sleeper(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.zeros(1))

            def training_step(self, batch, batch_idx):
                Path(marker).write_text(str(os.getpid()))
                time.sleep(120)
                return (self.w**2).sum()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

            def train_dataloader(self):
                return DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=1)

        pl.Trainer(
            max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(Sleeper())

    if __name__ == "__main__":
        marker = Path(sys.argv[1])
        with workers.worker_pool(1, 1) as pool:
            pool.apply_async(fit_until_ended, (str(marker),))
            deadline = time.monotonic() + 90
            while not marker.exists() or not marker.read_text():
                assert time.monotonic() < deadline, "the worker's fit did not reach its first step"
                time.sleep(0.05)
            start = time.monotonic()
        print(f"ended in {time.monotonic() - start:.2f}")
    """
)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended and not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow  # a Lightning fit in a forked worker, and the grace period
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the sweep forks its workers on Linux")
def test_the_pool_ends_a_worker_in_the_middle_of_a_lightning_fit_after_the_grace_period(tmp_path):
    script, marker = tmp_path / "sweep.py", tmp_path / "pid"
    script.write_text(SCRIPT)
    bound = workers.END_GRACE_S + 30
    try:
        proc = subprocess.run(
            [sys.executable, str(script), str(marker)], capture_output=True, text=True, timeout=90 + bound
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the pool's end waited for a worker in a Lightning fit")
    assert proc.returncode == 0, proc.stderr[-3000:]
    seconds = float(proc.stdout.split("ended in ")[1])
    assert workers.END_GRACE_S <= seconds < bound  # SIGTERM was not enough: the worker was killed after the grace
    pid = int(marker.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
