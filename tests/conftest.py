import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lab.fixtures import *  # noqa: F401,F403  (fake_lab fixture)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def yrpd_home(tmp_path, monkeypatch):
    """A private YRPD_HOME so tests never see the user's sessions."""
    home = tmp_path / "yrpd-home"
    monkeypatch.setenv("YRPD_HOME", str(home))
    return home


def run_yrpd(*args, cwd=None, env=None, timeout=300, check=None):
    """Run the real CLI in a subprocess, as a user would."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "yrpd", *map(str, args)], cwd=cwd or REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check is not None and proc.returncode != check:
        raise AssertionError(f"yrpd {' '.join(map(str, args))} exited {proc.returncode}, wanted {check}\n"
                             f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


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
