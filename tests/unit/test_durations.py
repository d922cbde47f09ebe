"""tests/durations.py: the per-phase times both passes record, summed per test and per module."""

import json
import subprocess
import sys

from tests.conftest import REPO
from tests.durations import _clock, per_module, per_test, slowest, text_report

LINES = [
    {"test": "tests/lab/test_a.py::test_one", "when": "setup", "outcome": "passed", "s": 100.0},
    {"test": "tests/lab/test_a.py::test_one", "when": "call", "outcome": "passed", "s": 20.0},
    {"test": "tests/lab/test_a.py::test_one", "when": "teardown", "outcome": "passed", "s": 5.0},
    {"test": "tests/lab/test_a.py::test_two", "when": "call", "outcome": "failed", "s": 30.0},
    {"test": "tests/unit/test_b.py::test_x", "when": "call", "outcome": "passed", "s": 0.5},
]


def test_a_test_pays_for_its_set_up_and_tear_down():
    assert per_test(LINES)["tests/lab/test_a.py::test_one"] == 125.0


def test_modules_and_tests_slowest_first():
    modules = per_module(per_test(LINES))
    assert [(m.name, m.tests, m.seconds) for m in modules] == [("tests/lab/test_a.py", 2, 155.0),
                                                               ("tests/unit/test_b.py", 1, 0.5)]
    assert [t.name for t in slowest(per_test(LINES), 2)] == ["tests/lab/test_a.py::test_one",
                                                              "tests/lab/test_a.py::test_two"]


def test_the_report_names_the_total_and_the_failures():
    text = text_report(LINES, 30, wall=200.0)
    assert "total: 3 tests (1 failed) in 2:35.5 of test time, 3:20.0 wall" in text
    assert text.index("test_one") < text.index("test_two")


def test_the_hook_records_every_phase_of_a_real_run(tmp_path):
    (tmp_path / "test_timed.py").write_text("import time\n\ndef test_sleeps():\n    time.sleep(0.2)\n")
    times = tmp_path / "times.jsonl"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           str(tmp_path / "test_timed.py")], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "YRPD_TEST_TIMES": str(times), "PATH": "/usr/bin:/bin"},
                          stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:]
    lines = [json.loads(line) for line in times.read_text().splitlines()]
    assert [line["when"] for line in lines] == ["setup", "call", "teardown"]
    assert per_test(lines)[next(iter(per_test(lines)))] >= 0.2


def test_times_round_into_the_next_minute():
    assert _clock(719.96) == "12:00.0" and _clock(720.0) == "12:00.0"
    assert _clock(61.04) == "1:01.0" and _clock(59.94) == "0:59.9"
