"""The main job: ``python -m lit_slowcal fit --config configs/slowcal.yaml``.

A ``LightningCLI`` whose four experiment settings live at the top level of the config, each in one
place: ``method``, ``num_machines`` (M), ``local_steps`` (K) and ``batch_size`` (b); the options and
the settings linked from them while parsing are ``lit_slowcal.experiments.run.options``'. Once the
problem exists (the data module is built), the run's shape is computed once from them
(``lit_slowcal.experiments.train.shape.RunShape``: sync period, per-step batch, steps per round, rounds,
machines per process), and the CLI hands that one object to everything that needs its values: torch's
threads, the strategy's ``sync_every``, the data module (``ProblemDataModule.use_shape``) and the model
(``MachinesModel.use_shape``); nothing else computes them. R = ceil(N / (M * K * b)) rounds make one
epoch for every method (N the problem's training samples, 60,000 for MNIST).

``data.problem`` picks the problem (``MNIST`` by default, ``Synthetic``, ``Quadratic``; see
``lit_slowcal.experiments.data.problems``); the model's shape and loss follow from it. Every fit measures
the training objective, the excess loss against a cached float64 optimum and G_*, and, with
``--diagnostics`` (the default), the machines' dispersion before each synchronisation and the
per-step movement of query point and iterate (``lit_slowcal.experiments.measure.diagnostics``).

The other jobs of a run live in their own modules: where it writes and W&B
(``lit_slowcal.experiments.run.run_folder``), the checks of a checkpoint it loads (``...resume``), the
summary it prints (``...summary``), the strategy's K and options (``...strategy_setup``) and torch's threads,
set from the run's shape before the trainer is built (``--threads``, ``auto`` by default; ``...threads``), printed once:
``threads: 1 (auto: 16 machines x 1 sample x 784 features per step; --threads N to choose)``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch
from jsonargparse import Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_slowcal._validation import check_int, check_number, is_int
from lit_slowcal.experiments._lightning import KeepCommandLineModelArgs
from lit_slowcal.experiments.data.datamodule import ProblemDataModule
from lit_slowcal.experiments.measure.diagnostics import Diagnostics
from lit_slowcal.experiments.print_once import say_lines
from lit_slowcal.experiments.run.identity import RunIdentity, run_identity
from lit_slowcal.experiments.run.last_checkpoint import LastCheckpoint
from lit_slowcal.experiments.run.options import (
    ConfigFile,
    OneLineErrorParser,
    add_options,
    averaging_options,
    check_state_keys_held,
    links_of,
    state_options,
    step_seconds_of,
)
from lit_slowcal.experiments.run.resume import check_checkpoint, check_trains_more, last_checkpoint
from lit_slowcal.experiments.run.run_folder import RUN_VERSION_ENV, run_dir_error, run_loggers, run_name, run_version
from lit_slowcal.experiments.run.strategy_setup import check_init_args, set_up_strategy
from lit_slowcal.experiments.run.summary import summary_lines
from lit_slowcal.experiments.run.threads import configure_run_threads, world_size_of
from lit_slowcal.experiments.train.architectures import get_architecture
from lit_slowcal.experiments.train.methods import get_method, method_names
from lit_slowcal.experiments.train.model import MachinesModel
from lit_slowcal.experiments.train.shape import RunShape

__all__ = ["SlowcalCLI", "diagnostics_callback", "run"]


class SlowcalCLI(KeepCommandLineModelArgs, LightningCLI):
    """LightningCLI with the paper's experiment settings and their derived values linked in.

    When the trainer is built, ``self.shape`` is the run's ``RunShape`` (``run_shape``), built once: torch's
    threads, the strategy's ``sync_every``, the data module's rounds and batches (``use_shape``), the model's
    machines per process (``use_shape``), the evaluation interval and the checkpoint interval all come from it.

    A command that loads a checkpoint (``fit --ckpt_path``, ``validate``, ``test``) must describe the
    checkpoint's run: its configuration is compared with the identity stored in the checkpoint
    before anything is built (``lit_slowcal.experiments.run.identity``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("model_class", MachinesModel)
        kwargs.setdefault("datamodule_class", ProblemDataModule)
        kwargs.setdefault("seed_everything_default", 1)
        kwargs.setdefault("save_config_kwargs", {"overwrite": False})
        # The method picks the optimizer (SlowcalSGD or SGD); a generic --optimizer would bypass it.
        kwargs.setdefault("auto_configure_optimizers", False)
        description = (
            f"{', '.join(get_method(name).label for name in method_names())} on M machines. Subcommands: fit, validate, test, "
            "predict; also `sweep`, `report` and `tune` (see --help of each)."
        )
        kwargs.setdefault("parser_kwargs", {"prog": "python -m lit_slowcal", "description": description})
        defaults = {
            "strategy": "periodic_averaging",
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 1,
            "num_sanity_val_steps": 0,
            "check_val_every_n_epoch": None,  # evaluate every `eval_every` rounds, across epochs
            "log_every_n_steps": 10,  # rounds: one training batch is one round
        }
        kwargs["trainer_defaults"] = {**defaults, **kwargs.get("trainer_defaults", {})}
        try:
            super().__init__(*args, **kwargs)  # parses, builds and runs the subcommand
        except MisconfigurationException as err:  # Lightning's refusal of a trainer setting, when fit starts
            message = " ".join(str(err).split()).replace(
                " or switch to automatic optimization.", " (every method steps its own optimizer, K steps per round)."
            )
            raise ValueError(f"Invalid trainer setting: {message}") from err
        except OSError as err:  # a full disk, a file for a folder: say --run_dir and the path
            config = getattr(self, "config", None)
            error = run_dir_error(err, self.setting("run_dir") if config is not None else None)
            if error is None:
                raise
            raise error from err
        finally:
            # Runs started later in this process (a sweep) pick their own version folder. With
            # run=False the caller trains later, and its DDP children still need the variable.
            if getattr(self, "_owns_version_env", False) and getattr(self, "subcommand", None) is not None:
                os.environ.pop(RUN_VERSION_ENV, None)

    def run_config(self, *, initialized: bool = False) -> Namespace:
        """This run's configuration: the subcommand's section (``fit``, ...) when one runs, else all of it.

        ``initialized`` gives the one with the classes instantiated (``config_init``).
        """
        config = self.config_init if initialized else self.config
        subcommand = getattr(self, "subcommand", None)
        return config[subcommand] if subcommand else config

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """LightningCLI's parser (the root's and each subcommand's), refusing a value in one line."""
        kwargs.setdefault("dump_header", [f"lightning.pytorch=={lightning.pytorch.__version__}"])
        parser = OneLineErrorParser(**kwargs)
        parser.add_argument(
            "-c", "--config", action=ConfigFile, help="Path to a configuration file in json or yaml format."
        )
        return parser

    def setting(self, key: str, default: Any = None) -> Any:
        """A value of this run's configuration by its (dotted) key: ``setting("model.lr")``."""
        return self.run_config().get(key, default)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        add_options(parser)

    def before_instantiate_classes(self) -> None:
        get = self.setting
        # What defines this run (lit_slowcal.experiments.run.identity): stored in its checkpoints, and
        # compared with the checkpoint it loads, if any, before anything is built. The root parser's
        # dump holds each subcommand's section (as the sweep takes a trial's identity).
        dumped = json.loads(self.parser.dump(self.config, format="json", skip_unset=False, skip_validation=True))
        self.identity = run_identity(dumped[self.subcommand] if self.subcommand else dumped)
        if self.subcommand == "fit":  # refused now, before anything is built
            links_of(get("link"))
            step_seconds_of(get("step_seconds"))
            averaging_options(get)
            check_init_args(get)  # the strategy's own options and the run's: one line now if both give one
        if self.subcommand and get("run_dir") == "":
            raise ValueError("Invalid run_dir: '' (must be a folder; . for the current one)")
        if self.subcommand and get("ckpt_path") == "":
            raise ValueError("--ckpt_path is empty: pass a checkpoint file, or last for this run's newest checkpoint")
        if self.subcommand in ("validate", "test", "predict") and get("ckpt_path") is None:
            print(
                f"note: {self.subcommand} without --ckpt_path evaluates the untrained starting model; pass "
                "--ckpt_path <run folder>/checkpoints/last.ckpt to evaluate a trained one",
                file=sys.stderr,
                flush=True,
            )
        if self.subcommand and get("ckpt_path") == "last":  # Lightning's own "last" would not find ours
            self.config[self.subcommand]["ckpt_path"] = str(self.last_checkpoint())
        self._resumed_step = 0
        if self.subcommand and get("ckpt_path"):
            self._resumed_step = check_checkpoint(get("ckpt_path"), self.identity, self.subcommand)

    def last_checkpoint(self) -> Path:
        """The newest ``last.ckpt`` of this run under ``run_dir``: of its name (method, M, K, b and seed) and
        of its identity (``self.identity``: the learning rate and every other setting too); see
        ``lit_slowcal.experiments.run.resume.last_checkpoint``."""
        return last_checkpoint(self.setting("run_dir"), self.run_name(), self.identity)

    def run_shape(self, world_size: int) -> RunShape:
        """The run's shape over ``world_size`` processes, from its settings, on the data module's problem."""
        return RunShape.of_settings(
            self.run_config(), train_size=self.datamodule.num_train_samples, world_size=world_size
        )

    def _diagnostics(self) -> Diagnostics:
        return diagnostics_callback(self.setting)

    def run_name(self) -> str:
        """``<method>_M<M>_K<K>_b<b>_seed<seed>``: the run's folder under ``run_dir``."""
        return run_name(self.setting)

    def _version(self) -> int:
        """This run's version folder number under ``run_dir/<run name>`` (``run_folder.run_version``)."""
        version, claimed = run_version(self.setting("run_dir"), self.run_name())
        self._owns_version_env = getattr(self, "_owns_version_env", False) or claimed
        return version

    def run_folder(self) -> Path:
        """``run_dir/<run name>/version_<n>``: where the run's logs, config.yaml, figure and checkpoints go."""
        return Path(self.setting("run_dir")) / self.run_name() / f"version_{self._version()}"

    def _loggers(self) -> list[Logger]:
        wandb = bool(self.setting("wandb")) and self.subcommand == "fit"
        loggers, self._wandb_offline = run_loggers(
            self.setting("run_dir"),
            self.run_name(),
            self._version(),
            self.run_config(),
            wandb=wandb,
            project=self.setting("wandb_project"),
        )
        return loggers

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer_config = self.run_config(initialized=True).get("trainer")
        # The run's shape, computed once: over the processes the trainer will start (checked against the
        # trainer's own count below), on the problem the data module holds. Torch's threads follow from
        # it, set before the trainer is built.
        shape = self.shape = self.run_shape(world_size_of(self.setting("trainer") or {}))
        configure_run_threads(self.setting, self.subcommand, shape)
        if self.subcommand == "fit" and self._resumed_step:
            check_trains_more(self.setting("ckpt_path"), self._resumed_step, shape, *self._training_limits())
        if self.subcommand == "fit":
            self._check_method_over(self._run_steps(shape))
            keys = state_options(self.setting)["average_state"]
            if keys:  # a key the method's optimizer never holds: one line now, not at the first round
                check_state_keys_held(keys, get_method(self.setting("method")).probe(self.model.hparams))
            self._note_max_steps(shape)
        if trainer_config.get("logger") in (None, True):
            kwargs["logger"] = self._loggers()
        elif trainer_config.get("logger") is False and trainer_config.get("default_root_dir") is None:
            # Without a logger, Lightning writes config.yaml, the figure and checkpoints to the
            # default_root_dir, the current folder by default: keep them in the run folder instead.
            kwargs["default_root_dir"] = str(self.run_folder())
        kwargs["callbacks"] = self._callbacks(trainer_config, shape)
        kwargs["val_check_interval"] = shape.val_check_interval
        trainer = self._build_trainer(**kwargs)
        if trainer.world_size != shape.world_size:
            shape = self.shape = shape.on(trainer.world_size)
        set_up_strategy(trainer.strategy, shape, self.setting, self.model)
        self.model.use_links(links_of(self.setting("link")), step_seconds_of(self.setting("step_seconds")))
        # The batches' K, the model's machines and the strategy's K: all the shape's.
        self.datamodule.use_shape(shape)
        self.model.use_shape(shape)
        return trainer

    def _training_limits(self) -> tuple[Any, Any]:
        return self.setting("trainer.max_epochs"), self.setting("trainer.max_steps")

    def _run_steps(self, shape: RunShape) -> Optional[int]:
        """The optimizer steps the fit ends at (``None``: no end): its epochs' trained rounds, at most ``max_steps``."""
        max_epochs, max_steps = self._training_limits()
        if max_epochs is None and max_steps in (None, -1):
            max_epochs = 1000  # Lightning's default then
        steps = (
            max_epochs * shape.trained_rounds * shape.steps_per_round
            if is_int(max_epochs) and max_epochs >= 0
            else None
        )
        if is_int(max_steps) and max_steps >= 0:
            steps = max_steps if steps is None else min(steps, max_steps)
        return steps

    def _note_max_steps(self, shape: RunShape) -> None:
        """Say where a ``max_steps`` that is not a whole number of rounds stops the run: after the round reaching it."""
        max_steps, per_round = self.setting("trainer.max_steps"), shape.steps_per_round
        if is_int(max_steps) and max_steps > 0 and max_steps % per_round:
            stop = -(-max_steps // per_round) * per_round
            if all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK")):
                print(
                    f"note: trainer.max_steps={max_steps} is not a whole number of rounds ({per_round} optimizer steps "
                    f"each): training stops after the round that reaches it, at step {stop}",
                    file=sys.stderr,
                    flush=True,
                )

    def _check_method_over(self, steps: Optional[int]) -> None:
        """The method's options that depend on the run's length (SLowcal's weight_power), before training."""
        if steps is None:
            return
        try:
            get_method(self.setting("method")).probe(self.model.hparams, steps)
        except ValueError as err:
            raise ValueError(str(err).replace("Invalid ", "Invalid model.", 1)) from None

    def _callbacks(self, trainer_config: Any, shape: RunShape) -> list[Any]:
        """The configured callbacks, and the run's identity, last.ckpt and diagnostics callbacks unless given."""
        callbacks = trainer_config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        extra: list[Any] = [RunIdentity(self.identity)]
        if trainer_config.get("enable_checkpointing") is not False and not any(
            isinstance(c, ModelCheckpoint) for c in callbacks
        ):
            # last.ckpt only, every `checkpoint_every` rounds and when training ends.
            rounds = check_int("checkpoint_every", self.setting("checkpoint_every"), minimum=0)
            extra.append(LastCheckpoint(every_n_train_steps=rounds * shape.steps_per_round or None))
        if not any(isinstance(c, Diagnostics) for c in callbacks):
            extra.append(self._diagnostics())
        return [*callbacks, *extra]

    def _build_trainer(self, **kwargs: Any) -> Trainer:
        try:
            return super().instantiate_trainer(**kwargs)
        except (
            MisconfigurationException,
            ModuleNotFoundError,
        ) as err:  # Lightning's refusal of what this machine lacks
            message = " ".join(str(err).split())
            if not re.search(r"accelerator|devices|gpu|GPU|MPS|TPU|xla|backend", message):
                raise ValueError(f"Invalid trainer setting: {message}") from err
            accelerator, devices = self.setting("trainer.accelerator"), self.setting("trainer.devices")
            advice = (
                "--trainer.accelerator=cpu runs on any machine"
                if accelerator != "cpu"
                else "use --trainer.devices=N, N >= 1"
            )
            raise ValueError(
                f"This machine cannot meet trainer.accelerator={accelerator}, trainer.devices={devices}: {message} ({advice})"
            ) from err

    def before_fit(self) -> None:
        self._start = time.perf_counter()

    def after_fit(self) -> None:
        if self.trainer.global_step == self._resumed_step:
            raise ValueError(
                f"The run trained nothing: it was at step {self.trainer.global_step} before and after fit with "
                f"trainer.max_epochs={self.trainer.max_epochs}, trainer.max_steps={self.trainer.max_steps} and "
                f"trainer.limit_train_batches={self.trainer.limit_train_batches}; raise the one that stops it."
            )
        if not self.trainer.is_global_zero:
            return
        lines = summary_lines(
            self.trainer, self.setting, self.shape, time.perf_counter() - self._start, self.datamodule.partition_png,
            getattr(self, "_wandb_offline", False),
        )  # fmt: skip
        say_lines(lines)  # its note (no excess loss) as a note: once per sweep


def diagnostics_callback(get: Callable[..., Any]) -> Diagnostics:
    """The ``Diagnostics`` callback every fit gets, from ``get(key, default)`` as ``run_name`` takes it."""
    linear = get_architecture(get("model.arch", "linear") or "linear").linear
    return Diagnostics(
        objective=get("objective", True) and linear,  # f, f* and G_* are the linear model's
        per_round=get("diagnostics", True),
        step_every=check_int("step_every", get("step_every", 10), minimum=0),
        cache_dir=get("cache_dir"),
        tol=check_number("optimum_tol", get("optimum_tol", 1e-8)),
    )


# Every rank evaluates the same synchronised x on the whole test set: nothing to sync.
warnings.filterwarnings("ignore", message=r".*sync_dist=True.*when logging on epoch level")
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")


def run(args: Optional[list[str]] = None) -> None:
    """The training CLI: ``fit``, ``validate``, ``test``, ``predict`` (``SlowcalCLI``), with SIGTERM as exit 143 and
    Ctrl-C as exit 130, each with how to continue."""
    interrupted = (
        "Interrupted (Ctrl-C). Continue with the same command and --ckpt_path last (from its last checkpoint)."
    )
    try:
        SlowcalCLI(args=args)
    except SIGTERMException:  # a SystemExit: caught before it
        # Lightning stops at the end of the current round and raises SystemExit(None), i.e. status 0;
        # a terminated job must not look like a finished one.
        print("Stopped by SIGTERM. Continue with the same command and --ckpt_path last.", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGTERM) from None
    except SystemExit as err:
        if isinstance(err.__context__, KeyboardInterrupt):  # Lightning exits with status 1 after a Ctrl-C
            print(interrupted, file=sys.stderr, flush=True)
            raise SystemExit(128 + signal.SIGINT) from None
        raise
    except KeyboardInterrupt:  # outside the trainer (while building it)
        print(interrupted, file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGINT) from None


if __name__ == "__main__":
    run()
