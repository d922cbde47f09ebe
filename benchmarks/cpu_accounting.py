"""Where a command's CPU goes, by kind of process: the kernel's BSD process accounting (acct(2)) records every process
that exits, with its CPU time, however short its life and in whatever namespace it ran; a side thread notes each
process's command line while it lives, so that the many Python processes can be told apart. Accounting is the whole
machine's: whatever else runs meanwhile is counted too.

    python benchmarks/cpu_accounting.py record OUT -- COMMAND...   # as root: run COMMAND with accounting on
    python benchmarks/cpu_accounting.py report OUT [--top 30] [--each KIND]  # CPU minutes per kind, most first

What the CI's time is made of is its CPU (both cores are busy about 90 % of a run: docs/testing.md), so this says
what a change to the suite can save: each kind's CPU minutes and its processes. A process still running when
accounting stops is not counted (nothing is, once the command has ended). Linux only; `record` needs root.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shlex
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from yrpd.provenance import record as provenance

#: struct acct_v3 (linux/acct.h): 64 bytes, times as comp_t in AHZ (100) ticks
RECORD = 64
AHZ = 100


def comp_t(value: int) -> int:
    """A comp_t: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * ((value >> 13) & 7))


def records(data: bytes) -> list[dict]:
    out = []
    for i in range(0, len(data) - RECORD + 1, RECORD):
        raw = data[i:i + RECORD]
        pid, ppid, start = struct.unpack_from("<III", raw, 16)
        (elapsed,) = struct.unpack_from("<f", raw, 28)
        utime, stime = struct.unpack_from("<HH", raw, 32)
        comm = raw[48:64].split(b"\0")[0].decode(errors="replace")
        out.append({"pid": pid, "ppid": ppid, "start": start, "comm": comm, "life_s": elapsed / AHZ,
                    "cpu_s": (comp_t(utime) + comp_t(stime)) / AHZ})
    return out


def watch_command_lines(path: Path, stop: threading.Event) -> None:
    """Every pid's command line, at the first and the last time it is seen (a supervisor's fork shows its parent's
    until it execs), twice a second."""
    last: dict[str, str] = {}
    with path.open("w") as out:
        while not stop.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                line = line[:400]
                if last.get(pid) != line:
                    last[pid] = line
                    out.write(json.dumps([int(pid), line]) + "\n")
            out.flush()
            stop.wait(0.5)


def record(out: Path, command: list[str]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    acct_file = out.with_suffix(".acct")
    out.parent.mkdir(parents=True, exist_ok=True)
    acct_file.write_bytes(b"")
    if libc.acct(str(acct_file).encode()) != 0:
        sys.exit(f"cpu_accounting: acct({acct_file}) failed: {os.strerror(ctypes.get_errno())} (needs root)")
    stop = threading.Event()
    watcher = threading.Thread(target=watch_command_lines, args=(out.with_suffix(".cmdlines"), stop), daemon=True)
    watcher.start()
    started = time.time()
    try:
        rc = subprocess.call(command)
    finally:
        libc.acct(None)
        stop.set()
        watcher.join(5)
    out.with_suffix(".json").write_text(json.dumps({
        "exit_code": rc, "started": int(started), "wall_s": round(time.time() - started, 1),
        "provenance": provenance([shlex.join(command)])}, indent=2) + "\n")
    return rc


def kind(comm: str, cmdline: str) -> str:
    """What a process was, from its name and its last command line."""
    if comm.startswith("VLLM::"):  # the kernel keeps 15 characters of a name
        return "vLLM " + {"EngineCor": "EngineCore"}.get(comm[6:], comm[6:])
    if comm == "vllm":
        return "vLLM API server (vllm serve)"
    if " bench serve " in cmdline:
        return "vllm bench serve"
    if "supervise.py" in cmdline:
        return "yrpd supervisor (supervise.py)"
    if "-m yrpd.proxy" in cmdline:
        return "yrpd proxy"
    if "yrpd.connector.saver" in cmdline:
        return "connector writer process"
    match = re.search(r"-m yrpd (\w+)", cmdline)
    if match:
        return f"yrpd {match.group(1)} (CLI)"
    if "pytest" in cmdline:
        return "pytest"
    if comm.startswith("datasystem") or "datasystem_worker" in cmdline:
        return "data-system worker"
    if comm.startswith("python") and cmdline:
        return "other Python: " + " ".join(cmdline.split()[1:3])[:60]
    return comm or "?"


def report(out: Path, top: int, each: str | None = None) -> str:
    lines = {}
    cmdlines = out.with_suffix(".cmdlines")
    if cmdlines.exists():
        for line in cmdlines.read_text().splitlines():
            pid, cmd = json.loads(line)
            lines[pid] = cmd  # the last seen: after an exec
    meta = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {}
    prov = meta.get("provenance", {})
    rows = records(out.with_suffix(".acct").read_bytes())
    for r in rows:
        r["kind"] = kind(r["comm"], lines.get(r["pid"], ""))
    cpu, count = Counter(), Counter()
    for r in rows:
        cpu[r["kind"]] += r["cpu_s"]
        count[r["kind"]] += 1
    total = sum(cpu.values())
    text = [f"command: {' '.join(prov.get('commands', []))}",
            (f"commit: {prov.get('commit', '?')}  cpu: {prov.get('cpu', '?')} x {prov.get('cores', '?')}  "
             f"wall: {meta.get('wall_s', 0) / 60:.1f} min  exit: {meta.get('exit_code', '?')}"),
            f"CPU of the processes that exited: {total / 60:.1f} min ({len(rows)} processes)", "",
            "  CPU min   share  processes  kind"]
    for k, v in cpu.most_common(top):
        text.append(f"  {v / 60:7.2f}  {100 * v / total:5.1f}%  {count[k]:9d}  {k}")
    if each:
        first = meta.get("started") or min(r["start"] for r in rows)
        text += ["", f"each {each} process: started (min after the command), life (s), CPU (s)"]
        for r in sorted(rows, key=lambda r: r["start"]):
            if r["kind"] == each:
                text.append(f"  +{(r['start'] - first) / 60:5.1f}  {r['life_s']:7.0f}  {r['cpu_s']:6.1f}")
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out", type=Path)
    rec.add_argument("command", nargs=argparse.REMAINDER)
    rep = sub.add_parser("report")
    rep.add_argument("out", type=Path)
    rep.add_argument("--top", type=int, default=30)
    rep.add_argument("--each", metavar="KIND", help="also list each process of this kind (as the table names it)")
    args = parser.parse_args(argv)
    if args.what == "record":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("record: the command to run after --")
        return record(args.out, command)
    print(report(args.out, args.top, args.each))
    return 0


if __name__ == "__main__":
    sys.exit(main())
