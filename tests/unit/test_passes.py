"""scripts/test.sh's two passes (tests/passes.py): together they run exactly what a user's `-m EXPR` selects, each
test once, torch tests in the second pass only."""

import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.conftest import LANES
from tests.passes import passes, split_marks


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


def test_without_an_expression_the_runs_split_on_torch_and_by_lane():
    expr, lanes, torch = passes(["-v"])
    assert expr is None and list(lanes) == list(LANES)
    for name, run in lanes.items():
        assert run == ["tests", "-m", "not torch", "--lane", name, "-o", f"cache_dir=.pytest_cache/{name}", "-v"]
    assert torch == ["tests/connector", "-m", "torch", "-p", "no:cacheprovider", "-v"]


@pytest.mark.parametrize("expr", [None, "lab", "not lab and not e2e", "e2e"])
def test_the_runs_together_select_exactly_what_the_expression_selects(expr):
    _, lanes, torch = passes(["-m", expr] if expr else [])
    runs = [collected(run) for run in (*lanes.values(), torch)]
    everything = set().union(*runs)
    assert sum(len(r) for r in runs) == len(everything), "a test would run twice"
    assert everything == collected(["tests", *(["-m", expr] if expr else [])])
    assert all(t.startswith("tests/connector/") for t in runs[-1])


def test_the_old_way_ran_a_selection_twice():
    """The control: the old script appended the user's -m after each pass's own, and pytest keeps the last one."""
    old_first = collected(["tests", "-m", "not torch", "-m", "e2e"])
    old_second = collected(["tests/connector", "-m", "torch", "-p", "no:cacheprovider", "-m", "e2e"])
    assert old_first & old_second, "e2e tests of tests/connector ran in both passes"


def test_every_torch_test_is_in_the_torch_pass_and_the_shared_lane_holds_the_shared_deployments():
    torch_tests = collected(["tests", "-m", "torch"])
    assert torch_tests and torch_tests == collected(passes([])[2])
    shared = collected(passes([])[1]["shared"])
    assert any("test_host_faults" in t for t in shared) and any("test_scale_lab" in t for t in shared)
    assert not any(t.startswith("tests/unit/") for t in shared)
