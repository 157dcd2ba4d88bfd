"""Tuning without the test set: ``python -m lit_slowcal tune sweeps/results/table1_tuned.jsonl --out docs/table1_tuned.csv``.

The command: it reads a sweep's results file, chooses the rate of every (method, M, K) by a training
criterion averaged over seeds (``lit_slowcal.experiments.analysis.rate_choice``, where the criteria and the rules
are stated), then writes and prints the figures at the chosen rates
(``lit_slowcal.experiments.analysis.tuned_output``). The names of both are importable from here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from lit_slowcal.experiments.analysis.rate_choice import Choice, check_criterion, tune, winners
from lit_slowcal.experiments.analysis.records import load_results
from lit_slowcal.experiments.analysis.tuned_output import (
    CSV_HEADER,
    communication_table,
    floats_per_machine,
    markdown,
    plot_accuracy_vs_floats,
    write_csv,
    write_docs,
)

__all__ = [
    "CSV_HEADER", "Choice", "check_criterion", "communication_table", "floats_per_machine", "main",
    "plot_accuracy_vs_floats", "tune", "winners", "write_csv", "write_docs",
]  # fmt: skip


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m lit_slowcal tune RESULTS.jsonl [--criterion C] [--out FILE.csv] [--docs DIR] [--floats FIGURE.png]``."""
    parser = argparse.ArgumentParser(
        prog="python -m lit_slowcal tune",
        description="Choose the learning rate of every (method, M, K) by a training criterion averaged over seeds "
        "(never the test set), then report the test figures at it.",
    )
    parser.add_argument("results", type=Path, help="JSON-lines file written by `lit_slowcal sweep`")
    parser.add_argument(
        "--criterion", default="train_objective",
        help="train_objective (f(x_R), default), excess_loss (f(x_R) - f*), train_loss (the last logged loss of the "
        "machines' steps; non-linear models) or val_<metric>; test_* is refused",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the table as CSV there (columns: " + ",".join(CSV_HEADER) + ")")
    parser.add_argument(
        "--docs", type=Path,
        help="write <results stem>.md (the table, the map of which method wins each cell) and its figures there",
    )  # fmt: skip
    parser.add_argument(
        "--floats", type=Path, metavar="FIGURE.png",
        help="draw the final test accuracy against the floats sent per machine there (one line per method through "
        "its K) and print the table of tuned rate, train loss, test accuracy and floats per machine",
    )  # fmt: skip
    opts = parser.parse_args(argv)
    try:
        check_criterion(opts.criterion)
        for option, path in (("--out", opts.out), ("--floats", opts.floats)):
            if path is not None and path.is_dir():
                raise ValueError(f"Invalid {option}: {path} is a folder; give a file's path")
        if opts.docs is not None and opts.docs.exists() and not opts.docs.is_dir():
            raise ValueError(f"Invalid --docs: {opts.docs} is a file; give a folder (made if missing)")
        notes: list[str] = []
        choices = tune(load_results(opts.results, notes), opts.criterion)
        for line in notes:
            print(f"note: {line}", file=sys.stderr)
        if opts.out is not None:
            if opts.out.parent != Path(""):
                opts.out.parent.mkdir(parents=True, exist_ok=True)
            write_csv(choices, opts.out)
        if opts.docs is not None:
            for path in write_docs(choices, opts.criterion, opts.docs, opts.results.stem):
                print(f"wrote {path}")
        if opts.floats is not None:
            plot_accuracy_vs_floats(
                choices, opts.floats, f"{opts.results.stem}: final test accuracy against communication"
            )
            print(communication_table(choices))
            print(f"wrote {opts.floats}")
    except (OSError, ValueError) as err:
        print(f"lit_slowcal tune: error: {err}", file=sys.stderr)
        return 2
    print(markdown(choices, opts.criterion))
    if opts.out is not None:
        print(f"wrote {opts.out}")
    return 0
