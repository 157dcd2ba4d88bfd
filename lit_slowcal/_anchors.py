"""The anchors and error feedback of a coded round (``CompressedAverage``, ``CodedAverage``), kept by name.

Every averaged tensor has a name (``lit_slowcal._selection.names_of``: ``"param i"``, ``"param i w"``,
``"buffer j"``), the same for a tensor that takes its place (optimizer state loaded afresh). Per name
``Anchored`` keeps the tensor's spec (shape, dtype, stacking), its anchor (the value every machine held
after the last synchronisation, one machine's shape), ``errors`` (this process's machines' error
feedback, the tensor's own shape) and ``owner_errors`` (the second stage's, on the blocks this process
reduces, one machine's shape). A tensor is anchored while its name has an anchor of its spec: a round
codes those and averages the others exactly in the same round (``lit_slowcal._rounds.CodedRound``),
and ``anchor`` then gives every tensor its anchor. State that appears after ``broadcast()`` (SLowcal-SGD's
w, at the first step) is so averaged exactly once, the parameters coded from the first round on.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from torch import Tensor

from lit_slowcal._selection import Tensors

__all__ = ["STORES", "Anchored", "check_saved"]

#: The per-tensor stores of the saved state, besides the names and their specs.
STORES = ("anchors", "errors", "owner_errors")


class Anchored:
    """The anchors and error-feedback buffers of one averager, by tensor name (see the module docstring)."""

    def __init__(self, error_feedback: bool) -> None:
        self.error_feedback = error_feedback
        self.specs: dict[str, list[Any]] = {}  # name -> [shape, dtype, stacked]
        self.anchors: dict[str, Tensor] = {}  # the value every machine held after the last synchronisation
        self.errors: dict[str, Tensor] = {}  # this process's machines' error feedback
        self.owner_errors: dict[str, Tensor] = {}  # the second stage's, on the blocks this process reduces
        self._by_place: Optional[dict[str, Any]] = None  # a state saved by place, taken if its signature matches
        self._loaded = False  # a loaded state, not yet on the tensors' devices

    @staticmethod
    def spec(t: Tensor, stacked: bool) -> list[Any]:
        """A tensor's shape, dtype and stacking, as plain data."""
        return [list(t.shape), str(t.dtype), bool(stacked)]

    @classmethod
    def signature_of(cls, tensors: Tensors) -> list[Any]:
        """Every tensor's ``spec``."""
        return [cls.spec(t, s) for t, s in tensors]

    def anchored(self, tensors: Tensors, names: list[str]) -> list[bool]:
        """Whether each tensor has an anchor of its shape, dtype and stacking (a loaded state taken first)."""
        self._take_loaded(tensors, names)
        return [n in self.anchors and self.specs.get(n) == self.spec(t, s) for (t, s), n in zip(tensors, names)]

    def anchor(self, tensors: Tensors, names: list[str], missing_only: bool = False, only: bool = False) -> None:
        """Every tensor's current value (machine 0's slice of a stacked one) becomes its anchor (``missing_only``:
        of the tensors without one); the error feedback starts afresh where a tensor changed its spec; names no
        longer averaged are dropped, unless ``only`` (a round of some of them: the others' stay as they are).
        Only where every machine holds the same values."""
        had = self.anchored(tensors, names)
        specs: dict[str, list[Any]] = dict(self.specs) if only else {}
        anchors: dict[str, Tensor] = dict(self.anchors) if only else {}
        for (t, s), n, kept in zip(tensors, names, had):
            value = (t[0] if s else t).detach()
            specs[n] = self.spec(t, s)
            if kept:
                anchors[n] = self.anchors[n]
                if not missing_only:
                    anchors[n].copy_(value)
            else:
                anchors[n] = value.clone()
                self.errors.pop(n, None)
                self.owner_errors.pop(n, None)
        self.specs, self.anchors = specs, anchors
        self.errors = {n: e for n, e in self.errors.items() if n in specs}
        self.owner_errors = {n: e for n, e in self.owner_errors.items() if n in specs}

    def state_dict(self) -> dict[str, Any]:
        """The names, their specs (``signature``), anchors and buffers, one entry per name (``None``: none)."""
        names = list(self.specs)
        state: dict[str, Any] = {"names": names, "signature": [self.specs[n] for n in names]}
        for key in STORES:
            store = getattr(self, key)
            state[key] = [store.get(n) for n in names]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take ``state_dict()``'s (checked by ``lit_slowcal._averager_state``). A state saved by place (without
        ``names``) is taken at the next round if the tensors then have its signature, else dropped (an exact round)."""
        self.specs, self.anchors, self.errors, self.owner_errors = {}, {}, {}, {}
        self._by_place = None
        if state.get("names") is None:
            self._by_place = state
        else:
            self._fill(state["names"], state)
        self._loaded = True

    def _fill(self, names: list[str], state: dict[str, Any]) -> None:
        for i, n in enumerate(names):
            self.specs[n] = state["signature"][i]
            for key in STORES:
                values = state.get(key) or []
                if i < len(values) and values[i] is not None:
                    getattr(self, key)[n] = values[i].detach().clone()

    def _take_loaded(self, tensors: Tensors, names: list[str]) -> None:
        """A state saved by place given its names; a loaded state's tensors onto the tensors' devices (once)."""
        if self._by_place is not None:
            saved, self._by_place = self._by_place, None
            if saved.get("signature") is not None and saved["signature"] == self.signature_of(tensors):
                self._fill(names, saved)
        if self._loaded:
            self._loaded = False
            devices = {n: t.device for (t, _), n in zip(tensors, names)}
            for key in STORES:
                store = getattr(self, key)
                for n, value in store.items():
                    if n in devices:
                        store[n] = value.to(devices[n])


def check_saved(state: dict[str, Any]) -> None:
    """One line naming the first entry of a saved ``Anchored.state_dict()`` that is missing or of the wrong type."""
    signature, names = state.get("signature"), state.get("names")
    problem = None
    if signature is not None and not isinstance(signature, list):
        problem = f"'signature' is {type(signature).__name__} (a list, or None)"
    elif names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        problem = "'names' is not a list of str"
    elif names is not None and (signature is None or len(signature) != len(names)):
        problem = f"'signature' has {None if signature is None else len(signature)} entries for {len(names)} names"
    for key in STORES:
        values = state.get(key, [])
        if problem is None and not (
            isinstance(values, list) and all(v is None or isinstance(v, Tensor) for v in values)
        ):
            problem = f"{key!r} is not a list of tensors or None"
    if problem is None and signature is not None:
        problem = _wrong_size(state, signature)
    if problem is not None:
        raise ValueError(f"Cannot load the averager's state: its 'compression' part is damaged: {problem}")


def _wrong_size(state: dict[str, Any], signature: list[Any]) -> Optional[str]:
    """The first entry whose values do not fit its tensor's spec (anchors and owner errors: one machine's values;
    errors: every machine's), or a spec that is not ``[shape, dtype, stacked]``."""
    for i, spec in enumerate(signature):
        if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], list)):
            return f"signature entry {i} is {spec!r} (shape, dtype, stacked)"
        full = math.prod(spec[0])
        one = math.prod(spec[0][1:]) if spec[2] else full
        for key, size in (("anchors", one), ("errors", full), ("owner_errors", one)):
            values = state.get(key) or []
            if i < len(values) and values[i] is not None and values[i].numel() != size:
                return (
                    f"{key} entry {i} holds {values[i].numel()} values for a tensor of shape {tuple(spec[0])} ({size})"
                )
    return None
