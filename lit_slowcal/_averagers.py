"""What the Trainer and Fabric strategies share: one ``PeriodicAverager`` per optimizer.

``AveragerSet`` is a mixin of the three strategies. It keeps the options every averager is built with
(one ``AveragingOptions``), the averagers by optimizer, each buffer given to one of them (``buffer_owners``), and the operations on
all of them: K changed mid-run, the round closed, the schedules saved and restored, the counts read
(floats, bytes, the ring model's ``LinkCounts`` and the DDP reference).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

from torch import Tensor, nn
from torch.optim import Optimizer

from lit_slowcal._option_access import HoldsOptions
from lit_slowcal.averaging import PeriodicAverager, buffer_owners
from lit_slowcal.link import LinkCounts
from lit_slowcal.options import AveragingOptions

__all__ = ["CHECKPOINT_KEY", "AveragerSet"]

#: Where a checkpoint holds the averagers' states (the schedule, every process's per-machine optimizer
#: state): a list, one per optimizer in the strategy's order.
CHECKPOINT_KEY = "periodic_averaging"


class AveragerSet(HoldsOptions):
    """One ``PeriodicAverager`` per optimizer, built alike (mixed into the strategies)."""

    #: What a rank whose count fell behind should do (``PeriodicAverager.skip_advice``).
    skip_advice = "call optimizer.step() in every iteration on every rank"

    def _init_averagers(self, options: AveragingOptions) -> None:
        # Every averager's options: replaced freely until fit builds the averagers, then only K (``HoldsOptions``).
        self.options = options
        self.averagers: dict[int, PeriodicAverager] = {}  # id(torch optimizer) -> its averager

    def _options_built(self) -> bool:
        return bool(getattr(self, "averagers", None))

    def _sync_every_changed(self, value: int) -> None:
        """K set mid-run (``strategy.sync_every = 16``): the running averagers take it too."""
        for averager in self.averagers.values():
            averager.sync_every = value

    @property
    def num_syncs(self) -> int:
        """Synchronisations so far (of the first optimizer)."""
        return next(iter(self.averagers.values())).num_syncs if self.averagers else 0

    @property
    def floats_communicated(self) -> Union[int, float]:
        """Floats one machine has sent so far (all optimizers' averagers)."""
        return sum(a.floats_communicated for a in self.averagers.values())

    @property
    def bytes_communicated(self) -> Union[int, float]:
        """Bytes one machine has sent so far, in the dtypes sent (all optimizers' averagers)."""
        return sum(a.bytes_communicated for a in self.averagers.values())

    @property
    def link_counts(self) -> LinkCounts:
        """What one participating machine has sent so far, for the ring model (all optimizers' averagers)."""
        return sum((a.link_counts for a in self.averagers.values()), LinkCounts())

    @property
    def overlapped_counts(self) -> LinkCounts:
        """The part of ``link_counts`` sent by overlapped rounds (``PeriodicAverager.overlapped_counts``)."""
        return sum((a.overlapped_counts for a in self.averagers.values()), LinkCounts())

    @property
    def short_rounds(self) -> dict[int, int]:
        """The overlapped rounds closed before their tau steps, by steps in flight (``PeriodicAverager.short_rounds``)."""
        out: dict[int, int] = {}
        for averager in self.averagers.values():
            for steps, rounds in averager.short_rounds.items():
                out[steps] = out.get(steps, 0) + rounds
        return out

    def ddp_counts(self) -> LinkCounts:
        """What DDP would have sent over the same optimizer steps (all optimizers' averagers)."""
        return sum((a.ddp_counts() for a in self.averagers.values()), LinkCounts())

    def close_rounds(self) -> bool:
        """Close every optimizer's round (``PeriodicAverager.close_round``): a synchronisation where a
        step was taken since the last one. Call it before evaluating or returning the model mid-round
        (the strategies do at their boundaries). Returns whether any synchronised."""
        return any([averager.close_round() for averager in self.averagers.values()])

    def _new_averager(
        self, modules: Any, optimizer: Optimizer, buffers: Optional[list[Tensor]] = None
    ) -> PeriodicAverager:
        averager = PeriodicAverager(
            modules, optimizer, options=self.options, process_group=self._averaging_group(), buffers=buffers
        )
        averager.skip_advice = self.skip_advice
        return averager

    def _averaging_group(self) -> Optional[Any]:
        """The processes the averagers average over (``PeriodicAverager``'s ``process_group``): ``None``, all of
        them; a sharded strategy's replicate group."""
        return None

    def _add_averagers(
        self, root: nn.Module, modules: Any, optimizers: Sequence[Optimizer], restored: Optional[list[dict]] = None
    ) -> list[PeriodicAverager]:
        """An averager for each of ``optimizers`` that has none, each buffer of ``root`` given to one of
        them, each schedule restored from ``restored`` (by position) where given. Returns the new averagers."""
        owners = buffer_owners(root, optimizers) if len(optimizers) > 1 else None
        added = []
        for i, optimizer in enumerate(optimizers):
            if id(optimizer) in self.averagers:
                continue
            averager = self.averagers[id(optimizer)] = self._new_averager(
                modules, optimizer, owners[i] if owners else None
            )
            added.append(averager)
            if restored is not None and i < len(restored):
                averager.load_state_dict(restored[i])
        return added

    def _drop_averagers(self) -> None:
        for averager in self.averagers.values():
            averager.remove_hooks()
        self.averagers = {}

    def _schedules(self, optimizers: Sequence[Optimizer]) -> Optional[list[dict[str, Any]]]:
        """Every optimizer's averager state, in order, with every process's per-machine optimizer state
        (``PeriodicAverager.gather_state_dict``: a collective, called on every rank as the strategies'
        saves are): what a checkpoint holds, on rank 0; ``None`` before all have averagers, and on the
        other ranks."""
        if not optimizers or not all(id(o) in self.averagers for o in optimizers):
            return None
        states = [self.averagers[id(o)].gather_state_dict() for o in optimizers]
        return None if any(state is None for state in states) else states  # type: ignore[return-value]
