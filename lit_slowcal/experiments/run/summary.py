"""The lines a fit prints when it ends: the run's settings and rounds, its final test metrics, the
training objective (f(x), the excess loss, f*, G_*), the wall time and where its logs are."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from lit_slowcal.experiments.measure.diagnostics import Diagnostics
from lit_slowcal.experiments.print_once import Note

__all__ = ["diagnostics_lines", "summary_lines"]


def summary_lines(
    trainer: Trainer,
    get: Callable[..., Any],
    rounds: int,
    wall_time: float,
    partition_png: Optional[Any],
    wandb_offline: bool,
) -> list[str]:
    """The summary of a fit: ``get(key)`` its settings, ``rounds`` its rounds per epoch."""
    metrics = trainer.callback_metrics
    value = lambda k: float(metrics[k]) if k in metrics else math.nan
    lines = [
        "",
        "lit_slowcal summary",
        f"  method {get('method')}   M={get('num_machines')}  K={get('local_steps')}"
        f"  b={get('batch_size')}   rounds {trainer.strategy.num_syncs}/{rounds}",
        f"  final test accuracy {value('test_acc'):.4f}   test loss {value('test_loss'):.4f}",
        *diagnostics_lines(trainer, value),
        f"  wall time {wall_time:.1f} s",
    ]
    csv = next((lg for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)
    if csv is not None:
        lines.append(f"  logs: {csv.log_dir}/metrics.csv")
    wandb = next((lg for lg in trainer.loggers if isinstance(lg, WandbLogger)), None)
    if wandb_offline and wandb is not None:
        lines.append(f"  W&B (offline): upload later with `wandb sync {wandb.save_dir}/wandb/offline-run-*`")
    if partition_png is not None:
        lines.append(f"  class distribution: {partition_png}")
    return lines


def diagnostics_lines(trainer: Trainer, get: Callable[[str], float]) -> list[str]:
    """The summary's lines on the objective: f(x), the excess loss, f*, G_* (or why there is none)."""
    found = next((c for c in trainer.callbacks if isinstance(c, Diagnostics)), None)
    if found is None or found.objective is None:
        return []
    line = f"  train objective {get('train_objective'):.6f}"
    if found.optimum is not None:
        line += f"   excess loss {get('excess_loss'):.4e}   f* {found.optimum.value:.6f}   G_* {found.g_star:.4f}"
    lines = [line]
    if found.note:
        lines.append(Note(f"  ({found.note})"))  # the same for every run: once per sweep
    return lines
