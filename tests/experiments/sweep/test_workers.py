"""The sweep's worker processes: the pool's end ends every worker, also one in the middle of a Lightning fit,
whose own SIGTERM handler only flags the signal (the pool's ``terminate()`` alone would wait for it forever)."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import subprocess_env

from lit_slowcal.experiments.sweep import workers

# A sweep process: a worker of worker_pool(1, 1) in a Lightning fit whose first training step writes the worker's
# pid to a file and sleeps; the pool's block is left then, and the seconds its end took are printed. With "again",
# a second Ctrl-C reaches the sweep a second into the pool's end.
SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading, time
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
                time.sleep(600)
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
        # Ctrl-C raises KeyboardInterrupt, as in a terminal, also where this process was started with SIGINT
        # ignored (a shell starts its background commands so; Python then leaves it ignored).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        marker, again = Path(sys.argv[1]), sys.argv[2] == "again"
        try:
            with workers.worker_pool(1, 1) as pool:
                pool.apply_async(fit_until_ended, (str(marker),))
                while not marker.exists() or not marker.read_text():
                    time.sleep(0.05)
                start = time.monotonic()
                if again:
                    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        except KeyboardInterrupt:
            print("interrupted")
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


def _end_a_pool_in_a_fit(tmp_path: Path, again: bool) -> tuple[str, float]:
    """SCRIPT's output, and the seconds from its worker's first training step to the end of the sweep process
    (its interpreter's exit included), once the worker is gone; fails if the sweep outlives ``END_GRACE_S`` and a
    margin (then the sweep and its worker are killed here)."""
    script, marker = tmp_path / "sweep.py", tmp_path / "pid"
    script.write_text(SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(marker), "again" if again else "once"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not marker.exists() or not marker.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the worker's fit did not reach its first step: {proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    started, pid = time.monotonic(), int(marker.read_text())
    try:
        out, err = proc.communicate(timeout=workers.END_GRACE_S + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the sweep process waited for a worker in a Lightning fit")
    seconds = time.monotonic() - started
    assert proc.returncode == 0, err[-3000:]
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)
    return out, seconds


@pytest.mark.slow  # a Lightning fit in a forked worker, and the grace period
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the sweep forks its workers on Linux")
def test_the_pool_ends_a_worker_in_the_middle_of_a_lightning_fit_after_the_grace_period(tmp_path):
    out, seconds = _end_a_pool_in_a_fit(tmp_path, again=False)
    ended = float(out.split("ended in ")[1])
    assert workers.END_GRACE_S <= ended <= seconds  # SIGTERM was not enough: the worker was killed after the grace


@pytest.mark.slow  # a Lightning fit in a forked worker
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the sweep forks its workers on Linux")
def test_a_second_ctrl_c_during_the_grace_period_kills_the_workers_at_once(tmp_path):
    """Interrupted, the pool's end still ends its workers (the interpreter's exit would otherwise wait for them)."""
    out, _ = _end_a_pool_in_a_fit(tmp_path, again=True)
    assert "interrupted" in out
    assert float(out.split("ended in ")[1]) < workers.END_GRACE_S
