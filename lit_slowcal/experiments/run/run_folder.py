"""Where a run writes: its name, its version folder, its loggers (CSV, and W&B online or offline).

A run of method m, M machines, K local steps, b samples and seed s logs into
``run_dir/<m>_M<M>_K<K>_b<b>_seed<s>/version_<n>``, the next free ``n``, claimed by creating the folder
(two runs started at once never share one). The launching process claims it and passes it to its
DDP children through the environment (``RUN_VERSION_ENV``).

W&B: online when there are credentials (``WANDB_API_KEY`` or ``wandb login``'s netrc entry) and the
server answers within ``WANDB_INIT_TIMEOUT`` seconds, else offline with one line on how to upload later
(``start_wandb``). A training CLI run and a stacked sweep trial start their W&B runs through it.
"""

from __future__ import annotations

import errno
import netrc
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, TypeVar
from urllib.parse import urlparse

from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger

__all__ = [
    "RUN_VERSION_ENV", "claim_version", "flat_config", "run_dir_error", "run_loggers", "run_name", "run_version",
    "start_wandb", "wandb_logged_in",
]  # fmt: skip

#: The run's version folder, chosen by the launching process and inherited by its DDP children.
RUN_VERSION_ENV = "LIT_SLOWCAL_RUN_VERSION"

T = TypeVar("T")


def run_name(get: Callable[..., Any]) -> str:
    """``<method>_M<M>_K<K>_b<b>_seed<seed>``: a run's folder under ``run_dir``, from ``get(key)``, its
    configuration's values (``SlowcalCLI.setting``, or ``dict.get`` of the parsed ``fit`` section)."""
    return (
        f"{get('method')}_M{get('num_machines')}_K{get('local_steps')}_b{get('batch_size')}"
        f"_seed{get('seed_everything')}"
    )


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


def run_version(run_dir: str | Path, name: str) -> tuple[int, bool]:
    """This run's version number under ``run_dir/<name>``, and whether this process claimed it.

    Every rank must write to the same version folder: the launching process (rank 0) claims the next
    free one (``claim_version``) and sets ``RUN_VERSION_ENV``; its DDP children, started later,
    inherit it through the environment. The claiming process removes the variable when its run ends.
    Under an outside launcher the other ranks claim nothing (``launched_rank``): they never write there.
    """
    version = os.environ.get(RUN_VERSION_ENV)
    if version is not None:
        return int(version), False
    if launched_rank() > 0:  # another launcher's process (torchrun, SLURM): rank 0 claims, this one only looks
        return CSVLogger(save_dir=str(run_dir), name=name).version, False
    number = claim_version(run_dir, name)
    os.environ[RUN_VERSION_ENV] = str(number)
    return number, True


def launched_rank() -> int:
    """This process's global rank as an outside launcher gives it (torchrun's ``RANK``, SLURM's ``SLURM_PROCID``;
    0 where neither is set): its processes start at once, each without the version its rank 0 claims. Only rank 0
    writes into the folder (the loggers, config.yaml, checkpoints), so another rank never makes one."""
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def run_dir_error(err: OSError, run_dir: Any) -> Optional[OSError]:
    """``err``, a failure to write under ``run_dir``, as one line naming ``--run_dir``, the path and what is wrong
    (a full disk with the space left, a file where a folder must be); ``None`` for a failure elsewhere."""
    if not run_dir or not isinstance(err, OSError) or err.errno is None:
        return None
    root = Path(str(run_dir)).absolute()
    paths = [Path(str(f)).absolute() for f in (err.filename2, err.filename) if f is not None]
    path = next((f for f in paths if f == root or root in f.parents), None)
    if path is None:
        return None
    what = err.strerror or str(err)
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        existing = next((p for p in (path, *path.parents) if p.exists()), root)
        free = shutil.disk_usage(existing).free
        what = (f"the disk is full ({free / 2**20:.1f} MiB free there): free space or pass another --run_dir, then "
                "continue with the same command and --ckpt_path last")  # fmt: skip
    elif err.errno in (errno.ENOTDIR, errno.EEXIST):
        blocking = next((p for p in (root, *root.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            what = f"{blocking} is not a folder: pass a folder (it is created if missing)"
    elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        what = f"{what}: pass a --run_dir this user may write to"
    return OSError(f"--run_dir {run_dir}: cannot write {path}: {what}")


def flat_config(config: Any) -> dict[str, Any]:
    """A run's configuration as W&B's config: plain values, ``section.key`` for the model's and the data's."""
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


def start_wandb(
    start: Callable[[bool], T], folder: str, *, probe: bool = True, announce: bool = True
) -> tuple[T, bool]:
    """A W&B run started by ``start(offline)``: online when logged in and reachable, else offline.

    ``start(False)`` must start the run (and raise when W&B cannot be reached); it is tried with a bounded
    wait (``WANDB_INIT_TIMEOUT``, 30 s by default) when ``probe``; a process that does not probe (a DDP
    child) starts online whenever there are credentials. Falling back to offline sets ``WANDB_MODE=offline``
    for the processes and runs that follow, and ``announce`` prints one line saying why and how to upload
    the run later (``wandb sync <folder>/wandb/offline-run-*``).

    Returns:
        what ``start`` returned, and whether the run is offline.
    """
    offline = os.environ.get("WANDB_MODE") in ("offline", "dryrun") or not wandb_logged_in()
    reason = "no credentials (WANDB_API_KEY or `wandb login`) found"
    if not offline:
        if not probe:
            return start(False), False
        os.environ.setdefault("WANDB_INIT_TIMEOUT", "30")
        try:
            return start(False), False
        except Exception as err:  # no network, server down, bad key: never lose the run for it
            import wandb

            try:
                wandb.finish(exit_code=1)
            finally:
                wandb.teardown()  # forget the online settings: the offline run starts afresh
            reason = f"cannot reach W&B ({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})"
        os.environ["WANDB_MODE"] = "offline"
    if announce:
        print(
            f"W&B: {reason}; logging offline. Upload later with `wandb sync {folder}/wandb/offline-run-*`, "
            "or pass --wandb=false to turn W&B off.",
            flush=True,
        )
    return start(True), True


def run_loggers(
    run_dir: str, name: str, version: int, config: Any, *, wandb: bool, project: Optional[str]
) -> tuple[list[Logger], bool]:
    """The run's CSV logger and, with ``wandb``, its W&B logger in ``project`` (``start_wandb``); and whether
    W&B logs offline. Only the launching process (local rank 0 on node 0) probes W&B and says so."""
    loggers: list[Logger] = [CSVLogger(save_dir=run_dir, name=name, version=version)]
    if not wandb:
        return loggers, False
    folder = str(Path(run_dir) / name / f"version_{version}")
    kwargs = dict(project=project, name=name, save_dir=folder, config=flat_config(config))
    launcher = os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"

    def start(offline: bool) -> WandbLogger:
        logger = WandbLogger(offline=offline, **kwargs)
        if not offline and launcher:
            logger.experiment  # start the run now: a missing network shows here, not later
        return logger

    logger, offline = start_wandb(start, folder, probe=launcher, announce=launcher)
    return [*loggers, logger], offline
