"""benchmarks/cpu_accounting.py: the kernel's accounting records read right, and processes sorted into the kinds the
CI's CPU table names (docs/testing.md). Records are made here in the kernel's layout (struct acct_v3): turning
accounting on is the machine's, and would end a recording someone runs around the suite."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("cpu_accounting", ROOT / "benchmarks" / "cpu_accounting.py")
acc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(acc)


def raw(pid: int, comm: str, utime: int, stime: int, start: int = 1_000, life: float = 50_000.0) -> bytes:
    """One record as the kernel writes it: times in AHZ (100) ticks, the elapsed time a float of them."""
    head = struct.pack("<BBHIIIIIIf", 0, 3, 0, 0, 0, 0, pid, 1, start, life)
    return head + struct.pack("<8H", utime, stime, 0, 0, 0, 0, 0, 0) + comm.encode().ljust(16, b"\0")


def test_a_record_is_64_bytes_and_its_times_decode_with_the_exponent():
    assert len(raw(1, "x", 0, 0)) == acc.RECORD
    # comp_t: 13-bit mantissa, base-8 exponent in the top 3 bits: 1000 ticks = 10 s; (1 << 13 | 5000) = 5000 * 8
    [one] = acc.records(raw(42, "VLLM::Worker", 1000, (1 << 13) | 5000, life=1234.0))
    assert (one["pid"], one["comm"]) == (42, "VLLM::Worker")
    assert one["cpu_s"] == 10 + 400 and one["life_s"] == 12.34


def test_processes_are_told_apart_by_name_then_command_line():
    assert acc.kind("VLLM::EngineCor", "") == "vLLM EngineCore"  # the kernel cuts names at 15 characters
    assert acc.kind("vllm", "/v/bin/python /v/bin/vllm serve /m") == "vLLM API server (vllm serve)"
    assert acc.kind("python3", "python3 -I /tmp/s/run/supervise.py {}") == "yrpd supervisor (supervise.py)"
    assert acc.kind("python", ".venv/bin/python -m yrpd status --json") == "yrpd status (CLI)"
    assert acc.kind("python", "/v/bin/python -m yrpd.proxy --port 8000") == "yrpd proxy"
    assert acc.kind("python", "/v/bin/python /v/bin/vllm bench serve --model m") == "vllm bench serve"
    assert acc.kind("etcd", "") == "etcd"


def test_the_report_sums_each_kind_and_lists_one_kind_process_by_process(tmp_path):
    out = tmp_path / "run"
    out.with_suffix(".acct").write_bytes(raw(1, "VLLM::Worker", 1200, 0, start=1_060) +
                                         raw(2, "VLLM::Worker", 600, 0, start=1_120) + raw(3, "etcd", 60, 0))
    prov = {"commands": ["bash .ci/run"], "commit": "abc", "cpu": "c", "cores": 2}
    out.with_suffix(".json").write_text(json.dumps({"started": 1_000, "wall_s": 600, "exit_code": 0,
                                                    "provenance": prov}))
    text = acc.report(out, top=10, each="vLLM Worker")
    assert "command: bash .ci/run" in text and "commit: abc  cpu: c x 2  wall: 10.0 min  exit: 0" in text
    assert "    0.30   96.8%          2  vLLM Worker" in text and "etcd" in text
    assert "  +  1.0      500    12.0" in text and "  +  2.0      500     6.0" in text
