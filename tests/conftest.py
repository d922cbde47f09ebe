import json
import os

import pytest

from lab.cli import REPO, run_yrpd  # noqa: F401 - tests import run_yrpd and REPO from here
from tests.lab.fixtures import fake_lab  # noqa: F401 - the fake-host lab, for tests outside tests/lab too


@pytest.fixture
def yrpd_home(tmp_path, monkeypatch):
    """A private YRPD_HOME so tests never see the user's sessions."""
    home = tmp_path / "yrpd-home"
    monkeypatch.setenv("YRPD_HOME", str(home))
    return home


@pytest.fixture
def yrpd():
    return run_yrpd


def _fail_a_skip(report) -> None:
    """Where every test must run (tests/prereq.py: the README's test command, CI), a skip is a failure that names why
    it would have skipped."""
    from tests.prereq import must_run

    if report.skipped and must_run() and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped where every test must run: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip from a test (a plugin, an importorskip, a skip marker, a fixture)."""
    outcome = yield
    _fail_a_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A skip while collecting: a module-level `pytest.skip(allow_module_level=True)` or `importorskip` skips the whole
    module before any test of it exists, so the hook above never sees it."""
    outcome = yield
    _fail_a_skip(outcome.get_result())


def pytest_runtest_logreport(report):
    """Each test's time (set-up, call and tear-down: a shared deployment's cost lands on the test that builds it), one
    JSON line per phase appended to $YRPD_TEST_TIMES: scripts/test.sh sums both passes into the durations table
    (tests/durations.py)."""
    path = os.environ.get("YRPD_TEST_TIMES")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                                 "s": round(report.duration, 3)}) + "\n")


#: the two lanes of the first pass: scripts/test.sh runs one pytest process per lane, both at once, each running its
#: tests one after another in the order collected. "shared": the tests of the shared deployments and of the one
#: reference vLLM (their fixtures live per process: tests/lab/fixtures.py), and a few others for balance; "own":
#: everything else (connector end-to-end, the bench, the self-healing namespaces, the cluster, docker and deploy labs,
#: the unit tests)
SHARED_LANE, OWN_LANE = "shared", "own"
LANES = (SHARED_LANE, OWN_LANE)
_SHARED_FIXTURES = {"two_hosts", "three_hosts", "reference_answers"}
#: modules in the shared lane for balance alone: the lanes end within a minute of each other (the durations table of
#: docs/testing.md: each lane's sum; the Python 3.12 containers went back to the own lane once the bench test ran on
#: the tiny model and the crash-loop test on the kill matrix's deployment, session 23; the spanning lab test took the
#: place of the shared lane's DP-span test, session 25: the CI of 84ada85 ended the shared lane at 47:05 with deploy's
#: refusals in it and the own lane at 45:27, so those went back; the CI of d342379 ended the shared lane at 40:31 and
#: the own lane at 44:31, so the patch series' checks on the real sources, 2:37 of it, moved, session 44; the CI of
#: e016d27 ended the shared lane at 40:43 and the own lane at 43:12 with the DP engines' test, 1:48, in the own lane,
#: so it moved, session 47)
_SHARED_FOR_BALANCE = {"test_model_change_lab", "test_embedded_default", "test_spanning_lab", "test_patch_sources",
                       "test_dp_engines"}


def lane(item) -> str:
    module = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
    if _SHARED_FIXTURES & set(getattr(item, "fixturenames", ())) or module in _SHARED_FOR_BALANCE:
        return SHARED_LANE
    return OWN_LANE


def pytest_addoption(parser):
    parser.addoption("--lane", choices=LANES, help="run only this lane's tests (scripts/test.sh runs both at once)")


def pytest_collection_modifyitems(config, items):
    """`--lane NAME`: the other lane's tests are deselected (before the lab's conftest orders what is left)."""
    chosen = config.getoption("lane")
    if chosen:
        other = [item for item in items if lane(item) != chosen]
        if other:
            config.hook.pytest_deselected(items=other)
            items[:] = [item for item in items if lane(item) == chosen]
