"""examples/sharded_lm.py as a user runs it: four gloo processes (2 machines x 2 shards) train the
FSDP2-sharded character model, the loss falls, and every process ends with the same full parameters."""

import re
import subprocess
import sys

import pytest
from helpers import REPO, subprocess_env

pytestmark = pytest.mark.slow  # four processes

STEPS, K = 48, 8


def test_the_sharded_example_learns_and_the_ranks_agree():
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "sharded_lm.py"), "--steps", str(STEPS), "--sync-every", str(K)],
        cwd=REPO, env=subprocess_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"stdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-4000:]}"
    out = proc.stdout
    first, last = map(float, re.search(r"first loss (\S+)  last loss (\S+)", out).groups())
    assert last < 0.9 * first, out
    assert f"{STEPS // K} synchronisations" in out, out
    checksums = re.search(r"checksums: (.+)", out).group(1).split()
    assert len(checksums) == 4 and len(set(checksums)) == 1, out
    assert "max difference from rank 0: 0\n" in out, out
