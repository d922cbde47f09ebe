"""Self-healing on `yrpd deploy --hosts localhost` (in a network namespace of its own): `kill -9` of etcd, the data
system worker (both under yrpd's supervisors: the default dscli launcher) and the proxy, each alone, and SIGSTOP of
an API server and an EngineCore together (one of prefill with one of decode: ROUNDS; their `kill -9` is the two-host
test's, below). After each round, with no command typed,
requests through the proxy succeed again with the same greedy answer, `yrpd status` is healthy with the restart
shown, nothing of the killed process group is left, and what was healthy kept its pid. During the outage every
answer is a clean 5xx JSON or a success, never 200-empty. Then the same kinds of kill with automatic restart off,
healed by `yrpd deploy` (which restarts only the dead parts, and nothing on a second run); an instance that crashes
on every start is given up after the cap and reported with its log; `yrpd down` right after a fault exits 0.
Uses the tiny model (the subject is the processes, not the language); kill-to-answer times are printed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from lab.fakehosts import _ns_key, _pids_in_ns
from lab.hosts import left_behind, shm_segments
from tests.lab.test_embedded_default import in_ns, netns  # noqa: F401 - the namespace fixture

pytestmark = [pytest.mark.lab, pytest.mark.e2e]

YRPD = [sys.executable, "-m", "yrpd"]
RECOVERY_S = 60  # the bound; an instance's restart is about 35-40 s of vLLM start on this CPU
INSTANCE_RECOVERY_S = 240  # ... which a loaded 2-core machine stretches (vLLM start is CPU-bound): figures are printed
#: the cluster's processes under the default launcher (dscli: no data system master of its own)
CLUSTER = ("etcd", "ds_worker")
HANG_AFTER_S = 10
#: the kills on localhost, a round at a time. The cluster's processes and the proxy alone (what each one breaks is
#: its own); the instances' hangs in one round, decode's API server and prefill's EngineCore stopped: each instance
#: restarts once and the rest keeps its pid. The kill -9 of each kind in each role is the two-host test's (the API
#: servers together, then the EngineCores together): every kill of each role is seen somewhere, in the fewest vLLM
#: starts (a localhost round of kill -9 as well cost the suite two starts and saw nothing the two-host test does not)
ROUNDS = (("etcd",), ("ds_worker",), ("proxy",), ("decode-0:stop", "prefill-0:engine-stop"))
PROMPT = {"model": "tiny-qwen2", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


class Deployment:
    def __init__(self, ns: str, home, extra: tuple = (), model: str = "builtin:tiny-qwen2") -> None:
        self.ns, self.env = ns, {"YRPD_HOME": str(home)}
        self.extra = list(extra)
        self.model = model

    def yrpd(self, *args, check=True, timeout=900):
        proc = in_ns(self.ns, *YRPD, *args, env=self.env, timeout=timeout)
        if check:
            assert proc.returncode == 0, f"yrpd {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
        return proc

    def deploy(self, *more):
        return self.yrpd("deploy", "--hosts", "localhost", "--model", self.model, *self.extra, *more)

    def status(self) -> dict:
        return json.loads(self.yrpd("status", "--json", check=False).stdout)

    def ask(self, timeout: float = 30) -> tuple[int, str]:
        """(HTTP status, completion text or error body) of one greedy request through the proxy, from the netns."""
        code = ("import json, sys, urllib.request, urllib.error\n"
                f"req = urllib.request.Request('http://127.0.0.1:8000/v1/completions', data={json.dumps(PROMPT)!r}"
                ".encode(), headers={'Content-Type': 'application/json'})\n"
                "try:\n"
                f"    r = urllib.request.urlopen(req, timeout={timeout}); print(r.status); print(r.read().decode())\n"
                "except urllib.error.HTTPError as e:\n"
                "    print(e.code); print(e.read().decode())\n"
                "except Exception as e:\n"
                "    print(0); print(type(e).__name__)\n")
        proc = in_ns(self.ns, sys.executable, "-c", code, env={}, timeout=timeout + 10)
        status, _, body = proc.stdout.partition("\n")
        return int(status or 0), body.strip()


class KvSight:
    """The proxy's sight of each instance's prefix cache (its /yrpd/status "kv_index", issue 46), read every half
    second from the namespace in a thread of its own: (seconds after start, {role: sight}) each time it changed."""

    def __init__(self, ns: str) -> None:
        self.ns, self.seen, self._stop = ns, [], threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def now(self) -> dict[str, str]:
        proc = in_ns(self.ns, "curl", "-sf", "--max-time", "5", "http://127.0.0.1:8000/yrpd/status", env={},
                     timeout=15)
        if proc.returncode != 0:
            return {}
        return {i["role"]: (i.get("kv_index") or {}).get("sight") for i in json.loads(proc.stdout)["instances"]}

    def _watch(self) -> None:
        started = time.monotonic()
        while not self._stop.is_set():
            sights = self.now()
            if sights and (not self.seen or self.seen[-1][1] != sights):
                self.seen.append((round(time.monotonic() - started, 1), sights))
            self._stop.wait(0.5)

    def __enter__(self) -> KvSight:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def configured(ns: str, tmp_path, config_text: str) -> Deployment:
    config = tmp_path / "yrpd.yaml"
    config.write_text(config_text)
    return Deployment(ns, tmp_path / "home", ("--config", str(config)))


def text_of(body: str) -> str:
    return json.loads(body)["choices"][0]["text"]


def state_file(report: dict, name: str) -> dict:
    with open(f"/tmp/yrpd_sessions/{report['session']}/run/{name}.state.json") as fh:
        return json.load(fh)


def children(pid: int, comm: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            if int(rest[1]) == pid and name.startswith(comm):
                found.append(int(entry))
    return found


def group_alive(pgid: int) -> list[int]:
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                rest = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(rest[2]) == pgid and rest[0] not in "ZX":
                alive.append(int(entry))
    return alive


def pids(report: dict) -> dict[str, int]:
    out = {c["component"]: c["pid"] for c in report["cluster"]["components"]}
    out.update({i["name"]: i["pid"] for i in report["instances"]})
    out["proxy"] = report["proxy"]["pid"]
    return out


def restarts(report: dict) -> dict[str, int]:
    return {**{c["component"]: c["restarts"] for c in report["cluster"]["components"]},
            **{i["name"]: i["restarts"] for i in report["instances"]}, "proxy": report["proxy"]["restarts"]}


def target_pid(report: dict, target: str) -> tuple[int, int]:
    """(pid to signal, the process group that must be gone afterwards: every supervised command leads its own)."""
    if target in CLUSTER:
        return pids(report)[target], pids(report)[target]
    name, _, part = target.partition(":")
    api = state_file(report, name)["pid"]
    if part.startswith("engine"):
        [engine] = children(api, "VLLM::EngineCor")
        return engine, api
    return api, api


def wait_recovered(d: Deployment, baseline: str, started: float, limit: float,
                   timeout: float = 30) -> tuple[float, list[int]]:
    """Seconds from the kill to the first good answer; every other answer meanwhile must be a clean 5xx JSON (0:
    the client gave up after `timeout` s)."""
    codes = []
    while time.monotonic() - started < limit:
        status, body = d.ask(timeout)
        codes.append(status)
        if status == 200:
            assert body and text_of(body) == baseline, f"answered 200 with {body[:300]!r}"
            return time.monotonic() - started, codes
        if status:
            assert 500 <= status < 600 and json.loads(body).get("error"), (status, body[:300])
        time.sleep(0.5)
    raise AssertionError(f"no good answer within {limit}s of the kill (answers: {codes})")


def wait_healthy(d: Deployment, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        report = d.status()
        if report["healthy"] or time.monotonic() > deadline:
            return report
        time.sleep(2)


def test_every_process_comes_back_by_itself_and_down_is_clean(netns, tmp_path):  # noqa: F811
    """Each kill: exactly one more restart of what was killed, none of anything else, and nothing left of its
    process group. An API server or an EngineCore stopped with SIGSTOP (alive, never exiting) is found hung by
    its supervisor and restarted. The shared memory of every killed instance is gone. Then an instance that crashes
    on every start is given up (on the same deployment: one vLLM deployment fewer for the suite), and after `down`
    /dev/shm holds no segment it did not hold before the deploy."""
    shm_before = shm_segments()
    # a hang is judged after `restart.hang_after_s`: 10 s here (the default 30 s would only make each SIGSTOP wait)
    d = configured(netns, tmp_path, f"restart: {{hang_after_s: {HANG_AFTER_S}}}\n")
    # a copy of the model that the crash loop below may take away: the one under /opt/yrpd/venvs is every lab
    # host's, and the other lane's deployments start instances from it meanwhile (a rollout's new instance failed so)
    d.model = str(tmp_path / "tiny-qwen2")
    shutil.copytree("/opt/yrpd/venvs/models/tiny-qwen2", d.model)
    try:
        d.deploy()
        status, body = d.ask()
        assert status == 200, body
        baseline = text_of(body)
        report = wait_healthy(d)
        assert report["healthy"], report["problems"]
        # the proxy follows both instances' KV-cache events (prefix routing, the default): it sees both caches
        assert KvSight(netns).now() == {"prefill": "seeing", "decode": "seeing"}
        figures = {}
        for kills in ROUNDS:
            before, counted = pids(report), restarts(report)
            components = [k.partition(":")[0] for k in kills]
            shm_of_run = {k: set(state_file(report, c)["shm"]) if c not in (*CLUSTER, "proxy") else set()
                          for k, c in zip(kills, components)}
            groups = {}
            instances = set(components) - {*CLUSTER, "proxy"}
            with KvSight(netns) if instances else contextlib.nullcontext() as sight:
                for target in kills:
                    pid, groups[target] = target_pid(report, target)
                    os.kill(pid, signal.SIGSTOP if target.endswith("stop") else signal.SIGKILL)
                started = time.monotonic()
                hang = any(k.endswith("stop") for k in kills)
                limit = RECOVERY_S if not instances else INSTANCE_RECOVERY_S
                # a hung instance holds what reached it until its supervisor's bound (restart.hang_after_s):
                # the client waits longer than that, and must then get an answer, not its own timeout
                took, codes = wait_recovered(d, baseline, started, limit + (60 if hang else 0),
                                             timeout=75 if hang else 30)
                if instances:  # the proxy said it could not see their caches, and sees them again once they are back
                    deadline = time.monotonic() + 30
                    while not sight.seen or sight.seen[-1][1] != {"prefill": "seeing", "decode": "seeing"}:
                        assert time.monotonic() < deadline, f"{kills}: the proxy's sight after: {sight.seen}"
                        time.sleep(0.5)
                    for role in ("prefill", "decode"):
                        blind = [t for t, sights in sight.seen if sights.get(role) == "blind"]
                        assert blind, (f"{kills}: the proxy never said it was blind to {role}'s cache: {sight.seen}\n"
                                       + d.yrpd("logs", "proxy", "-n", "80", check=False).stdout[-6000:])
                        print(f"measured: the proxy blind to {role}'s cache {blind[0]:.1f}s after the kill")
            if "proxy" not in components:  # with the proxy dead nobody answers: the client's connection is refused
                assert 0 not in codes, f"{kills}: a request hung until the client gave up ({codes})"
            report = wait_healthy(d)
            assert report["healthy"], (kills, report["problems"])
            after = pids(report)
            kept = {k: v for k, v in before.items() if k not in components}
            assert {k: after[k] for k in kept} == kept, f"{kills}: healthy components changed pid"
            expected = {**counted, **{c: counted[c] + 1 for c in components}}
            assert restarts(report) == expected, (kills, counted, restarts(report))
            for target in kills:
                assert group_alive(groups[target]) == [], f"{target}: processes of the killed group are left"
                left = shm_of_run[target] & shm_segments()
                assert not left, f"{target}: its shared memory is left in /dev/shm: {sorted(left)}"
                if target.endswith("stop"):
                    assert "hung: " in d.yrpd("logs", target.partition(":")[0], "-n", "400").stdout, target
            for target in kills:
                figures[target] = took
                print(f"measured: {'SIGSTOP' if target.endswith('stop') else 'kill -9'} {target}"
                      f"{' (with ' + ', '.join(k for k in kills if k != target) + ')' if len(kills) > 1 else ''}: "
                      f"first good answer after {took:.1f}s ({len(codes) - 1} clean 5xx answers before; "
                      f"{len(shm_of_run[target])} shared-memory segments of the killed run removed)")
        report = crash_loop_is_given_up(d, report)
        # right after a fault, down leaves nothing, first time
        pid, _ = target_pid(report, "decode-0")
        os.kill(pid, signal.SIGKILL)
        down = d.yrpd("down")
        assert "is down" in down.stderr
        # nothing of it runs any more (so nothing of it still maps a segment), and it left no segment behind
        assert _pids_in_ns("net", _ns_key(f"/run/netns/{netns}")) == [], "down left a process behind"
        assert left_behind(shm_before) == set(), "down left shared memory behind"
    finally:
        d.yrpd("down", check=False)


def crash_loop_is_given_up(d: Deployment, report: dict) -> dict:
    """An instance that crashes on every start (its model directory gone) is given up after the restart cap (3 in
    600 s, the default: the kills above count within the window, so 1 to 3 more starts) and reported with its log,
    the rest untouched; once the cause is gone a re-deploy starts it anew. Returns the healthy report after."""
    os.rename(d.model, d.model + ".away")
    try:
        os.kill(target_pid(report, "decode-0")[0], signal.SIGKILL)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            report = d.status()
            decode = next(i for i in report["instances"] if i["name"] == "decode-0")
            if decode["state"] == "failed":
                break
            time.sleep(3)
        assert decode["state"] == "failed", decode
        problem = next(p for p in report["problems"] if p.startswith("decode-0"))
        assert "after 3 restarts in 600 s" in problem and "yrpd logs decode-0" in problem, problem
        # the cause is on screen: vLLM's own last words, not only the supervisor's
        proc = next(p for p in report["processes"] if p["name"] == "decode-0")
        print("decode-0's log ends:", *proc["last_log"], sep="\n  ")
        assert proc["last_log"] and "its log ends: " + proc["last_log"][-1] in problem
        shown = d.yrpd("status", check=False).stdout
        assert "decode-0 on" in shown and "last lines of its log:" in shown and proc["last_log"][-1][:40] in shown
        prefill = next(i for i in report["instances"] if i["name"] == "prefill-0")
        assert prefill["healthy"] and report["cluster"]["healthy"]  # the rest is untouched
        logs = d.yrpd("logs", "decode-0", "-n", "400").stdout
        assert "restart 3 of at most 3" in logs and "not restarting it again" in logs
    finally:
        os.rename(d.model + ".away", d.model)
    d.deploy()  # once the cause is gone, a re-deploy starts it anew
    report = wait_healthy(d)
    assert report["healthy"], report["problems"]
    return report


def test_with_restart_off_deploy_heals_only_what_is_dead(netns, tmp_path):  # noqa: F811
    d = configured(netns, tmp_path, "restart: {max: 0}\n")
    try:
        d.deploy()
        status, body = d.ask()
        baseline = text_of(body)
        report = wait_healthy(d)
        # what dies, in two rounds, each healed by one re-deploy that leaves the rest alone: decode's EngineCore (its
        # API server exits after it: with restart off an API server's death is the same to the supervisor) and the
        # cluster's processes, prefill kept (the test's one vLLM start after the deploy), then the proxy alone
        rounds = [(("decode-0:engine", *CLUSTER), ("prefill-0", "proxy")),
                  (("proxy",), ("prefill-0", "decode-0", *CLUSTER))]
        for killed, untouched in rounds:
            before = pids(report)
            for target in killed:
                os.kill(target_pid(report, target)[0], signal.SIGKILL)
            dead = {t.partition(":")[0] for t in killed} & {"prefill-0", "decode-0", "proxy"}

            def reported(report: dict) -> bool:  # an API server takes a moment to exit after its EngineCore
                return all(any(p.startswith(f"{name} on localhost is not running") for p in report["problems"])
                           for name in dead)

            deadline = time.monotonic() + 30
            while not reported(down := d.status()) and time.monotonic() < deadline:
                time.sleep(1)
            assert not down["healthy"] and reported(down), down["problems"]
            started = time.monotonic()
            d.deploy()
            print(f"measured: re-deploy healing {', '.join(sorted(dead))} (restart off) "
                  f"{time.monotonic() - started:.1f}s")
            report = wait_healthy(d)
            after = pids(report)
            assert all(after[name] == before[name] for name in untouched), (before, after)  # left alone
            assert all(after[name] != before[name] for name in dead)
            status, body = d.ask()
            assert status == 200 and text_of(body) == baseline
        again = d.deploy()
        assert pids(d.status()) == after  # a second run restarts nothing
        for step in ("start the openYuanrong master", "start the prefill and decode instances", "start the proxy"):
            assert "already done" in again.stderr.split(step, 1)[1].splitlines()[1], step
    finally:
        d.yrpd("down", check=False)


def test_on_two_hosts_the_proxy_sees_decodes_cache_through_h2s_relay_which_comes_back_when_killed(two_hosts):
    """The shared 2-host deployment: decode-0 on h2 publishes its KV-cache events on unix sockets there; h2's relay
    (yrpd.proxy.kvrelay) carries them to the proxy on h1 over tcp with CURVE. The proxy sees decode's cache, with the
    blocks a long prompt left there; killed, the relay is restarted by its supervisor and the proxy follows again,
    the blocks stored meanwhile included. The control beside it: prefill-0, on the proxy's own host, seen without
    a relay."""
    from tests.lab import real_model as rm

    d = two_hosts
    session = d.status()[0]["session"]

    def index() -> dict[str, dict]:
        code, body = rm.http("GET", f"{d.proxy}/yrpd/status", timeout=30)
        assert code == 200, body[:300]
        return {i["role"]: i.get("kv_index") or {} for i in json.loads(body)["instances"]}

    def ask(n: int) -> None:  # a prompt of several full blocks, new each time (its blocks are stored anew)
        prompt = {**PROMPT, "prompt": f"Report {n}: " + "the river runs past the old mill and on to the sea. " * 40}
        code, body = rm.http("POST", f"{d.proxy}/v1/completions", prompt)
        assert code == 200 and body, body[:300]

    def relay_pid() -> int | None:
        out = d.lab["h2"].exec(f"cat /tmp/yrpd_sessions/{session}/run/kv-relay.state.json 2>/dev/null || true").stdout
        return json.loads(out).get("pid") if out.strip() else None

    def until(check, what: str, within: float = 90, asking: bool = False) -> dict:
        deadline, n = time.monotonic() + within, 0
        while True:
            now = index()
            if check(now):
                return now
            assert time.monotonic() < deadline, f"{what}; the proxy's index: {now}"
            if asking:
                n += 1
                ask(1000 + n)
            time.sleep(1)

    ask(1)
    seen = until(lambda i: all(i.get(r, {}).get("sight") == "seeing" for r in ("prefill", "decode"))
                 and i["decode"].get("blocks", 0) > 0, "decode-0's cache is not seen through h2's relay")
    print(f"measured: 2 hosts, decode-0's cache seen through h2's relay: {seen['decode']['blocks']} blocks")
    # the data-system workers' own events: h1's, where prefill's connector saves, holds the prompts' blocks; h2's
    # worker publishes beside decode-0 and h2's relay carries it (decode saves nothing there to be seen)
    code, body = rm.http("GET", f"{d.proxy}/yrpd/status", timeout=30)
    store = json.loads(body)["kv_store_index"]
    assert len(store["workers"]) == 2 and store["blocks"] > 0, store
    assert d.lab["h2"].exec(f"grep -c 'instance datasystem: relaying' /tmp/yrpd_sessions/{session}/logs/kv-relay.log"
                            ).stdout.strip() not in ("", "0"), "h2's relay does not carry its worker's events"
    before, pid = seen["decode"]["blocks"], relay_pid()
    assert pid, "h2 runs no relay"
    assert d.lab["h1"].exec(f"test -e /tmp/yrpd_sessions/{session}/run/kv-relay.state.json || echo none"
                            ).stdout.strip() == "none"  # the proxy's host has none
    d.lab["h2"].exec(f"kill -9 {pid}")
    ask(2)  # its blocks are published while the relay may still be down: they come by a replay through the new one
    deadline = time.monotonic() + 60
    while relay_pid() in (None, pid):
        assert time.monotonic() < deadline, "the relay was not restarted"
        time.sleep(0.5)
    after = until(lambda i: i["decode"].get("sight") == "seeing" and i["decode"].get("blocks", 0) > before,
                  "the proxy did not follow decode-0's cache again after the relay came back", asking=True)
    print(f"measured: 2 hosts, after h2's relay was killed: decode-0 seen again, {after['decode']['blocks']} blocks")


def test_on_two_hosts_kills_heal_and_a_host_that_comes_back_is_rebuilt_alone(two_hosts):
    """The shared 2-host deployment (tests/lab/fixtures.py): prefill, the proxy and the cluster master on h1, decode on
    h2. Kills on both hosts heal by themselves; then h2 loses every process (torn down and brought back, its disk
    kept): `yrpd deploy` rebuilds h2's parts only."""
    from tests.lab import real_model as rm

    d = two_hosts
    lab, proxy = d.lab, d.proxy

    def healthy(timeout: float = 60) -> dict:
        return d.healthy(within=timeout)[0]

    def ask_until_good(baseline: str | None, limit: float) -> tuple[float, str]:
        started = time.monotonic()
        while time.monotonic() - started < limit:
            try:
                code, body = rm.http("POST", f"{proxy}/v1/completions", PROMPT)
            except (urllib.error.URLError, ConnectionError):  # the proxy itself is down: nobody to answer
                time.sleep(0.5)
                continue
            if code == 200:
                assert body and (baseline is None or text_of(body) == baseline), body[:300]
                return time.monotonic() - started, text_of(body)
            assert 500 <= code < 600 and json.loads(body)["error"], (code, body[:300])
            time.sleep(0.5)
        raise AssertionError(f"no good answer within {limit}s")

    def host_pid(host: str, name: str) -> int:
        session = d.status()[0]["session"]
        return json.loads(lab[host].exec(f"cat /tmp/yrpd_sessions/{session}/run/{name}.state.json").stdout)["pid"]

    _, baseline = ask_until_good(None, 30)
    healthy()
    # a round at a time; the instances' kills in pairs across the hosts, paired otherwise than localhost's stops (there
    # the API server of one role goes with the EngineCore of the other), so that no pairing hides what one kill does
    rounds = [(("h1", "etcd"),), (("h2", "ds_worker"),), (("h1", "prefill-0"), ("h2", "decode-0")),
              (("h1", "prefill-0:engine"), ("h2", "decode-0:engine")), (("h1", "proxy"),)]

    def counts(report: dict) -> dict[tuple[str, str], int]:
        out = {(c["host"], c["component"]): c["restarts"] for c in report["cluster"]["components"]}
        out.update({(i["host"], i["name"]): i["restarts"] for i in report["instances"]})
        out[(report["proxy"]["host"], "proxy")] = report["proxy"]["restarts"]
        return out

    for kills in rounds:
        report = healthy()
        before = counts(report)
        groups = {}
        for host, what in kills:
            name, _, part = what.partition(":")
            if what in CLUSTER:
                pid = next(c["pid"] for c in report["cluster"]["components"]
                           if (c["host"], c["component"]) == (host, what))
            else:
                pid = host_pid(host, name)
            groups[(host, what)] = pid  # every supervised command leads its own process group, in the host's pid
            # namespace
            if part:  # the API server's EngineCore
                pid = int(lab[host].exec(f"pgrep -P {pid} EngineCor").stdout.split()[0])
            lab[host].exec(f"kill -9 {pid}")
        took, _ = ask_until_good(baseline, INSTANCE_RECOVERY_S)
        for host, what in kills:
            beside = ", ".join(f"{w} on {h}" for h, w in kills if w != what)
            print(f"measured: 2 hosts, kill -9 {what} on {host}{f' (with {beside})' if beside else ''}: "
                  f"first good answer after {took:.1f}s")
        after = counts(healthy())
        bumped = {(host, what.partition(":")[0]) for host, what in kills}
        assert after == {**before, **{k: before[k] + 1 for k in bumped}}, (kills, before, after)
        for (host, what), group in groups.items():
            left = lab[host].exec(f"pgrep -g {group} || true").stdout.split()
            assert left == [], f"{what} on {host}: processes of the killed group are left: {left}"
    before = pids(healthy())

    lab.restart("h2")  # every process of h2 is gone; its /tmp (the session directory) is kept
    down = d.status()[0]
    assert not down["healthy"] and any("decode-0" in p for p in down["problems"]), down["problems"]
    started = time.monotonic()
    heal = d.cli("deploy", "--hosts", "h1,h2", "--config", str(d.config), timeout=1500)
    print(f"measured: re-deploy after h2 came back {time.monotonic() - started:.1f}s")
    after = pids(healthy())
    for name in ("prefill-0", "proxy", "etcd"):  # h1 kept its processes
        assert after[name] == before[name], name
    assert "done on h2" in heal.stderr.split("start the prefill and decode instances", 1)[1].splitlines()[1]
    assert ask_until_good(baseline, 30)[1] == baseline
