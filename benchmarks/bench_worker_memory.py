"""The memory of a sweep's worker process running a small stacked group (``sweep.workers.WORKER_BYTES``).

``python benchmarks/bench_worker_memory.py``: a 4-trial grid (SLowcal-SGD, M = 16, K = 16, 20 rounds, objective
and diagnostics on) run by ``python -m lit_slowcal sweep --workers 2``; every 50 ms the peak resident memory
(``VmHWM``) and the proportional share (``Pss``: shared pages split among the processes sharing them) of the
sweep and of each worker are read from ``/proc``. Linux only.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _kib(pid: int, file: str, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        grid = {
            "method": "grid",
            "parameters": {"method": {"value": "slowcal"}, "model.lr": {"values": [0.01, 0.03, 0.1, 0.3]}},
            "command": ["${env}", "python", "-m", "lit_slowcal", "fit", "--config", "configs/paper.yaml",
                        "--trainer.limit_train_batches=20", "--wandb=false", f"--run_dir={tmp}/runs", "${args}"],
        }  # fmt: skip
        path = Path(tmp) / "grid.yaml"
        path.write_text(yaml.safe_dump(grid))
        cmd = [sys.executable, "-m", "lit_slowcal", "sweep", str(path), "--results", f"{tmp}/r.jsonl", "--workers", "2"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        peak: dict[int, tuple[int, int]] = {}  # pid -> (VmHWM, largest Pss), KiB
        while proc.poll() is None:
            for pid in [proc.pid, *_children(proc.pid)]:
                hwm, pss = _kib(pid, "status", "VmHWM"), _kib(pid, "smaps_rollup", "Pss")
                old = peak.get(pid, (0, 0))
                peak[pid] = (max(old[0], hwm), max(old[1], pss))
            time.sleep(0.05)
        assert proc.returncode == 0, f"the sweep exited with {proc.returncode}"
    sweep = peak.pop(proc.pid)
    print(f"sweep: peak RSS {sweep[0] / 1024:.0f} MiB, Pss {sweep[1] / 1024:.0f} MiB")
    for pid, (hwm, pss) in sorted(peak.items()):
        if hwm:
            print(f"worker {pid}: peak RSS {hwm / 1024:.0f} MiB, Pss {pss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
