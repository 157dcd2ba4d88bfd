"""The run's strategy, once the trainer built it: ``sync_every`` from the run's shape, and the run's averaging options.

The run's options (``--participation``, ``--compression``, the overlap and state options;
``lit_slowcal.experiments.run.options``) may also be given as ``trainer.strategy.init_args``: ``settled`` takes the
run's where set, else the strategy's own, and gives one line where both are set and differ (checked while parsing,
and again when ``set_up_strategy`` writes them into the strategy's options).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from lit_slowcal.experiments.run.options import compression_options, overlap_options, state_options
from lit_slowcal.experiments.train.methods import get_method
from lit_slowcal.experiments.train.shape import RunShape
from lit_slowcal.options import AveragingOptions, check_participation
from lit_slowcal.protocol import declared
from lit_slowcal.strategy import PeriodicAveragingStrategy

__all__ = ["check_init_args", "set_up_strategy", "settled"]


def check_init_args(get: Callable[..., Any]) -> None:
    """While parsing a fit: one line where ``trainer.strategy.init_args`` and the run's options (``get``: its
    settings by key) both set one and differ (``settled``)."""
    init = get("trainer.strategy.init_args")
    if init is not None:
        ours = {
            **compression_options(get), **overlap_options(get), **state_options(get),
            "participation": get("participation"),
        }  # fmt: skip
        settled(lambda name: init.get(name, getattr(AveragingOptions(), name)), ours)


def set_up_strategy(strategy: Any, shape: RunShape, setting: Callable[..., Any], model: Any) -> None:
    """The strategy's ``sync_every`` from the run's shape, and its participation options (``setting``: the run's
    settings by key, ``SlowcalCLI.setting``; ``model``: the run's, whose hyperparameters build the method's optimizer)."""
    if not isinstance(strategy, PeriodicAveragingStrategy):
        raise ValueError(
            f"trainer.strategy must be 'periodic_averaging' (or PeriodicAveragingStrategy); got "
            f"{type(strategy).__name__}. The machines synchronise through it."
        )
    if strategy.sync_every not in (1, shape.sync_every):  # 1: the strategy's default, i.e. not given
        raise ValueError(
            f"Invalid trainer.strategy.sync_every: {strategy.sync_every} (it follows from method and local_steps: "
            f"{shape.sync_every} for {setting('method')} with local_steps={setting('local_steps')}; leave it unset)"
        )
    strategy.sync_every = shape.sync_every
    participation = check_participation(setting("participation"), shape.num_machines)
    if participation is not None:
        probe = get_method(setting("method")).probe(model.hparams)
        if not declared(probe).supports_participation:
            raise ValueError(
                f"Invalid participation: {participation!r} with method {setting('method')} ({type(probe).__name__} "
                "keeps per-machine state that machines outside a round would update; leave participation unset)"
            )
    seed = setting("seed_everything")
    ours = {
        "participation": participation,
        "participation_seed": seed if isinstance(seed, int) and seed >= 0 else 0,
        **compression_options(setting),
        **overlap_options(setting),
        **state_options(setting),
    }
    strategy.options = replace(strategy.options, **settled(lambda name: getattr(strategy.options, name), ours))


def settled(own_value: Callable[[str], Any], ours: dict[str, Any]) -> dict[str, Any]:
    """The run's options (``--participation``, ``--compression``, ...) where set, else the strategy's own
    (``trainer.strategy.init_args``, read by ``own_value``); one line where both are set and differ."""
    defaults = AveragingOptions()
    out = {}
    for name, value in ours.items():
        own, default = own_value(name), getattr(defaults, name)
        if name == "participation_seed" or value != default:
            if own not in (default, value) and name != "participation_seed":
                raise ValueError(
                    f"Invalid trainer.strategy.init_args.{name}: {own!r} with --{name}={value!r} (one setting "
                    f"in two places; give --{name} only)"
                )
            out[name] = value
    return out
