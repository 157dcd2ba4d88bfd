"""The sweep's worker processes: a process pool running units, longest first, each worker taking the next
when it is done (``run_in_workers``), and noticing a worker that ends before its unit does.

How many: ``--workers N``, else ``choose_workers``: the cores this process may use divided by ``--threads``,
no more than the trials to run, nor than the memory available holds (a worker's own ``WORKER_BYTES`` plus its
largest stacked group's), and one for trials that train on a GPU; printed in one line with why. One worker
runs every trial in the sweep's process.

Workers are forked on Linux (they start at once with what the sweep loaded, and share the check of the
trials' arguments: ``checking_pool``), spawned elsewhere or once CUDA is in use here. Ctrl-C reaches the sweep
only, which stops the workers; SIGTERM to the sweep ends them too. A pool ends its workers with SIGTERM and,
``END_GRACE_S`` later, SIGKILL for any still running (``end_pool``: a Lightning fit in progress only flags
SIGTERM), so the sweep's exit never waits for a trial.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

from lit_slowcal.experiments.print_once import in_worker, kept, record_warnings, say_again
from lit_slowcal.experiments.sweep import output
from lit_slowcal.experiments.sweep.units import Unit, run_unit

__all__ = [
    "END_GRACE_S", "WORKER_BYTES", "WorkerChoice", "checking_pool", "choose_workers", "end_pool", "run_in_workers",
    "worker_pool",
]  # fmt: skip

#: Memory a worker process takes besides its groups' (``grouping.trial_bytes``): the peak resident memory of a
#: forked worker running a small group, rounded up (``python benchmarks/bench_worker_memory.py`` measures it;
#: docs/performance.md has the figure).
WORKER_BYTES = 768 * 2**20
#: Seconds the workers of a pool that ends have from SIGTERM to end before they are killed (``end_pool``).
END_GRACE_S = 5.0


@dataclass(frozen=True)
class WorkerChoice:
    """How many worker processes a sweep runs (1: every trial in the sweep's process), and why, in words."""

    workers: int
    reason: str

    def line(self) -> str:
        return f"workers: {self.workers} ({self.reason})"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def choose_workers(
    *, cores: int, threads: int, available: Optional[int], trials: int, group_bytes: int = 0, cuda: bool = False,
    per_worker: int = WORKER_BYTES, given: Optional[int] = None,
) -> WorkerChoice:  # fmt: skip
    """The workers of a sweep: ``given`` (``--workers N``), else a pure function of what it runs on.

    Args:
        given: ``--workers N`` (no more than the trials), or ``None``: chosen from the others.
        cores: the CPU cores this process may use.
        threads: torch threads per worker (``--threads``; 0: torch's default, every core).
        available: bytes of memory available to the sweep (``limits.available_memory``; ``None``: unknown).
        trials: trials to run (a stacked group can be split among workers down to one trial each).
        group_bytes: the largest stacked group's ``trial_bytes`` (a lone trial's memory counts in ``per_worker``).
        cuda: the trials train on a CUDA device: one process uses the GPU.
        per_worker: a worker process's own memory (``WORKER_BYTES``).
    """
    how = "--workers N to set"
    each = (
        f"{threads} thread{'s' if threads > 1 else ''} each"
        if threads > 0
        else "torch's default threads (every core) each"
    )
    if given is not None:
        workers = max(1, min(given, trials))
        return WorkerChoice(
            workers, f"--workers {given}" + (": every trial in this process" if workers == 1 else f", {each}")
        )
    if cuda:
        return WorkerChoice(1, f"the trials train on the GPU: one process; {how}")
    by_cores = max(1, cores // threads) if threads > 0 else 1
    need = per_worker + group_bytes
    by_memory = by_cores if available is None else max(1, available // need)
    workers = max(1, min(by_cores, by_memory, trials))
    why = [f"{cores} core{'s' if cores > 1 else ''}, {each}"]
    if by_memory < by_cores:
        why.append(f"memory for {by_memory}: {_gib(need)} each of {_gib(available)} available")
    if trials < min(by_cores, by_memory):
        why.append(f"{trials} trial{'s' if trials > 1 else ''} to run")
    return WorkerChoice(workers, "; ".join([*why, how]))


# Per pool of worker_pool: the child processes the sweep had before it (the pool's workers are the others).
_children_before: weakref.WeakKeyDictionary[Any, set[Any]] = weakref.WeakKeyDictionary()

# In a worker: the queue on which it tells the sweep which unit it starts (_run_in_worker); in the sweep: the
# queue of its pool's workers (worker_pool), read by run_in_workers to tell which unit a lost worker ran.
_started: Any = None
_pool_started: Any = None


def _worker_start(threads: int, started: Any = None) -> None:
    import torch

    global _started
    _started = started
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the sweep, which stops the workers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (a forked worker inherits the sweep's handler)
    in_worker()  # the notes go back to the sweep, which prints each once
    output.in_worker()  # its reader gone, the sweep stops at its own next line
    if threads > 0:
        torch.set_num_threads(threads)


def _run_in_worker(check: tuple[str, bool], unit: Unit, index: int) -> Any:
    """``run_unit`` in a worker, which first sends the unit's number ``index`` and its process id to the sweep;
    the notes it said (``notes``) come back with its outcomes."""
    if _started is not None:
        _started.put((index, os.getpid()))
    with record_warnings() as warned:
        label, outcomes = run_unit(check, unit)
    return label, outcomes, kept() + warned


def _forks() -> bool:
    """Whether workers are forked. Forked workers start at once with what this process loaded (torch, Lightning,
    the parser); spawned ones import it all again (seconds each). Fork only on Linux (macOS: unsafe) and before
    CUDA is in use here."""
    import torch

    return sys.platform.startswith("linux") and not torch.cuda.is_initialized()


@contextlib.contextmanager
def worker_pool(workers: int, threads: int) -> Iterator[Any]:
    """``workers`` processes (forked where ``_forks()``, else spawned) for as long as the sweep needs them;
    SIGTERM to the sweep ends them too (it leaves through the pool's exit)."""
    import multiprocessing

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    global _pool_started
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        context = multiprocessing.get_context("fork" if _forks() else "spawn")
        _pool_started = context.SimpleQueue()  # put writes at once (a Queue's thread might not before a kill)
        before = set(multiprocessing.active_children())
        pool = context.Pool(workers, initializer=_worker_start, initargs=(threads, _pool_started))
        _children_before[pool] = before
        try:
            yield pool
        finally:
            end_pool(pool)
    finally:
        signal.signal(signal.SIGTERM, previous)
        _pool_started = None


def end_pool(pool: Any) -> None:
    """End ``pool`` (one of ``worker_pool``'s) and its workers for sure: its ``terminate()`` (SIGTERM to each
    worker, then a wait for each without a limit) and, if it has not returned ``END_GRACE_S`` later, SIGKILL
    to its workers until it has. A worker in the middle of a Lightning fit outlives SIGTERM (Lightning's
    handler only flags it, and the pool's worker goes on to wait for its next task). A second Ctrl-C or
    SIGTERM to the sweep during the grace period kills the workers at once, then goes on as an interrupt.
    Ending an ended pool does nothing."""
    before = _children_before.get(pool)
    ended = threading.Event()  # not the thread's join: one that an interrupt cuts short marks it ended (bpo-45274)

    def terminate() -> None:
        try:
            pool.terminate()
        finally:
            ended.set()

    threading.Thread(target=terminate, name="end-pool", daemon=True).start()
    try:
        ended.wait(END_GRACE_S)
    finally:  # also when an interrupt cuts the wait short: the interpreter's exit would wait for the workers
        while not ended.is_set():
            for process in _added_children(before):
                process.kill()  # nothing if it ended meanwhile
            ended.wait(0.1)


def _added_children(before: Optional[set[Any]]) -> list[Any]:
    """This process's children that are not in ``before`` (a pool's workers); none without ``before``."""
    import multiprocessing

    return [] if before is None else [p for p in multiprocessing.active_children() if p not in before]


@contextlib.contextmanager
def checking_pool(workers: int, threads: int) -> Iterator[Optional[Any]]:
    """The pool of ``workers`` processes started before the check of the trials' arguments, where they share it:
    forked workers start at once and share the check; spawned ones start only when trials run
    (``None`` here, as for one worker)."""
    if workers > 1 and _forks():
        with worker_pool(workers, threads) as pool:
            yield pool
    else:
        yield None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:  # ended, and reaped by the pool (which starts another worker in its place)
        return False
    except PermissionError:
        pass
    return True


def run_in_workers(pool: Any, units: list[Unit], check: tuple[str, bool], record: Any, lost: Any) -> list[str]:
    """Run ``units`` in the processes of ``pool``, longest first, each taking the next when it is done;
    every trial is recorded here, as its unit ends (the notes its worker said first, each printed once per
    sweep). A unit whose worker process ends before it does (killed,
    out of memory) is given to ``lost(unit, message)`` (which records its trials as failed) and the others go
    on; returns those messages."""
    order = sorted(units, key=lambda u: -u.cost)  # stable: the lone trials, cost 0, keep the sweep's order
    waiting = {i: pool.apply_async(_run_in_worker, (check, unit, i)) for i, unit in enumerate(order)}
    running: dict[int, int] = {}  # unit -> the worker process running it
    messages: list[str] = []
    while waiting:
        next(iter(waiting.values())).wait(0.2)
        for i, result in list(waiting.items()):
            if result.ready():
                del waiting[i]
                running.pop(i, None)
                label, outcomes, notes = result.get()
                say_again(notes)  # the ones not printed yet in this sweep
                for params, identity, outcome, args in outcomes:
                    record(params, identity, outcome, args, label)
        while not _pool_started.empty():
            i, pid = _pool_started.get()
            running[i] = pid
        for i, pid in list(running.items()):
            if i in waiting and not _alive(pid) and not waiting[i].wait(0.5):  # its result would be there by now
                del waiting[i], running[i]
                message = f"the worker process (pid {pid}) running {order[i].label} ended before it did (killed, or out of memory?)"
                lost(order[i], message)
                messages.append(message)
    return messages
