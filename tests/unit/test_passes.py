"""scripts/test.sh's two passes (tests/passes.py): together they run exactly what a user's `-m EXPR` selects, each
test once, torch tests in the second pass only."""

import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.passes import LANES, passes, split_marks


def collected(args: list[str]) -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, cwd=REPO, stdin=subprocess.DEVNULL, timeout=300,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode in (0, 5), proc.stdout[-2000:] + proc.stderr[-2000:]
    return {line for line in proc.stdout.splitlines() if "::" in line}


def test_marks_are_taken_out_of_the_arguments_and_joined():
    assert split_marks(["-v", "-m", "lab", "-x"]) == ("(lab)", ["-v", "-x"])
    assert split_marks(["-mlab", "-m", "not e2e"]) == ("(lab) and (not e2e)", [])
    assert split_marks(["--maxfail", "1"]) == (None, ["--maxfail", "1"])  # a long option is not -m


def test_without_an_expression_the_passes_split_on_torch():
    expr, first, second = passes(["-v"])
    assert expr is None
    assert first == ["tests", "-m", "not torch", *LANES, "-v"]
    assert second == ["tests/connector", "-m", "torch", "-p", "no:cacheprovider", "-v"]


@pytest.mark.parametrize("expr", ["lab", "not lab and not e2e", "e2e"])
def test_both_passes_together_select_exactly_what_the_expression_selects(expr):
    _, first, second = passes(["-m", expr])
    one, two = collected(first), collected(second)
    assert one & two == set(), "a test would run in both passes"
    assert one | two == collected(["tests", "-m", expr])
    assert all(t.startswith("tests/connector/") for t in two)


def test_the_old_way_ran_a_selection_twice():
    """The control: the old script appended the user's -m after each pass's own, and pytest keeps the last one."""
    old_first = collected(["tests", "-m", "not torch", "-m", "e2e"])
    old_second = collected(["tests/connector", "-m", "torch", "-p", "no:cacheprovider", "-m", "e2e"])
    assert old_first & old_second, "e2e tests of tests/connector ran in both passes"


def test_every_torch_test_is_in_the_second_pass():
    torch_tests = collected(["tests", "-m", "torch"])
    assert torch_tests and torch_tests == collected(passes([])[2])
