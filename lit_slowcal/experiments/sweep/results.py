"""The results file of a sweep: finished trials, one JSON object a line.

Every finished trial is added at once, by rewriting the file atomically (``ResultsFile.put``): a
sweep killed at any moment leaves a readable file, and running the same command again skips the
trials it holds (a trial is its parameter dict, see ``trial_key``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from lit_slowcal.experiments.sweep.trials import trial_key
from lit_slowcal.files import atomic_write

__all__ = ["ResultsFile"]


class ResultsFile:
    """Finished trials, one JSON object a line, keyed by ``trial_key(record["params"])``.

    ``put`` rewrites the whole file atomically (``lit_slowcal.files.atomic_write``: a temporary file
    in the same folder, fsync, rename; the file keeps its permission bits): a reader, or a sweep
    restarted after a kill, sees the old file or the new one.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.records: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            with open(self.path) as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                        key = trial_key(record["params"])
                    except (json.JSONDecodeError, KeyError, TypeError) as err:
                        raise ValueError(f"{self.path}, line {n}: not a trial record ({err})") from None
                    self.records[key] = record

    def get(self, params: dict[str, Any]) -> Optional[dict[str, Any]]:
        return self.records.get(trial_key(params))

    def put(self, record: dict[str, Any]) -> None:
        """Add (or replace) a trial's record and write the file."""
        self.records[trial_key(record["params"])] = record
        with atomic_write(self.path) as f:
            for r in self.records.values():
                f.write(json.dumps(r, allow_nan=False) + "\n")
