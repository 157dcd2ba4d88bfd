"""W&B sweep files run here, without a W&B server: ``python -m lit_slowcal sweep sweeps/lr.yaml``.

The same YAML works both ways. With a W&B account, ``wandb sweep sweeps/lr.yaml`` and ``wandb agent
<sweep id>`` run it on W&B's controller; this package runs it in one process, one module a step:

1. ``spec``: the sweep file is read and checked as W&B would (``parse_sweep``, ``load_sweep``): the
   top-level keys, every parameter's search space, the ``metric`` and the ``command``.
2. ``trials``: the search space becomes a list of trials (``expand_trials``), and each trial the
   argument list the W&B agent would pass (``trial_args``).
3. ``checks``: every trial's arguments are checked by the CLI's own parser before anything runs
   (``CommandLine``), and each trial gets its identity; ``cli`` is the command line (``main``).
4. ``runner``: the pending trials run in units (``units``), one after another in this process or with
   ``--workers N`` in N processes at once (``workers``). By default (``--stack``) the trials that differ
   only in the learning rate, the seed and K are grouped (``grouping``) and each group trains as one
   vectorized program (``stacked``), each trial exactly as it trains alone; the others, and every trial
   with ``--no-stack``, run alone as the training CLI in this process (``single``: ``run_trial``).
5. ``results``: every finished trial is added to the results file (JSON lines) at once, atomically
   (``ResultsFile``); running the same command again skips the trials it holds.
6. ``table``: the sweep ends with a markdown table (``summary_table``): the best ``model.lr`` per
   ``method`` when both are swept, otherwise every trial.

Only ``checks``, ``single`` and ``stacked`` use the training CLI (``lit_slowcal.experiments.run.cli``), and only
when they check or run trials; the CLI never imports this package.
"""

from lit_slowcal.experiments.sweep.checks import CommandLine
from lit_slowcal.experiments.sweep.cli import main
from lit_slowcal.experiments.sweep.results import ResultsFile
from lit_slowcal.experiments.sweep.single import run_trial
from lit_slowcal.experiments.sweep.spec import DISTRIBUTIONS, Param, Sweep, load_sweep, parse_sweep
from lit_slowcal.experiments.sweep.table import summary_table
from lit_slowcal.experiments.sweep.trials import expand_trials, trial_args, trial_key

__all__ = [
    "DISTRIBUTIONS",
    "CommandLine",
    "Param",
    "ResultsFile",
    "Sweep",
    "expand_trials",
    "load_sweep",
    "main",
    "parse_sweep",
    "run_trial",
    "summary_table",
    "trial_args",
    "trial_key",
]
