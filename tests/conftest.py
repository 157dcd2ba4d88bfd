"""Test-suite policy: a skipped test is a failure (nothing may be skipped silently on CI).

One exception: tests marked ``@pytest.mark.cuda`` need a CUDA device. Where
``torch.cuda.is_available()`` is False they are skipped (with the reason below), the session says
how many did not run, and that does not fail it. Where CUDA is available they run like any other
test, and a skip of one of them fails the session as well.

Every case of a test parametrized over ``method`` other than ``slowcal`` is marked ``other_methods``:
the same code path again for another method (so are the cases of Table 1's sweep files in
``test_sweep.py``, which parse the other methods' trials). ``.ci/run`` runs the whole suite with the README's
command, then once more with the oldest Lightning allowed, there with ``-m "not other_methods"``
(said in its output): the Lightning integration is the same for every method, and the second pass
stays short. It also leaves out the modules of ``TORCH_ONLY`` (marked ``torch_only``): they import no
Lightning (``tests/test_markers.py`` checks it), so no Lightning version can change what they test.
The list is ``helpers.TORCH_ONLY``. And it leaves out ``tests/experiments/sweep`` (the sweep runner's
bookkeeping of trials, records and workers; a trial's Lightning path is the app's run, which
``tests/experiments/run`` tests in both passes).

Tests marked ``slow`` (subprocess launches, multi-process runs, sweeps, whole fits; a module that is
all such sets ``pytestmark``) are left out of the fast tier, ``pytest -m "not slow"``; the README's
command runs them all.
"""

import sys
from pathlib import Path

import pytest
import torch

# The test folders mirror the package (core/, experiments/ and its rooms: run/, train/, data/, measure/,
# analysis/, sweep/). Test modules and the helper
# scripts import helpers from one another by module name (``from test_stacked import grid_file``), so every
# folder is on sys.path whichever file runs first; test file basenames are unique across the folders.
TESTS = Path(__file__).resolve().parent
ROOMS = ("run", "train", "data", "measure", "analysis", "sweep")
FOLDERS = [str(TESTS / folder) for folder in ("core", "experiments", *(f"experiments/{room}" for room in ROOMS))]
sys.path[:0] = [folder for folder in FOLDERS if folder not in sys.path]

CUDA_SKIP_REASON = "needs CUDA (torch.cuda.is_available() is False)"

from helpers import TORCH_ONLY  # noqa: E402 (the folders above on sys.path first)

_skipped: list[str] = []
_cuda_not_run: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped (and counted) where there is none")
    config.addinivalue_line("markers", "other_methods: a method-parametrized case for a method other than slowcal")
    config.addinivalue_line("markers", "torch_only: a test of a module that imports no Lightning (TORCH_ONLY)")
    config.addinivalue_line(
        "markers", "slow: launches processes, trains whole runs or sweeps; pytest -m 'not slow' is the fast tier"
    )


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "method" in params and params["method"] != "slowcal":
            item.add_marker(pytest.mark.other_methods)
        if item.path.stem in TORCH_ONLY:
            item.add_marker(pytest.mark.torch_only)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=CUDA_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def _is_cuda_skip(report: pytest.TestReport) -> bool:
    """A skip of a cuda-marked test for the one allowed reason (set at collection, no CUDA)."""
    if "cuda" not in report.keywords or torch.cuda.is_available():
        return False
    longrepr = report.longrepr
    # A skip's longrepr is (file, line, "Skipped: <reason>").
    return isinstance(longrepr, tuple) and len(longrepr) == 3 and str(longrepr[2]).endswith(CUDA_SKIP_REASON)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        (_cuda_not_run if _is_cuda_skip(report) else _skipped).append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _cuda_not_run:
        terminalreporter.write_line(
            f"{len(_cuda_not_run)} CUDA tests not run: no CUDA device (torch.cuda.is_available() is False)",
            yellow=True,
        )
    if _skipped:
        terminalreporter.write_line(
            f"{len(_skipped)} test(s) skipped; skips are not allowed: {', '.join(_skipped)}", red=True
        )
