"""Reading the session's logs (yrpd.logtail): one request's lines from every host in time order (`yrpd logs
--request`), against scripted hosts answering what grep prints there. The 2-host lab runs it on a real deployment
(tests/lab/test_serving_lab.py)."""

from __future__ import annotations

import datetime
import subprocess

import pytest

from yrpd import api
from yrpd.errors import SpecError
from yrpd.logtail import grep_lines, grep_script, in_time_order, line_time
from yrpd.testing import ScriptedHosts

from tests.unit.sessions import recorded

PROXY = "2026-11-26 12:00:01,250 INFO yrpd.proxy: POST /v1/completions 200 830ms id=abc123 prefill_ms=400"
PREFILL = ("(EngineCore_DP0 pid=7) INFO 11-26 12:00:01 [connector.py:1] yrpd connector: request cmpl-abc123-0: "
           "hands over 5 blocks through the data system (loaded 0 of them from it)")
DECODE = ("(EngineCore_DP0 pid=9) INFO 11-26 12:00:02 [connector.py:1] yrpd connector: request cmpl-abc123-0: "
          "loads 5 blocks from the data system (prefill handed over 5; waited 3 ms), first key 9f")


def test_both_line_formats_are_dated_and_a_line_without_a_stamp_is_not():
    assert line_time(PROXY, 2026) == datetime.datetime(2026, 11, 26, 12, 0, 1, 250000)
    assert line_time(DECODE, 2026) == datetime.datetime(2026, 11, 26, 12, 0, 2)
    assert line_time("Traceback (most recent call last):", 2026) is None


def test_the_grep_script_finds_a_request_in_every_log_and_an_absent_one_is_no_failure(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "proxy.log").write_text(f"{PROXY}\nother line\n")
    (logs / "decode-0.log").write_text(f"{DECODE}\n")

    class Layout:
        logs_dir = str(logs)

    found = subprocess.run(["bash", "-c", grep_script(Layout, "abc123")], capture_output=True, text=True)
    assert found.returncode == 0
    assert sorted((x.log, x.text) for x in grep_lines("h1", found.stdout, 2026)) == [("decode-0", DECODE),
                                                                                   ("proxy", PROXY)]
    absent = subprocess.run(["bash", "-c", grep_script(Layout, "zzz999")], capture_output=True, text=True)
    assert (absent.returncode, absent.stdout) == (0, "")  # the control: none found is an answer
    Layout.logs_dir = str(tmp_path / "gone")
    missing = subprocess.run(["bash", "-c", grep_script(Layout, "abc123")], capture_output=True, text=True)
    assert missing.returncode == 3 and "no logs directory" in missing.stderr


def test_a_requests_lines_come_from_every_host_in_time_order(tmp_path):
    deployment = recorded(tmp_path)
    with ScriptedHosts() as hosts:
        hosts.on(r"grep -r -H -F", host="h1", stdout=f"./decode-x.log:{DECODE}\n./proxy.log:{PROXY}\n"
                                                      f"./prefill-0.log:{PREFILL}\n")
        hosts.on(r"grep -r -H -F", host="h2", stdout="")
        lines, results = api.request_lines(deployment, "abc123")
    assert [x.log for x in lines] == ["prefill-0", "proxy", "decode-x"]  # 12:00:01 (vLLM's, no ms), 01.250, 02
    assert all(r.ok for r in results.values())
    assert [x.host for x in in_time_order(grep_lines("h2", f"./a.log:{DECODE}\n", 2026) +
                                          grep_lines("h1", f"./b.log:{PROXY}\n", 2026))] == ["h1", "h2"]
    with pytest.raises(SpecError, match="^--request: 'a b' is not a request id"):
        api.request_lines(deployment, "a b")
