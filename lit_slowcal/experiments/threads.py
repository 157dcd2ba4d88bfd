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
and 2 threads, on an idle machine and beside a 2-thread float32 matmul loop
(``python benchmarks/bench_conditions.py --steps``; ms per step, median of 5, 2 cores):

=======  ==========  ========  ========  =====  ========  ========  =====
m x b    samples     idle 1t   idle 2t   2t/1t  busy 1t   busy 2t   2t/1t
=======  ==========  ========  ========  =====  ========  ========  =====
16x1     16          0.37      0.35      0.94   1.05      96        92
64x1     64          0.61      0.50      0.82   2.75      54        20
16x16    256         0.58      0.49      0.84   2.31      28        12
64x16    1,024       1.63      1.02      0.62   7.93      78        9.8
1024x1   1,024       11.1      7.85      0.71   52.8      138       2.6
64x64    4,096       7.11      3.55      0.58   21.0      164       7.9
1024x16  16,384      29.9      (noisy)         92.3      216       2.3
64x1024  65,536      77.2      41.2      0.53   233       343       1.47
256x1024 262,144     302       398       1.32   445       336       0.75
=======  ==========  ========  ========  =====  ========  ========  =====

Two threads gain at most 1.6-2x on an idle machine, from about 1,000 samples per step on, and lose
badly whenever anything else needs the cores: 10-90x below 1,000 samples per step, 2-8x up to
16,384; only from about 65,536 samples (5e7 samples x features) per step is the loss below 2x, and
from 262,144 on two threads win under competition as well. On 2 cores there is no size at which
two threads win clearly when idle *and* hold up under competition before 5e7, so:

``auto``: 1 thread while a step of this process touches fewer than ``AUTO_MIN_WORK`` = 5e7
samples x features (every configuration of the paper: at most 64 machines x 64 samples x 784
features = 3.2e6), else ``min(CPUs / processes on this node, 4)``.

The user's settings win: ``auto`` keeps torch's setting when ``OMP_NUM_THREADS`` or
``MKL_NUM_THREADS`` is set in the environment (the sweep runner sets ``OMP_NUM_THREADS``), and an
explicit ``--threads N`` wins over everything; ``--threads 0`` leaves torch and Lightning their
defaults (Lightning's launcher sets CPUs / processes threads when ``OMP_NUM_THREADS`` is unset).
A chosen count is exported as ``OMP_NUM_THREADS`` too, so that Lightning's DDP launcher (which resets
torch's threads unless it is set) and the processes it starts keep it. Nothing is restored when the
run ends: a caller that trains later (``run=False``) needs the same setting.

Threads do not change what is computed, only how ops are split: with the same thread count the
results are bitwise the same.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

__all__ = [
    "AUTO_MAX_THREADS",
    "AUTO_MIN_WORK",
    "THREADS_TYPE",
    "ThreadChoice",
    "ThreadsError",
    "WorkSize",
    "choose_threads",
    "configure_threads",
    "parse_threads",
]

#: Samples x features per step (of one process) from which ``auto`` uses more than one thread.
AUTO_MIN_WORK = 50_000_000
#: The most threads ``auto`` uses: the ops of one step stop scaling well beyond a few threads.
AUTO_MAX_THREADS = 4
#: Environment variables through which a user sets torch's threads; ``auto`` respects them.
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_ALLOWED = "auto, 0 for torch's default, or an integer >= 1"

Setting = Union[str, int]


class ThreadsError(argparse.ArgumentTypeError, ValueError):
    """A ``--threads`` value that is not allowed (an ``ArgumentTypeError`` so the parser shows the message)."""


def parse_threads(value: Any) -> Setting:
    """``"auto"`` or an integer >= 0 from a command-line string or a config value.

    Raises:
        ThreadsError: ``Invalid threads: '-1' (must be auto, 0 for torch's default, or an integer >= 1)``.
    """
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    number: Optional[int] = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().lstrip("+").isdigit():
        number = int(value)
    if number is None or number < 0:
        raise ThreadsError(f"Invalid threads: {value!r} (must be {_ALLOWED})")
    return number


class _ThreadsType:
    """The parser's type for ``--threads`` (its name appears in ``--help``)."""

    __name__ = "threads"

    def __call__(self, value: Any) -> Setting:
        return parse_threads(value)

    def __repr__(self) -> str:
        return "auto or int >= 0"


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


def _cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def user_environ() -> dict[str, str]:
    """The thread variables of ``os.environ``, less an ``OMP_NUM_THREADS`` this module exported itself."""
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

    cpus = _cpus()
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
        print(f"threads: {threads} ({choice.reason})", flush=True)
        _State.printed = threads
    return threads
