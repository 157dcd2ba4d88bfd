"""The results file of a sweep: finished trials, one JSON object a line.

Several sweeps may write one results file at once (``--results X.jsonl`` in two terminals): every
write happens under the file's lock (``lit_slowcal.files.locked``). A new trial's record is appended
whole, as one line in one ``write`` to the file opened with ``O_APPEND``; a trial run again
(``--retry-failed``) has its record replaced by rewriting the file atomically from a fresh read,
so the records other processes appended meanwhile stay. Reading takes no lock: a last line without
its newline is a record being appended at that moment (the kernel makes an append visible a page at
a time), read once it is whole. Nothing is lost or duplicated, a sweep
killed at any moment leaves a readable file, and running the same command again skips the trials
it holds (a trial is its parameter dict, see ``trial_key``). The file itself is only ever appended
to, except for those replacements (which keep its permission bits).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from lit_slowcal.experiments.sweep.trials import trial_key
from lit_slowcal.files import atomic_write, locked

__all__ = ["ResultsFile"]


class ResultsFile:
    """Finished trials, one JSON object a line, keyed by ``trial_key(record["params"])``.

    ``records`` is what the file held when last read (``refresh``, and every ``put``), the last
    record of a trial winning.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.records: dict[str, dict[str, Any]] = {}
        self.refresh()

    def refresh(self) -> None:
        """Read the file again: trials that other processes recorded since are seen as done."""
        records: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            with open(self.path) as f:
                for n, line in enumerate(f, 1):
                    if not line.endswith("\n"):  # the last line, being appended now (see the module's docstring)
                        break
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                        key = trial_key(record["params"])
                    except (json.JSONDecodeError, KeyError, TypeError) as err:
                        raise ValueError(f"{self.path}, line {n}: not a trial record ({err})") from None
                    records[key] = record
        self.records = records

    def get(self, params: dict[str, Any]) -> Optional[dict[str, Any]]:
        return self.records.get(trial_key(params))

    def put(self, record: dict[str, Any]) -> None:
        """Add a trial's record (append), or replace the one the file holds (atomic rewrite), under the lock."""
        key = trial_key(record["params"])
        line = json.dumps(record, allow_nan=False) + "\n"
        with locked(self.path):
            self.refresh()
            replace = key in self.records
            self.records[key] = record
            if replace:
                with atomic_write(self.path) as f:
                    for r in self.records.values():
                        f.write(json.dumps(r, allow_nan=False) + "\n")
                return
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                data, size = line.encode(), os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":  # no append is under way: we hold the lock
                    raise OSError(f"{self.path}: its last line is cut short (a write that did not end); remove that line and run again")
                written = os.write(fd, data)
                if written != len(data):  # a full disk: never leave half a record
                    os.ftruncate(fd, size)
                    raise OSError(f"{self.path}: wrote {written} of {len(data)} bytes of a record (disk full?)")
                os.fsync(fd)
            finally:
                os.close(fd)
