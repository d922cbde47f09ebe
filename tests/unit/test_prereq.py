"""tests/prereq.py and the skip hook in tests/conftest.py: where every test must run, a test that would skip fails,
naming why; elsewhere it skips."""

import os
import subprocess
import sys

from tests.conftest import REPO

SKIPPING = '''
import pytest
from tests.prereq import missing

def test_needs_a_thing():
    missing("the thing is not installed (install it)")

def test_marked():
    pytest.importorskip("no_such_module_yrpd")
'''

#: a module that skips while it is collected: no test of it exists for the per-test hook to see
SKIPPING_MODULE = '''
import pytest

pytest.importorskip("no_such_module_at_collection_yrpd")


def test_never_collected():
    pass
'''


def run(tmp_path, source: str = SKIPPING, **env):
    path = tmp_path / "test_skipping.py"
    path.write_text(source)
    # YRPD_TEST_TIMES too: the inner run's planned failures would land in the outer suite's durations table
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "YRPD_NO_SKIP", "YRPD_TEST_TIMES")}
    # the suite's conftest as a plugin: its skip hook is what is tested (the file lies outside tests/)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "-rs", str(path)],
                          capture_output=True, text=True, cwd=REPO, env={**clean, **env, "PYTHONPATH": str(REPO)},
                          stdin=subprocess.DEVNULL, timeout=120)


def test_the_readme_command_and_ci_fail_a_missing_prerequisite_naming_it(tmp_path):
    for env in ({"YRPD_NO_SKIP": "1"}, {"CI": "true"}):
        proc = run(tmp_path, **env)
        assert proc.returncode == 1, (env, proc.stdout[-2000:])
        assert "2 failed" in proc.stdout and "the thing is not installed (install it)" in proc.stdout, env
        assert "no_such_module_yrpd" in proc.stdout, env
        # a module that skips while collected is a collection error naming why (the run stops), not a silent skip
        proc = run(tmp_path, SKIPPING_MODULE, **env)
        assert proc.returncode == 2 and "1 error during collection" in proc.stdout, (env, proc.stdout[-2000:])
        assert "skipped where every test must run" in proc.stdout, env
        assert "no_such_module_at_collection_yrpd" in proc.stdout, env


def test_elsewhere_a_missing_prerequisite_skips(tmp_path):
    for env in ({}, {"CI": "false"}, {"CI": "0"}):  # one reading of CI: false and 0 are not CI
        proc = run(tmp_path, **env)
        assert proc.returncode == 0 and "2 skipped" in proc.stdout, (env, proc.stdout[-2000:])
        proc = run(tmp_path, SKIPPING_MODULE, **env)
        assert proc.returncode == 5 and "1 skipped" in proc.stdout, (env, proc.stdout[-2000:])  # 5: nothing ran
