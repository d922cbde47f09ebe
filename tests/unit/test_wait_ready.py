"""deploy_scripts/wait_ready.py, run as the host runs it, against an HTTP server on loopback: an instance whose KV
connector goes through the data system is ready only once it answers /health and its connector's stats say the
data system is reachable (the instances start before openYuanrong)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "deploy_scripts" / "wait_ready.py"


class Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def wait(tmp_path: Path, url: str, timeout: float, ds_link: bool = True) -> subprocess.CompletedProcess:
    (tmp_path / "decode-0.pid").write_text(str(os.getpid()))
    args = {"pidfile": f"{tmp_path}/{{name}}.pid", "log": f"{tmp_path}/{{name}}.log",
            "state": f"{tmp_path}/{{name}}.state", "kv_stats": f"{tmp_path}/{{name}}.kv-*.json", "timeout": timeout,
            "targets": [{"name": "decode-0", "url": url + "/health", "ds_link": ds_link}]}
    return subprocess.run([sys.executable, str(SCRIPT), json.dumps(args)], capture_output=True, text=True, timeout=60)


def stats(tmp_path: Path, side: str, healthy: bool, pid: int = os.getpid()) -> None:
    (tmp_path / f"decode-0.kv-{side}.json").write_text(json.dumps(
        {"pid": pid, "side": side, "rank": 0, "ds_address": "10.0.0.2:31501", "ds_healthy": healthy,
         **({} if healthy else {"ds_last_error": "connect refused"})}))


def test_answering_is_not_ready_until_the_connector_reaches_the_data_system(tmp_path, server):
    missing = wait(tmp_path, server, timeout=1)
    assert missing.returncode == 1 and "answers" in missing.stderr and "has written no stats yet" in missing.stderr
    stats(tmp_path, "scheduler", True)
    stats(tmp_path, "worker", False)
    down = wait(tmp_path, server, timeout=1)
    assert down.returncode == 1
    assert ("decode-0 answers " in down.stderr and "its KV connector (worker rank 0) cannot reach the data system at "
            "10.0.0.2:31501: connect refused within 1s" in down.stderr), down.stderr
    stats(tmp_path, "worker", True)
    assert "decode-0" in json.loads(wait(tmp_path, server, timeout=5).stdout)


def test_stats_of_an_earlier_run_do_not_count_and_plain_targets_need_no_link(tmp_path, server):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stats(tmp_path, "worker", True, pid=gone.pid)  # written by a process that has exited
    assert "has written no stats yet" in wait(tmp_path, server, timeout=1).stderr
    assert wait(tmp_path, server, timeout=1, ds_link=False).returncode == 0


def test_every_dp_engine_of_an_instance_must_reach_the_data_system(tmp_path, server):
    """An instance of two DP engines on the host, as yrpd lays out their stats files: the one that cannot reach the
    data system is named, though the other can (with one file for both, whichever wrote last decided)."""
    from yrpd.layout import HostSessionLayout

    layout = HostSessionLayout(str(tmp_path), "s")
    Path(layout.run_dir).mkdir(parents=True)
    (tmp_path / "decode-0.pid").write_text(str(os.getpid()))

    def engines(down: int | None) -> subprocess.CompletedProcess:
        for dp in (0, 1):
            Path(layout.kv_stats("decode-0").format(side="worker", dp=dp, rank=0)).write_text(json.dumps(
                {"pid": os.getpid(), "side": "worker", "rank": 0, "dp": dp, "ds_address": "10.0.0.2:31501",
                 "ds_healthy": dp != down, "ds_last_error": "connect refused"}))
        args = {"pidfile": f"{tmp_path}/{{name}}.pid", "log": f"{tmp_path}/{{name}}.log",
                "state": f"{tmp_path}/{{name}}.state", "kv_stats": layout.for_scripts()["kv_stats"], "timeout": 1,
                "targets": [{"name": "decode-0", "url": server + "/health", "ds_link": True}]}
        return subprocess.run([sys.executable, str(SCRIPT), json.dumps(args)], capture_output=True, text=True,
                              timeout=60)

    down = engines(down=1)
    assert down.returncode == 1 and "(worker rank 0 of DP engine 1) cannot reach" in down.stderr, down.stderr
    assert engines(down=None).returncode == 0  # the control: both engines reach it


def test_the_proxy_is_ready_only_once_its_status_lists_every_member_up(tmp_path):
    listed: dict = {"instances": []}

    class Proxy(Health):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps(listed).encode() if self.path == "/yrpd/status" else b"{}"
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    old, new = "http://10.0.0.2:8100", "http://10.0.0.3:8100"
    try:
        (tmp_path / "proxy.pid").write_text(str(os.getpid()))

        def wait_proxy(timeout):
            args = {"pidfile": f"{tmp_path}/{{name}}.pid", "log": f"{tmp_path}/{{name}}.log",
                    "state": f"{tmp_path}/{{name}}.state", "kv_stats": f"{tmp_path}/{{name}}.kv-*.json",
                    "timeout": timeout, "targets": [{"name": "proxy", "url": url + "/health", "members": [old, new],
                                                     "status_url": url + "/yrpd/status"}]}
            return subprocess.run([sys.executable, str(SCRIPT), json.dumps(args)], capture_output=True, text=True,
                                  timeout=60)

        listed["instances"] = [{"url": old, "up": True}, {"url": new, "up": False}]
        joining = wait_proxy(1)  # /health answers, but the new instance is not routed to yet
        assert joining.returncode == 1 and f"it does not route to {new} yet" in joining.stderr, joining.stderr
        listed["instances"][1]["up"] = True  # the control: the same proxy once it has the new one up
        assert "proxy" in json.loads(wait_proxy(5).stdout)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_earlier_supervisors_ending_is_not_the_new_starts(tmp_path):
    """A process restarted by `yrpd deploy` after its supervisor gave up (restart off): the state file still says how
    the old run ended until the new supervisor has started the command (on a busy host, after the wait began: the CI
    of d342379 failed its deploy so). Only a state written by the supervisor the pidfile names counts."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    state = tmp_path / "decode-0.state"
    state.write_text(json.dumps({"state": "failed", "reason": "killed by signal 9", "supervisor": gone.pid}))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Health)  # bound now, answering only in 2 s: a start under way
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.server_close()
    httpd_box: list = []
    late = threading.Timer(2, lambda: threading.Thread(target=serve_at, args=(url, httpd_box), daemon=True).start())
    late.start()
    try:
        assert "decode-0" in json.loads(wait(tmp_path, url, timeout=10, ds_link=False).stdout)
    finally:
        late.cancel()
        for h in httpd_box:
            h.shutdown()
            h.server_close()
    # the control: the same ending written by the supervisor the pidfile names fails at once
    state.write_text(json.dumps({"state": "failed", "reason": "killed by signal 9", "supervisor": os.getpid()}))
    ended = wait(tmp_path, "http://127.0.0.1:1", timeout=30, ds_link=False)  # nothing answers there
    assert ended.returncode == 1 and "decode-0 ended (killed by signal 9) before answering" in ended.stderr


def serve_at(url: str, box: list) -> None:
    httpd = ThreadingHTTPServer(("127.0.0.1", int(url.rsplit(":", 1)[1])), Health)
    box.append(httpd)
    httpd.serve_forever()
