"""``python -m lit_slowcal`` / ``lit-slowcal``: ``fit``, ``validate``, ``test`` (LightningCLI), ``sweep``, ``report``."""

from __future__ import annotations

import sys
from typing import Optional


def main(args: Optional[list[str]] = None) -> None:
    """Dispatch to the sweep runner, the report, or the training CLI (each imported only when used)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] == "sweep":
        from lit_slowcal.experiments.sweep import main as sweep_main

        raise SystemExit(sweep_main(argv[1:]))
    if argv and argv[0] == "report":
        from lit_slowcal.experiments.report import main as report_main

        raise SystemExit(report_main(argv[1:]))
    from lit_slowcal.experiments.cli import run

    run(args)


if __name__ == "__main__":
    main()
