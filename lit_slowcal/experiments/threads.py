"""Torch's intra-op threads for the main job: ``--threads auto`` (the default), ``N`` or ``0``.

The model is tiny: one local step of the default job (16 machines x 1 sample x 784 features) is a
few small matmuls and elementwise updates of 16 x 7,850 parameters, about 0.4 ms on one core. Torch
splits such ops over its OpenMP threads, and an OpenMP thread that waits for a core it does not get
(another job runs there) stalls every op of the step. Measured on this project's 2-core machine
(torch 2.14.1), the default job trains in 1.8 s alone with torch's default 2 threads, but in 6.8 s
each when two such jobs run at once, 7.6 s beside a torch process doing 2-thread matmuls and 12.2 s
beside a 2-thread float64 solver; with 1 thread it takes 1.9 s alone, 2.0 s each as a pair and
3.1 s beside the matmuls.

The rule for ``auto`` comes from timing one local step (``SimulatedMachines`` of
``nn.Linear(784, 10)``, m machines x b samples, forward + backward + ``SlowcalSGD`` step) with 1
and 2 threads, idle and beside a 2-thread float32 matmul loop, on the 2-core machine
(``python benchmarks/bench_conditions.py --steps``: idle and busy samples alternate, and only
samples during which no other process used the CPUs count). ms per step, medians; the busy column
gives 2t/1t of separate runs, to show how erratic it is:

==========  =========  =======  =======  =====  ==========================
m x b       samples    idle 1t  idle 2t  2t/1t  busy 2t/1t (runs)
==========  =========  =======  =======  =====  ==========================
16 x 1      16         0.37     0.36     0.97   2.9, 4.8, 1.4
64 x 1      64         0.90     0.68     0.77   1.5, 33, 2.6
16 x 16     256        0.57     0.46     0.81   16, 113, 1.1
64 x 16     1,024      1.46     0.89     0.60   9.0, 2.1, 7.7
1024 x 1    1,024      11.5     8.2      0.71   1.9, 1.3
64 x 64     4,096      5.8      3.1      0.54   0.95, 1.8
1024 x 4    4,096      16.7     10.0     0.60   1.4, 4.4
64 x 256    16,384     21.2     11.6     0.55   1.9
1024 x 16   16,384     30.5     17.0     0.56   1.4
64 x 1024   65,536     76.2     39.6     0.52   1.4, 1.4
256 x 256   65,536     79.5     41.4     0.52   1.0, 1.2
256 x 1024  262,144    302      155      0.51   0.83, 0.8
==========  =========  =======  =======  =====  ==========================

Idle, two threads gain little below 1,000 samples per step (0.8-1.0x the time) and 1.7-2x above.
Beside another multi-threaded process they lose, erratically: up to 100x below 1,000 samples per
step (the default job's size is 16), 1-4x up to 16,384; only from 65,536 samples (5e7 samples x
features) per step do they stay within 1.5x of one thread, and from 262,144 they win there too.
Another process busy on one core does the same (the samples the table leaves out: 2 threads took a
median 2-4x the time of one). So:

``auto``: 1 thread while a step of this process touches fewer than ``AUTO_MIN_WORK`` = 5e7
samples x features (every configuration of the paper: at most 64 machines x 64 samples x 784
features = 3.2e6), else ``min(CPUs / processes on this node, 4)``. Validate and test size one
evaluation batch (10,000 x 784 = 7.8e6 by default: 1 thread).

The user's settings win: ``auto`` keeps torch's setting when ``OMP_NUM_THREADS`` or
``MKL_NUM_THREADS`` is set in the environment (the sweep runner sets ``OMP_NUM_THREADS``), and an
explicit ``--threads N`` (from 1 to 4 x the machine's CPUs, ``max_threads``) wins over everything; ``--threads 0`` leaves torch and Lightning their
defaults (Lightning's launcher sets CPUs / processes threads when ``OMP_NUM_THREADS`` is unset).
A chosen count is exported as ``OMP_NUM_THREADS`` too, so that Lightning's DDP launcher (which resets
torch's threads unless it is set) and the processes it starts keep it. Nothing is restored when the
run ends: a caller that trains later (``run=False``) needs the same setting.

Threads change how ops are split, and with that possibly the last bits of a result; with the same
thread count the results are bitwise those of a run without this option (the default job with one
thread: test accuracy 0.9124000072479248, test loss 0.30589842796325684 in metrics.csv).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from lit_slowcal._validation import is_int
from lit_slowcal.experiments.notes import note

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
    even be started: 100,000 failed with "can't start new thread" in ``fit`` and crashed ``sweep`` (exit 139).
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


def configure_run_threads(get: Callable[..., Any], subcommand: Optional[str], samples_per_step: int) -> int:
    """``configure_threads`` for a CLI run: ``get(key)`` its settings, ``samples_per_step`` a machine's per-step
    batch (a fit; validate, test and predict size one evaluation batch). Set before the trainer exists."""
    trainer = get("trainer") or {}
    processes = processes_per_node(trainer.get("devices"), trainer.get("accelerator"))
    world = world_size_of(trainer)
    features = get("model.input_dim") or 784
    if subcommand in (None, "fit"):
        machines = get("num_machines")
        work = WorkSize(
            machines=max(1, machines // world) if is_int(machines) else 1,
            samples=samples_per_step,
            features=features,
            per_process=world > 1,
        )
    else:  # validate, test, predict: one forward of the averaged model per evaluation batch
        work = WorkSize(1, get("data.eval_batch_size") or 1, features, what="evaluation batch")
    rank_zero = all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK"))
    return configure_threads(get("threads"), work, processes=processes, verbose=rank_zero)
