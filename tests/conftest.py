"""Test-suite policy: a skipped test is a failure (nothing may be skipped silently on CI)."""

import pytest

_skipped: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped and session.exitstatus == 0:
        print(f"\n{len(_skipped)} test(s) skipped; skips are not allowed: {', '.join(_skipped)}")
        session.exitstatus = 1
