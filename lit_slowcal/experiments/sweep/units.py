"""What one process of a sweep runs at a time (a ``Unit``): a stacked group, or one trial alone (``run_unit``).

A unit reads the results file just before it starts and leaves out the trials it holds already (another sweep
on the same file ran them meanwhile); it returns the outcome of every trial it ran, for the sweep to record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lit_slowcal.experiments.sweep import single
from lit_slowcal.experiments.sweep.checks import results_file

__all__ = ["Outcome", "Unit", "pending", "run_unit"]


@dataclass
class Unit:
    """What one process runs at a time: a stacked group (``StackedTrial`` s), or one trial alone
    (``(params, args, parsed, identity)``, ``parsed`` being ``CommandLine.parse(args)``)."""

    label: str  # "group 2/9", "4/20"
    title: str  # what it runs, printed as it starts
    trials: Any  # list[StackedTrial] (a group) or (params, args, parsed, identity) (a trial alone)
    cost: float = 0.0  # relative running time (groups: grouping.group_cost), to start the longest first

    def members(self) -> list[tuple[dict[str, Any], Optional[str], list[str]]]:
        """``(params, identity, args)`` of each of its trials."""
        if isinstance(self.trials, list):
            return [(t.params, t.identity, t.args) for t in self.trials]
        params, args, _, identity = self.trials
        return [(params, identity, args)]


def pending(record: Optional[dict[str, Any]], retry_failed: bool) -> bool:
    """Whether a trial whose record in the results file is ``record`` (None: none) is to run."""
    return record is None or (retry_failed and record["status"] != "finished")


Outcome = tuple[dict[str, Any], str, dict[str, Any], list[str]]  # (params, identity, outcome, args) of a trial


def run_unit(check: tuple[str, bool], unit: Unit) -> tuple[str, list[Outcome]]:
    """Run ``unit`` here; return its label and ``(params, identity, outcome, args)`` of each trial it ran: the
    trials that the results file ``check = (path, retry_failed)`` holds already (another sweep ran them
    meanwhile) are left out, read just before the unit starts."""
    results, retry = results_file(check[0]), check[1]
    if isinstance(unit.trials, tuple):
        params, args, parsed, identity = unit.trials
        if not pending(results.get(params, identity), retry):
            print(f"\n[{unit.label}] {unit.title}: already in {check[0]}", flush=True)
            return unit.label, []
        print(f"\n[{unit.label}] {unit.title}", flush=True)
        return unit.label, [(params, identity, single.run_trial(args, parsed), args)]
    from lit_slowcal.experiments.sweep.grouping import group_title
    from lit_slowcal.experiments.sweep.stacked import run_group
    from lit_slowcal.experiments.sweep.stacked_trial import config_yaml

    group = [t for t in unit.trials if pending(results.get(t.params, t.identity), retry)]
    if not group:
        print(f"\n[{unit.label}] {unit.title}: already in {check[0]}", flush=True)
        return unit.label, []
    title = (
        unit.title
        if len(group) == len(unit.trials)
        else f"{group_title(group)} ({len(unit.trials) - len(group)} already in {check[0]})"
    )
    print(f"\n[{unit.label}] {title}", flush=True)
    run_group(group, config_yaml)
    return unit.label, [(t.params, t.identity, t.outcome, t.args) for t in group]
