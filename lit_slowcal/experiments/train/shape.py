"""A run's shape: one object, built once per run, that every part of a run takes its K and M from.

The experiment settings say what a run is: the method, M machines, K local steps of b samples, on a
problem of N training samples, over P processes, evaluated every ``eval_every`` rounds, trained for
``trainer.limit_train_batches`` rounds of an epoch. Everything that follows from them is a field or a
property of ``RunShape``:

=================  ======================  ====================================
                   slowcal, local_sgd,     minibatch_sgd, accel_minibatch_sgd
                   scaffold, diloco
=================  ======================  ====================================
sync period        K                       1
per-step batch     b                       K * b
steps per round    K                       1
=================  ======================  ====================================

(the method's entry in ``lit_slowcal.experiments.train.methods`` says which, and only this module asks it),
R = ceil(N / (M * K * b)) rounds make one epoch for every method (``rounds``; ``trained_rounds`` under the
limit), each process hosts m = M / P machines (``machines_per_process``), and one training batch (one round)
has the shape ``(steps per round, m, per-step batch, features)`` (``batch_shape``).

Who owns what: this module computes every value above, and nothing else does.

- The training CLI (``lit_slowcal.experiments.run.cli``) builds one ``RunShape`` per run from its settings
  (``RunShape.of_settings``) once the problem is known, and hands it to the threads, the strategy
  (``sync_every``), the data module (``ProblemDataModule.use_shape``) and the model
  (``MachinesModel.use_shape``); while parsing, ``check_settings`` refuses a bad method, M, K or b.
- A data module built by hand takes its shape from its own arguments (``ProblemDataModule.shape``); a
  model built by hand without one hosts its M machines over the trainer's processes (``RunShape.of_machines``).
- The stacked engine and its grouping take each trial's shape from its parsed configuration
  (``RunShape.of_settings``), with the trial's problem's N.

Every divisibility and range check of these values is made here, once, each refused in one line naming the
field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from lit_slowcal._validation import check_int, is_int, is_number
from lit_slowcal.experiments.train.methods import get_method

__all__ = ["RunShape", "check_settings", "hosted_machines", "limited_rounds", "steps_between_syncs"]


def check_settings(method: Any, num_machines: Any, local_steps: Any, batch_size: Any) -> None:
    """Refuse, in one line, a method, M, K or b no run can have: the checks that need no problem (made while
    the command line is parsed, before the problem's N is known)."""
    _per_round(method, num_machines, local_steps, batch_size)


def steps_between_syncs(method: Any, num_machines: Any, local_steps: Any, batch_size: Any) -> int:
    """The optimizer steps between two synchronisations of ``method`` with M, K and b (``RunShape.sync_every``),
    known before the problem is."""
    return _per_round(method, num_machines, local_steps, batch_size)[2]


def _per_round(method: Any, num_machines: Any, local_steps: Any, batch_size: Any) -> tuple[int, int, int]:
    """``(steps per round, per-step batch, sync period)`` of ``method`` with M, K and b, as its registry
    entry maps K (the one place that asks it), after checking each value."""
    entry = get_method(method)
    check_int("num_machines", num_machines)
    check_int("batch_size", batch_size)
    return (
        entry.steps_per_round(local_steps),
        entry.per_step_batch(local_steps, batch_size),
        entry.sync_period(local_steps),
    )


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

    Build it from the experiment settings with ``RunShape.of(method, M, K, b, train_size=N, ...)``, from a
    parsed configuration with ``RunShape.of_settings``, or from a round's own values (a data module built by
    hand: its steps per round and per-step batch; ``RunShape.of_machines``: a model built by hand).

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
        steps, batch, sync = _per_round(method, num_machines, local_steps, batch_size)
        return cls(
            num_machines=num_machines,
            steps_per_round=steps,
            per_step_batch=batch,
            train_size=train_size,
            world_size=world_size,
            sync_every=sync,
            eval_every=eval_every,
            limit_train_batches=limit_train_batches,
        )

    @classmethod
    def of_settings(cls, settings: Any, *, train_size: int, world_size: int = 1) -> RunShape:
        """The shape of the run a parsed configuration describes (its ``fit`` section, as plain data or as the
        parser's namespace): its ``method``, ``num_machines``, ``local_steps``, ``batch_size``, ``eval_every``
        and ``trainer.limit_train_batches``, on a problem of ``train_size`` samples over ``world_size`` processes.

        The configuration's ``data.steps_per_round`` and ``data.batch_size`` (written by earlier versions, or
        given by hand) are the shape's: ``check_data_settings`` refuses them where they differ."""
        trainer = settings.get("trainer") or {}
        shape = cls.of(
            settings["method"], settings["num_machines"], settings["local_steps"], settings["batch_size"],
            train_size=train_size, world_size=world_size, eval_every=settings.get("eval_every", 1),
            limit_train_batches=trainer.get("limit_train_batches"),
        )  # fmt: skip
        data = settings.get("data") or {}
        shape.check_data_settings(data.get("steps_per_round"), data.get("batch_size"))
        return shape

    @classmethod
    def of_machines(cls, num_machines: int, world_size: int = 1) -> RunShape:
        """The shape of a run known only by its M machines over P processes: a model built by hand and trained
        on data that is not a ``ProblemDataModule`` (its rounds are its data's: one step here, one round)."""
        return cls(num_machines, 1, 1, train_size=num_machines, world_size=world_size)

    def check_data_settings(self, steps_per_round: Any, batch_size: Any, what: str = "data") -> None:
        """Refuse a data module's ``steps_per_round`` or ``batch_size`` other than this shape's (``None``: the
        shape's): in one line naming the field, the value and the shape's."""
        for name, value, own in (
            ("steps_per_round", steps_per_round, self.steps_per_round),
            ("batch_size", batch_size, self.per_step_batch),
        ):
            if value is not None and (not is_int(value) or value != own):
                raise ValueError(
                    f"Invalid {what}.{name}: {value!r} (the run's shape has {own}, from method, local_steps and "
                    f"batch_size; leave it unset or give {own})"
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
