"""Every trial of a sweep checked by the training CLI's own parser before anything runs, and each trial's identity.

``CommandLine`` is ``SlowcalCLI``'s parser, built once without instantiating anything; ``check_trials`` parses
every trial's arguments with it (in this process, or shared among forked workers), and a large grid part by part
(``check_by_parts``) where that saves parses: a parameter the CLI does not take, or a value it refuses, stops the
sweep before the first run. A trial's identity (``trial_identity_of``) is the digest of everything that defines
its results; the results file (``results_file``) finds a trial's record by it, and gives records written before
identities were stored theirs from their arguments.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from lit_slowcal.experiments.sweep.results import ResultsFile
from lit_slowcal.experiments.sweep.table import param_text
from lit_slowcal.experiments.sweep.trials import identity_digest, trial_key

__all__ = [
    "LARGE_GRID", "CommandLine", "check_by_parts", "check_distinct", "check_trials", "new_command_line", "results_file",
    "trial_identity_of",
]  # fmt: skip

#: Grids larger than this are checked by parts where that saves parses, say their size and the time of their check
#: before it starts, and an estimate of their running time once a group or a trial has run.
LARGE_GRID = 100


class CommandLine:
    """``SlowcalCLI``'s parser, built once without instantiating anything, to check trial arguments.

    Parsing runs exactly what ``SlowcalCLI(args=...)`` runs before it builds the model: the config
    file, every option's type, the linked settings and the four experiment settings (K >= 1, ...).
    """

    def __init__(self) -> None:
        from lit_slowcal.experiments.run.cli import SlowcalCLI

        class _Built(Exception):
            pass

        class _ParserOnly(SlowcalCLI):
            def parse_arguments(self, parser: Any, args: Any) -> None:
                raise _Built(self)

        # Parsers that raise ArgumentError instead of printing usage and exiting: the main parser
        # and, through their own keyword arguments, each subcommand's.
        no_exit = {"exit_on_error": False}
        subcommands = {name: dict(no_exit) for name in SlowcalCLI.subcommands()}
        try:
            _ParserOnly(args=[], parser_kwargs={"prog": "python -m lit_slowcal", **no_exit, **subcommands})
        except _Built as built:
            cli = built.args[0]
        self.parser = cli.parser

    def parse(self, args: Sequence[str]) -> Any:
        """The parsed configuration (a jsonargparse Namespace; keys such as ``fit.model.lr``).

        Raises:
            ValueError: with the parser's message when the CLI refuses the arguments.
        """
        from lit_slowcal.experiments.run.options import one_line_message

        try:
            return self.parser.parse_args(list(args))
        except argparse.ArgumentError as err:
            raise ValueError(one_line_message(err)) from None
        except SystemExit as err:  # an option that prints and exits (--help, --print_config) among them
            raise ValueError(f"the CLI exits (status {err.code}) instead of running the trial") from None


# The sweep's parser, read by the workers forked to check trials (_parse): a forked worker has it already.
_checker: Optional[CommandLine] = None


def new_command_line() -> CommandLine:
    """The sweep's parser, built afresh: before the workers fork, so that they check trials with it too."""
    global _checker
    _checker = CommandLine()
    return _checker


def _command_line() -> CommandLine:
    """The sweep's parser (``_checker``), built here where it is not yet (a spawned worker)."""
    global _checker
    if _checker is None:
        _checker = CommandLine()
    return _checker


def _dumped_fit(parsed: Any) -> dict[str, Any]:
    # As the CLI takes a run's identity: the dump leaves out the settings linked from others (data.batch_size, ...).
    return json.loads(_command_line().parser.dump(parsed, format="json", skip_unset=False, skip_validation=True))["fit"]


def trial_identity_of(parsed: Any) -> str:
    """The identity digest of a trial's run from its parse (``CommandLine.parse``): everything that defines
    its results (``lit_slowcal.experiments.run.identity.trial_identity``), the command and config included."""
    from lit_slowcal.experiments.run.identity import SEED_KEYS, trial_identity

    return identity_digest(trial_identity(_dumped_fit(parsed)), SEED_KEYS)


# Identities of records written before identities were stored, by their arguments (parsed once per process).
_legacy: dict[tuple[str, ...], Optional[str]] = {}


def _legacy_identity(record: dict[str, Any]) -> Optional[str]:
    """The identity of a record that stores none: its ``args`` parsed by the CLI now (``None`` if it cannot
    tell: no args, or args the CLI refuses today). Its config file is read as it is now."""
    args = record.get("args")
    if not isinstance(args, list) or not args:
        return None
    key = tuple(args)
    if key not in _legacy:
        try:
            _legacy[key] = trial_identity_of(_command_line().parse(args))
        except (ValueError, OSError):
            _legacy[key] = None
    return _legacy[key]


def results_file(path: str | Path) -> ResultsFile:
    """The sweep's results file, whose records without a stored identity get one from their arguments."""
    return ResultsFile(path, identify=_legacy_identity)


def _parse(args: list[str]) -> tuple[Any, Optional[str], Optional[str]]:
    """``(_checker.parse(args), its identity, None)``, or ``(None, None, the CLI's message)`` when it refuses them."""
    assert _checker is not None
    try:
        parsed = _checker.parse(args)
    except ValueError as err:
        return None, None, str(err)
    return parsed, trial_identity_of(parsed), None


def _own_keys(name: str) -> Optional[frozenset[str]]:
    """The keys of the parsed configuration that a value of the option ``name`` sets, where they do not depend on any
    other option: ``fit.<name>``, and the settings linked from it alone (``fit.seed_everything``: also
    ``fit.data.seed`` and ``fit.model.seed``); ``None`` where they may (a source of a setting linked from several
    options, or a setting another option sets too), or ``name`` is not one key of the ``fit`` section and of a
    run's identity (``model.lr``, ``checkpoint_every``, ``num_machines``)."""
    from lit_slowcal.experiments.run.options import PARSE_LINKS

    parts = name.split(".")
    if not (len(parts) == 1 or (len(parts) == 2 and parts[0] in ("model", "data", "trainer"))):
        return None
    targets = [target for sources, target, _ in PARSE_LINKS if name == sources]
    for sources, target, _ in PARSE_LINKS:
        if (
            (name in sources and not isinstance(sources, str))
            or (target in targets and sources != name)
            or target == name
        ):
            return None
    return frozenset(f"fit.{k}" for k in (name, *targets))


def _parse_or_refuse(make_args: Any, params: dict[str, Any], what: str) -> Any:
    config, _, error = _parse(make_args(params))
    if error is not None:
        raise ValueError(f"{what}: the CLI refuses it: {error}")
    return config


def _leaf_values(
    trials: list[tuple[dict[str, Any], list[str]]], make_args: Any, candidates: dict[str, frozenset[str]]
) -> tuple[dict[str, Any], Any]:
    """Of the ``candidates`` (name -> its own keys, ``_own_keys``), the options each of whose values changes its own
    keys of the configuration only: name -> value's trial key -> (its keys' parsed values, its dumped value); and
    the first trial's parse."""
    first = trials[0][0]
    parsed = _parse_or_refuse(make_args, first, f"trial {param_text(first)}")
    base = dict(parsed.items())
    leaves: dict[str, dict[str, tuple[dict[str, Any], Any]]] = {}
    for n, own in candidates.items():
        values = {trial_key({n: t[0][n]}): t[0][n] for t in trials}
        leaves[n] = {}
        for key, v in values.items():
            config = _parse_or_refuse(make_args, {**first, n: v}, f"{n}={v}")
            flat = dict(config.items())
            changed = {k for k, x in flat.items() if k not in base or base[k] != x} | (base.keys() - flat.keys())
            if not changed <= own <= flat.keys():
                break
            dumped = json.loads(json.dumps(_get(_dumped_fit(config), n), default=str))
            leaves[n][key] = ({k: flat[k] for k in own}, dumped)
        else:
            continue
        del leaves[n]  # it changes other keys too: checked with the combinations
    return leaves, parsed


def check_by_parts(trials: list[tuple[dict[str, Any], list[str]]], make_args: Any) -> Optional[dict[str, Any]]:
    """``check_trials``'s result with fewer parses, or ``None`` where it would not save any.

    A swept option whose value sets keys of the configuration that no other option's value changes (``_own_keys``:
    one key, as ``model.lr``, or with the settings linked from it alone, as the seed; the check confirms that a
    value of it changes those keys only) is parsed value by value; the trials are parsed once per combination of
    the other options' values; each trial's parse is its combination's with its own values of the first options
    set in.
    It is the parse of the trial's own arguments (``tests/experiments/sweep/test_sweep.py`` compares them).
    """
    from lit_slowcal.experiments.run.identity import SEED_KEYS, trial_identity

    names = list(trials[0][0])
    candidates = {n: own for n in names if (own := _own_keys(n)) is not None}
    distinct = {n: {trial_key({n: t[0][n]}) for t in trials} for n in names}
    rest = {tuple(trial_key({n: t[0][n]}) for n in names if n not in candidates) for t in trials}
    if not candidates or 1 + sum(len(distinct[n]) for n in candidates) + len(rest) > len(trials) // 2:
        return None
    leaves, first = _leaf_values(trials, make_args, candidates)
    others = [n for n in names if n not in leaves]
    combos: dict[tuple[str, ...], tuple[Any, dict[str, Any]]] = {
        tuple(trial_key({n: trials[0][0][n]}) for n in others): (first, trial_identity(_dumped_fit(first)))
    }
    checked: dict[str, Any] = {}
    for params, args in trials:
        combo = tuple(trial_key({n: params[n]}) for n in others)
        if combo not in combos:
            config = _parse_or_refuse(make_args, params, f"trial {param_text(params)}")
            combos[combo] = (config, trial_identity(_dumped_fit(config)))
        config, identity = combos[combo]
        config, identity = config.clone(), dict(identity)
        for n, values in leaves.items():
            parsed_values, dumped_value = values[trial_key({n: params[n]})]
            for k, parsed_value in parsed_values.items():
                config[k] = parsed_value
            if n in identity:  # the identity's keys are the configuration's, flattened one level (model.lr)
                identity[n] = dumped_value
        checked[trial_key(params)] = (args, config, identity_digest(identity, SEED_KEYS))
    return checked


def _get(d: dict[str, Any], name: str) -> Any:
    for part in name.split("."):
        d = d[part]
    return d


def check_trials(
    trials: list[tuple[dict[str, Any], list[str]]], pool: Any = None, workers: int = 1, make_args: Any = None
) -> dict[str, Any]:
    """Every trial's ``(params, args)`` as ``(args, parsed, identity)`` by trial key, ``parsed`` by the CLI's parser
    (``_checker``): in this process, or shared among the forked workers of ``pool`` (each has ``_checker`` from
    this process).

    With ``make_args`` (a trial's arguments from its parameters), a large grid is checked by parts
    (``check_by_parts``) where that saves parses.

    Raises:
        ValueError: naming the first trial the CLI refuses, with its message.
    """
    if make_args is not None and len(trials) > LARGE_GRID:
        by_parts = check_by_parts(trials, make_args)
        if by_parts is not None:
            return by_parts
    args = [a for _, a in trials]
    if pool is None:
        outcomes: Any = map(_parse, args)
    else:  # a few chunks per worker: even shares, and few round trips
        outcomes = pool.imap(_parse, args, chunksize=max(1, len(args) // (4 * workers)))
    checked: dict[str, Any] = {}
    for (params, trial), (config, identity, error) in zip(trials, outcomes):
        if error is not None:
            raise ValueError(f"trial {param_text(params)}: the CLI refuses it: {error}")
        checked[trial_key(params)] = (trial, config, identity)
    return checked


def check_distinct(trials: list[dict[str, Any]], checked: dict[str, Any]) -> None:
    """Refuse two trials that are one run: their values differ only in how they are written (``1e-2`` and
    ``0.01``, ``true`` and ``True``): the same identity, and no parameter between them outside the identity (a
    parameter that does not change a run's results, as ``eval_every``, makes two trials of one identity).

    Raises:
        ValueError: naming both trials' differing values.
    """
    from lit_slowcal.experiments.run.identity import RESULT_SETTINGS, may_change_on_resume

    seen: dict[str, dict[str, Any]] = {}
    for params in trials:
        identity = checked[trial_key(params)][2]
        other = seen.setdefault(identity, params)
        if other is params:
            continue
        differ = [
            n
            for n in params
            if trial_key({n: params[n]}) + type(params[n]).__name__
            != trial_key({n: other[n]}) + type(other[n]).__name__
        ]
        if all(not may_change_on_resume(n) or n in RESULT_SETTINGS for n in differ):
            shown = ", ".join(f"{n} {other.get(n)!r} and {params[n]!r}" for n in differ)
            raise ValueError(
                f"the trials {param_text(other)} and {param_text(params)} are one run: the CLI reads {shown} alike "
                "(YAML reads 1e-2 without a dot as text); list each value once"
            )
