"""The sweep's output when its reader goes away (``sweep ... | head -1``): the sweep stops, quietly.

A Unix tool whose output's reader has ended is stopped by SIGPIPE at its next write, silently, with status
141 (128 + SIGPIPE). Python ignores SIGPIPE (a socket's closed peer must not kill it: W&B's, gloo's), so a
write raises ``BrokenPipeError`` instead, which a trial would record as its failure. While a sweep runs,
its standard output and error are ``guarded``: the first write that finds its reader gone sends what
follows to ``os.devnull`` and raises ``OutputClosed`` in the sweep's process, a ``BaseException`` that no
trial takes for its own failure; the sweep stops as after Ctrl-C (the trial it was running is not recorded,
those recorded before stay) and exits with 141 without a word. A worker process carries on silently, and
the sweep stops at its own next line.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["EXIT_STATUS", "OutputClosed", "guarded", "in_worker"]

#: The exit status of a sweep whose output's reader ended: as a process stopped by SIGPIPE reports it.
EXIT_STATUS = 128 + 13


class OutputClosed(BaseException):
    """The reader of the sweep's standard output (or error) has ended: the sweep stops (not a trial's failure)."""


_worker = False  # in a worker process: carry on silently


class _Guarded:
    """A text stream whose writes, once its reader is gone, go nowhere (and raise ``OutputClosed`` in the sweep)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._gone = False

    def _closed(self) -> None:
        self._gone = True
        with contextlib.suppress(OSError, ValueError, AttributeError):  # pytest's capture has no file descriptor
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())  # the buffered rest, and the interpreter's exit, write there
            os.close(devnull)
        if not _worker:
            raise OutputClosed

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._closed()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._closed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _guard(name: str) -> Any:
    stream = getattr(sys, name)
    if not isinstance(stream, _Guarded):
        setattr(sys, name, _Guarded(stream))
    return stream


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` guarded while the sweep runs (its forked workers inherit them), restored
    afterwards."""
    saved = {name: _guard(name) for name in ("stdout", "stderr")}
    try:
        yield
    finally:
        for name, stream in saved.items():
            setattr(sys, name, stream)


def in_worker() -> None:
    """In a worker process: guarded (a spawned one) and carrying on silently when the reader is gone."""
    global _worker
    _worker = True
    _guard("stdout"), _guard("stderr")
