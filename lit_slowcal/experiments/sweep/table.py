"""The markdown table a sweep ends with: the best ``model.lr`` per ``method`` and communication options when
both are swept, otherwise every trial."""

from __future__ import annotations

from typing import Any, Optional

from lit_slowcal.experiments.run.options import COMMUNICATION_OPTIONS
from lit_slowcal.experiments.sweep.spec import Sweep

__all__ = ["COMMUNICATION_PARAMS", "format_value", "param_text", "summary_table"]

#: The parameters that change what a round sends or how (docs/communication.md): trials that differ in one of
#: them are rows of their own in the table, never averaged together.
COMMUNICATION_PARAMS = (
    *(name.lstrip("-") for name, *_ in COMMUNICATION_OPTIONS),
    "participation",
    "model.outer",
    "model.outer_lr",
    "model.outer_momentum",
)


def format_value(value: Any, digits: int = 4) -> str:
    """A metric as the table and the progress lines print it: ``n/a``, a fixed-point float, or ``str``."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def param_text(params: dict[str, Any]) -> str:
    """A trial's parameters on one line: ``method=slowcal model.lr=0.1``."""
    return " ".join(f"{k}={v}" for k, v in params.items())


def summary_table(sweep: Sweep, records: list[dict[str, Any]]) -> str:
    """Markdown: the best ``model.lr`` per ``method`` and swept communication options (``COMMUNICATION_PARAMS``:
    one row per combination, by the sweep's metric averaged over the other swept parameters, seeds among them)
    when both are swept, otherwise one row per trial."""
    metric, sign = sweep.metric, (1.0 if sweep.goal == "maximize" else -1.0)
    if "method" in sweep.param_names and "model.lr" in sweep.param_names:
        comm = [n for n in COMMUNICATION_PARAMS if n in sweep.param_names]
        groups: dict[tuple[str, ...], dict[Any, list[dict[str, Any]]]] = {}
        for r in records:
            row = (str(r["params"]["method"]), *(str(r["params"].get(n)) for n in comm))
            groups.setdefault(row, {}).setdefault(r["params"]["model.lr"], []).append(r)
        cols = list(dict.fromkeys([metric, "test_acc", "test_loss"]))
        lines = [
            f"| {' | '.join(['method', *comm])} | best lr | {' | '.join(cols)} | trials at best lr | lrs tried "
            "| diverged or failed |",
            "|---|" + "---|" * len(comm) + "---|" + "---|" * len(cols) + "---|---|---|",
        ]
        for cells, by_lr in groups.items():
            method = " | ".join(cells)  # the method and its communication options

            def mean(rs: list[dict[str, Any]], key: str) -> Optional[float]:
                vals = [r["metrics"].get(key) for r in rs if r["status"] == "finished"]
                vals = [v for v in vals if v is not None]
                return sum(vals) / len(vals) if vals else None

            scored = [(mean(rs, metric), lr, rs) for lr, rs in by_lr.items()]
            bad = sum(r["status"] != "finished" for rs in by_lr.values() for r in rs)
            ok = [s for s in scored if s[0] is not None]
            if not ok:
                lines.append(f"| {method} | n/a |" + " n/a |" * len(cols) + f" 0 | {len(by_lr)} | {bad} |")
                continue
            _, lr, rs = max(ok, key=lambda s: sign * s[0])
            finished = sum(r["status"] == "finished" for r in rs)
            vals = " | ".join(format_value(mean(rs, c)) for c in cols)
            lines.append(f"| {method} | {lr} | {vals} | {finished} | {len(by_lr)} | {bad} |")
        return "\n".join(lines)
    names = sweep.param_names
    lines = [
        f"| {' | '.join(names)} | status | test_acc | test_loss | wall s |",
        "|" + "---|" * (len(names) + 4),
    ]
    for r in records:
        p, m = r["params"], r["metrics"]
        cells = [str(p.get(n)) for n in names]
        cells += [r["status"], format_value(m.get("test_acc")), format_value(m.get("test_loss"))]
        cells.append(format_value(r.get("wall_time_s"), 1))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
