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
    (tests/durations.py). Under pytest-xdist the controller writes them (it hears every worker's reports)."""
    path = os.environ.get("YRPD_TEST_TIMES")
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as fh:
            fh.write(json.dumps({"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                                 "s": round(report.duration, 3)}) + "\n")


#: modules marked `lab` or `e2e` whose tests start no deployment, no vLLM server and no fake host: sources parsed,
#: wheels fetched, a name resolved. They run beside the heavy tests, as the unit tests do.
LIGHT = {"test_ascend_store_sources", "test_brought_wheels", "test_npu_transport_api", "test_patch_sources"}
#: the pytest-xdist lanes (groups) of the heavy tests: each lane is one worker running its tests one after another,
#: in the order they were collected, beside the other lane. "shared": the tests of a shared deployment or of the one
#: reference vLLM (their fixtures live per worker: tests/lab/fixtures.py), and the model change's 4 hosts; "own": the
#: rest (connector end-to-end, localhost namespaces, the bench, the cluster, docker and deploy labs)
SHARED_LANE, OWN_LANE = "shared", "own"
_SHARED_FIXTURES = {"two_hosts", "three_hosts", "reference_answers"}


def lane(item) -> str | None:
    """The lane of a heavy test (None: a light one, run wherever a worker is free)."""
    if not heavy(item):
        return None
    module = item.module.__name__.rsplit(".", 1)[-1]
    if _SHARED_FIXTURES & set(getattr(item, "fixturenames", ())) or module == "test_model_change_lab":
        return SHARED_LANE
    return OWN_LANE


def heavy(item) -> bool:
    module = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
    return bool(item.get_closest_marker("lab") or item.get_closest_marker("e2e")) and module not in LIGHT


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist names the groups
def pytest_collection_modifyitems(config, items):
    """With pytest-xdist (`-n 2 --dist loadgroup`, as scripts/test.sh runs the first pass) each lane is a group."""
    # (in a worker `dist` reads "no": the controller's choice is `loadgroup`; the mark does nothing without it)
    if config.pluginmanager.hasplugin("xdist"):
        for item in items:
            if (name := lane(item)) is not None:
                item.add_marker(pytest.mark.xdist_group(name))
