"""A run's shape: one object, computed once, that every part of a run takes its K and M from.

The experiment settings say what a run is: the method, M machines, K local steps of b samples, on a
problem of N training samples, over P processes. Everything that follows from them is a field or a
property of ``RunShape``:

=================  ======================  ====================================
                   slowcal, local_sgd,     minibatch_sgd, accel_minibatch_sgd
                   scaffold, diloco
=================  ======================  ====================================
sync period        K                       1
per-step batch     b                       K * b
steps per round    K                       1
=================  ======================  ====================================

(the method's entry in ``lit_slowcal.experiments.train.methods`` says which), R = ceil(N / (M * K * b))
rounds make one epoch for every method, each process hosts M / P machines, and one training batch
(one round) has the shape ``(steps per round, M / P, per-step batch, features)``. The CLI builds one
``RunShape`` and gives the strategy its ``sync_every`` and the data module the whole shape
(``ProblemDataModule.use_shape``), so the two cannot disagree; every divisibility and range check of
these values is made here, once, each refused in one line naming the field, the value and what is
allowed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Union

from lit_slowcal._validation import check_int, is_int, is_number
from lit_slowcal.experiments.train.methods import get_method

__all__ = ["RunShape", "hosted_machines", "limited_rounds", "per_step_batch", "steps_per_round"]


def steps_per_round(method: str, local_steps: int) -> int:
    """Optimizer steps between synchronisations: K for the local methods, 1 for the minibatch methods."""
    return get_method(method).steps_per_round(local_steps)


def per_step_batch(method: str, local_steps: int, batch_size: int) -> int:
    """Samples per machine per step: b, or K * b for the minibatch methods (same samples per round)."""
    return get_method(method).per_step_batch(local_steps, batch_size)


def limited_rounds(rounds: int, limit: Optional[Union[int, float]]) -> int:
    """The rounds of an epoch Lightning trains under ``trainer.limit_train_batches``: all of them for
    ``None`` or 1.0, ``min(rounds, limit)`` for a count, ``int(rounds * limit)`` for a fraction."""
    if limit is None or (isinstance(limit, float) and limit == 1.0):
        return rounds
    if not is_number(limit) or limit < 0:
        raise ValueError(f"Invalid trainer.limit_train_batches: {limit!r} (a count >= 0 or a fraction in [0, 1])")
    if isinstance(limit, float) and limit < 1.0:
        return int(rounds * limit)
    return min(rounds, int(limit))


def hosted_machines(num_machines: int, world_size: int) -> int:
    """m = M / P, the machines each of P processes hosts; the one check that P divides M."""
    if num_machines % world_size:
        raise ValueError(
            f"num_machines = {num_machines} is not divisible by the number of processes ({world_size} = "
            f"trainer.devices x trainer.num_nodes); every process hosts num_machines / processes machines. "
            f"Use a multiple of {world_size}."
        )
    return num_machines // world_size


@dataclass(frozen=True)
class RunShape:
    """The shape of a run, per round and per process (see the module docstring).

    Build it from the experiment settings with ``RunShape.of(method, M, K, b, train_size=N, ...)``, or
    from a round's own values (a data module built by hand: its steps per round and per-step batch).

    Attributes:
        num_machines: M, machines over all processes.
        steps_per_round: optimizer steps per round (one training batch).
        per_step_batch: samples per machine per step.
        train_size: N, the training samples one epoch covers (the problem's, ``Problem.train_size``).
        world_size: P, the processes; each hosts ``num_machines / world_size`` machines.
        sync_every: optimizer steps between synchronisations; ``None``: one per round. A round ends
            with exactly one synchronisation, so any other value than ``steps_per_round`` is refused.
        eval_every: rounds between evaluations (the last round is evaluated too).
        limit_train_batches: the trainer's limit on an epoch's rounds (``None``: all of them).
    """

    num_machines: int
    steps_per_round: int
    per_step_batch: int
    train_size: int
    world_size: int = 1
    sync_every: Optional[int] = None
    eval_every: int = 1
    limit_train_batches: Optional[Union[int, float]] = None

    def __post_init__(self) -> None:
        for name in ("num_machines", "steps_per_round", "per_step_batch", "train_size", "world_size", "eval_every"):
            check_int(name, getattr(self, name))
        if self.sync_every is None:
            object.__setattr__(self, "sync_every", self.steps_per_round)
        elif not is_int(self.sync_every) or self.sync_every != self.steps_per_round:
            raise ValueError(
                f"Invalid sync_every: {self.sync_every!r} (a round of {self.steps_per_round} steps ends with one "
                f"synchronisation: it must equal steps_per_round, {self.steps_per_round})"
            )
        hosted_machines(self.num_machines, self.world_size)
        limited_rounds(self.rounds, self.limit_train_batches)  # refuses a bad limit now

    @classmethod
    def of(
        cls,
        method: str,
        num_machines: int,
        local_steps: int,
        batch_size: int,
        *,
        train_size: int,
        world_size: int = 1,
        eval_every: int = 1,
        limit_train_batches: Optional[Union[int, float]] = None,
    ) -> RunShape:
        """The shape of a run of ``method`` with M, K and b, as its entry in the methods registry maps K."""
        entry = get_method(method)
        check_int("num_machines", num_machines)
        check_int("batch_size", batch_size)
        return cls(
            num_machines=num_machines,
            steps_per_round=entry.steps_per_round(local_steps),
            per_step_batch=entry.per_step_batch(local_steps, batch_size),
            train_size=train_size,
            world_size=world_size,
            sync_every=entry.sync_period(local_steps),
            eval_every=eval_every,
            limit_train_batches=limit_train_batches,
        )

    def on(self, world_size: int) -> RunShape:
        """The same run over ``world_size`` processes (checked again)."""
        return dataclasses.replace(self, world_size=world_size)

    @property
    def machines_per_process(self) -> int:
        """m = M / P, the machines each process hosts."""
        return hosted_machines(self.num_machines, self.world_size)

    @property
    def samples_per_round(self) -> int:
        """Samples one machine draws per round: K * b for every method."""
        return self.steps_per_round * self.per_step_batch

    @property
    def rounds(self) -> int:
        """R = ceil(N / (M * K * b)): the rounds of one epoch, for all machines to see N samples."""
        return math.ceil(self.train_size / (self.num_machines * self.samples_per_round))

    @property
    def trained_rounds(self) -> int:
        """The rounds of an epoch trained under ``limit_train_batches``."""
        return limited_rounds(self.rounds, self.limit_train_batches)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of one whole epoch: R rounds of ``steps_per_round`` steps."""
        return self.rounds * self.steps_per_round

    @property
    def val_check_interval(self) -> int:
        """Rounds between evaluations: ``eval_every``, at most one epoch (the last round is evaluated anyway)."""
        return min(self.eval_every, self.rounds)

    def batch_shape(self, features: Optional[int] = None) -> tuple[int, ...]:
        """One round's training batch on one process: ``(steps_per_round, m, per_step_batch[, features])``."""
        shape = (self.steps_per_round, self.machines_per_process, self.per_step_batch)
        return shape if features is None else (*shape, features)
