"""Files that are whole or absent: write to a temporary name, make it durable, rename it over the target.

One routine serves every file the project writes in place of another (checkpoints, results files,
reports): ``atomic_path`` for writers that want a path (``torch.save``, Lightning's checkpoint IO),
``atomic_write`` for writers that want an open file. A process killed at any moment leaves the
previous file intact and at most a stray hidden ``.<name>.*.tmp`` file beside it.

Durability, in order: the temporary file is flushed and ``fsync``-ed, renamed over the target with
``os.replace`` (atomic on POSIX and Windows), and the folder is ``fsync``-ed so that the rename
itself survives a power loss. Permissions: an existing target keeps its mode bits; a new file gets
the usual ``0o666`` less the process umask (as ``open`` would create it), not ``mkstemp``'s ``0o600``.

Several processes writing one file take turns with ``locked``: an exclusive lock on a hidden
``.<name>.lock`` file beside it (``fcntl.flock``), held while they read, append or replace it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Union

__all__ = ["atomic_path", "atomic_write", "fsync_dir", "locked"]

PathLike = Union[str, "os.PathLike[str]"]


def fsync_dir(folder: PathLike) -> None:
    """Make a rename or creation in ``folder`` durable (a no-op where folders cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block ends without error, it becomes ``path``.

    Whatever the block wrote to the temporary path is fsync-ed and renamed over ``path``; on error
    the temporary file is removed and ``path`` is untouched.

    Example:
        >>> with atomic_path("model.pt") as tmp:  # doctest: +SKIP
        ...     torch.save(state, tmp)
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # Created here with the mode `open` would give a new file (0o666 less the umask).
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        yield tmp
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            mode = None
        if mode is not None:
            os.chmod(tmp, mode)
        _fsync_file(tmp)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_dir(target.parent)


@contextlib.contextmanager
def atomic_write(path: PathLike, mode: str = "w", **open_kwargs: Any) -> Iterator[IO[Any]]:
    """``open(path, mode)`` whose content replaces ``path`` only when the block ends without error.

    ``mode`` is ``"w"`` or ``"wb"`` (plus ``open``'s keyword arguments, e.g. ``encoding``).

    Example:
        >>> with atomic_write("results.jsonl") as f:  # doctest: +SKIP
        ...     f.write(line)
    """
    if mode not in ("w", "wb", "wt"):
        raise ValueError(f"Invalid mode: {mode!r} (allowed: w, wt, wb)")
    with atomic_path(path) as tmp, open(tmp, mode, **open_kwargs) as f:
        yield f
        f.flush()


@contextlib.contextmanager
def locked(path: PathLike) -> Iterator[None]:
    """Hold an exclusive lock for ``path`` while the block runs: other processes' ``locked(path)`` wait.

    The lock is ``fcntl.flock`` on ``.<name>.lock`` beside ``path`` (created once and left there), not
    on ``path`` itself, so a writer may replace ``path`` (``atomic_write``) while holding it. The
    kernel drops the lock when its holder exits, killed or not. POSIX only (Linux, macOS).
    """
    import fcntl

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target.with_name(f".{target.name}.lock"), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
