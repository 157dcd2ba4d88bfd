"""The records of a results file, as the analysis reads them: loading and checking them, which trial and which
cell (method, M, K) each is, and that a cell's trials differ only in their seed; with the methods' labels and the
figures' saving that the report, the tuning and the time to a target share."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from lit_slowcal.experiments.train.methods import METHODS
from lit_slowcal.files import atomic_path

__all__ = [
    "CELL_KEYS", "SEED", "Record", "cell_of", "check_one_setting", "integer_param", "load_results", "located",
    "method_label", "methods_in_order", "save_figure",
]  # fmt: skip

#: The parameters that name a cell.
CELL_KEYS = ("method", "num_machines", "local_steps")
SEED = "seed_everything"


class Record(dict):
    """A trial record read from a results file, with where it was read (``where``: ``<file>, line <n>``)."""

    where: str = ""


def located(record: dict[str, Any], message: str) -> ValueError:
    """``message`` about ``record``, preceded by the file and line it was read from (when it was read from one)."""
    where = getattr(record, "where", "")
    return ValueError(f"{where}: {message}" if where else message)


def load_results(path: str | Path, notes: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """The records of a results file (one JSON object a line), each checked to be a whole trial record, one per
    trial: two records of one trial (its parameters and identity) with the same status and metrics count once
    (files concatenated), with different ones are refused. Each is a ``Record`` that knows its line.

    Raises:
        ValueError: naming the file and the line that is not JSON or not a trial record, or the two lines of
            one trial that disagree; or naming the file when it holds no record.

    ``notes``: a list that gets a line saying how many repeated records were counted once, if any.
    """
    from lit_slowcal.experiments.sweep.results import duplicate_error, read_record, same_values

    records: dict[str, Record] = {}
    lines: dict[str, int] = {}
    repeated = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.strip():
                record = Record(read_record(raw, path, n))
                record.where = f"{path}, line {n}"
                key = _trial_of(record)
                if key in records:
                    if not same_values(records[key], record):
                        raise duplicate_error(path, record, lines[key], n)
                    repeated += 1
                    continue
                records[key], lines[key] = record, n
    if not records:
        raise ValueError(f"{path}: no trial records (the file is empty); give the results file a sweep wrote")
    if repeated and notes is not None:
        notes.append(
            f"{path}: {repeated} record{'s' if repeated > 1 else ''} repeat{'' if repeated > 1 else 's'} another of the same trial with the same status and metrics; each trial is counted once"
        )
    return list(records.values())


def _trial_of(record: dict[str, Any]) -> str:
    """Which trial a record is: its run's identity (two spellings of one value, ``1e-2`` and ``0.01``, are one
    run) and its parameters that are not part of it (``eval_every``); a record written before identities were
    stored: its parameters and its arguments."""
    from lit_slowcal.experiments.run.identity import RESULT_SETTINGS, may_change_on_resume
    from lit_slowcal.experiments.sweep.trials import record_key

    params = record["params"]
    if record.get("identity") is None:
        return record_key(params, json.dumps(record.get("args")))
    return record_key(
        {k: v for k, v in params.items() if may_change_on_resume(k) and k not in RESULT_SETTINGS}, record["identity"]
    )


def cell_of(record: dict[str, Any], needed: str) -> tuple[str, int, int]:
    """``(method, M, K)`` of a record's parameters.

    Raises:
        ValueError: naming the record's file and line when one is missing or not of its type (``needed``: why
            the caller needs them).
    """
    p = record["params"]
    missing = [k for k in CELL_KEYS if k not in p]
    if missing:
        raise located(record, f"a trial lacks {', '.join(missing)} in its params ({p}); {needed}")
    if not isinstance(p["method"], str):
        raise located(record, f"method is {p['method']!r}, expected a method's name")
    return p["method"], integer_param(record, "num_machines"), integer_param(record, "local_steps")


def integer_param(record: dict[str, Any], name: str) -> int:
    value = record["params"][name]
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise located(record, f"{name} is {value!r}, expected an integer")
    return int(value)


def _flags(args: Sequence[str]) -> dict[str, str]:
    """A record's command-line settings that define its run but its seed: ``{option: value}``, as given."""
    from lit_slowcal.experiments.run.identity import SEED_KEYS, may_change_on_resume

    flags: dict[str, str] = {}
    tokens = list(args)
    for i, token in enumerate(tokens):
        if not token.startswith("--"):
            continue
        key, eq, value = token[2:].partition("=")
        if not eq:
            value = tokens[i + 1] if i + 1 < len(tokens) and not tokens[i + 1].startswith("--") else ""
        if key not in SEED_KEYS and (key == "config" or not may_change_on_resume(key)):
            flags[key] = flags[key] + " " + value if key == "config" and key in flags else value
    return flags


def check_one_setting(
    key: tuple[int, int, str],
    records: list[dict[str, Any]],
    varies: Sequence[str] = (),
    averages: str = "the report averages",
) -> None:
    """Refuse a point whose records were run with different settings (not only another seed): by their stored
    identities (``sweep.trials.setting_of``; not when a setting ``varies`` among them), and by their arguments
    (but the options that ``varies`` names)."""
    from lit_slowcal.experiments.sweep.trials import setting_of

    where = f"M={key[0]}, K={key[1]}, {key[2]}"
    advice = f"{averages} over seeds only; give each setting its own results file (sweep --results) or remove the old records"
    by_args: dict[str, dict[str, str]] = {}
    for r in records:
        flags = {k: v for k, v in _flags(r.get("args") or []).items() if k not in varies}
        by_args.setdefault(json.dumps(flags, sort_keys=True), flags)
    if len(by_args) > 1:
        first, *others = by_args.values()
        other = others[0]
        diff = sorted(k for k in first.keys() | other.keys() if first.get(k) != other.get(k))
        shown = "; ".join(
            f"--{k} {first.get(k, '(not given)')} in one, {other.get(k, '(not given)')} in another" for k in diff[:4]
        )
        raise ValueError(f"the trials at {where} were run with different command lines ({shown}): {advice}")
    settings = {setting_of(r["identity"]) for r in records if r.get("identity")}
    if len(settings) > 1 and not varies:
        raise ValueError(
            f"the trials at {where} were run with different settings (the same arguments, {len(settings)} identities: "
            f"a config file changed in between?): {advice}"
        )


def methods_in_order(found: Sequence[str]) -> list[str]:
    """The methods found: the registry's in its order, then any others by name."""
    return [m for m in METHODS if m in found] + sorted(m for m in set(found) if m not in METHODS)


def method_label(method: str) -> str:
    return METHODS[method].label if method in METHODS else method


def save_figure(fig: Any, path: str | Path) -> None:
    # The temporary file's suffix is not the target's: the format is given, not inferred.
    fmt = Path(path).suffix[1:].lower() or "png"
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format=fmt)
