"""The sweep's worker processes (``--workers N``): a process pool running units, longest first, each worker
taking the next when it is done (``run_in_workers``), and noticing a worker that ends before its unit does.

Workers are forked on Linux (they start at once with what the sweep loaded, and share the check of the
trials' arguments: ``checking_pool``), spawned elsewhere or once CUDA is in use here. Ctrl-C reaches the sweep
only, which stops the workers; SIGTERM to the sweep ends them too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any, Iterator, Optional

from lit_slowcal.experiments.sweep.units import Unit, run_unit

__all__ = ["checking_pool", "run_in_workers", "worker_pool"]

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
    if threads > 0:
        torch.set_num_threads(threads)


def _run_in_worker(check: tuple[str, bool], unit: Unit, index: int) -> Any:
    """``run_unit`` in a worker, which first sends the unit's number ``index`` and its process id to the sweep."""
    if _started is not None:
        _started.put((index, os.getpid()))
    return run_unit(check, unit)


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
        with context.Pool(workers, initializer=_worker_start, initargs=(threads, _pool_started)) as pool:
            yield pool
    finally:
        signal.signal(signal.SIGTERM, previous)
        _pool_started = None


@contextlib.contextmanager
def checking_pool(workers: int, threads: int) -> Iterator[Optional[Any]]:
    """The pool of ``workers`` processes started before the check of the trials' arguments, where they share it:
    forked workers start at once and share the check (0.03 s a trial); spawned ones start only when trials run
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


def run_in_workers(
    pool: Any, workers: int, units: list[Unit], threads: int, check: tuple[str, bool], record: Any, lost: Any
) -> list[str]:
    """Run ``units`` in the ``workers`` processes of ``pool``, longest first, each taking the next when it is done;
    every trial is recorded here, as its unit ends. A unit whose worker process ends before it does (killed,
    out of memory) is given to ``lost(unit, message)`` (which records its trials as failed) and the others go
    on; returns those messages."""
    order = sorted(units, key=lambda u: -u.cost)  # stable: the lone trials, cost 0, keep the sweep's order
    each = f"{threads} torch thread{'s' if threads > 1 else ''}" if threads > 0 else "torch's default threads"
    print(f"workers: {workers} processes, each running one group or trial at a time with {each}", flush=True)
    waiting = {i: pool.apply_async(_run_in_worker, (check, unit, i)) for i, unit in enumerate(order)}
    running: dict[int, int] = {}  # unit -> the worker process running it
    messages: list[str] = []
    while waiting:
        next(iter(waiting.values())).wait(0.2)
        for i, result in list(waiting.items()):
            if result.ready():
                del waiting[i]
                running.pop(i, None)
                label, outcomes = result.get()
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
