"""Checks of user-given values, one line each: which field, the value, and what is allowed.

Shared by the core and the experiment app, so that every refusal reads the same:
``Invalid num_machines: 0 (must be an integer >= 1)``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

__all__ = ["check_int", "check_number", "is_int", "is_number"]


def is_int(value: Any) -> bool:
    """An integer (``int``, or another ``numbers.Integral`` such as numpy's) and not a ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number (``int``, ``float``, or another ``numbers.Real`` such as numpy's) and not a ``bool``."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` if it is an integer >= ``minimum``; else ``ValueError`` naming ``name``."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"Invalid {name}: {value!r} (must be an integer >= {minimum})")
    return int(value)


def check_number(
    name: str, value: Any, *, minimum: float = 0.0, strict: bool = True, maximum: Optional[float] = None
) -> float:
    """``value`` if it is a finite number > ``minimum`` (>= when not ``strict``) and <= ``maximum``."""
    low_ok = is_number(value) and math.isfinite(value) and (value > minimum if strict else value >= minimum)
    if not low_ok or (maximum is not None and value > maximum):
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        if maximum is not None:
            bound += f" and <= {maximum:g}"
        raise ValueError(f"Invalid {name}: {value!r} (must be a finite number {bound})")
    return value
