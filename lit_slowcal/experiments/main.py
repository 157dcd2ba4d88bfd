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

import gc
import os
import sys
from collections.abc import Callable
from typing import Optional

__all__ = ["DEBUG_ENV", "USER_ERRORS", "main"]

#: Set to 1 to get the traceback of a failure the command would otherwise report in one line.
DEBUG_ENV = "LIT_SLOWCAL_DEBUG"
#: The exception classes of the failures a user causes (see the module docstring).
USER_ERRORS = (ValueError, OSError, FloatingPointError)


def main(args: Optional[list[str]] = None, freeze_imports: bool = False) -> None:
    """Dispatch to the sweep runner, the report, the tuning, or the training CLI (each imported only when used).

    ``freeze_imports`` (``python -m lit_slowcal``, which turns the garbage collector off before its imports):
    once the command's modules are imported, ``_freeze`` the objects made so far and turn the collector on.
    """
    argv = sys.argv[1:] if args is None else list(args)
    had_group = _process_group_initialized()
    try:
        command = _command(argv, args)
        if freeze_imports:
            _freeze()
        command()
    except USER_ERRORS as err:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"lit_slowcal: error: {message} ({DEBUG_ENV}=1 shows the traceback)", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        # Lightning leaves the process group it made for several processes to the script; a gloo group
        # still alive at the interpreter's exit occasionally aborts the process ("terminate called
        # without an active exception"), whatever the run's outcome. The command made it: it ends it.
        if not had_group and _process_group_initialized():
            import torch.distributed as dist

            dist.destroy_process_group()


def _process_group_initialized() -> bool:
    """Whether this process has a default process group (torch not imported: no)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _command(argv: list[str], args: Optional[list[str]]) -> Callable[[], None]:
    """The command ``argv`` names, ready to run: its modules imported."""
    if argv and argv[0] in ("sweep", "report", "tune"):
        if argv[0] == "sweep":
            from lit_slowcal.experiments.sweep import main as command_main
        elif argv[0] == "report":
            from lit_slowcal.experiments.analysis.report import main as command_main
        else:
            from lit_slowcal.experiments.analysis.tune import main as command_main

        def exit_with_status() -> None:
            raise SystemExit(command_main(argv[1:]))

        return exit_with_status
    from lit_slowcal.experiments.run.cli import run

    return lambda: run(args)


def _freeze() -> None:
    """Move every object made so far out of the garbage collector's reach (``gc.freeze``) and turn it on again.

    Importing torch, Lightning and the app makes 660,000 objects and no garbage. A collection walks them all
    (six full ones during the imports: 0.6 s), and so does the interpreter's exit (about 1 s): frozen, they are
    skipped, here and in the sweep's forked workers, as CPython's documentation advises for a process that
    forks. Objects made afterwards are collected as usual.
    """
    gc.freeze()
    gc.enable()


if __name__ == "__main__":
    main()
