"""The exactness contract of stacked trials: what "a stacked trial equals its single run" means, checked.

A trial trained in a stacked group (``stacked``) and the same trial run alone (``--no-stack``, or
``python -m lit_slowcal fit`` with its arguments) give:

* **bit for bit** the same training trajectory and parameters, and every metric of training and of the
  test set (``train_loss``, ``test_loss``, ``test_acc``, ``round``, ``samples_seen``,
  ``floats_communicated``, ...): the same float operations in the same order;
* **within 1e-12 relative** the diagnostics computed from them (``DIAGNOSTICS``: the training objective
  f(x), the excess loss f(x) - f*, the dispersion and the step norms, and f*, G_*): the training objective
  of many evaluations is one float64 product over the training inputs (``objective.values``), whose
  value for one point depends on the others of the pass only within float64 rounding (bounded in
  ``lit_slowcal.experiments.measure.float64_product``; measured on the paper grid: at most 1 ulp).

``differences`` and ``csv_differences`` check two records, or two ``metrics.csv`` files, of one trial by it.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["DIAGNOSTICS", "DIAGNOSTICS_RTOL", "MEASURED", "csv_differences", "differences"]

#: Metrics computed from a trial's trajectory: equal within ``DIAGNOSTICS_RTOL`` relative; all others bit for bit.
DIAGNOSTICS = frozenset(
    {
        "train_objective",
        "excess_loss",
        "dispersion",
        "query_step",
        "iterate_step",
        "f_star",
        "G_star",
        "optimum_grad_norm",
    }
)
DIAGNOSTICS_RTOL = 1e-12
#: Logged metrics that are measured times (``train_s``, the seconds of a fit's rounds), not functions of the
#: trial's settings: outside the contract. A sweep record keeps them beside its metrics (as ``wall_time_s``); a
#: stacked trial logs none (its seconds are its stack's).
MEASURED = frozenset({"train_s"})


def _agree(name: str, a: Any, b: Any) -> bool:
    if a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)):
        return True
    if name not in DIAGNOSTICS or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (a, b)):
        return False
    return abs(a - b) <= DIAGNOSTICS_RTOL * max(abs(a), abs(b))


def differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The metrics in which ``a`` and ``b`` (two metric dicts of one trial, e.g. records' ``metrics``) break the
    contract, each as ``name: a != b``; a metric one holds and the other not is one too (``MEASURED`` ones aside).
    Empty: they agree."""
    a, b = ({k: v for k, v in m.items() if k not in MEASURED} for m in (a, b))
    out = [f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in sorted(set(a) | set(b)) if k not in a or k not in b]
    return out + [f"{k}: {a[k]!r} != {b[k]!r}" for k in sorted(set(a) & set(b)) if not _agree(k, a[k], b[k])]


def _without_measured(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """``rows`` without the ``MEASURED`` columns."""
    return [{k: v for k, v in r.items() if k not in MEASURED} for r in rows]


def _cell(text: str) -> Any:
    try:
        return float(text)
    except ValueError:
        return text


def csv_differences(a: str, b: str) -> list[str]:
    """The cells in which two ``metrics.csv`` texts of one trial break the contract (same columns and rows;
    the text of every cell equal, diagnostics' within 1e-12 relative), as ``row N name: a != b``."""
    ra, rb = (_without_measured(list(csv.DictReader(io.StringIO(text)))) for text in (a, b))
    head_a, head_b = (
        ",".join(name for name in text.split("\n", 1)[0].split(",") if name not in MEASURED) for text in (a, b)
    )
    if head_a != head_b or len(ra) != len(rb):
        return [f"columns or rows differ: {head_a!r} ({len(ra)} rows) != {head_b!r} ({len(rb)} rows)"]
    out = []
    for n, (x, y) in enumerate(zip(ra, rb), 1):
        for name in x:
            if x[name] != y[name] and not (name in DIAGNOSTICS and _agree(name, _cell(x[name]), _cell(y[name]))):
                out.append(f"row {n} {name}: {x[name]!r} != {y[name]!r}")
    return out
