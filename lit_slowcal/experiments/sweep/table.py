"""The markdown table a sweep ends with: the best ``model.lr`` per ``method`` when both are swept,
otherwise every trial."""

from __future__ import annotations

from typing import Any, Optional

from lit_slowcal.experiments.sweep.spec import Sweep

__all__ = ["format_value", "param_text", "summary_table"]


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
    """Markdown: the best ``model.lr`` per ``method`` (by the sweep's metric, averaged over the other
    swept parameters) when both are swept, otherwise one row per trial."""
    metric, sign = sweep.metric, (1.0 if sweep.goal == "maximize" else -1.0)
    if "method" in sweep.param_names and "model.lr" in sweep.param_names:
        groups: dict[str, dict[Any, list[dict[str, Any]]]] = {}
        for r in records:
            groups.setdefault(r["params"]["method"], {}).setdefault(r["params"]["model.lr"], []).append(r)
        cols = list(dict.fromkeys([metric, "test_acc", "test_loss"]))
        lines = [
            f"| method | best lr | {' | '.join(cols)} | trials at best lr | lrs tried | diverged or failed |",
            "|---|---|" + "---|" * len(cols) + "---|---|---|",
        ]
        for method, by_lr in groups.items():

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
