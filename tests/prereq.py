"""A test's missing prerequisite (a venv, a source download, root, docker), read one way everywhere.

The README's test command (scripts/test.sh, which sets YRPD_NO_SKIP=1) and CI (CI set to anything but '', 0, false,
no) must run every test: there a missing prerequisite fails the test, naming it. Elsewhere (a developer running
pytest on a part) it skips. tests/conftest.py turns any other skip into a failure the same way.
"""

import os

import pytest


def must_run() -> bool:
    ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
    return ci or os.environ.get("YRPD_NO_SKIP") == "1"


def missing(reason: str):
    if must_run():
        pytest.fail(f"{reason} (the README's test command and CI run every test: a missing prerequisite fails)")
    pytest.skip(reason)
