"""The results file of a sweep: finished trials, one JSON object a line.

Several sweeps may write one results file at once (``--results X.jsonl`` in two terminals): every
write happens under the file's lock (``lit_slowcal.files.locked``). A new trial's record is appended
whole, as one line in one ``write`` to the file opened with ``O_APPEND``; a trial run again
(``--retry-failed``) has its record replaced by rewriting the file atomically from a fresh read,
so the records other processes appended meanwhile stay. Reading takes no lock: a last line without
its newline is a record being appended at that moment (the kernel makes an append visible a page at
a time), read once it is whole. Nothing is lost or duplicated, a sweep
killed at any moment leaves a readable file, and running the same command again skips the trials
it holds. A trial is its parameter dict and the identity of the run it made (``record_key``: the
digest of everything that defines the run, the sweep's fixed command and config included): a record
of another identity (the same parameters with another command) is kept, and never taken for this
trial's. A record written before identities were stored gets one from its ``args`` (``identify``).
A file holds one record per trial; two records of one trial (files concatenated, as when merging two
machines' results) count once where their values (status and metrics) are the same, and are refused,
naming both lines, where they differ (``same_values``): the sweep, ``tune`` and ``report`` read a file alike.
The file itself is only ever appended to, except for those replacements (which keep its permission
bits). A results path that is a symbolic link is followed: the file it points to is the one updated.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from lit_slowcal.experiments.sweep.trials import record_key, trial_key
from lit_slowcal.files import atomic_write, locked

__all__ = ["MAX_DEPTH", "ResultsFile", "check_record", "duplicate_error", "parse_line", "read_record", "same_values"]


#: The statuses a record may have.
STATUSES = ("finished", "diverged", "failed")
#: How deeply a record's values may nest (lists and objects in lists and objects): a trial's parameters are a
#: few levels deep at most.
MAX_DEPTH = 32
#: How close (relative) two records' metrics of one trial must be to say the same: the stacked and the lone run
#: of a trial agree within 1e-12 (the exactness contract), two CPUs' float sums about as closely.
SAME_METRICS = 1e-9


def _depth(value: Any) -> int:
    """How deeply ``value`` nests (0 for a number or a string), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d + 1 > MAX_DEPTH:
                return d + 1
            deepest = max(deepest, d + 1)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def parse_line(line: bytes) -> Any:
    """A results line's JSON value.

    Raises:
        ValueError: what is wrong with it (not text, not JSON, nested too deeply), without the file and line.
    """
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON ({err})") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"not text ({err})") from None
    except RecursionError:
        raise ValueError(f"not a trial record: nested too deeply (at most {MAX_DEPTH} levels)") from None


def same_values(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two records of one trial say the same: the same status and metrics, each within ``SAME_METRICS``
    relative (their run folder, time and error text may differ: the same trial stacked and alone, or run on two
    machines)."""
    ma, mb = a.get("metrics", {}), b.get("metrics", {})
    if a["status"] != b["status"] or ma.keys() != mb.keys():
        return False
    return all(
        x == y or (x is not None and y is not None and math.isclose(x, y, rel_tol=SAME_METRICS))
        for x, y in ((ma[k], mb[k]) for k in ma)
    )


def duplicate_error(path: Any, record: dict[str, Any], first: int, second: int) -> ValueError:
    """The refusal of two records of one trial that differ in status or metrics (lines ``first`` and ``second``)."""
    identity = f", identity {record['identity']}" if record.get("identity") else ""
    return ValueError(
        f"{path}, lines {first} and {second}: two records of one trial ({trial_key(record['params'])}{identity}) with "
        "different status or metrics; keep the one to count and remove the other"
    )


def read_record(line: bytes, path: Any, n: int) -> dict[str, Any]:
    """Line ``n`` of the results file ``path``, parsed and checked to be a whole trial record.

    Raises:
        ValueError: naming the file and the line that is not JSON or not a trial record.
    """
    try:
        record = parse_line(line)
    except ValueError as err:
        raise ValueError(f"{path}, line {n}: {err}; remove or repair that line") from None
    wrong = check_record(record)
    if wrong is not None:
        raise ValueError(f"{path}, line {n}: not a trial record: {wrong}; remove or repair that line")
    return record


def check_record(record: Any) -> Optional[str]:
    """``None`` when ``record`` is a whole trial record as a sweep writes it, else what is wrong with it."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    if _depth(record) > MAX_DEPTH:
        return f"nested more than {MAX_DEPTH} levels deep"
    if not isinstance(record.get("params"), dict):
        return f"'params' is {record.get('params')!r}, expected an object of the swept parameters"
    if record.get("status") not in STATUSES:
        return f"'status' is {record.get('status')!r}, expected one of {', '.join(STATUSES)}"
    metrics = record.get("metrics", {})
    if not isinstance(metrics, dict):
        return f"'metrics' is {metrics!r}, expected an object of numbers"
    for name, value in metrics.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"metric {name!r} is {value!r}, expected a number or null"
    for name in ("identity", "error", "run_dir", "ended_at"):
        if record.get(name) is not None and not isinstance(record[name], str):
            return f"{name!r} is {record[name]!r}, expected a string or null"
    wall = record.get("wall_time_s")
    if wall is not None and (isinstance(wall, bool) or not isinstance(wall, (int, float))):
        return f"'wall_time_s' is {wall!r}, expected a number or null"
    if "args" in record and not (isinstance(record["args"], list) and all(isinstance(a, str) for a in record["args"])):
        return f"'args' is {record['args']!r}, expected a list of strings"
    return None


class ResultsFile:
    """Finished trials, one JSON object a line, keyed by ``record_key(record["params"], identity)``.

    ``records`` is what the file held when last read (``refresh``, and every ``put``): one record a trial (two
    records of one trial with the same values count once, with different ones are refused: ``same_values``).
    ``identify(record)`` gives the identity of a record that stores none
    (written before identities were stored; ``None``: unknown, it matches no trial that has one).
    """

    def __init__(self, path: str | Path, identify: Optional[Callable[[dict[str, Any]], Optional[str]]] = None) -> None:
        path = Path(path)
        # A symbolic link is followed, so that a rewrite (atomic_write) replaces the file it points to.
        self.path = path.resolve() if path.is_symlink() else path
        self.identify = identify
        self.records: dict[str, dict[str, Any]] = {}
        self.refresh()

    def _identity(self, record: dict[str, Any]) -> Optional[str]:
        if "identity" in record or self.identify is None:
            return record.get("identity")
        return self.identify(record)

    def refresh(self) -> None:
        """Read the file again: trials that other processes recorded since are seen as done."""
        records: dict[str, dict[str, Any]] = {}
        lines: dict[str, int] = {}
        if self.path.exists():
            with open(self.path, "rb") as f:
                for n, line in enumerate(f, 1):
                    if not line.endswith(b"\n"):  # the last line, being appended now (see the module's docstring)
                        break
                    if not line.strip():
                        continue
                    record = read_record(line, self.path, n)
                    key = record_key(record["params"], self._identity(record))
                    if key in records and not same_values(records[key], record):
                        raise duplicate_error(self.path, record, lines[key], n)
                    records.setdefault(key, record)
                    lines.setdefault(key, n)
        self.records = records

    def check_writable(self) -> None:
        """Raise ``OSError`` naming the file when a record could not be added to it: its folder cannot be created
        or written (a new file is created there, a retried record replaced through it), the file is not a
        writable regular file, or its last line is cut short."""
        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OSError(
                f"results file {self.path}: cannot create its folder ({err.strerror or err}); pass --results elsewhere"
            ) from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise OSError(f"results file {self.path}: its folder {folder} is not writable; pass --results elsewhere")
        if self.path.exists():
            if not self.path.is_file() or not os.access(self.path, os.W_OK):
                raise OSError(f"results file {self.path}: not a writable file; pass --results elsewhere")
            with open(self.path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                if size and (f.seek(size - 1), f.read(1))[1] != b"\n":
                    raise OSError(
                        f"{self.path}: its last line is cut short (a write that did not end); remove that line and run again"
                    )

    def get(self, params: dict[str, Any], identity: Optional[str] = None) -> Optional[dict[str, Any]]:
        """The record of the trial ``params`` whose run has this identity (``None``: records that store none)."""
        return self.records.get(record_key(params, identity))

    def put(self, record: dict[str, Any]) -> None:
        """Add a trial's record (append), or replace the one the file holds (atomic rewrite), under the lock."""
        key = record_key(record["params"], self._identity(record))
        line = json.dumps(record, allow_nan=False) + "\n"
        with locked(self.path):
            self.refresh()
            replace = key in self.records
            self.records[key] = record
            if replace:
                try:
                    with atomic_write(self.path) as f:
                        for r in self.records.values():
                            f.write(json.dumps(r, allow_nan=False) + "\n")
                except OSError as err:
                    raise OSError(
                        f"{self.path}: cannot replace a record ({err.strerror or err}); the file is as it was"
                    ) from None
                return
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                data, size = line.encode(), os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":  # no append is under way: we hold the lock
                    raise OSError(
                        f"{self.path}: its last line is cut short (a write that did not end); remove that line and run again"
                    )
                try:
                    written = os.write(fd, data)
                    if written != len(data):  # a full disk: never leave half a record
                        raise OSError(f"wrote {written} of {len(data)} bytes of a record (disk full?)")
                    os.fsync(fd)
                except OSError as err:
                    os.ftruncate(fd, size)
                    raise OSError(
                        f"{self.path}: cannot add a record ({err.strerror or err}); the file is as it was"
                    ) from None
            finally:
                os.close(fd)
