"""Start-up of one one-rank CPU instance two ways, side by side (benchmark, not a test; issue 45's CI budget): vLLM's
CPU default, where the model runs in a worker process of its own beside the EngineCore (the mp executor), and with
multiprocessing off (VLLM_ENABLE_V1_MULTIPROCESSING=0), where the model runs inside the EngineCore (vLLM's uni
executor, as on every other platform). The API server keeps its EngineCore process either way.

Measured, and NOT used by yrpd: under uni, vLLM's CPU build binds no core (its binding lives in the mp executor's
process start: every thread of the instance may run on every core), and in the lab PD answers through the data
system differed from one plain instance's (docs/dev/notes.md, session 27). Kept as the figure a future attempt
starts from.

    .venv/bin/python benchmarks/cpu_executor_start.py [--runs 3] [--model DIR] [--out FILE.json]

Per run, the two ways in turn (A B A B ...), each on core 0 with yrpd's CPU engine flags: time from the start until
/health answers 200 and until a first greedy completion (8 tokens) has come back; at that moment the CPU time
(user + system, /proc) and the resident memory of every process of the instance's session, and their count; then all
are killed. Reported: each way's medians and runs, the per-pair ratios uni / mp, and whether both answered alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from multinode_start import end_run

from yrpd.provenance import record
from yrpd.serving import BASE_ENV, KIND_ENGINE_ARGS
from yrpd.spec import DeviceKind

VENV = Path(os.environ.get("YRPD_VLLM_VENV", "/opt/yrpd/venvs/vllm"))
PORT = 18191
WAYS = {"mp (vLLM's CPU default)": {}, "uni (multiprocessing off)": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def session_processes(sid: int) -> list[tuple[int, str, float, int]]:
    """(pid, name, CPU seconds, resident bytes) of every live process of session `sid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) != sid:  # fields from state on: state ppid pgrp session ...
            continue
        cpu = (int(fields[11]) + int(fields[12])) / TICK  # utime stime
        out.append((int(entry), name, cpu, int(fields[21]) * PAGE))  # rss in pages
    return out


def ask(path: str, body: dict | None = None):
    data = json.dumps(body).encode() if body else None
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.load(resp)["choices"][0]["text"] if body else resp.status == 200
    except OSError:
        return None


def one_run(model: str, way: str, logs: Path) -> dict:
    before = set(os.listdir("/dev/shm"))
    argv = [str(VENV / "bin/vllm"), "serve", model, "--served-model-name", "m", "--host", "127.0.0.1", "--port",
            str(PORT), *KIND_ENGINE_ARGS[DeviceKind.cpu]]
    env = {**os.environ, **BASE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CACHE_ROOT": str(logs / "cache"), **WAYS[way]}
    started = time.monotonic()
    with open(logs / f"{way.split()[0]}.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    try:
        while not ask("/health"):
            if proc.poll() is not None:
                raise SystemExit(f"{way}: vllm serve exited before /health answered; see {logs}")
            if time.monotonic() - started > 600:
                raise SystemExit(f"{way}: no /health after 600 s; see {logs}")
            time.sleep(0.2)
        healthy = time.monotonic() - started
        text = ask("/v1/completions", {"model": "m", "prompt": "The capital of France is", "max_tokens": 8,
                                       "temperature": 0})
        answered = time.monotonic() - started
        procs = session_processes(proc.pid)
        return {"healthy_s": round(healthy, 2), "first_answer_s": round(answered, 2),
                "cpu_s": round(sum(p[2] for p in procs), 2), "rss_mb": round(sum(p[3] for p in procs) / 2**20),
                "processes": sorted(p[1] for p in procs), "answer": text}
    finally:
        end_run([proc], before)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default="/opt/yrpd/venvs/models/smollm2")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {w: [] for w in WAYS}
    with tempfile.TemporaryDirectory(prefix="yrpd-executor-") as tmp:
        for i in range(args.runs + 1):  # the first pair warms vLLM's compile cache and is not counted
            for way in WAYS:
                result = one_run(args.model, way, Path(tmp))
                print(way, "(warm-up)" if i == 0 else "", result, flush=True)
                if i:
                    runs[way].append(result)
    [mp, uni] = WAYS
    keys = ("healthy_s", "first_answer_s", "cpu_s", "rss_mb")
    report = {
        "provenance": record([" ".join(sys.argv)], vllm_venv=VENV),
        "model": args.model,
        "what": "one one-rank CPU instance (yrpd's CPU engine flags, core 0), vLLM's mp executor vs uni (the model "
                "in the EngineCore); each way's first start warms vLLM's compile cache and is left out",
        "ways": {w: {**{f"median_{k}": statistics.median(r[k] for r in runs[w]) for k in keys}, "runs": runs[w]}
                 for w in WAYS},
        "ratios_uni_over_mp": {k: [round(b[k] / a[k], 3) for a, b in zip(runs[mp], runs[uni])] for k in keys},
        "same_answers": len({r["answer"] for w in WAYS for r in runs[w]}) == 1,
    }
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
