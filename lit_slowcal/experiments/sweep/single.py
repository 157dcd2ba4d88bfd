"""A trial run alone, in this process: ``SlowcalCLI(args=...)`` as the sweep runs it (``run_trial``).

What does not depend on the trial is set up once per process: the CLI's parsers (``_trial_cli``), MNIST
decoded, each (M, seed) split and its figure; a trial trains in one process, without a process group, and
starts from the parse the sweep's check made of its arguments. A trial that raises is returned as ``failed``
(``diverged`` for a non-finite training loss); Ctrl-C or SIGTERM is raised, to stop the sweep.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, Optional

__all__ = ["run_trial"]


@contextlib.contextmanager
def _trial_environment() -> Iterator[None]:
    # LightningCLI warns when given args while sys.argv has some (ours: the sweep's); and the CLI
    # remembers its run folder version in the environment for its DDP children: each trial needs a fresh one.
    from lit_slowcal.experiments.run.run_folder import RUN_VERSION_ENV

    argv = sys.argv
    sys.argv = argv[:1]
    os.environ.pop(RUN_VERSION_ENV, None)
    try:
        yield
    finally:
        sys.argv = argv
        os.environ.pop(RUN_VERSION_ENV, None)


def _finish_wandb(failed: bool) -> None:
    # WandbLogger reuses a run left open; the next trial must start its own.
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish(exit_code=1 if failed else 0)


@functools.cache
def _trial_cli() -> Any:
    """``SlowcalCLI`` for trials: it keeps the trainer reachable when fit raises, and builds its parsers once.

    Building the parsers (jsonargparse reads the signature of the Trainer, the model and the data
    module, for each of the four subcommands) takes longer than a short run trains; the parsers
    depend on nothing but the class, so the first trial of the process builds them and the next
    ones reuse them. Each trial still parses its own arguments (and reads its config file) afresh.
    """
    from lit_slowcal.experiments.run.cli import SlowcalCLI

    built: dict[str, dict[str, Any]] = {}

    class TrialCLI(SlowcalCLI):
        last: Optional[TrialCLI] = None  # the running trial's CLI
        given: Any = None  # the running trial's arguments as the sweep's check parsed them, or None

        def parse_arguments(self, parser: Any, args: Any) -> None:
            # The sweep's check (CommandLine) parsed these very arguments with the same parser class:
            # its result is what this parse would give.
            if self.given is None:
                super().parse_arguments(parser, args)
            else:
                self.config = self.given

        def setup_parser(
            self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
        ) -> None:
            # What setup_parser sets on the CLI (the parser, the subcommand parsers and the names of
            # their method arguments), recorded once and set again on every later trial's CLI.
            key = repr((add_subcommands, main_kwargs, subparser_kwargs))
            if key not in built:
                before = dict(vars(self))
                super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
                built[key] = {k: v for k, v in vars(self).items() if k not in before or before[k] is not v}
            vars(self).update(built[key])

        def before_instantiate_classes(self) -> None:
            type(self).last = self  # keeps the trainer reachable when fit raises
            super().before_instantiate_classes()

    return TrialCLI


def run_trial(args: Sequence[str], parsed: Any = None) -> dict[str, Any]:
    """Run ``SlowcalCLI(args=args)`` here; never raises for a failing run.

    ``parsed``: ``CommandLine().parse(args)``, when the caller has it (the sweep's check): the CLI uses
    it instead of parsing ``args`` again. It is not changed.

    Ctrl-C (KeyboardInterrupt) and SIGTERM (Lightning's SIGTERMException) are raised: they stop the
    sweep, and the interrupted trial is not recorded.

    Returns:
        ``status`` (``finished``, ``diverged`` or ``failed``), ``error`` (None or the message),
        ``metrics`` (final ``trainer.callback_metrics``), ``run_dir`` (the CSV log folder),
        ``wall_time_s`` and ``step_seconds``, the compute time of one optimizer step of one machine,
        measured (``MachinesModel.measured_step_seconds``; ``None`` where nothing trained).
    """
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from lit_slowcal.experiments.sweep.contract import MEASURED
    from lit_slowcal.experiments.train.rounds import trial_status

    trial_cli = _trial_cli()
    trial_cli.last = None
    trial_cli.given = None if parsed is None else parsed.clone()
    status, error = "finished", None
    start = time.perf_counter()
    with _trial_environment():
        try:
            trial_cli(args=list(args))
        except SIGTERMException:  # Lightning's form of SIGTERM: stop the sweep, not just this trial
            status = "interrupted"
            raise
        except FloatingPointError as err:  # TrainingDiverged: diverged; another: failed
            status, error = trial_status(err), str(err)
        except SystemExit as err:
            if isinstance(err.__context__, KeyboardInterrupt):  # Lightning exits this way after Ctrl-C
                status = "interrupted"
                raise KeyboardInterrupt from err
            status, error = "failed", f"SystemExit: {err}"  # e.g. the parser's exit
        except Exception as err:
            status, error = "failed", f"{type(err).__name__}: {err}"
        except BaseException:  # KeyboardInterrupt outside the trainer
            status = "interrupted"
            raise
        finally:
            _finish_wandb(failed=status != "finished")
    wall = time.perf_counter() - start
    trainer = getattr(trial_cli.last, "trainer", None)
    trial_cli.last = trial_cli.given = None
    metrics: dict[str, Optional[float]] = {}
    measured_now: dict[str, Optional[float]] = {}  # MEASURED: beside the metrics
    run_dir = None
    step_seconds = None
    if trainer is not None:
        measured = getattr(trainer.lightning_module, "measured_step_seconds", math.nan)
        step_seconds = measured if math.isfinite(measured) else None
        for key, value in trainer.callback_metrics.items():
            if getattr(value, "numel", lambda: 1)() == 1:
                v = float(value)
                (measured_now if key in MEASURED else metrics)[key] = v if math.isfinite(v) else None  # no NaN
        run_dir = next((str(lg.log_dir) for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)
    return {
        "status": status,
        "error": error,
        "metrics": metrics,
        "run_dir": run_dir,
        "wall_time_s": round(wall, 3),
        "step_seconds": step_seconds,
        **measured_now,
    }
