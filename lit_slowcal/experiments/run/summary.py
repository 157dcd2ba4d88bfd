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
from lit_slowcal.experiments.train.rounds import modelled_wall
from lit_slowcal.experiments.train.shape import RunShape

__all__ = ["diagnostics_lines", "link_lines", "rounds_text", "summary_lines"]


def rounds_text(steps: int, syncs: int, shape: RunShape, fragments: int) -> str:
    """The summary's rounds after ``steps`` optimizer steps and ``syncs`` synchronisations (the averager's
    ``num_syncs``): ``rounds r/R``, the rounds of K steps trained and R, the rounds of an epoch; where the
    synchronisations are not these r, what they are: the scheduled rounds (F a round of K steps with
    ``fragments`` F, each of one fragment) and the syncs that closed a round early (an evaluation, a
    checkpoint, the end of training: the whole model), which add up to ``syncs``."""
    done = steps // shape.steps_per_round
    scheduled = steps // (shape.sync_every // fragments)
    closing = syncs - scheduled
    text = f"rounds {done}/{shape.rounds}"
    if fragments == 1 and closing == 0:
        return text
    what = f"{scheduled} fragment rounds (F={fragments} a round)" if fragments > 1 else f"{scheduled} scheduled"
    return f"{text}; {syncs} synchronisations: {what} + {closing} closing a round early"


def summary_lines(
    trainer: Trainer,
    get: Callable[..., Any],
    shape: RunShape,
    wall_time: float,
    partition_png: Optional[Any],
    wandb_offline: bool,
) -> list[str]:
    """The summary of a fit: ``get(key)`` its settings, ``shape`` its shape (K's steps per round, R)."""
    metrics = trainer.callback_metrics
    value = lambda k: float(metrics[k]) if k in metrics else math.nan
    counts = trainer.lightning_module.round_counts()
    lines = [
        "",
        "lit_slowcal summary",
        f"  method {get('method')}   M={get('num_machines')}  K={get('local_steps')}"
        f"  b={get('batch_size')}   {rounds_text(counts.steps, counts.syncs, shape, get('fragments'))}",
        f"  final test accuracy {value('test_acc'):.4f}   test loss {value('test_loss'):.4f}"
        + (f"   bits per character {value('test_bpc'):.4f}" if "test_bpc" in metrics else ""),
        *diagnostics_lines(trainer, value),
        f"  wall time {wall_time:.1f} s",
        *link_lines(trainer, get),
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


def _size(nbytes: float) -> str:
    """Bytes in decimal units: ``27.7 MB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _times(reference: float, ours: float) -> str:
    return f"{reference / ours:.1f}x" if ours > 0 else "inf x" if reference > 0 else "-"


def link_lines(trainer: Trainer, get: Callable[..., Any]) -> list[str]:
    """One line per ``--link``: what one machine sent on the ring, the modelled communication time, the modelled
    wall time (compute, given by ``--step_seconds`` or measured, plus communication) and DDP's, with the ratios."""
    model = trainer.lightning_module
    counts = model.round_counts()
    given = model.step_seconds
    step_seconds = given if given is not None else model.measured_step_seconds
    compute = counts.steps * step_seconds if math.isfinite(step_seconds) else math.nan
    source = "given" if given is not None else "measured"
    lines = [
        f"  communication, ring model (docs/library.md), per machine: {counts.syncs} synchronisations, compute "
        f"{compute:.2f} s ({source}: {step_seconds * 1e6:.1f} us a step x {counts.steps} steps)"
    ]
    for link in model.links:
        comm, ddp = counts.sent.seconds(link), counts.ddp.seconds(link)
        wall, ddp_wall = modelled_wall(counts, link, step_seconds) if math.isfinite(step_seconds) else (math.nan,) * 2
        lines.append(
            f"  {link}: sent {_size(counts.sent.ring_bytes)}, {comm:.3g} s; wall {wall:.3g} s | DDP: "
            f"{_size(counts.ddp.ring_bytes)}, {ddp:.3g} s; wall {ddp_wall:.3g} s | {_times(counts.ddp.ring_bytes, counts.sent.ring_bytes)} "
            f"fewer bytes, {_times(ddp, comm)} less communication, {_times(ddp_wall, wall)} less wall time"
        )
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
