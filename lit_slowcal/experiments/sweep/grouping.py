"""Which trials of a sweep stack (``--stack``), and in which groups: the plan of a stacked sweep (``plan_stacked``).

Trials that differ only in their learning rate, their seed and K (same method, M, b, data and model
options; K of a minibatch method is its per-step batch, so it stays in the group key there) form a
group, which trains as one vectorized program (``stacked.run_group``). What cannot be stacked runs one
trial at a time as before (``stackable`` says why): more than one epoch, several devices, a checkpoint
to resume from, another problem than MNIST (``data.problem``), ...

A group trains where its trials' single runs train (``trial_device``: the CPU, or the first CUDA device).
A group is split to fit the memory budget (``--stack-memory``, by default a quarter of this machine's
memory, at most 8 GiB; ``trial_bytes`` a trial), and with several workers the largest groups are halved
while that shortens the sweep (``balance_groups``, by ``group_cost``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lit_slowcal.experiments.train.shape import RunShape

__all__ = [
    "StackedTrial", "balance_groups", "default_memory_budget", "group_cost", "group_title", "group_trials",
    "plan_stacked", "stackable", "trial_bytes", "trial_device", "trial_problem", "trial_shape",
]  # fmt: skip

# Settings a group's trials may differ in: each trial's own learning rate and seed, and K (a local
# method's steps per round: every machine takes one step per b samples whatever K, so the trials of
# one epoch step together and each synchronises and evaluates on its own schedule).
_PER_TRIAL = (
    "seed_everything",
    "model.lr",
    "model.seed",
    "data.seed",
    "run_dir",
    "local_steps",
    "data.steps_per_round",
)


@dataclass
class StackedTrial:
    """One trial of a group: its sweep parameters, CLI arguments and parsed configuration (``fit``)."""

    params: dict[str, Any]
    args: list[str]
    config: dict[str, Any]
    identity: Optional[str] = None  # the identity digest of its run (checks.trial_identity_of)
    outcome: dict[str, Any] = field(default_factory=dict)  # as run_trial returns it, once the group ran
    final_state: dict[str, Any] = field(default_factory=dict)  # {"params": the trial's (M, ...) tensors}


def stackable(config: dict[str, Any]) -> Optional[str]:
    """``None`` when a trial of this configuration (the parsed ``fit`` section) can be stacked, else why not."""
    trainer = config.get("trainer") or {}
    if config.get("ckpt_path") is not None:
        return "it resumes from a checkpoint"
    if trainer.get("max_epochs") != 1:
        return f"trainer.max_epochs is {trainer.get('max_epochs')} (stacking runs one epoch)"
    if trainer.get("devices") not in (1, "1") or trainer.get("num_nodes", 1) != 1:
        return "it runs on several devices (stacking runs on one: trainer.devices=1)"
    device = trial_device(config)
    if device is None:
        return f"trainer.accelerator is {trainer.get('accelerator')!r} (stacking runs on cpu, or gpu / cuda with CUDA)"
    if trainer.get("precision") not in (None, 32, "32", "32-true"):
        return f"trainer.precision is {trainer.get('precision')!r} (stacking trains in float32: 32-true)"
    if trainer.get("strategy") != "periodic_averaging" or trainer.get("logger") not in (None, True):
        return "it sets its own strategy or logger"
    if trainer.get("max_steps", -1) != -1 or trainer.get("max_time") is not None:
        return "it sets trainer.max_steps or trainer.max_time"
    limit = trainer.get("limit_train_batches")
    if limit is not None and not (isinstance(limit, (int, float)) and (limit == 1.0 or float(limit).is_integer())):
        return f"trainer.limit_train_batches is {limit!r}"
    if (config.get("data") or {}).get("problem") is not None:
        return "data.problem is set (stacking trains the default problem, MNIST, only; use data.problem=null)"
    model = config.get("model") or {}
    if model.get("arch", "linear") != "linear":
        return f"model.arch is {model.get('arch')} (stacking trains the linear model only)"
    if config.get("participation") is not None:
        return "participation is set (stacking averages every machine every round)"
    if config.get("overlap_delay", 0) != 0 or config.get("fragments", 1) != 1:
        return "overlap_delay or fragments is set (stacking runs blocking rounds)"
    if config.get("state_every", 1) != 1:
        return "state_every is set (stacking averages the state every round)"
    if config.get("average_state") not in (None, "", []):
        return "average_state is set (stacking averages the method's own state only)"
    if config.get("method") == "diloco" or model.get("outer") not in (None, "none"):
        return "it takes a server step (diloco, model.outer; stacking takes the plain average)"
    return None


def trial_device(config: dict[str, Any]) -> Optional[torch.device]:
    """The device a trial's single run trains on, as Lightning picks it for ``trainer.accelerator`` and one
    device: the CPU, or the first CUDA device (``gpu``, ``cuda``, or ``auto`` where CUDA is available);
    ``None`` for another accelerator, or for gpu / cuda without CUDA (the single run then says why)."""
    accelerator = str((config.get("trainer") or {}).get("accelerator", "auto"))
    cuda = torch.cuda.is_available()
    if accelerator == "cpu" or (accelerator == "auto" and not cuda and not _mps()):
        return torch.device("cpu")
    if accelerator in ("gpu", "cuda", "auto") and cuda:
        return torch.device("cuda", 0)
    return None


def _mps() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def trial_problem(config: dict[str, Any]) -> Any:
    """The trial's problem, as its data module builds it (``data.problem``; ``None``: MNIST)."""
    from lit_slowcal.experiments.data.problems import MNIST

    problem = (config.get("data") or {}).get("problem")
    return MNIST() if problem is None else problem


def trial_shape(config: dict[str, Any]) -> RunShape:
    """The trial's ``RunShape`` (``RunShape.of_settings`` of its parsed configuration), on its problem's N, on
    one process (a stacked trial runs on one device)."""
    problem = trial_problem(config)
    train_size = problem.train_size(config["num_machines"], (config.get("data") or {}).get("seed", 1))
    return RunShape.of_settings(config, train_size=train_size)


def _group_key(config: dict[str, Any]) -> str:
    def strip(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out = {}
        for k, v in d.items():
            name = f"{prefix}{k}"
            if name in _PER_TRIAL or name == "config":
                continue
            out[k] = strip(v, f"{name}.") if isinstance(v, dict) else v
        return out

    # The per-step batch is the shape's (K * b for a minibatch method): trials of one group share it.
    key = {**strip(config), "per_step_batch": trial_shape(config).per_step_batch}
    return json.dumps(key, sort_keys=True, default=str)


def trial_bytes(config: dict[str, Any]) -> int:
    """Memory one stacked trial needs, in bytes (an estimate, on the safe side).

    Its parameters, gradients and up to four optimizer-state copies of them, its sample indices for
    the epoch, and its slice of one round's gathered samples (twice: the gather and the step).
    """
    shape = trial_shape(config)
    m, steps, b, rounds = shape.num_machines, shape.steps_per_round, shape.per_step_batch, shape.rounds
    problem = trial_problem(config)
    dim = problem.input_dim
    params = m * (dim + 1) * problem.num_outputs * 4
    return 6 * params + rounds * steps * m * b * 8 + 2 * steps * m * b * (dim * 4 + 8)


def default_memory_budget(device: Optional[torch.device] = None) -> int:
    """A quarter of this machine's memory (on a CUDA device: of the smaller of it and the device's), at most 8 GiB."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = 8 * 2**30
    if device is not None and device.type == "cuda":
        total = min(total, torch.cuda.get_device_properties(device).total_memory)
    return min(total // 4, 8 * 2**30)


def group_trials(trials: list[StackedTrial], budget: int) -> list[list[StackedTrial]]:
    """Trials grouped by everything but their learning rate, seed and K (``_PER_TRIAL``), in sweep order; groups larger
    than ``budget`` bytes (``trial_bytes`` each) are split into consecutive parts that fit (at least
    one trial each)."""
    groups: dict[str, list[StackedTrial]] = {}
    for t in trials:
        groups.setdefault(_group_key(t.config), []).append(t)
    out = []
    for members in groups.values():
        per = max(1, budget // max(1, trial_bytes(members[0].config)))
        out += [members[i : i + per] for i in range(0, len(members), per)]
    return out


def balance_groups(groups: list[list[StackedTrial]], workers: int) -> list[list[StackedTrial]]:
    """``groups`` with the largest halved (in sweep order) while that shortens the estimated time of ``workers``
    processes each taking the longest group left (``group_cost``; a half costs more than half a group: its
    steps' fixed cost is not shared); printed when it splits."""

    def makespan(parts: list[list[StackedTrial]]) -> float:
        ends = [0.0] * workers
        for cost in sorted(map(group_cost, parts), reverse=True):
            ends[ends.index(min(ends))] += cost
        return max(ends)

    parts = [list(g) for g in groups]
    while parts:
        big = max(range(len(parts)), key=lambda i: group_cost(parts[i]))
        if len(parts[big]) < 2:
            break
        g = parts[big]
        split = parts[:big] + [g[: len(g) // 2], g[len(g) // 2 :]] + parts[big + 1 :]
        if makespan(split) >= makespan(parts):
            break
        parts = split
    if len(parts) > len(groups):
        print(f"stacking: {len(groups)} groups split into {len(parts)} for {workers} workers", flush=True)
    return parts


def plan_stacked(
    trials: list[tuple[dict[str, Any], list[str], Any, Optional[str]]], budget: Optional[int]
) -> tuple[list[list[StackedTrial]], list[tuple[dict[str, Any], list[str]]]]:
    """The stackable trials in groups (printed: how many, the memory budget, why the others are not
    stacked), and the others (``(params, args)``) to run one at a time.

    Args:
        trials: ``(params, args, parsed, identity)`` of every trial to run, ``parsed`` being ``CommandLine.parse(args)``.
        budget: bytes a group may take (``trial_bytes`` per trial); ``None``: ``default_memory_budget()``.
    """
    stacked, alone, reasons = [], [], {}
    for params, args, parsed, identity in trials:
        config = parsed.get("fit").as_dict()
        why = stackable(config)
        if why is None:
            stacked.append(StackedTrial(params, list(args), config, identity))
        else:
            alone.append((params, list(args)))
            reasons[why] = reasons.get(why, 0) + 1
    if budget is None:
        budget = min(
            [default_memory_budget(d) for d in {trial_device(t.config) for t in stacked}] or [default_memory_budget()]
        )
    groups = group_trials(stacked, budget)
    print(
        f"stacking: {len(stacked)} trials in {len(groups)} groups (memory budget {budget / 2**20:.0f} MiB, "
        f"--stack-memory to set it); {len(alone)} run one at a time",
        flush=True,
    )
    for why, n in reasons.items():
        print(f"  {n} trials not stacked: {why}", flush=True)
    return groups, alone


def group_title(group: list[StackedTrial]) -> str:
    """``method=... M=... K=4,8 b=1: 15 trials stacked (about 12 MiB)``."""
    c = group[0].config
    size = len(group) * trial_bytes(c) / 2**20
    ks = ",".join(str(k) for k in sorted({t.config["local_steps"] for t in group}))
    return f"method={c['method']} M={c['num_machines']} K={ks} b={c['batch_size']}: {len(group)} trials stacked (about {size:.0f} MiB)"


#: An evaluation's cost in ``group_cost``'s units (a machine's step on a CPU): the test set and the training
#: objective, or the test set alone; timed against a step on MNIST on one CPU core.
EVALUATION_COST, TEST_COST = 2800, 900


def group_cost(group: list[StackedTrial]) -> float:
    """A group's relative running time, to start the longest first: its steps times (the machines they
    train + 40, a step's fixed cost in machines' worth of work on a CPU: a lone M = 16 trial of 3,750 steps
    takes 1.9 s, one of a group of 6 0.65 s), and its trials' evaluations (``EVALUATION_COST`` each; the small
    M and K have the most)."""
    c = group[0].config
    first = trial_shape(c)
    steps = first.train_size / (first.num_machines * first.per_step_batch)
    every = max(1, int(c.get("eval_every") or 1))
    evaluations = sum(-(-trial_shape(t.config).rounds // every) for t in group)
    return steps * (len(group) * first.num_machines + 40) + evaluations * (
        EVALUATION_COST if c.get("objective", True) else TEST_COST
    )
