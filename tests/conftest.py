import pytest

from lab.cli import REPO, run_yrpd  # noqa: F401 - tests import run_yrpd and REPO from here
from tests.lab.fixtures import *  # noqa: F401,F403  (fake_lab fixture)


@pytest.fixture
def yrpd_home(tmp_path, monkeypatch):
    """A private YRPD_HOME so tests never see the user's sessions."""
    home = tmp_path / "yrpd-home"
    monkeypatch.setenv("YRPD_HOME", str(home))
    return home


@pytest.fixture
def yrpd():
    return run_yrpd


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Where every test must run (tests/prereq.py: the README's test command, CI), a skip from anywhere (a plugin, an
    importorskip, a skip marker) is a failure that names why it would have skipped."""
    from tests.prereq import must_run

    outcome = yield
    report = outcome.get_result()
    if report.skipped and must_run() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped where every test must run: {reason}"
