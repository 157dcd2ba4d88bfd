"""``strategy="periodic_averaging"`` for Lightning's Trainer and Fabric, without importing Lightning here.

Importing Lightning costs seconds (and, through torchmetrics, pulls torchvision and matplotlib where
they are installed), which users of ``SlowcalSGD`` or ``PeriodicAverager`` alone should not pay.
So ``import lit_slowcal`` registers the strategy names only when Lightning's strategy registries
are loaded: at once if they already are, otherwise through a post-import hook on
``lightning.pytorch.strategies`` and ``lightning.fabric.strategies`` (a ``sys.meta_path`` finder
that runs the registration right after those modules execute). The registered entries are small
factories that import ``lit_slowcal.strategy`` / ``lit_slowcal.fabric`` when a Trainer or Fabric
asks for the name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import types
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

_DESCRIPTION = "Local updates averaged every K steps (parameters and optimizer state)"


def trainer_strategy(**kwargs: Any) -> Any:
    from lit_slowcal.strategy import PeriodicAveragingStrategy

    return PeriodicAveragingStrategy(**kwargs)


def sharded_trainer_strategy(**kwargs: Any) -> Any:
    from lit_slowcal.sharded_strategy import ShardedAveragingStrategy

    return ShardedAveragingStrategy(**kwargs)


def fabric_strategy(**kwargs: Any) -> Any:
    from lit_slowcal.fabric import PeriodicAveragingFabricStrategy

    return PeriodicAveragingFabricStrategy(**kwargs)


def _register_trainer(module: ModuleType) -> None:
    registry = module.StrategyRegistry
    for name, start_method in (("periodic_averaging", "popen"), ("periodic_averaging_spawn", "spawn")):
        if name not in registry:
            registry.register(
                name, trainer_strategy, description=f"{_DESCRIPTION}, '{start_method}'", start_method=start_method
            )
    if "sharded_averaging" not in registry:
        registry.register(
            "sharded_averaging",
            sharded_trainer_strategy,
            description="FSDP2 within each replica, replicas averaged every K steps",
        )


def _register_fabric(module: ModuleType) -> None:
    registry = module.STRATEGY_REGISTRY
    if "periodic_averaging" not in registry:
        registry.register("periodic_averaging", fabric_strategy, description=_DESCRIPTION)


def _load_cli_names(module: ModuleType) -> None:
    # LightningCLI (jsonargparse) resolves a class by its name among the loaded subclasses of
    # Strategy: loading lit_slowcal.strategy makes `--trainer.strategy=periodic_averaging
    # --trainer.strategy.sync_every=8` resolve to the class of that name.
    importlib.import_module("lit_slowcal.strategy")
    cli = module.LightningCLI
    if not getattr(cli.parse_arguments, "keeps_strategy_init_args", False):
        cli.parse_arguments = KeepingStrategyInitArgs(cli.parse_arguments)


def _strategy_kind(value: Any) -> Any:
    """``"popen"`` or ``"spawn"`` for a ``trainer.strategy`` value naming ``PeriodicAveragingStrategy`` (a registered
    name, a class name or import path, or a ``class_path`` spec); else ``None``."""
    name = value if isinstance(value, str) else getattr(value, "class_path", None)
    if not isinstance(name, str):
        return None
    last = name.strip().rsplit(".", 1)[-1]
    return {
        "periodic_averaging": "popen",
        "PeriodicAveragingStrategy": "popen",
        "periodic_averaging_spawn": "spawn",
    }.get(last)


def _strategy_names(argv: list[str]) -> list[tuple[int, int]]:
    """``(index, count)`` of each ``--trainer.strategy=NAME`` (or ``--trainer.strategy NAME``) in ``argv`` naming ours."""
    found = []
    for i, arg in enumerate(argv):
        if arg.startswith("--trainer.strategy="):
            value, count = arg.split("=", 1)[1], 1
        elif arg == "--trainer.strategy" and i + 1 < len(argv):
            value, count = argv[i + 1], 2
        else:
            continue
        if _strategy_kind(value) is not None:
            found.append((i, count))
    return found


class KeepingStrategyInitArgs:
    """``LightningCLI.parse_arguments``, keeping a config's ``trainer.strategy`` init args when the command line
    names the same strategy again; a method of the class it is set on.

    ``Trainer(strategy=...)`` takes a string or a Strategy, and jsonargparse parses a bare name as the string:
    ``--trainer.strategy=periodic_averaging`` replaced a config's ``{class_path: periodic_averaging, init_args:
    {sync_every: 20, outer_optimizer: ...}}`` whole, and a following ``--trainer.strategy.sync_every=20`` started
    a new one with every other init arg at its default (``outer_optimizer`` None), without a word. Naming the
    class the config already has now keeps its init args, as jsonargparse does for a class given by its path.
    """

    #: Tells ``LightningCLI.parse_arguments`` is wrapped already, whichever import of this module wrapped it: the
    #: registration wraps it once.
    keeps_strategy_init_args = True

    def __init__(self, parse_arguments: Callable[..., None]) -> None:
        self.wrapped = parse_arguments  # LightningCLI's own

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        return self if instance is None else types.MethodType(self, instance)

    def __call__(self, cli: Any, parser: Any, args: Any) -> None:
        self.wrapped(cli, parser, args)
        if args is not None and not isinstance(args, (list, tuple)):  # a dict or Namespace: no command line
            return
        argv = [str(a) for a in (sys.argv[1:] if args is None else args)]
        names = _strategy_names(argv)
        if not names:
            return
        kinds = {_strategy_kind(argv[i + c - 1].split("=", 1)[-1]) for i, c in names}
        dropped = {j for i, c in names for j in range(i, i + c)}
        config = _parse_quietly(parser, [a for j, a in enumerate(argv) if j not in dropped])
        if config is None:
            return
        subcommand = config.get("subcommand")  # parse_arguments comes before LightningCLI sets self.subcommand
        kept = config.get(f"{subcommand}.trainer.strategy" if subcommand else "trainer.strategy")
        if hasattr(kept, "class_path") and {_strategy_kind(kept)} == kinds:
            cli.config = config  # else the config had no strategy of this kind: the name chooses it, as before


def _parse_quietly(parser: Any, argv: list[str]) -> Any:
    """``parser.parse_args(argv)``, or ``None`` where it fails (nothing printed: the first parse stands)."""
    import contextlib
    import io

    exit_on_error = getattr(parser, "exit_on_error", True)
    try:
        parser.exit_on_error = False
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(argv)
    except (Exception, SystemExit):
        return None
    finally:
        parser.exit_on_error = exit_on_error


_HOOKS: dict[str, Callable[[ModuleType], None]] = {
    "lightning.pytorch.strategies": _register_trainer,
    "lightning.fabric.strategies": _register_fabric,
    "lightning.pytorch.cli": _load_cli_names,
}
_LOADED_ATTRIBUTE = {
    "lightning.pytorch.strategies": "StrategyRegistry",
    "lightning.fabric.strategies": "STRATEGY_REGISTRY",
    "lightning.pytorch.cli": "LightningCLI",
}


def _run(name: str, module: ModuleType) -> None:
    hook = _HOOKS.pop(name, None)
    if hook is None:
        return
    try:
        hook(module)
    except Exception as err:  # never break the user's import of Lightning
        warnings.warn(f"lit_slowcal could not register strategy 'periodic_averaging' with {name}: {err}", stacklevel=2)


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the registration."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _run(self._name, module)

    def __getattr__(self, attr: str) -> Any:  # resources, get_source, ...: the real loader's
        return getattr(self._loader, attr)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _HOOKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


def install() -> None:
    """Register now where Lightning's registries are loaded; otherwise when they are."""
    for name in list(_HOOKS):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, _LOADED_ATTRIBUTE[name]):
            _run(name, module)
    if _HOOKS and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
