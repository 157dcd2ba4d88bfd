"""Shared by the tests that start the CLI in a subprocess."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Rendezvous variables that in-process trainers of other tests leave in os.environ; a subprocess
# inheriting them would join a process group that no longer exists.
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def subprocess_env(**extra: str) -> dict[str, str]:
    """os.environ for a clean launch: no rendezvous, W&B or test-hook variables, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCH_VARS and not k.startswith(("WANDB_", "LIT_SLOWCAL_")) and k not in ("KILL", "FAIL")
    }
    env.update(extra)
    return env


class Batches:
    """An iterable of ready batches (a list would be read as several dataloaders)."""

    def __init__(self, batches):
        self.batches = list(batches)

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)
