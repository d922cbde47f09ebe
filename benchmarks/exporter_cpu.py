"""What a host's metrics exporter costs in CPU (benchmark, not a test; issue 35: "under 1 % of a core per host").

    .venv/bin/python benchmarks/exporter_cpu.py [--seconds 60] [--instances 4] [--out FILE.json]

Runs deploy_scripts/exporter.py as a host runs it (the shipped text, `python3 -I`) over a data system resource.log
written every 5 s (as the worker writes it) and the stats files of `--instances` instances (scheduler and worker side
each, rewritten every 5 s, as the connector does), and reads its CPU time from /proc over `--seconds` each:
idle (nothing scrapes it), scraped every 15 s (Prometheus's default) and every 1 s. Reported: % of one core per
phase. Provenance: commit, CPU, cores, the command.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lab.report import write_report  # noqa: E402
from yrpd.assets import deploy_script  # noqa: E402

RESOURCE = ("{at} | I | res_metric_collector.cpp:116 |   | 3337:3883 | e7ee040e-f57d-4835-af30-13f75b7f9582 |  | "
            "509689856/509689856/1073741824/0.475/0/564051968 | 0/0/0/0 | 4 | 81 | 477836368 | 0/16/0/0/0.000 | "
            "0/16/0/0/0.000 | 0/16/0/0/0.000 | 0/16/0/0/0.000 | 0/80000/0.000 |  |  | 0/2/0/0/0.000 |  |  |  |  |  "
            "|  | 0/0/0/0 |  | 226/0/0/0/0 |\n")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def writer(root: Path, instances: int, stop: threading.Event) -> None:
    """What the worker and the connectors do to the files the exporter reads: a new line / a new file every 5 s."""
    n = 0
    while not stop.is_set():
        with open(root / "resource.log", "a") as fh:
            fh.write(RESOURCE.format(at=time.strftime("%Y-%m-%dT%H:%M:%S.000000")))
        for i in range(instances):
            for side in ("scheduler", "worker"):
                doc = {"schema": "yrpd.connector.stats/1", "side": side, "rank": 0, "ds_healthy": True,
                       "counters": {"saved_blocks": n, "loaded_blocks": n, "lookup_requests": n},
                       "latency_ms": {"load": {"count": n, "total": 3.0 * n}}}
                tmp = root / f".kv-{i}-{side}.tmp"
                tmp.write_text(json.dumps(doc))
                os.replace(tmp, root / f"kv-instance-{i}-{side}-rank0.json")
        n += 1
        stop.wait(5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--out")
    opts = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        root = Path(tmp)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        (root / "exporter.py").write_text(deploy_script("exporter.py"))
        args = {"host": "127.0.0.1", "port": port, "host_name": "h1", "resource_log": str(root / "resource.log"),
                "stats": str(root / "kv-*-rank*.json")}
        stop = threading.Event()
        files = threading.Thread(target=writer, args=(root, opts.instances, stop), daemon=True)
        files.start()
        proc = subprocess.Popen(["python3", "-I", str(root / "exporter.py"), json.dumps(args)])
        url = f"http://127.0.0.1:{port}/metrics"
        try:
            for _ in range(100):
                try:
                    size = len(urllib.request.urlopen(url, timeout=1).read())
                    break
                except OSError:
                    time.sleep(0.1)
            figures: dict = {"metrics_page_bytes": size, "instances": opts.instances, "seconds_per_phase": opts.seconds}
            for phase, every in (("idle", None), ("scraped_every_15s", 15.0), ("scraped_every_1s", 1.0)):
                t0, c0, scrapes = time.monotonic(), cpu_seconds(proc.pid), 0
                while time.monotonic() - t0 < opts.seconds:
                    if every:
                        urllib.request.urlopen(url, timeout=5).read()
                        scrapes += 1
                    time.sleep(every or 1.0)
                used = cpu_seconds(proc.pid) - c0
                figures[phase] = {"core_percent": round(100 * used / (time.monotonic() - t0), 3), "scrapes": scrapes}
                print(f"{phase}: {figures[phase]}", flush=True)
        finally:
            stop.set()
            proc.terminate()
            proc.wait(10)
    if opts.out:
        write_report(opts.out, figures, command="benchmarks/exporter_cpu.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
