"""A real Prometheus (Debian's `prometheus` package) for the lab: it scrapes what `yrpd metrics targets` lists, every
second, and answers PromQL over its HTTP API. It listens on 127.0.0.1 only and keeps its data under the test's
tmp_path; stopped (and waited for) when the block ends."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from tests.prereq import missing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict]:
        q = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as resp:
            answer = json.load(resp)
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def until_data(self, exprs: list[str], within: float = 60) -> dict[str, list[dict]]:
        """Each query's result once every one of them has a series; fails naming those still empty."""
        deadline = time.monotonic() + within
        while True:
            got = {e: self.query(e) for e in exprs}
            empty = [e for e, r in got.items() if not r]
            if not empty:
                return got
            assert time.monotonic() < deadline, f"no series for: {empty}"
            time.sleep(2)


@contextlib.contextmanager
def scraping(targets_file: Path, work: Path):
    binary = shutil.which("prometheus")
    if binary is None:
        missing("prometheus (Debian's package) is not installed: scripts/bootstrap.sh installs it")
    work.mkdir(parents=True, exist_ok=True)
    config = work / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                      f"  - job_name: yrpd\n    file_sd_configs:\n      - files: [{targets_file}]\n"
                      "        refresh_interval: 2s\n")
    port = _free_port()
    log = open(work / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    try:
        prom = Prometheus(f"http://127.0.0.1:{port}")
        for _ in range(150):
            try:
                urllib.request.urlopen(f"{prom.url}/-/ready", timeout=1).read()
                break
            except OSError:
                assert proc.poll() is None, (work / "prometheus.log").read_text()[-2000:]
                time.sleep(0.2)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
