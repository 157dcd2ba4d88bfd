"""Notes: lines that say the same for every run of a sweep, printed once per sweep (``note``, ``once_per_sweep``).

A run says such a line with ``note(line)`` (the logger ``lit_slowcal.experiments.print_once``, printed on stdout
as ``print`` would): why there is no excess loss, the optimum of its split read from the cache (the same for
every run of that split), the threads it trains with; its summary restates the first
(a ``Note`` among its lines, left out in a sweep: ``say_lines``). Lightning says its own through
its loggers (``_lightning.LIGHTNING_INFO_LOGGERS``: the accelerators available, the litlogger tip, ``fit``
stopped at ``max_epochs``). A run alone prints them all, as it always did.

A sweep runs many: inside ``once_per_sweep()`` a filter on those loggers passes each message the first time
(by logger, level and text) and drops it after. A worker process of the sweep (``in_worker``) prints none:
it keeps them and its unit returns them (``kept``) with the trials' outcomes, and the sweep says them again
through the same loggers (``say_again``), where the filter passes the new ones. Its Python warnings come back
the same way (``record_warnings``) and go through the sweep's warning filters, which show each once. A line
that differs between trials (a trial's result, its error, a solve of an optimum) is printed as it comes.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from typing import Any, Optional

from lit_slowcal.experiments._lightning import LIGHTNING_INFO_LOGGERS

__all__ = ["Kept", "Note", "in_worker", "kept", "note", "once_per_sweep", "record_warnings", "say_again", "say_lines"]

NOTES = logging.getLogger(__name__)

Kept = list[tuple[str, Any]]  # ("log", (logger, level, text)) or ("warning", (text, category, filename, lineno))


class _Stdout(logging.Handler):
    """Each note on ``sys.stdout`` as it is at the time (a redirect, pytest's capture), as ``print`` prints it."""

    def emit(self, record: logging.LogRecord) -> None:
        print(record.getMessage(), flush=True)


_once: Optional[_Once] = None  # the filter of the sweep in progress (in its workers: their copy, or their own)
_warnings_seen: dict[Any, Any] = {}  # the sweep's registry of the warnings its workers sent back

NOTES.addHandler(_Stdout())
NOTES.setLevel(logging.INFO)
NOTES.propagate = False  # printed here only: a root handler (basicConfig) would print it twice


def note(line: str) -> None:
    """Say ``line``, the same for every run of a sweep (printed once per sweep; a run alone prints it)."""
    NOTES.info(line)


class Note(str):
    """A line among others (``say_lines``) that restates a note: a summary's line on why there is no excess loss."""


def say_lines(lines: list[str]) -> None:
    """``lines`` printed in order; a ``Note`` among them only in a run alone (a sweep says the note once)."""
    for line in lines:
        if _once is None or not isinstance(line, Note):
            print(line, flush=True)


class _Once(logging.Filter):
    """Passes each message (logger, level, text) the first time; in a worker (``keep`` a list), none: it
    keeps them for the sweep."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, int, str]] = set()
        self.keep: Optional[Kept] = None

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        if self.keep is not None:
            self.keep.append(("log", key))
            return False
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def _loggers() -> list[logging.Logger]:
    return [NOTES, *map(logging.getLogger, LIGHTNING_INFO_LOGGERS)]


@contextlib.contextmanager
def once_per_sweep() -> Iterator[None]:
    """Within it, each note and Lightning info line is printed once (``in_worker``: not at all, kept)."""
    global _once
    _once, before = _Once(), _once
    for logger in _loggers():
        logger.addFilter(_once)
    try:
        yield
    finally:
        for logger in _loggers():
            logger.removeFilter(_once)
        _once = before
        _warnings_seen.clear()


def in_worker() -> None:
    """In a worker process of the sweep: keep the notes (for ``kept``) instead of printing them. A forked worker
    has the sweep's filter already; a spawned one gets its own."""
    global _once
    if _once is None:
        _once = _Once()
        for logger in _loggers():
            logger.addFilter(_once)
    _once.keep = []


def kept() -> Kept:
    """The notes kept since the last call (in a worker; elsewhere none), to send to the sweep."""
    if _once is None or _once.keep is None:
        return []
    out, _once.keep = _once.keep, []
    return out


@contextlib.contextmanager
def record_warnings() -> Iterator[Kept]:
    """In a worker: the Python warnings raised within, kept (``("warning", ...)``) instead of shown; elsewhere
    they are shown as usual (the process's own registry shows each once)."""
    if _once is None or _once.keep is None:
        yield []
        return
    out: Kept = []
    with warnings.catch_warnings(record=True) as caught:
        try:
            yield out
        finally:
            out += [("warning", (str(w.message), w.category, w.filename, w.lineno)) for w in caught]


def say_again(notes: Kept) -> None:
    """Notes a worker kept, said here (in the sweep) through the same loggers and the warnings' filters: the
    ones not printed yet in this sweep are printed."""
    for kind, value in notes:
        if kind == "log":
            name, level, text = value
            logging.getLogger(name).log(level, text)
        else:
            text, category, filename, lineno = value
            warnings.warn_explicit(text, category, filename, lineno, registry=_warnings_seen)
