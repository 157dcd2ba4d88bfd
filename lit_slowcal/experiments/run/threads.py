"""Torch's intra-op threads for the main job: ``--threads auto`` (the default), ``N`` or ``0``.

The model is tiny: one local step of the default job is a few small matmuls and elementwise updates.
Torch splits such ops over its OpenMP threads, and an OpenMP thread that waits for a core it does not
get (another job runs there) stalls every op of the step: beside another busy process, a small step
with two threads can take many times as long as with one, while idle, two threads gain little until a
step touches a great deal of data. ``python benchmarks/bench_conditions.py --steps`` times one local
step with 1 and 2 threads, idle and busy, over a range of machines x samples.

``auto``: 1 thread while a step of this process touches fewer than ``AUTO_MIN_WORK`` samples x
features (every configuration of the paper does), else ``min(CPUs / processes on this node, 4)``.
Validate and test size one evaluation batch (by default: 1 thread).

The user's settings win: ``auto`` keeps torch's setting when ``OMP_NUM_THREADS`` or
``MKL_NUM_THREADS`` is set in the environment (the sweep runner sets ``OMP_NUM_THREADS``), and an
explicit ``--threads N`` (from 1 to 4 x the machine's CPUs, ``max_threads``) wins over everything; ``--threads 0`` leaves torch and Lightning their
defaults (Lightning's launcher sets CPUs / processes threads when ``OMP_NUM_THREADS`` is unset).
A chosen count is exported as ``OMP_NUM_THREADS`` too, so that Lightning's DDP launcher (which resets
torch's threads unless it is set) and the processes it starts keep it. Nothing is restored when the
run ends: a caller that trains later (``run=False``) needs the same setting.

Threads change how ops are split, and with that possibly the last bits of a result; with the same
thread count the results are bitwise those of a run without this option.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

from lit_slowcal._validation import is_int
from lit_slowcal.experiments.print_once import note

if TYPE_CHECKING:
    from lit_slowcal.experiments.train.shape import RunShape

__all__ = [
    "AUTO_MAX_THREADS",
    "AUTO_MIN_WORK",
    "THREADS_PER_CPU",
    "THREADS_TYPE",
    "ThreadChoice",
    "ThreadsError",
    "WorkSize",
    "check_thread_count",
    "choose_threads",
    "configure_run_threads",
    "configure_threads",
    "max_threads",
    "parse_threads",
    "processes_per_node",
    "usable_cpus",
    "world_size_of",
]

#: Samples x features per step (of one process) from which ``auto`` uses more than one thread.
AUTO_MIN_WORK = 50_000_000
#: The most threads ``auto`` uses: the ops of one step stop scaling well beyond a few threads.
AUTO_MAX_THREADS = 4
#: Environment variables through which a user sets torch's threads; ``auto`` respects them.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: How many threads per CPU of the machine ``--threads N`` may ask for (``max_threads``).
THREADS_PER_CPU = 4


def max_threads() -> int:
    """The most threads ``--threads N`` may ask for: ``THREADS_PER_CPU`` x this machine's CPUs (``os.cpu_count()``).

    More threads than CPUs never speed a step up (they take turns on the cores); up to 4 per CPU lets a run
    split its ops as a machine with 4x the cores would (the same last bits). Far beyond, the threads cannot
    even be started ("can't start new thread" in ``fit``, a crash in ``sweep``).
    """
    return THREADS_PER_CPU * (os.cpu_count() or 1)


def _allowed() -> str:
    return f"auto, 0 for torch's default, or an integer from 1 to {max_threads()} ({THREADS_PER_CPU} x this machine's CPUs)"


Setting = Union[str, int]


class ThreadsError(argparse.ArgumentTypeError, ValueError):
    """A ``--threads`` value that is not allowed (an ``ArgumentTypeError`` so the parser shows the message)."""


def parse_threads(value: Any) -> Setting:
    """``"auto"`` or an integer >= 0 from a command-line string or a config value.

    Raises:
        ThreadsError: ``Invalid threads: '-1' (must be auto, 0 for torch's default, or an integer from 1 to 8 (...))``.
    """
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    number: Optional[int] = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().lstrip("+").isdigit():
        number = int(value)
    if number is None or number < 0 or number > max_threads():
        raise ThreadsError(f"Invalid threads: {value!r} (must be {_allowed()})")
    return number


def check_thread_count(name: str, value: Any) -> int:
    """``value`` if it is 0 (torch's default) or a count from 1 to ``max_threads()``: the sweep's ``--threads``.

    Raises:
        ThreadsError: ``Invalid --threads: 99999 (must be 0 for torch's default or an integer from 1 to 8 (...))``.
    """
    if not is_int(value) or not 0 <= value <= max_threads():
        raise ThreadsError(
            f"Invalid {name}: {value!r} (must be 0 for torch's default or an integer from 1 to {max_threads()} "
            f"({THREADS_PER_CPU} x this machine's CPUs))"
        )
    return value


class _ThreadsType:
    """The parser's type for ``--threads`` (its name appears in ``--help``)."""

    __name__ = "threads"

    def __call__(self, value: Any) -> Setting:
        return parse_threads(value)

    def __repr__(self) -> str:
        return f"auto or int from 0 to {max_threads()}"


#: ``type=`` of the ``--threads`` argument: refuses a bad value with the message above, at parse time.
THREADS_TYPE = _ThreadsType()


@dataclass(frozen=True)
class WorkSize:
    """What one step of this process computes on: ``machines`` x ``samples`` x ``features``."""

    machines: int
    samples: int
    features: int
    per_process: bool = False  # the machines are this process's share (several processes)
    what: str = "step"  # or "evaluation batch" (validate, test: no machines, one forward)

    @property
    def size(self) -> int:
        return self.machines * self.samples * self.features

    def describe(self) -> str:
        def n(count: int, word: str) -> str:
            return f"{count} {word}{'' if count == 1 else 's'}"

        machines = n(self.machines, "machine") + (" per process" if self.per_process else "") + " x "
        if self.what != "step" and self.machines == 1:
            machines = ""
        return f"{machines}{n(self.samples, 'sample')} x {n(self.features, 'feature')} per {self.what}"


@dataclass(frozen=True)
class ThreadChoice:
    """What to do: set ``threads`` (None: leave torch as it is), and why, in words."""

    threads: Optional[int]
    reason: str


def choose_threads(
    setting: Setting,
    work: WorkSize,
    *,
    cpus: int,
    processes: int = 1,
    environ: Mapping[str, str] = {},  # noqa: B006 (read only)
) -> ThreadChoice:
    """The thread policy as a pure function (see the module docstring).

    Args:
        setting: ``"auto"``, ``0`` (torch's default) or ``N >= 1``.
        work: the size of one step of this process.
        cpus: the CPUs this process may use.
        processes: processes of this run on this node (they share the CPUs).
        environ: the environment's thread settings made by the user (not by an earlier run).
    """
    setting = parse_threads(setting)
    if setting == 0:
        return ThreadChoice(None, "--threads 0: torch's default")
    if setting != "auto":
        return ThreadChoice(int(setting), f"--threads {setting}")
    user = [f"{name}={environ[name]}" for name in THREAD_ENV_VARS if environ.get(name)]
    if user:
        return ThreadChoice(None, f"auto: {' and '.join(user)} set; --threads N to choose")
    if work.size < AUTO_MIN_WORK:
        threads = 1
    else:
        threads = max(1, min(AUTO_MAX_THREADS, cpus // max(1, processes)))
    return ThreadChoice(threads, f"auto: {work.describe()}; --threads N to choose")


class _State:
    """This process's record: what it exported (to tell it from a user's setting) and what it printed."""

    exported: Optional[str] = None  # the OMP_NUM_THREADS value this module set
    before: Optional[tuple[Optional[str], int]] = None  # (OMP_NUM_THREADS, torch threads) before that
    printed: Optional[int] = None  # the thread count last printed


def usable_cpus() -> int:
    """The CPUs this process may use (its affinity where the system tells it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def user_environ() -> dict[str, str]:
    """The thread variables of ``os.environ``, less an ``OMP_NUM_THREADS`` this module exported itself.

    A value Lightning's launcher exported in an earlier run of this process (one with ``--threads 0``)
    counts as the user's, as does the sweep runner's: neither can be told from a user's setting.
    """
    env = {name: os.environ[name] for name in THREAD_ENV_VARS if os.environ.get(name)}
    if _State.exported is not None and env.get("OMP_NUM_THREADS") == _State.exported:
        env.pop("OMP_NUM_THREADS")
    return env


def configure_threads(setting: Setting, work: WorkSize, *, processes: int = 1, verbose: bool = True) -> int:
    """Choose (``choose_threads``) and apply: torch's threads and ``OMP_NUM_THREADS``.

    Prints ``threads: N (why)`` when ``verbose`` (rank 0): once per process, and again only when a
    later run of the same process (a sweep) trains with another count.

    Returns:
        The thread count the run will train with.
    """
    import torch

    cpus = usable_cpus()
    environ = user_environ()
    choice = choose_threads(setting, work, cpus=cpus, processes=processes, environ=environ)
    if choice.threads is not None:
        if _State.before is None:
            _State.before = (os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads())
        torch.set_num_threads(choice.threads)
        # Lightning's launcher resets torch's threads unless OMP_NUM_THREADS is set; DDP children inherit it.
        os.environ["OMP_NUM_THREADS"] = _State.exported = str(choice.threads)
        threads = choice.threads
    else:
        if _State.exported is not None and os.environ.get("OMP_NUM_THREADS") == _State.exported:
            # An earlier run of this process chose; torch's default is what was there before it.
            omp, torch_threads = _State.before or (None, torch.get_num_threads())
            torch.set_num_threads(torch_threads)
            if omp is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = omp
            _State.exported = None
        if "OMP_NUM_THREADS" not in os.environ and "MKL_NUM_THREADS" in environ:
            # Keep the count MKL_NUM_THREADS gave torch: Lightning's launcher reads only OMP_NUM_THREADS.
            os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
        if "OMP_NUM_THREADS" in os.environ:
            threads = torch.get_num_threads()
        else:  # what Lightning's launcher will set (CPUs / processes), torch's default otherwise
            threads = max(1, cpus // max(1, processes))
    if verbose and threads != _State.printed:
        note(f"threads: {threads} ({choice.reason})")  # a sweep's trials: once per sweep
        _State.printed = threads
    return threads


def processes_per_node(devices: Any, accelerator: Any) -> int:
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


def world_size_of(trainer: Mapping[str, Any]) -> int:
    """The processes of all nodes a Trainer with these settings (``trainer.*`` of the config) starts."""
    nodes = trainer.get("num_nodes")
    return processes_per_node(trainer.get("devices"), trainer.get("accelerator")) * (
        nodes if is_int(nodes) and nodes > 0 else 1
    )


def configure_run_threads(get: Callable[..., Any], subcommand: Optional[str], shape: RunShape) -> int:
    """``configure_threads`` for a CLI run: ``get(key)`` its settings, ``shape`` its ``RunShape`` (a fit's step
    takes its per-step batch on each of its machines per process; validate, test and predict size one
    evaluation batch). Set before the trainer exists."""
    trainer = get("trainer") or {}
    processes = processes_per_node(trainer.get("devices"), trainer.get("accelerator"))
    features = get("model.input_dim") or 784
    if subcommand in (None, "fit"):
        work = WorkSize(
            machines=shape.machines_per_process,
            samples=shape.per_step_batch,
            features=features,
            per_process=shape.world_size > 1,
        )
    else:  # validate, test, predict: one forward of the averaged model per evaluation batch
        work = WorkSize(1, get("data.eval_batch_size") or 1, features, what="evaluation batch")
    rank_zero = all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK"))
    return configure_threads(get("threads"), work, processes=processes, verbose=rank_zero)
