"""``python -m lit_slowcal`` / ``lit-slowcal``: ``fit``, ``validate``, ``test`` (LightningCLI), ``sweep``, ``report``, ``tune``.

A failure the user can cause (a refused value, a missing or corrupt file, a resume of a different
run, a run that diverges or does not fit in memory) ends the command with one line on stderr,
``lit_slowcal: error: <what, which file or field, what to do>``, and exit status 1, without a
traceback: every check raises ``ValueError``, ``OSError`` or ``FloatingPointError`` with that line as
its message, and ``main`` is the one place that turns them into the exit. ``LIT_SLOWCAL_DEBUG=1``
in the environment lets the exception through, traceback and all. Other exceptions (bugs) keep
their traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

__all__ = ["DEBUG_ENV", "USER_ERRORS", "main"]

#: Set to 1 to get the traceback of a failure the command would otherwise report in one line.
DEBUG_ENV = "LIT_SLOWCAL_DEBUG"
#: The exception classes of the failures a user causes (see the module docstring).
USER_ERRORS = (ValueError, OSError, FloatingPointError)


def main(args: Optional[list[str]] = None) -> None:
    """Dispatch to the sweep runner, the report, the tuning, or the training CLI (each imported only when used)."""
    argv = sys.argv[1:] if args is None else list(args)
    try:
        if argv and argv[0] == "sweep":
            from lit_slowcal.experiments.sweep import main as sweep_main

            raise SystemExit(sweep_main(argv[1:]))
        if argv and argv[0] == "report":
            from lit_slowcal.experiments.report import main as report_main

            raise SystemExit(report_main(argv[1:]))
        if argv and argv[0] == "tune":
            from lit_slowcal.experiments.tune import main as tune_main

            raise SystemExit(tune_main(argv[1:]))
        from lit_slowcal.experiments.cli import run

        run(args)
    except USER_ERRORS as err:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"lit_slowcal: error: {message} ({DEBUG_ENV}=1 shows the traceback)", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
