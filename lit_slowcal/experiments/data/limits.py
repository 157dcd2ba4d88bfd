"""Resource limits checked before training, each refused with the numbers.

``check_round_fits``: a round's samples (gathered as one ``(steps, m, b, 784)`` batch per process,
and the next one prefetched) must fit in the memory available now. ``check_shards_hold_a_batch``:
the per-step batch must not exceed every machine's shard of the split (each step would repeat
samples on every machine).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Optional

from torch import Tensor

__all__ = ["available_memory", "check_round_fits", "check_shards_hold_a_batch", "round_bytes"]

_GIB = 2**30


def available_memory() -> Optional[int]:
    """Bytes of memory available to new allocations: ``MemAvailable`` of ``/proc/meminfo`` (Linux), else
    free pages (``os.sysconf``); ``None`` where neither tells."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def round_bytes(machines: int, steps_per_round: int, batch_size: int, features: int) -> int:
    """Memory of one round's training batch: float32 samples, int64 labels and int64 sample indices,
    for ``machines`` machines, twice (the round trained and the next one, fetched ahead)."""
    samples = machines * steps_per_round * batch_size
    return 2 * samples * (4 * features + 8 + 8)


def _size(nbytes: int) -> str:
    """``150.3 GiB``, or ``1.5 MiB`` below a tenth of a GiB."""
    return f"{nbytes / _GIB:.1f} GiB" if nbytes >= _GIB / 10 else f"{nbytes / 2**20:.1f} MiB"


def check_round_fits(
    machines: int, steps_per_round: int, batch_size: int, features: int, available: Optional[int] = None
) -> None:
    """Refuse (``ValueError``) a round whose batch does not fit in the available memory.

    ``machines``: the machines hosted on this node (all its processes'), ``available``: bytes
    (default ``available_memory()``; unknown: no check).
    """
    available = available_memory() if available is None else available
    need = round_bytes(machines, steps_per_round, batch_size, features)
    if available is not None and need > available:
        per_step = available // round_bytes(machines, steps_per_round, 1, features)  # the largest batch that fits
        if per_step >= 1:
            advice = f"Use a batch_size of at most {per_step} per step, fewer machines or fewer local_steps."
        else:  # not even one sample per step: only fewer machines or steps help
            fit = available // round_bytes(1, steps_per_round, 1, features)
            advice = (
                f"Not even 1 sample per step fits: at most {fit} machines do with {steps_per_round} steps per round. "
                "Use fewer machines (or more nodes) or fewer local_steps, or free memory."
            )
        raise ValueError(
            f"A round does not fit in memory: {machines} machines x {steps_per_round} steps x {batch_size} samples "
            f"per step x {features} features need {_size(need)} (with the next round, fetched ahead), and "
            f"{_size(available)} are available. {advice}"
        )


def check_shards_hold_a_batch(shards: Sequence[Tensor], batch_size: int, split: str) -> None:
    """Refuse (``ValueError``) a per-step batch larger than every machine's shard of the split.

    Then no machine can draw one step's batch without repeating samples. A batch larger than only
    some shards is allowed: a skewed split gives some machines few samples (the paper's split at
    M = 64: 39 for the smallest), and their streams cycle their shard, as the paper's code does.
    """
    sizes = [len(s) for s in shards]
    largest = max(sizes)
    if batch_size > largest:
        raise ValueError(
            f"Invalid batch_size: each machine takes {batch_size} samples per step, more than any machine's shard "
            f"of the split ({split}) holds: {min(sizes)} to {largest} samples (machine {sizes.index(largest)}). Use "
            f"a per-step batch of at most {largest} (Minibatch-SGD's is local_steps x batch_size), or fewer machines."
        )
