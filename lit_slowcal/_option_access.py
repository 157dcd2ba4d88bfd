"""How the averager and the strategies hold their ``AveragingOptions``: read freely, changed only where it is safe.

``HoldsOptions`` is mixed into ``PeriodicAverager`` and the strategies' ``AveragerSet``. ``options`` is a
property: before anything is built from it (a strategy before ``fit`` builds its averagers) any valid
``AveragingOptions`` may replace it; once built (an averager's engine, a strategy's running averagers) only
``sync_every`` may change, every other field is refused in one line naming it. An option set as an
attribute (``averager.compression = "int8"``) is refused too: it would do nothing. ``refuse_unknown``
gives a misspelt keyword of a strategy one line, instead of letting it reach a wrapper that is never built.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from typing import Any

from lit_slowcal.options import OPTION_NAMES, AveragingOptions

__all__ = ["HoldsOptions", "refuse_unknown"]

#: The options that live in ``options`` only (``sync_every`` stays settable): refused as attributes.
_OPTIONS_NOT_K = frozenset(OPTION_NAMES) - {"sync_every"}


class HoldsOptions:
    """``options`` and ``sync_every`` as properties (see the module docstring)."""

    _options: AveragingOptions

    def _options_built(self) -> bool:
        """Whether something was built from the options already (then only K may change)."""
        return True

    def _sync_every_changed(self, value: int) -> None:
        """K changed (``sync_every`` or ``options`` set): what was built from it follows."""

    @property
    def options(self) -> AveragingOptions:
        """Every synchronisation option (``lit_slowcal.options.AveragingOptions``)."""
        return self._options

    @options.setter
    def options(self, value: AveragingOptions) -> None:
        if not isinstance(value, AveragingOptions):
            raise TypeError(f"Invalid options: {value!r} (an AveragingOptions)")
        held = getattr(self, "_options", None)
        if held is not None and self._options_built():
            field = lambda n: "compressor" if n == "compression" else n  # noqa: E731 (a code compared as the code)
            changed = [n for n in _OPTIONS_NOT_K if getattr(value, field(n)) != getattr(held, field(n))]
            if changed:
                name = sorted(changed)[0]
                raise AttributeError(
                    f"Invalid options: {name}={getattr(value, name)!r} (it is {getattr(held, name)!r}, fixed once "
                    f"{type(self).__name__} built its rounds; only sync_every may change now: build anew with it)"
                )
            value = held.with_sync_every(value.sync_every)  # one line naming sync_every where tau or F forbid it
        object.__setattr__(self, "_options", value)
        if held is not None and value.sync_every != held.sync_every:
            self._sync_every_changed(value.sync_every)

    @property
    def sync_every(self) -> int:
        """K, optimizer steps between synchronisations (``options.sync_every``); settable mid-run."""
        return self._options.sync_every

    @sync_every.setter
    def sync_every(self, value: int) -> None:
        self.options = self._options.with_sync_every(value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OPTIONS_NOT_K:  # an option lives in ``options`` only: never set silently
            raise AttributeError(
                f"{type(self).__name__}.{name} is an option, fixed when it was built: give {name}= to its "
                "constructor (only sync_every changes afterwards)"
            )
        super().__setattr__(name, value)


def refuse_unknown(owner: str, kwargs: dict[str, Any], *bases: Callable[..., Any]) -> None:
    """One ``TypeError`` line for a keyword in ``kwargs`` that is not a parameter of one of ``bases`` (the Lightning
    strategy's ``__init__``, and the wrapper's that it would pass the rest to: LightningCLI gives every one of
    those with its default), naming the nearest option or parameter."""
    accepted = [
        n for base in bases for n, p in inspect.signature(base).parameters.items()
        if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]  # fmt: skip
    unknown = [name for name in kwargs if name not in accepted]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, [*OPTION_NAMES, "options", *accepted], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TypeError(
            f"{owner}() got an unexpected keyword argument {name!r} ({hint}an option of AveragingOptions, or one of "
            f"{', '.join(accepted[: len(inspect.signature(bases[0]).parameters) - 2])})"
        )
