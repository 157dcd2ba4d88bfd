"""The main job: ``python -m lit_slowcal fit --config configs/slowcal.yaml``.

A ``LightningCLI`` whose four experiment settings live at the top level of the config, each in one
place: ``method``, ``num_machines`` (M), ``local_steps`` (K) and ``batch_size`` (b). Everything that
follows from them is computed here, from the method's entry in ``lit_slowcal.experiments.methods``,
and linked into the model, the data and the trainer:

=================  ======================  ====================================
                   slowcal, local_sgd,     minibatch_sgd, accel_minibatch_sgd
                   scaffold
=================  ======================  ====================================
sync period        K                       1
per-step batch     b                       K * b
steps per round    K                       1
=================  ======================  ====================================

and R = ceil(N / (M * K * b)) rounds make one epoch for every method (N = 60,000 for MNIST).

``data.problem`` picks the problem (``MNIST`` by default, ``Synthetic``, ``Quadratic``; see
``lit_slowcal.experiments.problems``); the model's shape and loss follow from it. Every fit measures
the training objective, the excess loss against a cached float64 optimum and G_*, and, with
``--diagnostics`` (the default), the machines' dispersion before each synchronisation and the
per-step movement of query point and iterate (``lit_slowcal.experiments.diagnostics``).

Torch's threads are set before anything is built (``--threads``, ``auto`` by default: one thread
for steps as small as these; see ``lit_slowcal.experiments.threads``), and the choice is printed
once: ``threads: 1 (auto: 16 machines x 1 sample x 784 features per step; --threads N to choose)``.
"""

from __future__ import annotations

import json
import netrc
import os
import re
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Union
from urllib.parse import urlparse

import lightning.pytorch
from jsonargparse import ActionConfigFile, Namespace
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lit_slowcal._lightning import KeepCommandLineModelArgs
from lit_slowcal._validation import check_int, check_number, is_int
from lit_slowcal.checkpoint import read_checkpoint
from lit_slowcal.experiments.checkpointing import LastCheckpoint
from lit_slowcal.experiments.data import MNIST_TRAIN_SIZE, MNISTDataModule, num_rounds
from lit_slowcal.experiments.diagnostics import Diagnostics
from lit_slowcal.averaging import check_participation
from lit_slowcal.experiments.architectures import get_architecture
from lit_slowcal.experiments.identity import RunIdentity, allowed_on_resume, check_same_run, run_identity
from lit_slowcal.experiments.methods import get_method, method_names
from lit_slowcal.experiments.model import LogisticRegression
from lit_slowcal.experiments.threads import THREADS_TYPE, WorkSize, configure_threads
from lit_slowcal.strategy import PeriodicAveragingStrategy

__all__ = ["PARSE_LINK_SOURCES", "RUN_VERSION_ENV", "SlowcalCLI", "claim_version", "diagnostics_callback", "one_line_message", "per_step_batch", "run", "run_name", "steps_per_round"]

#: The run's version folder, chosen by the launching process and inherited by its DDP children.
RUN_VERSION_ENV = "LIT_SLOWCAL_RUN_VERSION"

# As link functions (see add_arguments_to_parser), the three below check the settings while the
# command line is parsed: before anything is built.


def steps_per_round(method: str, local_steps: int) -> int:
    """Optimizer steps between synchronisations: K for the local methods, 1 for the minibatch methods."""
    return get_method(method).steps_per_round(local_steps)


def per_step_batch(method: str, local_steps: int, batch_size: int) -> int:
    """Samples per machine per step: b, or K * b for the minibatch methods (same samples per round)."""
    return get_method(method).per_step_batch(local_steps, batch_size)


def _val_check_interval(num_machines: int, local_steps: int, batch_size: int, eval_every: int) -> int:
    # One training batch is one round; evaluate every `eval_every` rounds and after the last one.
    check_int("num_machines", num_machines)
    check_int("local_steps", local_steps)
    check_int("batch_size", batch_size)
    check_int("eval_every", eval_every)
    return min(eval_every, num_rounds(MNIST_TRAIN_SIZE, num_machines, local_steps, batch_size))


def wandb_logged_in() -> bool:
    """Whether W&B has credentials (``WANDB_API_KEY`` or ``wandb login``'s netrc entry), without prompting."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC", str(Path.home() / ".netrc"))
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


_LINK_PREFIX = re.compile(r"^Call to compute_fn of link '.*?' with args \(.*?\) failed: ", re.S)


_UNION = re.compile(r'^Parser key "(?P<key>[^"]+)":.*Does not validate against any of the Union subtypes Subtypes: \[(?P<types>.*?)\] Errors:.*Given value: (?P<value>.*)$')
_TYPE_NAMES = {"<class 'float'>": "a number", "<class 'int'>": "an integer", "<class 'NoneType'>": "null", "<class 'bool'>": "true or false",
               "<class 'str'>": "a string"}  # fmt: skip


def one_line_message(message: Any) -> str:
    """A refusal of the parser on one line: without the name of the link function that checked the value, and
    a value none of a Union's types takes as ``key: value is not <the types>``."""
    return _short_union_error(" ".join(_LINK_PREFIX.sub("", str(message)).split()))


def _short_union_error(message: str) -> str:
    """jsonargparse's refusal of a value none of a Union's types takes, as ``key: value is not <the types>``."""
    match = _UNION.match(message)
    if match is None:
        return message
    allowed = []
    for part in re.findall(r"typing\.Literal\[[^\]]*\]|<class '[^']*'>", match["types"]):
        if part.startswith("typing.Literal"):
            allowed.append("one of " + part[len("typing.Literal[") : -1])
        elif part == "<class 'lit_slowcal.experiments.problems.Problem'>":
            from lit_slowcal.experiments.problems import PROBLEMS

            allowed.append(f"a problem ({', '.join(PROBLEMS)}, or a Problem's import path)")
        else:
            allowed.append(_TYPE_NAMES.get(part, part.replace("<class '", "").replace("'>", "")))
    return f"{match['key']}: {match['value']!r} is not {' or '.join(allowed)}"


class _OneLineErrorParser(LightningArgumentParser):
    """LightningCLI's parser whose refusals are one line, ``lit_slowcal: error: <message>`` (exit status 2).

    The message is jsonargparse's, without the usage it prints before it and without the name of the link
    function that checked the value (the check's own message names the field, the value and what is
    allowed). ``exit_on_error=False`` and jsonargparse's debug mode (``JSONARGPARSE_DEBUG``) keep
    jsonargparse's own behaviour.
    """

    def error(self, message: str, *args: Any, **kwargs: Any) -> Any:
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            return super().error(message, *args, **kwargs)
        message = one_line_message(message)
        prog = self.prog.replace(" [options]", "")
        print(f"lit_slowcal: error: {message} (`{prog} --help` lists the options)", file=sys.stderr, flush=True)
        self.exit(2)


class _ConfigFile(ActionConfigFile):
    """``--config``: a file that is empty or not text is refused naming it (jsonargparse would say only
    "Unexpected config:" or a decode error)."""

    def __call__(self, parser: Any, cfg: Any, values: Any, option_string: Optional[str] = None) -> None:
        path = Path(str(values))
        if path.is_file():
            data = path.read_bytes()
            if not data.strip():
                parser.error(f"--config {path}: the file is empty; a config file is YAML (key: value lines)")
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as err:
                parser.error(f"--config {path}: not a text file ({err}); a config file is YAML")
        super().__call__(parser, cfg, values, option_string)


class SlowcalCLI(KeepCommandLineModelArgs, LightningCLI):
    """LightningCLI with the paper's experiment settings and their derived values linked in.

    A command that loads a checkpoint (``fit --ckpt_path``, ``validate``, ``test``) must describe the
    checkpoint's run: its configuration is compared with the identity stored in the checkpoint
    before anything is built (``lit_slowcal.experiments.identity``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("model_class", LogisticRegression)
        kwargs.setdefault("datamodule_class", MNISTDataModule)
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
        parser = _OneLineErrorParser(**kwargs)
        parser.add_argument("-c", "--config", action=_ConfigFile, help="Path to a configuration file in json or yaml format.")
        return parser

    def setting(self, key: str, default: Any = None) -> Any:
        """A value of this run's configuration by its (dotted) key: ``setting("model.lr")``."""
        return self.run_config().get(key, default)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--method", type=str, default="slowcal", help=", ".join(method_names()))
        parser.add_argument("--num_machines", type=int, default=16, help="M, machines over all processes")
        parser.add_argument("--local_steps", type=int, default=16, help="K, local steps per round")
        parser.add_argument("--batch_size", type=int, default=1, help="b, samples per machine per local step")
        parser.add_argument("--eval_every", type=int, default=10, help="rounds between test evaluations")
        parser.add_argument("--run_dir", type=str, default="runs", help="folder of the CSV and W&B logs")
        parser.add_argument(
            "--checkpoint_every", type=int, default=10, help="rounds between checkpoints (last.ckpt; 0: epoch ends only)"
        )
        parser.add_argument("--wandb", type=bool, default=True, help="log to Weights & Biases (offline without an account)")
        parser.add_argument("--wandb_project", type=str, default="lit_slowcal")
        parser.add_argument(
            "--diagnostics",
            type=bool,
            default=True,
            help="log per-round diagnostics: dispersion before each sync, per-step movement of x (and w)",
        )
        parser.add_argument(
            "--step_every",
            type=int,
            default=10,
            help="with --diagnostics: measure the per-step movement of x and w in every N-th round (0: never)",
        )
        parser.add_argument(
            "--objective",
            type=bool,
            default=True,
            help="log train_objective at every evaluation, and excess_loss, f_star and G_star from x* (float64, cached)",
        )
        parser.add_argument(
            "--optimum_tol",
            type=float,
            default=1e-8,
            help="the solver's tolerance on ||grad f(x*)||; with weight decay lambda, f* is then exact to tol^2 / (2 lambda) "
            "(MNIST, lambda = 1e-4: 5e-13)",
        )
        parser.add_argument(
            "--cache_dir",
            type=Optional[str],
            default=None,
            help="folder of cached optima (default: $XDG_CACHE_HOME/lit_slowcal or ~/.cache/lit_slowcal)",
        )
        parser.add_argument(
            "--participation",
            type=Optional[Union[int, float]],
            default=None,
            help="machines taking part in each round: a count S (1..M) or a fraction of M in (0, 1], drawn every "
            "round from the seed; unset: all of them",
        )
        parser.add_argument(
            "--threads",
            type=THREADS_TYPE,
            default="auto",
            help="torch threads: auto (1 for steps this small, see lit_slowcal/experiments/threads.py; keeps "
            "OMP_NUM_THREADS or MKL_NUM_THREADS when set), N, or 0 for torch's default",
        )
        for sources, target, compute_fn in _PARSE_LINKS:
            parser.link_arguments(sources, target, compute_fn=compute_fn)
        # The model's shape and loss are the problem's.
        parser.link_arguments("data", "model.input_dim", compute_fn=lambda d: d.problem.input_dim, apply_on="instantiate")
        parser.link_arguments("data", "model.num_classes", compute_fn=lambda d: d.problem.num_outputs, apply_on="instantiate")
        parser.link_arguments("data", "model.loss", compute_fn=lambda d: d.problem.loss, apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        self._configure_threads()
        # What defines this run (lit_slowcal.experiments.identity): stored in its checkpoints, and
        # compared with the checkpoint it loads, if any, before anything is built.
        parser = self._parser(self.subcommand)
        dumped = parser.dump(self.run_config(), format="json", skip_unset=False, skip_validation=True)
        self.identity = run_identity(json.loads(dumped))
        if self.subcommand and self.setting("ckpt_path") == "":
            raise ValueError("--ckpt_path is empty: pass a checkpoint file, or last for this run's newest checkpoint")
        if self.subcommand in ("validate", "test", "predict") and self.setting("ckpt_path") is None:
            print(
                f"note: {self.subcommand} without --ckpt_path evaluates the untrained starting model; pass "
                "--ckpt_path <run folder>/checkpoints/last.ckpt to evaluate a trained one",
                file=sys.stderr,
                flush=True,
            )
        if self.subcommand and self.setting("ckpt_path") == "last":  # Lightning's own "last" would not find ours
            self.config[self.subcommand]["ckpt_path"] = str(self.last_checkpoint())
        self._resumed_step = 0
        if self.subcommand and self.setting("ckpt_path"):
            self._check_checkpoint(self.setting("ckpt_path"))

    def _check_checkpoint(self, path: str) -> None:
        """Refuse, before anything is built, a checkpoint that is unreadable, of another run, or done training."""
        if "://" in path or not Path(path).is_file():  # remote, "best", missing...: Lightning resolves or refuses it
            return
        checkpoint = read_checkpoint(path)
        verb = "resume" if self.subcommand == "fit" else f"{self.subcommand} with"
        missing = [k for k in ("pytorch-lightning_version", "state_dict", "global_step") if k not in checkpoint]
        if missing:
            raise ValueError(
                f"Cannot {verb} {path}: it is not a Lightning checkpoint (it lacks {', '.join(missing)}; its keys: "
                f"{', '.join(repr(k) for k in list(checkpoint)[:5]) or 'none'}). Pass a last.ckpt written by `lit_slowcal fit`."
            )
        check_same_run(path, checkpoint, self.identity, verb)
        self._resumed_step = step = int(checkpoint.get("global_step", 0))
        if self.subcommand != "fit":
            return
        get = self.setting
        steps_per_epoch = steps_per_round(get("method"), get("local_steps")) * num_rounds(
            MNIST_TRAIN_SIZE, get("num_machines"), get("local_steps"), get("batch_size")
        )
        epochs_done, max_epochs, max_steps = step // steps_per_epoch, get("trainer.max_epochs"), get("trainer.max_steps")
        if is_int(max_epochs) and 0 <= max_epochs <= epochs_done:
            stop = f"{epochs_done} epoch(s) ({step} steps) and trainer.max_epochs is {max_epochs}"
            more = f"--trainer.max_epochs={epochs_done + 1}"
        elif is_int(max_steps) and 0 <= max_steps <= step:
            stop, more = f"{step} steps and trainer.max_steps is {max_steps}", f"--trainer.max_steps={step + steps_per_epoch}"
        else:
            return
        raise ValueError(
            f"Cannot resume {path}: its run has trained {stop}, so there is nothing to train. Pass {more} (or more) "
            f"to train on, or use `test --ckpt_path {path}` to evaluate it."
        )

    def _configure_threads(self) -> None:
        """Torch's threads for this run (``--threads``), set before the trainer and its launcher exist."""
        trainer = self.setting("trainer") or {}
        processes = _processes_per_node(trainer.get("devices"), trainer.get("accelerator"))
        nodes = trainer.get("num_nodes")
        world = processes * (nodes if is_int(nodes) and nodes > 0 else 1)
        features = self.setting("model.input_dim") or 784
        if self.subcommand in (None, "fit"):
            machines = self.setting("num_machines")
            work = WorkSize(
                machines=max(1, machines // world) if is_int(machines) else 1,
                samples=per_step_batch(self.setting("method"), self.setting("local_steps"), self.setting("batch_size")),
                features=features,
                per_process=world > 1,
            )
        else:  # validate, test, predict: one forward of the averaged model per evaluation batch
            work = WorkSize(1, self.setting("data.eval_batch_size") or 1, features, what="evaluation batch")
        rank_zero = all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK"))
        configure_threads(self.setting("threads"), work, processes=processes, verbose=rank_zero)

    def last_checkpoint(self) -> Path:
        """The newest ``last.ckpt`` of this run under ``run_dir``: of its name (method, M, K, b and seed) and
        of its identity (``self.identity``: the learning rate and every other setting too).

        ``--ckpt_path last`` continues from it; the continuation logs into a new version folder, so the
        interrupted run's logs stay as they were. Runs of the same name with other settings (another
        learning rate) share the name's folder: their checkpoints are passed over, and when none is this
        run's, the error names each one considered and why it is not.
        """
        folder = Path(self.setting("run_dir")) / self.run_name()
        found = sorted(folder.glob("version_*/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
        if not found:
            raise FileNotFoundError(
                f"--ckpt_path last: no checkpoint of run {self.run_name()} in {folder}/version_*/checkpoints/ "
                f"(checkpoints are written every `checkpoint_every` rounds). Pass a checkpoint file instead."
            )
        reasons = []
        for path in found:
            try:
                check_same_run(path, read_checkpoint(path), self.identity)
                return path
            except ValueError as err:  # another run of this name, or an unreadable file
                why = str(err).split(": it is a different run: ", 1)[-1].split(" (only ", 1)[0]
                reasons.append(f"{path.relative_to(folder)} ({why})")
        raise ValueError(
            f"--ckpt_path last: none of the {len(found)} checkpoints of run {self.run_name()} in {folder} is of this "
            f"run: {'; '.join(reasons)} (only {allowed_on_resume()} may change on resume; pass the settings of the run "
            "to continue, a checkpoint file, or start a new run without --ckpt_path)"
        )

    def _checkpoint_callback(self) -> LastCheckpoint:
        # last.ckpt only, every `checkpoint_every` rounds and when training ends.
        rounds = check_int("checkpoint_every", self.setting("checkpoint_every"), minimum=0)
        steps = rounds * steps_per_round(self.setting("method"), self.setting("local_steps"))
        return LastCheckpoint(every_n_train_steps=steps or None)

    def _diagnostics(self) -> Diagnostics:
        return diagnostics_callback(self.setting)

    def run_name(self) -> str:
        """``<method>_M<M>_K<K>_b<b>_seed<seed>``: the run's folder under ``run_dir``."""
        return run_name(self.setting)

    def _version(self) -> int:
        """This run's version folder number under ``run_dir/<run name>``: the next free one.

        Every rank must write to the same version folder: the launching process (rank 0) picks the
        next free version and its DDP children, started later, inherit it through the environment.
        The launcher claims the folder by creating it, so that runs of the same name started at
        the same time (two sweeps) never share one.
        """
        version = os.environ.get(RUN_VERSION_ENV)
        if version is None:
            version = str(claim_version(self.setting("run_dir"), self.run_name()))
            os.environ[RUN_VERSION_ENV] = version
            self._owns_version_env = True
        return int(version)

    def run_folder(self) -> Path:
        """``run_dir/<run name>/version_<n>``: where the run's logs, config.yaml, figure and checkpoints go."""
        return Path(self.setting("run_dir")) / self.run_name() / f"version_{self._version()}"

    def _loggers(self) -> list[Logger]:
        run_dir, name, version = self.setting("run_dir"), self.run_name(), self._version()
        loggers: list[Logger] = [CSVLogger(save_dir=run_dir, name=name, version=version)]
        if self.setting("wandb") and self.subcommand == "fit":
            loggers.append(self._wandb_logger(name, str(self.run_folder())))
        return loggers

    def _wandb_logger(self, name: str, save_dir: str) -> WandbLogger:
        """Online when logged in and reachable, otherwise offline with a note on how to sync later."""
        launcher = os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"
        kwargs = dict(
            project=self.setting("wandb_project"),
            name=name,
            save_dir=save_dir,
            config=_flat_config(self.run_config()),
        )
        offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun") or not wandb_logged_in()
        if offline:
            reason = "no credentials (WANDB_API_KEY or `wandb login`) found"
        elif launcher:
            # Start the run now, with a bounded wait, so that a missing network falls back to offline
            # instead of failing later; the run is the one a `wandb agent` sweep prepared, if any.
            os.environ.setdefault("WANDB_INIT_TIMEOUT", "30")
            logger = WandbLogger(**kwargs)
            try:
                logger.experiment
                self._wandb_offline = False
                return logger
            except Exception as err:  # no network, server down, bad key: never lose the run for it
                import wandb

                try:
                    wandb.finish(exit_code=1)
                finally:
                    wandb.teardown()  # forget the online settings: the offline run starts afresh
                reason = f"cannot reach W&B ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
                offline = True
        if offline:
            os.environ["WANDB_MODE"] = "offline"
            if launcher:
                print(
                    f"W&B: {reason}; logging offline. Upload later with `wandb sync <run folder>/wandb/offline-run-*` "
                    "(the summary prints the folder), or pass --wandb=false to turn W&B off.",
                    flush=True,
                )
        self._wandb_offline = offline
        return WandbLogger(offline=offline, **kwargs)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer_config = self.run_config(initialized=True).get("trainer")
        if trainer_config.get("logger") in (None, True):
            kwargs["logger"] = self._loggers()
        elif trainer_config.get("logger") is False and trainer_config.get("default_root_dir") is None:
            # Without a logger, Lightning writes config.yaml, the figure and checkpoints to the
            # default_root_dir, the current folder by default: keep them in the run folder instead.
            kwargs["default_root_dir"] = str(self.run_folder())
        callbacks = trainer_config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        extra = [RunIdentity(self.identity)]
        if trainer_config.get("enable_checkpointing") is not False and not any(isinstance(c, ModelCheckpoint) for c in callbacks):
            extra.append(self._checkpoint_callback())
        if not any(isinstance(c, Diagnostics) for c in callbacks):
            extra.append(self._diagnostics())
        kwargs["callbacks"] = [*callbacks, *extra]
        try:
            trainer = super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ModuleNotFoundError) as err:  # Lightning's refusal of what this machine lacks
            message = " ".join(str(err).split())
            if not re.search(r"accelerator|devices|gpu|GPU|MPS|TPU|xla|backend", message):
                raise ValueError(f"Invalid trainer setting: {message}") from err
            accelerator, devices = self.setting("trainer.accelerator"), self.setting("trainer.devices")
            advice = "--trainer.accelerator=cpu runs on any machine" if accelerator != "cpu" else "use --trainer.devices=N, N >= 1"
            raise ValueError(
                f"This machine cannot meet trainer.accelerator={accelerator}, trainer.devices={devices}: {message} ({advice})"
            ) from err
        strategy = trainer.strategy
        if not isinstance(strategy, PeriodicAveragingStrategy):
            raise ValueError(
                f"trainer.strategy must be 'periodic_averaging' (or PeriodicAveragingStrategy); got "
                f"{type(strategy).__name__}. The machines synchronise through it."
            )
        strategy.sync_every = get_method(self.setting("method")).sync_period(self.setting("local_steps"))
        machines = self.setting("num_machines")
        participation = check_participation(self.setting("participation"), machines)
        if participation is not None:
            probe = get_method(self.setting("method")).optimizer([torch.zeros(1, requires_grad=True)], self.model.hparams, steps=1)
            if not getattr(probe, "supports_participation", True):
                raise ValueError(
                    f"Invalid participation: {participation!r} with method {self.setting('method')} ({type(probe).__name__} "
                    "keeps per-machine state that machines outside a round would update; leave participation unset)"
                )
        seed = self.setting("seed_everything")
        strategy.server_options.update(participation=participation, participation_seed=seed if isinstance(seed, int) and seed >= 0 else 0)
        if machines % trainer.world_size:
            raise ValueError(
                f"num_machines = {machines} is not divisible by the number of processes ({trainer.world_size} = "
                f"trainer.devices x trainer.num_nodes); every process hosts num_machines / processes machines. "
                f"Use a multiple of {trainer.world_size}."
            )
        return trainer

    def before_fit(self) -> None:
        self._start = time.perf_counter()
        # Problems other than MNIST have their own N, hence their own number of rounds per epoch.
        data = self.datamodule
        if isinstance(self.trainer.val_check_interval, int) and isinstance(data, MNISTDataModule):
            self.trainer.val_check_interval = min(self.trainer.val_check_interval, data.num_rounds)

    def after_fit(self) -> None:
        if self.trainer.global_step == self._resumed_step:
            raise ValueError(
                f"The run trained nothing: it was at step {self.trainer.global_step} before and after fit with "
                f"trainer.max_epochs={self.trainer.max_epochs}, trainer.max_steps={self.trainer.max_steps} and "
                f"trainer.limit_train_batches={self.trainer.limit_train_batches}; raise the one that stops it."
            )
        if not self.trainer.is_global_zero:
            return
        metrics = self.trainer.callback_metrics
        get = lambda k: float(metrics[k]) if k in metrics else float("nan")  # noqa: E731
        data: MNISTDataModule = self.datamodule
        csv = next((lg for lg in self.trainer.loggers if isinstance(lg, CSVLogger)), None)
        lines = [
            "",
            "lit_slowcal summary",
            f"  method {self.setting('method')}   M={data.num_machines}  K={self.setting('local_steps')}"
            f"  b={self.setting('batch_size')}   rounds {self.trainer.strategy.num_syncs}/{data.num_rounds}",
            f"  final test accuracy {get('test_acc'):.4f}   test loss {get('test_loss'):.4f}",
            *_diagnostics_lines(self.trainer, get),
            f"  wall time {time.perf_counter() - self._start:.1f} s",
        ]
        if csv is not None:
            lines.append(f"  logs: {csv.log_dir}/metrics.csv")
        if getattr(self, "_wandb_offline", False):
            wandb_dir = next(lg for lg in self.trainer.loggers if isinstance(lg, WandbLogger)).save_dir
            lines.append(f"  W&B (offline): upload later with `wandb sync {wandb_dir}/wandb/offline-run-*`")
        if data.partition_png is not None:
            lines.append(f"  class distribution: {data.partition_png}")
        print("\n".join(lines), flush=True)


def claim_version(run_dir: str | Path, name: str) -> int:
    """The next free version folder ``run_dir/<name>/version_<n>``, claimed by creating it: runs of one name
    started at the same time (two sweeps, a sweep's workers) never share one."""
    number = CSVLogger(save_dir=str(run_dir), name=name).version
    while True:
        try:
            (Path(run_dir) / name / f"version_{number}").mkdir(parents=True)
            return number
        except FileExistsError:
            number += 1


def run_name(get: Callable[..., Any]) -> str:
    """``<method>_M<M>_K<K>_b<b>_seed<seed>``: a run's folder under ``run_dir``, from ``get(key)``, its
    configuration's values (``SlowcalCLI.setting``, or ``dict.get`` of the parsed ``fit`` section)."""
    return (
        f"{get('method')}_M{get('num_machines')}_K{get('local_steps')}_b{get('batch_size')}"
        f"_seed{get('seed_everything')}"
    )


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


def _diagnostics_lines(trainer: Trainer, get: Any) -> list[str]:
    """The summary's lines on the objective: f(x), the excess loss, f*, G_* (or why there is none)."""
    found = next((c for c in trainer.callbacks if isinstance(c, Diagnostics)), None)
    if found is None or found.objective is None:
        return []
    line = f"  train objective {get('train_objective'):.6f}"
    if found.optimum is not None:
        line += f"   excess loss {get('excess_loss'):.4e}   f* {found.optimum.value:.6f}   G_* {found.g_star:.4f}"
    lines = [line]
    if found.note:
        lines.append(f"  ({found.note})")
    return lines


def _processes_per_node(devices: Any, accelerator: Any) -> int:
    """The processes a Trainer with these settings starts on this node (1 where it cannot tell)."""
    if isinstance(devices, (list, tuple)):
        return max(1, len(devices))
    if isinstance(devices, str):
        text = devices.strip()
        if "," in text:
            return max(1, len([d for d in text.split(",") if d.strip()]))
        devices = int(text) if text.lstrip("-").isdigit() else text
    if is_int(devices) and devices > 0:
        return devices
    if devices in (-1, "auto") and str(accelerator) in ("gpu", "cuda", "auto"):
        import torch

        return max(1, torch.cuda.device_count())
    return 1


def _seed(seed: Any) -> int:
    if not is_int(seed) or not 0 <= seed < 2**32:
        raise ValueError(
            f"Invalid seed_everything: {seed!r} (must be an integer from 0 to {2**32 - 1}: it seeds torch, numpy and the data split)"
        )
    return seed


#: The settings linked from others while the command line is parsed: (sources, target, compute_fn or None).
_PARSE_LINKS: tuple[tuple[Any, str, Optional[Callable[..., Any]]], ...] = (
    ("method", "model.method", None),
    ("num_machines", "model.num_machines", None),
    ("num_machines", "data.num_machines", None),
    (("method", "local_steps", "batch_size"), "data.batch_size", per_step_batch),
    (("method", "local_steps"), "data.steps_per_round", steps_per_round),
    (("num_machines", "local_steps", "batch_size", "eval_every"), "trainer.val_check_interval", _val_check_interval),
    ("seed_everything", "data.seed", _seed),
    ("seed_everything", "model.seed", _seed),
)
#: The options other settings are computed from while parsing (``_PARSE_LINKS``): a sweep checks every
#: combination of their values (``lit_slowcal.experiments.sweep.runner``), any other option value by value.
PARSE_LINK_SOURCES = frozenset(n for sources, _, _ in _PARSE_LINKS for n in ((sources,) if isinstance(sources, str) else sources))


def _flat_config(config: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (config.as_dict() if hasattr(config, "as_dict") else dict(config)).items():
        if key in ("config", "trainer"):
            continue
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, (int, float, str, bool)) or v is None:
                    out[f"{key}.{k}"] = v
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[key] = value
    return out


# Every rank evaluates the same synchronised x on the whole test set: nothing to sync.
warnings.filterwarnings("ignore", message=r".*sync_dist=True.*when logging on epoch level")
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")


def run(args: Optional[list[str]] = None) -> None:
    """The training CLI: ``fit``, ``validate``, ``test``, ``predict`` (``SlowcalCLI``), with SIGTERM as exit 143 and
    Ctrl-C as exit 130, each with how to continue."""
    interrupted = "Interrupted (Ctrl-C). Continue with the same command and --ckpt_path last (from its last checkpoint)."
    try:
        SlowcalCLI(args=args)
    except SystemExit as err:
        if isinstance(err.__context__, KeyboardInterrupt):  # Lightning exits with status 1 after a Ctrl-C
            print(interrupted, file=sys.stderr, flush=True)
            raise SystemExit(128 + signal.SIGINT) from None
        raise
    except KeyboardInterrupt:  # outside the trainer (while building it)
        print(interrupted, file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGINT) from None
    except SIGTERMException:
        # Lightning stops at the end of the current round and raises SystemExit(None), i.e. status 0;
        # a terminated job must not look like a finished one.
        print("Stopped by SIGTERM. Continue with the same command and --ckpt_path last.", file=sys.stderr, flush=True)
        raise SystemExit(128 + signal.SIGTERM) from None


if __name__ == "__main__":
    run()
