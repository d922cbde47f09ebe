"""deploy_scripts/exporter.py, run as on a host: what a scrape of /metrics returns from a data system worker's
resource.log and the connector's stats files (a resource line as the worker wrote it in a lab run)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from yrpd.assets import asset_dir, deploy_script
from yrpd.layout import HostSessionLayout

RESOURCE = ("2026-11-26T06:32:01.323244 | I | res_metric_collector.cpp:116 |   | 3337:3883 | e7ee040e-f57d-4835-af30-"
            "13f75b7f9582 |  | 509689856/509689856/1073741824/0.475/0/564051968 | 0/0/0/0 | 4 | 81 | 477836368 | "
            "0/16/0/0/0.000 | 0/16/0/0/0.000 | 0/16/0/0/0.000 | 0/16/0/0/0.000 | 0/80000/0.000 |  |  | 0/2/0/0/0.000 "
            "|  |  |  |  |  |  | 0/0/0/0 |  | 226/0/0/0/0 |")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def exporter(tmp_path):
    port = free_port()
    args = {"host": "127.0.0.1", "port": port, "host_name": "h1", "resource_log": str(tmp_path / "resource.log"),
            "stats": run_layout(tmp_path).kv_stats_glob}
    (tmp_path / "run").mkdir()
    shipped = tmp_path / "run" / "exporter.py"  # as the start step writes it: hostlib's text in place of its import
    shipped.write_text(deploy_script("exporter.py"))
    proc = subprocess.Popen([sys.executable, "-I", str(shipped), json.dumps(args)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.05)
        yield tmp_path, url
    finally:
        proc.terminate()
        proc.wait(10)


def run_layout(tmp_path) -> HostSessionLayout:
    """The session layout whose run directory is tmp_path/run, as on a host."""
    return HostSessionLayout(str(tmp_path.parent), tmp_path.name)


def stats_file(tmp_path, instance: str, side: str, dp: int = 0, rank: int = 0) -> Path:
    return Path(run_layout(tmp_path).kv_stats(instance).format(side=side, dp=dp, rank=rank))


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_a_scrape_gives_the_workers_figures_and_each_connectors_counters(exporter):
    root, url = exporter
    assert scrape(url) == {'yrpd_ds_up{host="h1"}': 0}  # the control: no resource line yet, no stats file
    (root / "resource.log").write_text("an older line\n" + RESOURCE + "\n")
    stats = {"schema": "yrpd.connector.stats/1", "side": "worker", "rank": 0, "dp": 0, "ds_healthy": True,
             "counters": {"loaded_blocks": 12, "load_failed_blocks": 1},
             "latency_ms": {"load": {"count": 4, "total": 250.0, "avg": 62.5, "max": 90.0, "last": 50.0}}}
    stats_file(root, "decode-0", "worker").write_text(json.dumps(stats))
    got = scrape(url)
    assert got['yrpd_ds_up{host="h1"}'] == 1
    assert got['yrpd_ds_memory_used_bytes{host="h1"}'] == 509689856
    assert got['yrpd_ds_memory_limit_bytes{host="h1"}'] == 1073741824
    assert got['yrpd_ds_objects{host="h1"}'] == 81
    assert got['yrpd_ds_hits_total{host="h1",tier="memory"}'] == 226
    labels = 'host="h1",yrpd_instance="decode-0",side="worker",dp="0",rank="0"'
    assert got[f"yrpd_connector_loaded_blocks_total{{{labels}}}"] == 12
    assert got[f"yrpd_connector_load_failed_blocks_total{{{labels}}}"] == 1
    assert got[f"yrpd_connector_load_seconds_total{{{labels}}}"] == 0.25
    assert got[f"yrpd_connector_ds_healthy{{{labels}}}"] == 1
    stats_file(root, "decode-0", "worker").write_text("{half a docu")  # being replaced
    assert not any(k.startswith("yrpd_connector_") for k in scrape(url))
    assert urllib.request.urlopen(url + "/health", timeout=5).read() == b"ok\n"


def test_each_dp_engine_of_an_instance_keeps_its_own_series(exporter):
    """The DP engines of one instance on a host each have TP rank 0: their stats files and series differ by `dp`
    (one file shared by both held whichever engine wrote last, and two series of one label set break a scrape). The
    file of an engine whose process is gone (dp 2, written by a process that exited) gives no series."""
    root, url = exporter
    gone = subprocess.Popen(["true"])
    gone.wait()
    for dp, loaded, pid in ((0, 5, os.getpid()), (1, 7, os.getpid()), (2, 9, gone.pid)):
        stats_file(root, "decode-0", "worker", dp=dp).write_text(json.dumps(
            {"pid": pid, "side": "worker", "rank": 0, "dp": dp, "ds_healthy": True,
             "counters": {"loaded_blocks": loaded}}))
    got = scrape(url)
    series = {k: v for k, v in got.items() if k.startswith("yrpd_connector_loaded_blocks_total")}
    assert series == {f'yrpd_connector_loaded_blocks_total{{host="h1",yrpd_instance="decode-0",side="worker",'
                      f'dp="{dp}",rank="0"}}': float(n) for dp, n in ((0, 5), (1, 7))}


def test_the_workers_counters_now_are_the_second_line_it_writes_after_the_call(tmp_path):
    """A bench or test reads the worker's hits between two loads (hostlib.ds_resource_now): the first line written
    after the call may have been sampled before it, so the second is taken."""
    import importlib.util
    import threading

    spec = importlib.util.spec_from_file_location("hostlib", asset_dir("deploy_scripts") / "hostlib.py")
    hostlib = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hostlib)
    line = lambda hits: RESOURCE.replace("226/0/0/0/0", f"{hits}/0/0/0/0")  # noqa: E731
    log = tmp_path / "resource.log"
    log.write_text(line(1) + "\n" + line(2)[:40])  # a line half written when the reading begins

    def worker(lines):
        with open(log, "a") as f:
            for text in lines:
                time.sleep(0.3)
                f.write(text)
                f.flush()

    writer = threading.Thread(target=worker, args=([line(2)[40:] + "\n", line(3) + "\n"],))
    writer.start()
    assert hostlib.ds_resource_now(log, 5)["hits_memory"] == 3
    writer.join()
    # the control: one whole line after the call is not enough
    writer = threading.Thread(target=worker, args=([line(4) + "\n"],))
    writer.start()
    with pytest.raises(RuntimeError, match="fewer than two new lines"):
        hostlib.ds_resource_now(log, 1.5)
    writer.join()
