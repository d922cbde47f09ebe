"""Soak: a 2-host deployment under steady load for a long time, with a process killed every few minutes (benchmark,
not a test; issue 32).

    .venv/bin/python benchmarks/soak.py [--minutes 30] [--concurrency 8] [--kill-every 5] [--out FILE.json]

Two fake hosts (root needed): prefill, the proxy and etcd on h1, decode on h2, the tiny model (the subject is the
processes, not the language). `--concurrency` clients send greedy completions in a loop, from a fixed set of prompts
(half of them sharing a long prefix, so the data system hands KV over), each answer compared with the one the
deployment gave before the load: a different 200 is a wrong answer. Every `--kill-every` minutes one process is
killed with -9, in turn: decode's API server, prefill's EngineCore, h2's data-system worker, the proxy, etcd, decode's
EngineCore. Every 30 s it samples, per host: the RSS and open fds of the proxy, the connector's writer processes
and the data-system workers, and the psm_* segments in /dev/shm.

Reported: per window of `--kill-every` minutes the p50/p99 latency of answered requests, errors and wrong answers;
per sampled series its first and last value, its slope per hour (least squares over the samples of one pid, the
longest such run) and that over the run's second half (past the warm-up), and the points themselves; after
`yrpd down`, what differs from before the deploy (psm_* segments, listening ports, the session's processes).
The tail: each request carries an X-Request-Id, and the slowest 1 % of the answered ones are broken down from the
deployment's own log lines: the proxy's (its own time, the prefill leg, the decode leg), prefill's connector (the
hand-over) and decode's (the wait for the hand-over's blocks, what it loaded). Provenance: yrpd.provenance.record.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lab.fakehosts import FakeHostLab  # noqa: E402
from lab.hosts import leftovers, session_processes  # noqa: E402
from lab.traffic import LONG, Call, TwoHosts, body, restarts  # noqa: E402
from yrpd.provenance import record  # noqa: E402
from yrpd.versions import DEFAULT_ENV_ROOT  # noqa: E402

KILLS = [("h2", "decode-0", ""), ("h1", "prefill-0", "engine"), ("h2", "ds_worker", ""), ("h1", "proxy", ""),
         ("h1", "etcd", ""), ("h2", "decode-0", "engine")]
PROMPTS = [f"{LONG}\n# question {i}" for i in range(4)] + [f"import module_{i}\n" * (i + 2) for i in range(4)]
#: what each sampled series is, by a fragment of its command line
WATCHED = {"proxy": "yrpd.proxy", "writer": "yrpd.connector.saver", "ds_worker": "datasystem_worker"}
SAMPLE = """import json, os
out = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
        rss = next(int(l.split()[1]) for l in open(f"/proc/{pid}/status") if l.startswith("VmRSS:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        continue
    out.append([int(pid), cmd, rss, fds])
print(json.dumps(out))
"""


def sample(lab) -> dict:
    """{"host/kind/pid": {"rss_kb", "fds"}} plus the psm_* count (the hosts share this machine's /dev/shm; the
    count includes what other runs left there before: its slope is the figure)."""
    got = {}
    for host in lab.hosts:
        rows = json.loads(host.exec(f"python3 - <<'EOF'\n{SAMPLE}\nEOF").stdout)
        for pid, cmd, rss, fds in rows:
            if "supervise.py" in cmd:  # a supervisor's argv carries its command's text: not the process itself
                continue
            kind = next((k for k, frag in WATCHED.items() if frag in cmd), None)
            if kind:
                got[f"{host.name}/{kind}/{pid}"] = {"rss_kb": rss, "fds": fds}
    got["shm_psm"] = sum(1 for n in os.listdir("/dev/shm") if n.startswith("psm_"))
    return got


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 3:
        return None
    mt = statistics.fmean(t for t, _ in points)
    mv = statistics.fmean(v for _, v in points)
    den = sum((t - mt) ** 2 for t, _ in points)
    return round(sum((t - mt) * (v - mv) for t, v in points) / den * 3600, 2) if den else None


def series(samples: list[tuple[float, dict]]) -> dict:
    """Per host/kind and measure: the longest run of one pid, its first and last value and its slope per hour."""
    runs: dict[tuple[str, str], dict[int, list[tuple[float, float]]]] = {}
    for t, s in samples:
        for key, row in s.items():
            if key == "shm_psm":
                continue
            host, kind, pid = key.split("/")
            for measure, value in row.items():
                runs.setdefault((f"{host}/{kind}", measure), {}).setdefault(int(pid), []).append((t, value))
    out = {}
    for (name, measure), by_pid in sorted(runs.items()):
        pid, points = max(by_pid.items(), key=lambda kv: len(kv[1]))
        # a process warms up (allocator arenas, caches filling to their bounds): the second half's slope is the
        # steady one, and the points show the shape
        out.setdefault(name, {})[measure] = {"pid": pid, "samples": len(points), "first": points[0][1],
                                             "last": points[-1][1], "slope_per_hour": slope_per_hour(points),
                                             "slope_per_hour_second_half": slope_per_hour(points[len(points) // 2:]),
                                             "pids_seen": len(by_pid),
                                             "points": [[round(t / 60, 1), v] for t, v in points]}
    shm = [(t, s["shm_psm"]) for t, s in samples]
    out["dev_shm_psm"] = {"first": shm[0][1], "last": shm[-1][1], "max": max(v for _, v in shm),
                          "slope_per_hour": slope_per_hour(shm)}
    return out


def kill(d: TwoHosts, host: str, name: str, part: str) -> str:
    report, _ = d.status()
    if name in ("etcd", "ds_worker"):
        pid = next(c["pid"] for c in report["cluster"]["components"] if (c["host"], c["component"]) == (host, name))
    else:
        state = json.loads(d.lab[host].exec(f"cat /tmp/yrpd_sessions/{report['session']}/run/{name}.state.json").stdout)
        pid = state["pid"]
        if part == "engine":
            pid = int(d.lab[host].exec(f"pgrep -P {pid} EngineCor").stdout.split()[0])
    d.lab[host].exec(f"kill -9 {pid}")
    return f"kill -9 {name}{':' + part if part else ''} on {host} (pid {pid})"


#: the proxy's line for one request: status, total ms, then key=value notes (yrpd/proxy/app.py `_record`)
PROXY_LINE = re.compile(r"POST /v1/completions (\d+) (\d+)ms (.*)$")
#: decode's connector on one request: what it loaded and how long it waited for the hand-over's blocks
DECODE_LOADS = re.compile(r"request \S*?(soak-\d+-\d+)\S*: loads (nothing|\d+ blocks).*?waited (\d+) ms")


def tail(d: TwoHosts, results: list[tuple], share: float = 0.01) -> dict:
    """The slowest `share` of the answered requests, each broken down from the deployment's log lines."""
    ok = sorted((r for r in results if r[2] == 200), key=lambda r: r[1], reverse=True)
    slow = ok[:max(1, int(len(ok) * share))]
    proxy: dict[str, dict] = {}
    for line in d.cli("logs", "proxy", "-n", "100000", timeout=600).stdout.splitlines():
        m = PROXY_LINE.search(line)
        if m:
            notes = dict(kv.split("=", 1) for kv in m.group(3).split() if "=" in kv)
            if notes.get("id", "").startswith("soak-"):
                proxy[notes["id"]] = {"status": int(m.group(1)), "total_ms": int(m.group(2)), **notes}
    decode: dict[str, dict] = {}
    for line in d.cli("logs", "decode-0", "-n", "100000", timeout=600).stdout.splitlines():
        m = DECODE_LOADS.search(line)
        if m:
            decode[m.group(1)] = {"loads": m.group(2), "waited_ms": int(m.group(3))}
    rows = []
    for start, seconds, _status, _wrong, rid, prompt in slow:
        p = proxy.get(rid, {})
        prefill_ms = int(p.get("prefill_ms", 0) or 0)
        own_ms = float(p.get("own_ms", 0) or 0)
        rows.append({"id": rid, "at_s": round(start, 1), "client_s": round(seconds, 3), "prompt": prompt,
                     "proxy_total_ms": p.get("total_ms"), "proxy_own_ms": own_ms, "prefill_leg_ms": prefill_ms,
                     "decode_leg_ms": (p["total_ms"] - prefill_ms - round(own_ms)) if p else None,
                     "prefill": p.get("prefill"), "decode": p.get("decode"), **{f"decode_{k}": v for k, v in
                                                                                 decode.get(rid, {}).items()}})
    everyone = [proxy[r[4]] for r in ok if r[4] in proxy]
    return {"share": share, "requests": len(slow), "threshold_s": round(slow[-1][1], 3) if slow else None,
            "median_prefill_leg_ms_all": statistics.median(int(p.get("prefill_ms", 0)) for p in everyone)
            if everyone else None, "slowest": rows}


def copy_logs(lab, session: str, into: Path) -> None:
    """Every *.log and *.state.json of the session, per host (each host's /tmp is its own); the data system's rocksdb
    write-ahead logs (*.log too) are not logs."""
    for host in lab.hosts:
        listing = host.exec(f"cd /tmp/yrpd_sessions/{session} && find . -path '*/rocksdb' -prune -o "
                            "\\( -name '*.log' -o -name '*.state.json' \\) -print", check=False).stdout.split()
        for rel in listing:
            target = into / host.name / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            # base64: a log may hold bytes that are not text (the data system's binary-prefixed lines)
            got = host.exec(f"base64 -w0 /tmp/yrpd_sessions/{session}/{rel}", check=False, timeout=120).stdout
            target.write_bytes(base64.b64decode(got))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kill-every", type=float, default=5, help="minutes")
    ap.add_argument("--out", default="")
    ap.add_argument("--logs", default="", help="copy every host's session logs here before `down` (the evidence)")
    opts = ap.parse_args()
    report: dict = {
        "provenance": record([" ".join(["benchmarks/soak.py", *sys.argv[1:]])],
                             vllm_venv=Path(DEFAULT_ENV_ROOT) / "vllm"),
        "minutes": opts.minutes, "concurrency": opts.concurrency, "kill_every_min": opts.kill_every}
    shm_before = {n for n in os.listdir("/dev/shm") if n.startswith("psm_")}
    with tempfile.TemporaryDirectory(prefix="yrpd-soak-") as tmp, FakeHostLab(2, Path(tmp) / "lab") as lab:
        d = TwoHosts(lab, Path(tmp))
        report["deploy_s"] = round(d.deploy(), 1)
        expected = {p: d.ask(p, 16, timeout=120).text for p in PROMPTS}
        assert all(expected.values()), "the deployment did not answer before the load"
        before_restarts = restarts(d.healthy()[0])
        results: list[tuple] = []  # (start, seconds, status, wrong, request id, prompt number)
        stop = threading.Event()
        started, started_wall = time.monotonic(), time.time()

        def client(n: int) -> None:
            i = n
            while not stop.is_set():
                prompt = PROMPTS[i % len(PROMPTS)]
                call = Call(d.proxy, body(prompt, 16), timeout=120, request_id=f"soak-{n}-{i}")
                call.run()
                results.append((call.started - started, call.ended - call.started, call.status,
                                call.status == 200 and call.text != expected[prompt], call.request_id,
                                i % len(PROMPTS)))
                if call.status != 200:
                    time.sleep(0.5)  # a refused client backs off, as a real one would
                i += 1

        clients = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(opts.concurrency)]
        for c in clients:
            c.start()
        samples: list[tuple[float, dict]] = []
        kills: list[dict] = []
        end = started + opts.minutes * 60
        next_kill, turn = started + opts.kill_every * 60, 0
        while time.monotonic() < end:
            samples.append((time.monotonic() - started, sample(lab)))
            if time.monotonic() >= next_kill and time.monotonic() < end - 60:
                what = kill(d, *KILLS[turn % len(KILLS)])
                kills.append({"at_s": round(time.monotonic() - started), "what": what})
                print(f"{kills[-1]['at_s']} s: {what}", file=sys.stderr, flush=True)
                next_kill, turn = next_kill + opts.kill_every * 60, turn + 1
            time.sleep(max(0.0, min(30.0, end - time.monotonic())))
        stop.set()
        for c in clients:
            c.join(150)
        after, _ = d.healthy(within=300)
        width = opts.kill_every * 60
        windows = []
        for w in range(int(opts.minutes * 60 // width) + 1):
            rows = [r for r in results if w * width <= r[0] < (w + 1) * width]
            if not rows:
                continue
            ok = sorted(r[1] for r in rows if r[2] == 200)
            windows.append({"from_min": round(w * width / 60, 1), "requests": len(rows), "ok": len(ok),
                            "errors": sum(1 for r in rows if r[2] != 200), "wrong": sum(1 for r in rows if r[3]),
                            "p50_s": round(ok[len(ok) // 2], 3) if ok else None,
                            "p99_s": round(ok[min(len(ok) - 1, int(len(ok) * 0.99))], 3) if ok else None,
                            "p99_over_p50": round(ok[min(len(ok) - 1, int(len(ok) * 0.99))] / ok[len(ok) // 2], 1)
                            if ok else None})
        report["started_at"] = round(started_wall, 3)  # the requests' at_s count from here; the logs' clocks are wall
        if opts.logs:
            copy_logs(lab, d.status()[0]["session"], Path(opts.logs))
        report.update(kills=kills, windows=windows, series=series(samples), tail=tail(d, results),
                      restarts={f"{h}/{n}": v - before_restarts.get((h, n), 0) for (h, n), v in restarts(after).items()},
                      totals={"requests": len(results), "errors": sum(1 for r in results if r[2] != 200),
                              "wrong": sum(1 for r in results if r[3])})
        down_started = time.monotonic()
        d.cli("down", timeout=300)
        report["down_s"] = round(time.monotonic() - down_started, 1)
        report["after_down"] = {
            "new_psm_segments": sorted({n for n in os.listdir("/dev/shm") if n.startswith("psm_")} - shm_before),
            "hosts": {h.name: {"session_processes": session_processes(h), "leftovers": leftovers(h)} for h in lab.hosts}}
    text = json.dumps(report, indent=2)
    if opts.out:
        Path(opts.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
