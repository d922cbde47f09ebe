"""`yrpd deploy --hosts localhost`, no other flag, on this CPU-only machine: the embedded default, end to end.

It runs inside a network namespace the test creates, so its 127.0.0.1 ports (proxy 8000, instances 8100+, the
data system, etcd) can never collide with anything else on the machine, and everything it leaves is found.
"""

import json
import os
import secrets
import shlex
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.doc_commands import acts_on_a_deployment, commands, documented_shell, words
from lab.fakehosts import _kill_and_wait, _ns_key, _pids_in_ns
from tests.prereq import missing as prerequisite

pytestmark = [pytest.mark.lab, pytest.mark.e2e]

ENV_ROOT = Path("/opt/yrpd/venvs")  # the embedded default's own environment root
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def netns():
    missing = [v for v in ("ds", "vllm") if not (ENV_ROOT / v / "bin" / "python").exists()]
    if missing:
        prerequisite(f"venvs {missing} missing under {ENV_ROOT}: run scripts/test.sh (it installs them)")
    # not "yl...": the fake-host lab removes namespaces with that prefix it does not hold a lock for
    name = f"ydemo-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        leftover = _pids_in_ns("net", _ns_key(f"/run/netns/{name}"))
        _kill_and_wait(leftover)
        subprocess.run(["ip", "netns", "del", name], check=False)


def in_ns(ns: str, *argv: str, env: dict, timeout: float = 1500, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env}, stdin=subprocess.DEVNULL, cwd=cwd)


def watch_in_tmux(ns: str, argv: list[str], env: dict, looks: float = 8.0) -> str:
    """The screen of a terminal (tmux, 200x100) `looks` seconds after starting a command that redraws itself in it,
    captured; then Ctrl-C, which must end it (the pane closes with it)."""
    sock = f"yrpd-watch-{ns}"
    tmux = ["tmux", "-L", sock, "-f", "/dev/null"]
    full_env = {**os.environ, **env}
    command = " ".join(shlex.quote(a) for a in ["ip", "netns", "exec", ns, "env",
                                                *(f"{k}={v}" for k, v in env.items()), *argv])
    subprocess.run([*tmux, "new-session", "-d", "-x", "200", "-y", "100", "-s", "watch", command],
                   check=True, env=full_env, cwd=REPO)
    try:
        time.sleep(looks)
        screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "watch"], capture_output=True, text=True,
                                check=True).stdout
        subprocess.run([*tmux, "send-keys", "-t", "watch", "C-c"], check=True)
        time.sleep(2)
        running = [a for a in _args_in_ns(ns) if a.startswith(argv[0]) and "--watch" in a]
        assert running == [], f"status --watch still runs after Ctrl-C: {running}"
        return screen
    finally:
        subprocess.run([*tmux, "kill-server"], check=False, capture_output=True)


def _args_in_ns(ns: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "exec", ns, "ps", "-eo", "args"], capture_output=True, text=True).stdout
    return out.splitlines()


def follow_in_ns(ns: str, argv: list[str], env: dict, wanted: int, timeout: float = 60) -> list[str]:
    """The first `wanted` lines of a command that never ends by itself (`logs -f`), then stop it."""
    proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, **env}, stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True)
    received = b""
    deadline = time.monotonic() + timeout
    try:
        while received.count(b"\n") < wanted and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                received += chunk
        return received.decode(errors="replace").splitlines()[:wanted]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_deploy_localhost_alone_serves_reuses_and_tears_down(netns, tmp_path):
    env = {"YRPD_HOME": str(tmp_path / "home")}
    yrpd = [sys.executable, "-m", "yrpd"]
    try:
        started = time.monotonic()
        first = in_ns(netns, *yrpd, "deploy", "--hosts", "localhost", env=env)
        print(f"measured: embedded default deploy {time.monotonic() - started:.1f}s\n{first.stderr}")
        assert first.returncode == 0, first.stderr[-4000:]
        url = first.stdout.strip().splitlines()[-1]
        assert url == "http://127.0.0.1:8000"
        assert "try: curl -s http://127.0.0.1:8000/v1/completions" in first.stderr

        # the sample request the deploy printed, sent as a user would: the real model knows the answer
        sample = first.stderr.split("try: ", 1)[1].splitlines()[0]
        answer = in_ns(netns, "bash", "-c", sample, env=env, timeout=300)
        reply = json.loads(answer.stdout)
        assert reply["model"] == "smollm2" and "Paris" in reply["choices"][0]["text"], answer.stdout[:500]
        # behind the proxy nothing is open: an instance refuses a request without the deployment's token (its
        # /health stays open for probes), and that token is on no command line, in no log and no status
        direct = in_ns(netns, "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "http://127.0.0.1:8100/v1/models",
                       env=env, timeout=60)
        assert direct.stdout == "401", direct.stdout
        health = in_ns(netns, "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "http://127.0.0.1:8100/health",
                       env=env, timeout=60)
        assert health.stdout == "200", health.stdout
        session_dir = next((tmp_path / "home" / "sessions").glob("2*"))
        token = (session_dir / "secrets" / "instance.token").read_text().strip()
        host_secrets = Path(f"/tmp/yrpd_sessions/{session_dir.name}/secrets")
        assert oct(host_secrets.stat().st_mode & 0o777) == "0o700"
        assert {p.name: oct(p.stat().st_mode & 0o777) for p in host_secrets.iterdir()} == {
            "instance.env": "0o600", "proxy.env": "0o600", "datasystem.env": "0o600", "curve": "0o700",
            "etcd": "0o700"}
        assert all(p.stat().st_mode & 0o077 == 0 for p in host_secrets.rglob("*")), "a secret readable by others"
        status_json = in_ns(netns, *yrpd, "status", "--json", env=env, timeout=120).stdout
        ps = in_ns(netns, "ps", "-eo", "args", env=env, timeout=60).stdout
        logs = [p.read_text(errors="replace") for p in Path(f"/tmp/yrpd_sessions/{session_dir.name}/logs").rglob("*.log")]
        logs += [p.read_text() for p in session_dir.glob("*.json*")]
        for where, text in [("status --json", status_json), ("ps", ps), *(("a log", t) for t in logs)]:
            assert token not in text, where
        # the container steps say why they did nothing, rather than "already done"
        after = first.stderr.split("create the container on every host", 1)[1].splitlines()[1]
        assert "not needed on localhost: runtime host" in after, after

        # what the demo ends with: two streamed chat questions sharing a context, and where their KV came from
        demo = in_ns(netns, sys.executable, "-m", "yrpd", "ask", env=env, timeout=300)
        print(demo.stdout)
        assert demo.returncode == 0, demo.stderr[-3000:]
        answers = [line for line in demo.stdout.splitlines() if line.startswith("A: ")]
        assert "Paris" in answers[0] and "Au" in answers[1], demo.stdout
        kv = [line for line in demo.stdout.splitlines() if line.startswith("KV of this")]
        loaded = [int(line.split("decode loaded ", 1)[1].split()[0]) for line in kv]
        cached = int(kv[1].split("took ", 1)[1].split()[0])
        assert len(kv) == 2 and loaded[0] > 0 and loaded[1] > 0 and cached > 0, kv  # the shared prefix: reused
        # the proxy follows both instances' KV-cache events (issue 46): it sees both caches, and prefill's holds the
        # blocks of the demo's prompts; `yrpd status` shows what the proxy sees
        report = json.loads(in_ns(netns, *yrpd, "status", "--json", env=env, timeout=120).stdout)
        routed = {i["role"]: (i.get("routed") or {}).get("kv_index") or {} for i in report["instances"]}
        assert {role: index.get("sight") for role, index in routed.items()} == {"prefill": "seeing",
                                                                              "decode": "seeing"}, routed
        assert routed["prefill"]["blocks"] > 0 and routed["prefill"]["block_size"] > 0, routed
        # and the data system's holdings, from its worker's own events: the blocks the connectors saved, and the
        # second question's prefill leg routed on them
        store = report["proxy"]["store_index"]
        assert store["sight"] == "seeing" and store["blocks"] > 0, store
        assert report["proxy"]["routing"]["store_routed"] >= 1, report["proxy"]["routing"]

        started = time.monotonic()
        second = in_ns(netns, *yrpd, "deploy", "--hosts", "localhost", env=env)
        print(f"measured: second deploy {time.monotonic() - started:.1f}s")
        assert second.returncode == 0, second.stderr[-4000:]
        assert "resuming session" in second.stderr
        for step in ("start the openYuanrong master", "start the prefill and decode instances", "start the proxy"):
            after = second.stderr.split(step, 1)[1].splitlines()[1]
            assert "already done on localhost" in after, (step, after)

        # `yrpd status --watch` in a real terminal (tmux): it redraws in place, with rates once it has looked twice
        watched = watch_in_tmux(netns, [*yrpd, "status", "--watch", "--interval", "1"], env)
        assert watched.count("Rates over the last") == 1 and watched.count("Instances") == 1, watched
        assert "prefill-0" in watched and "updated " in watched and "Ctrl-C stops" in watched, watched

        # the documented request and the documented commands against a deployment, verbatim
        answer = in_ns(netns, "bash", "-c", documented_shell("quickstart-cpu.md", "curl -s "), env=env, timeout=300)
        reply = json.loads(answer.stdout)
        assert "Paris" in reply["choices"][0]["message"]["content"], answer.stdout[:500]
        documented = commands(acts_on_a_deployment)
        ran = set()
        for command in sorted(documented, key=lambda c: words(c)[0] == "down"):  # down last, the rest in doc order
            argv = [*yrpd, *words(command)]
            if "-f" in argv:
                lines = follow_in_ns(netns, argv, env, wanted=3)
                assert len(lines) == 3 and all(line.startswith("localhost decode-0 | ") for line in lines), lines
                ran.add("follow")
                continue
            proc = in_ns(netns, *argv, env=env, timeout=300)
            assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
            if words(command) == ["status", "--json"]:
                report = json.loads(proc.stdout)
                assert {(i["role"], i["healthy"]) for i in report["instances"]} == {("prefill", True), ("decode", True)}
                assert report["proxy"]["url"] == url and report["proxy"]["healthy"]
                assert report["cluster"]["mode"] == "ds_only" and report["cluster"]["healthy"]
                ran.add("status --json")
            elif words(command) == ["status"]:
                for layer in ("Hosts", "openYuanrong cluster", "Instances", "Proxy"):
                    assert layer in proc.stdout, (layer, proc.stdout[-2000:])
                ran.add("status")
            elif words(command)[0] == "logs":
                assert {"localhost prefill-0 |", "localhost decode-0 |"} <= {
                    " ".join(line.split()[:2]) + " |" for line in proc.stdout.splitlines()}, proc.stdout[-2000:]
                ran.add("logs")
            elif words(command)[:2] == ["metrics", "targets"]:
                # each target answers its /metrics (scraped from inside the deployment's namespace)
                targets = [t for group in json.loads(proc.stdout) for t in group["targets"]]
                assert len(targets) == 4, targets  # the proxy, the host's exporter, prefill-0, decode-0
                for target in targets:
                    page = in_ns(netns, "curl", "-sf", f"http://{target}/metrics", env=env, timeout=30)
                    assert page.returncode == 0 and any(m in page.stdout for m in (
                        "yrpd_proxy_requests_total", "vllm:", "yrpd_ds_up 1")), (target, page.stdout[:300])
                    if "yrpd_ds_up" in page.stdout:  # the exporter: the worker's figures and both connectors'
                        assert 'yrpd_connector_loaded_blocks_total{host="localhost",yrpd_instance="decode-0"' in \
                            page.stdout and "yrpd_ds_memory_used_bytes" in page.stdout, page.stdout[:3000]
                ran.add("metrics targets")
            elif words(command) == ["down"]:
                ran.add("down")
        assert ran == {"status --json", "status", "logs", "follow", "metrics targets", "down"}, (ran, documented)
        assert not host_secrets.exists() and not (session_dir / "secrets").exists()  # down took them away
        listening = in_ns(netns, "ss", "-ltnpH", env=env, timeout=30).stdout
        assert listening.strip() == "", listening
        assert _pids_in_ns("net", _ns_key(f"/run/netns/{netns}")) == []
    finally:
        in_ns(netns, *yrpd, "down", env=env, timeout=300)
