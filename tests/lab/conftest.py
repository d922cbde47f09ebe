import pytest

from .fixtures import (LAST_USER, PHASES, fake_lab, lab_figures, last_users, order_shared_users,  # noqa: F401
                       reference_answers, shared_deployments, three_hosts, two_hosts)


def pytest_configure(config):
    config.addinivalue_line("markers", "lab: tests that start fake hosts (root, netns, sshd)")


@pytest.hookimpl(trylast=True)  # after -m and -k deselected what does not run
def pytest_collection_modifyitems(config, items):
    """The tests of a shared deployment run one after another, and the last of them tears it down."""
    items[:] = order_shared_users(items)
    config.stash[LAST_USER] = last_users(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report, for the figures a test writes at its tear-down (whether it passed)."""
    outcome = yield
    report = outcome.get_result()
    item.stash.setdefault(PHASES, {})[report.when] = report
