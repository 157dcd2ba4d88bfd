"""The results file of a sweep (``lit_slowcal.experiments.sweep.results``): concurrent writers lose and
duplicate nothing, and an append keeps the file itself."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from helpers import BARRIER, REPO, subprocess_env

WRITER = (
    textwrap.dedent(
        """
    import sys, time
    from lit_slowcal.experiments.sweep.results import ResultsFile
    path, name = sys.argv[1], sys.argv[2]
    results = ResultsFile(path)  # read before the other writer's records exist, like a sweep's start
    """
    )
    + BARRIER
    + textwrap.dedent(
        """
    for i in range(40):
        results.put({"params": {"writer": name, "i": i}, "status": "failed"})
        if i % 8 == 0:  # a retried trial: its record is replaced, not duplicated
            results.put({"params": {"writer": name, "i": i}, "status": "finished"})
    """
    )
)


@pytest.mark.slow
def test_two_processes_writing_one_results_file_lose_and_duplicate_nothing(tmp_path):
    path = tmp_path / "X.jsonl"
    path.write_text(json.dumps({"params": {"writer": "earlier"}, "status": "finished"}) + "\n")
    path.chmod(0o640)
    env = subprocess_env(PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), name, str(tmp_path)], env=env) for name in "ab"]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    keys = [json.dumps(r["params"], sort_keys=True) for r in records]
    assert len(keys) == len(set(keys)) == 1 + 2 * 40
    assert {(r["params"].get("i"), r["status"]) for r in records if r["params"]["writer"] == "a"} == {
        (i, "finished" if i % 8 == 0 else "failed") for i in range(40)
    }
    assert path.stat().st_mode & 0o7777 == 0o640


def test_appending_a_record_keeps_the_file_itself(tmp_path):
    from lit_slowcal.experiments.sweep.results import ResultsFile

    path = tmp_path / "r.jsonl"
    ResultsFile(path).put({"params": {"a": 1}, "status": "finished"})
    path.chmod(0o604)
    link = tmp_path / "link.jsonl"
    os.link(path, link)  # a second name: appends must reach it too
    ResultsFile(path).put({"params": {"a": 2}, "status": "finished"})
    assert link.read_text() == path.read_text() and len(path.read_text().splitlines()) == 2
    assert path.stat().st_mode & 0o7777 == 0o604
