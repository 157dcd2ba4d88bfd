"""What a synchronisation averages, as the averager reads it from its model, optimizer and options.

``AveragedTensors`` is ``PeriodicAverager``'s part that reads it: what the optimizer declares
(``lit_slowcal.protocol``; read once for a blocking round, ``_protocol_held``), the optimizer state keys averaged
(its declared ones and ``average_state``), the tensors (``_selection.averaged_tensors``), the outer optimizer's
parameters, and ``options.bucket_views`` with its default resolved.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

from torch import Tensor, nn
from torch.optim import Optimizer

from lit_slowcal import _selection, _server
from lit_slowcal._selection import Tensors
from lit_slowcal.options import AveragingOptions
from lit_slowcal.protocol import Declared, declared

__all__ = ["AveragedTensors"]


class AveragedTensors:
    """The averaged tensors and what decides them (mixed into ``PeriodicAverager``; see the module docstring)."""

    options: AveragingOptions
    modules: list[nn.Module]
    optimizer: Optimizer
    buffers: Optional[list[Tensor]]
    sharded: bool
    _simulated: bool

    def _init_protocol(self) -> None:
        """No blocking round under way: what the optimizer declares is read at each use."""
        self._round_protocol: Optional[Declared] = None  # what the optimizer declares, during a blocking round

    @contextmanager
    def _protocol_held(self) -> Iterator[None]:
        """A blocking round (``_sync``): what the optimizer declares, read once at its start, is what ``_declared``
        gives until it ends."""
        self._round_protocol = declared(self.optimizer)
        try:
            yield
        finally:
            self._round_protocol = None

    def _declared(self) -> Declared:
        """``declared(self.optimizer)``: what the optimizer declares, read once per blocking round (``_sync``)."""
        return self._round_protocol if self._round_protocol is not None else declared(self.optimizer)

    def _averaged_keys(self) -> tuple[str, ...]:
        """The optimizer state keys a synchronisation averages: the optimizer's declared ones and ``average_state``."""
        return tuple(dict.fromkeys((*self._declared().averaged_state, *self.options.average_state)))

    def _tensors(self, state: bool = True) -> Tensors:
        """The floating tensors to average (``_selection.averaged_tensors``): the parameters, the
        optimizer's declared state and ``average_state`` (unless ``state=False``), the buffers."""
        keys = self._averaged_keys() if state else ()
        return _selection.averaged_tensors(self.modules, self.optimizer, keys, self.buffers, self._simulated)

    def _outer_pairs(self, tensors: Optional[Tensors] = None) -> Tensors:
        """The optimizer's parameters, each with whether it is stacked (one slice per machine);
        ``tensors``: ``_tensors()`` where the caller has it already."""
        return _server.parameters(self.optimizer, self._tensors() if tensors is None else tensors)

    def _bucket_views(self) -> bool:
        """``options.bucket_views``, its default (``None``) resolved: on where the averaged tensors are the model's
        own (no optimizer state averaged: the buffer holds what ``model.state_dict()`` holds, so saving it writes
        nothing more) and every round is a blocking exact one; off where it is refused or where rounds are coded."""
        o = self.options
        if o.bucket_views is not None:
            return o.bucket_views
        blocking_exact = o.compressor is None and not o.overlap_delay and o.fragments == 1 and o.state_every == 1
        return blocking_exact and not self.sharded and not self._averaged_keys()
