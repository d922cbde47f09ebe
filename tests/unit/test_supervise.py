"""deploy_scripts/supervise.py on its own: real processes, no root, a few seconds each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "deploy_scripts" / "supervise.py"


class Supervised:
    def __init__(self, tmp_path: Path, command: str, **policy) -> None:
        self.state_path = tmp_path / "p.state.json"
        self.log = tmp_path / "p.log"
        args = {"name": "p", "command": command, "state": str(self.state_path), "max_restarts": 3, "window_s": 600,
                "grace_s": 2, **policy}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, str(SCRIPT), json.dumps(args)], stdout=out, stderr=out,
                                         stdin=subprocess.DEVNULL, start_new_session=True, cwd=tmp_path)

    def state(self) -> dict:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}

    def wait_for(self, predicate, timeout: float = 15) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state()
            if state and predicate(state):
                return state
            time.sleep(0.05)
        raise AssertionError(f"state never matched: {self.state()}\n{self.log.read_text()[-2000:]}")

    def close(self) -> None:
        """The supervisor, and the command's own group (which a killed supervisor leaves running)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        pid = self.state().get("pid")
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


def test_the_env_file_reaches_the_command_at_every_start_and_never_its_command_line(tmp_path):
    env_file = tmp_path / "secret.env"
    env_file.write_text("YRPD_TEST_SECRET=first-value\nIGNORED LINE\n")
    out = tmp_path / "seen"
    sup = Supervised(tmp_path, f'echo "$YRPD_TEST_SECRET" >> {out}; sleep 0.3; exit 1', env_file=str(env_file),
                     max_restarts=1)
    try:
        sup.wait_for(lambda s: s["restarts"] == 1)
        env_file.write_text("YRPD_TEST_SECRET=second-value\n")  # a re-deploy replaced it: the next start reads it
        sup.wait_for(lambda s: s["state"] == "failed")
        assert out.read_text().splitlines()[:1] == ["first-value"]
        assert "first-value" not in " ".join(sup.proc.args)  # the supervisor's own argv names the file only
    finally:
        sup.close()
    env_file.unlink()
    (tmp_path / "again").mkdir()
    gone = Supervised(tmp_path / "again", "sleep 5", env_file=str(env_file))
    try:  # no file: it does not start the command without its secrets
        state = gone.wait_for(lambda s: s["state"] == "failed")
        assert "cannot read its environment file" in state["reason"]
    finally:
        gone.close()


@pytest.fixture
def supervised(tmp_path):
    made: list[Supervised] = []

    def make(command: str, where: str | None = None, **policy) -> Supervised:
        """`where`: a directory of its own under tmp_path, for a second supervisor beside the first"""
        home = tmp_path / where if where else tmp_path
        home.mkdir(exist_ok=True)
        made.append(Supervised(home, command, **policy))
        return made[-1]

    yield make
    for s in made:
        s.close()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in "ZX"


def test_a_killed_command_is_restarted_and_what_it_left_behind_is_stopped(supervised, tmp_path):
    # the command leaves a child behind in its process group, as vLLM's API server leaves its EngineCore
    s = supervised(f"sleep 300 & echo $! > {tmp_path}/child; exec sleep 300")
    first = s.wait_for(lambda st: st["state"] == "running" and (tmp_path / "child").exists())
    child = int((tmp_path / "child").read_text())
    os.kill(first["pid"], signal.SIGKILL)
    again = s.wait_for(lambda st: st["state"] == "running" and st["pid"] != first["pid"])
    assert again["restarts"] == 1 and again["last_exit"] == -9
    assert not alive(child), "the killed command's child was left running"
    assert "killed by signal 9; stopping what is left of it (1 processes)" in s.log.read_text()


def test_restarts_stop_at_the_cap_and_the_state_says_why(supervised):
    s = supervised("echo crashing; exit 3", max_restarts=2)
    final = s.wait_for(lambda st: st["state"] == "failed", timeout=20)
    assert final["restarts"] == 2 and final["last_exit"] == 3
    assert "exited with status 3 after 2 restarts in 600 s; not restarting it again" in final["reason"]
    assert s.proc.wait(5) == 0  # the supervisor is gone: `yrpd deploy` starts a new one
    log = s.log.read_text()
    assert log.count("crashing") == 3 and "restart 1 of at most 2" in log and "in 2 s" in log  # backoff grows


def test_with_restarts_off_it_exits_with_the_command(supervised):
    s = supervised("exit 5", max_restarts=0)
    final = s.wait_for(lambda st: st["state"] == "exited")
    assert final["last_exit"] == 5 and final["restarts"] == 0
    assert s.proc.wait(5) == 0


def test_term_stops_the_whole_group_and_restarts_nothing(supervised, tmp_path):
    s = supervised(f"sleep 300 & echo $! > {tmp_path}/child; exec sleep 300")
    running = s.wait_for(lambda st: st["state"] == "running" and (tmp_path / "child").exists())
    child = int((tmp_path / "child").read_text())
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(30) == 0
    assert s.state()["state"] == "stopped"
    assert not alive(running["pid"]) and not alive(child)


def test_a_new_supervisor_stops_what_a_killed_one_left_running(supervised, tmp_path):
    s = supervised("exec sleep 300")
    orphan = s.wait_for(lambda st: st["state"] == "running")["pid"]
    os.kill(s.proc.pid, signal.SIGKILL)  # the supervisor dies; its command runs on
    s.proc.wait(5)
    assert alive(orphan)
    successor = supervised("exec sleep 300")
    fresh = successor.wait_for(lambda st: st["state"] == "running" and st["pid"] != orphan)
    assert not alive(orphan) and alive(fresh["pid"])
    assert "stopping what is left of its previous run" in successor.log.read_text()


def host_status(tmp_path, supervisor_pid: int) -> dict:
    """What session_processes.py answers for the supervised process `p` (its pid file naming `supervisor_pid`)."""
    (tmp_path / "p.pid").write_text(str(supervisor_pid))
    args = {"dir": str(tmp_path), "id": "unit", "action": "status", "pidfile": f"{tmp_path}/{{name}}.pid",
            "state": f"{tmp_path}/{{name}}.state.json", "log": f"{tmp_path}/{{name}}.log"}
    script = SCRIPT.with_name("session_processes.py")
    answer = json.loads(subprocess.run([sys.executable, str(script), json.dumps(args)], capture_output=True,
                                       text=True, check=True).stdout)
    return next(p for p in answer["processes"] if p["name"] == "p")


def test_a_command_whose_supervisor_was_killed_is_shown_alive_but_unsupervised(supervised, tmp_path, monkeypatch):
    # the session's and the process's markers, as yrpd starts every supervisor with
    monkeypatch.setenv("YRPD_SESSION", "unit")
    monkeypatch.setenv("YRPD_PROCESS", "p")
    s = supervised("exec sleep 300")
    running = s.wait_for(lambda st: st["state"] == "running")
    assert host_status(tmp_path, s.proc.pid)["state"] == "running"
    os.kill(s.proc.pid, signal.SIGKILL)
    s.proc.wait(5)
    proc = host_status(tmp_path, s.proc.pid)
    assert (proc["alive"], proc["pid"], proc["state"], proc["supervisor"]) == (True, running["pid"], "unsupervised",
                                                                               None)


def test_status_quotes_the_end_of_a_given_up_process_log_without_the_supervisor_lines(supervised, tmp_path):
    """What `yrpd status` shows for a process that failed: the host's own answer (session_processes.py) carries the
    last lines its command logged, so the cause is on screen."""
    s = supervised("echo 'Traceback (most recent call last):'; echo 'OSError: no model at /models/x' >&2; exit 1",
                   max_restarts=1)
    s.wait_for(lambda st: st["state"] == "failed", timeout=20)
    proc = host_status(tmp_path, s.proc.pid)
    assert proc["state"] == "failed" and not proc["alive"]
    assert proc["last_log"][-2:] == ["Traceback (most recent call last):", "OSError: no model at /models/x"]
    assert not any(line.startswith("[yrpd supervisor") for line in proc["last_log"])


@pytest.mark.parametrize("written_by_new", [False, True], ids=["earlier-supervisor", "control-same-supervisor"])
def test_status_right_after_a_restart_does_not_show_the_earlier_supervisors_ending(tmp_path, monkeypatch,
                                                                                   written_by_new):
    """`yrpd deploy` after a give-up starts a new supervisor, which writes its state only once its command runs; until
    then the state file is the one that gave up. Status must say restarting, not quote that ending as this run's."""
    monkeypatch.setenv("YRPD_SESSION", "unit")
    monkeypatch.setenv("YRPD_PROCESS", "p")
    # the new supervisor, before its first write: a process yrpd started as `p` that the pid file names
    new = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        earlier = 2 ** 22 + 17  # above any pid this kernel hands out by default: nobody
        (tmp_path / "p.state.json").write_text(json.dumps(
            {"state": "failed", "pid": None, "restarts": 3, "reason": "killed by signal 9",
             "supervisor": new.pid if written_by_new else earlier}))
        proc = host_status(tmp_path, new.pid)
    finally:
        new.kill()
        new.wait(5)
    shown = (proc["state"], proc["reason"], proc["supervisor"])
    if written_by_new:
        assert shown == ("failed", "killed by signal 9", new.pid)
    else:
        assert shown == ("starting", None, new.pid) and not proc["alive"]


SERVER = """import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with open(sys.argv[2], "a") as fh:
            fh.write("probe\\n")
        self.send_response(int(sys.argv[3]))
        self.end_headers()
    def log_message(self, *_):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health_server(tmp_path: Path, tag: str, status: int, before: str = "") -> tuple[str, dict, Path]:
    """(command, health policy, file the server appends a line to per probe) of a server answering `status`."""
    (tmp_path / "server.py").write_text(SERVER)
    port, probes = free_port(), tmp_path / f"{tag}.probes"
    command = f"{before}exec {sys.executable} {tmp_path}/server.py {port} {probes} {status}"
    return command, {"url": f"http://127.0.0.1:{port}/health", "hang_after_s": 3}, probes


def probed(probes: Path, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not (probes.exists() and probes.read_text()):
        assert time.monotonic() < deadline, "the supervisor never probed the server"
        time.sleep(0.1)


def test_a_server_that_stops_answering_is_taken_for_hung_and_restarted(supervised, tmp_path):
    hung_cmd, hung_health, hung_probes = health_server(tmp_path, "hung", 200)
    busy_cmd, busy_health, busy_probes = health_server(tmp_path, "busy", 503)
    hung = supervised(hung_cmd, health=hung_health)
    busy = supervised(busy_cmd, where="busy", health=busy_health)  # control: answers 503 ("no decode up"): it works, keep it
    first = hung.wait_for(lambda st: st["state"] == "running")
    kept = busy.wait_for(lambda st: st["state"] == "running")
    probed(hung_probes)
    probed(busy_probes)
    os.kill(first["pid"], signal.SIGSTOP)  # alive, listening, answering nothing
    stopped = time.monotonic()
    again = hung.wait_for(lambda st: st["state"] == "running" and st["pid"] != first["pid"], timeout=30)
    took = time.monotonic() - stopped
    assert again["restarts"] == 1 and not alive(first["pid"])
    assert "hung: " in hung.log.read_text()
    assert busy.state()["pid"] == kept["pid"] and busy.state()["restarts"] == 0
    print(f"measured: SIGSTOP to restart with hang_after_s 3: {took:.1f}s")


def test_an_engine_process_stopped_behind_an_answering_server_is_restarted_too(supervised, tmp_path):
    """vLLM's API server answers /health for its EngineCore: a stopped engine is seen by its process state."""
    spawn = f"sleep 300 & echo $! > {tmp_path}/engine; "
    cmd, health, probes = health_server(tmp_path, "engine", 200, before=spawn)
    s = supervised(cmd, health=health)
    watched_off = supervised(f"sleep 300 & echo $! > {tmp_path}/engine-off; exec sleep 300",
                             where="off")  # control: no probe
    first = s.wait_for(lambda st: st["state"] == "running" and (tmp_path / "engine").exists())
    off = watched_off.wait_for(lambda st: st["state"] == "running" and (tmp_path / "engine-off").exists())
    probed(probes)
    os.kill(int((tmp_path / "engine").read_text()), signal.SIGSTOP)
    os.kill(int((tmp_path / "engine-off").read_text()), signal.SIGSTOP)
    again = s.wait_for(lambda st: st["state"] == "running" and st["pid"] != first["pid"], timeout=30)
    assert again["restarts"] == 1 and "processes stopped (state T)" in s.log.read_text()
    assert watched_off.state()["pid"] == off["pid"] and watched_off.state()["restarts"] == 0
    os.kill(int((tmp_path / "engine-off").read_text()), signal.SIGCONT)


MAKE_SHM = """import mmap, os, sys, time
maps = []
for name in sys.argv[1:]:
    fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    maps.append(mmap.mmap(fd, 4096))
    os.close(fd)
time.sleep(300)
"""


LOCK_THEN_SLEEP = """import multiprocessing, time
# a spawned program's lock: a named POSIX semaphore (/dev/shm/sem.mp-*), which its resource tracker (a process of the
# same group) would unlink at a clean exit
lock = multiprocessing.get_context("spawn").Lock()
print("LOCKED", flush=True)
time.sleep(300)
"""


def test_the_named_semaphores_of_a_killed_group_are_removed_too(supervised, tmp_path):
    (tmp_path / "lock.py").write_text(LOCK_THEN_SLEEP)
    before = {n for n in os.listdir("/dev/shm") if n.startswith("sem.mp-")}
    s = supervised(f"exec {sys.executable} {tmp_path}/lock.py", max_restarts=0)
    first = s.wait_for(lambda st: st["state"] == "running" and any("/sem.mp-" in p for p in st.get("shm") or []))
    [semaphore] = [p for p in first["shm"] if "/sem.mp-" in p]
    assert os.path.exists(semaphore) and Path(semaphore).name not in before
    os.killpg(first["pid"], signal.SIGKILL)  # the program and its resource tracker: nobody unlinks it
    s.wait_for(lambda st: st["state"] == "exited")
    assert not os.path.exists(semaphore), "the killed group's semaphore is left in /dev/shm"


def test_shared_memory_left_by_a_killed_group_is_removed_unless_someone_still_maps_it(supervised, tmp_path):
    import mmap
    import uuid

    (tmp_path / "make_shm.py").write_text(MAKE_SHM)
    tag = uuid.uuid4().hex[:8]
    # named as vLLM's CPU build names a TP group's all-reduce buffer (found left by instances killed with -9)
    lost, shared = f"/dev/shm/vllm_dist_yrpdtest{tag}-tp:0-[0-1]-cpushm_0", f"/dev/shm/psm_yrpdtest_{tag}_shared"
    s = supervised(f"exec {sys.executable} {tmp_path}/make_shm.py {Path(lost).name} {Path(shared).name}",
                   max_restarts=0)
    mapping = None
    try:
        first = s.wait_for(lambda st: st["state"] == "running" and len(st.get("shm") or []) == 2)
        assert sorted(first["shm"]) == sorted([lost, shared])
        with open(shared, "r+b") as fh:  # another process maps this one: it is in use, whoever made it
            mapping = mmap.mmap(fh.fileno(), 4096)
        os.kill(first["pid"], signal.SIGKILL)  # as vLLM's processes die: no chance to unlink anything
        after = s.wait_for(lambda st: st["state"] == "exited")
        assert not os.path.exists(lost) and os.path.exists(shared)
        assert after["shm"] == [shared] and "removed 1 shared-memory segments" in s.log.read_text()
        mapping.close()
        mapping = None
        # `yrpd down` finds what the supervisors noted and nobody holds any more
        (tmp_path / "p.pid").write_text(str(s.proc.pid))
        args = {"dir": str(tmp_path), "id": "unit", "action": "stop", "grace": 1, "port_wait": 0,
                "pidfile": f"{tmp_path}/{{name}}.pid", "state": f"{tmp_path}/{{name}}.state.json",
                "log": f"{tmp_path}/{{name}}.log"}
        script = SCRIPT.with_name("session_processes.py")
        report = json.loads(subprocess.run([sys.executable, str(script), json.dumps(args)], capture_output=True,
                                           text=True, check=True).stdout)
        assert report["shm_removed"] == [shared] and not os.path.exists(shared)
    finally:
        if mapping is not None:
            mapping.close()
        for path in (lost, shared):
            if os.path.exists(path):
                os.unlink(path)


# a group whose engine makes a segment between two of the supervisor's scans (its first at 1 s, then every 10 s) and
# dies with it at once, as vLLM's engine and workers die with their API server: no periodic scan sees it
MAKE_LATE = """import mmap, os, subprocess, sys, time
if sys.argv[1] == "engine":
    time.sleep(2.0)
    fd = os.open("/dev/shm/" + sys.argv[2], os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096)
    open(sys.argv[3], "w").close()
    time.sleep(300)
engine = subprocess.Popen([sys.executable, __file__, "engine", *sys.argv[2:]])
engine.wait()
"""

# a program that makes a segment as it shuts down (TERM): after the supervisor's last look at its group
MAKE_ON_TERM = """import mmap, os, signal, sys, time
def on_term(*_):
    fd = os.open("/dev/shm/" + sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096)
    time.sleep(0.3)
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
open(sys.argv[2], "w").close()
time.sleep(300)
"""


def _segment(path: str) -> None:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    os.close(fd)


def test_a_segment_made_between_two_scans_is_noted_at_once_and_removed_with_its_group_not_another_programs(
        supervised, tmp_path):
    import uuid

    (tmp_path / "late.py").write_text(MAKE_LATE)
    tag = uuid.uuid4().hex[:8]
    late, other = f"/dev/shm/psm_yrpdtest_{tag}_late", f"/dev/shm/psm_yrpdtest_{tag}_other"
    made = tmp_path / "made"
    s = supervised(f"exec {sys.executable} {tmp_path}/late.py api {Path(late).name} {made}", max_restarts=0)
    try:
        first = s.wait_for(lambda st: st["state"] == "running" and made.exists())
        # control: made by another program during the run and held by nobody (as vLLM holds none for a moment when it
        # hands one to a process it starts): not the group's, so not removed
        _segment(other)
        s.wait_for(lambda st: late in st["shm"], timeout=5)  # long before the 10 s scan
        os.killpg(first["pid"], signal.SIGKILL)  # the API server and its engine at once
        after = s.wait_for(lambda st: st["state"] == "exited")
        assert not os.path.exists(late), "the segment its engine made between two scans is left in /dev/shm"
        assert os.path.exists(other) and other not in after["shm"], "another program's segment was removed"
        assert "removed 1 shared-memory segments" in s.log.read_text()
    finally:
        for path in (late, other):
            if os.path.exists(path):
                os.unlink(path)


def test_a_segment_made_while_the_group_shuts_down_is_removed_when_the_supervisor_stops(supervised, tmp_path):
    import uuid

    (tmp_path / "on_term.py").write_text(MAKE_ON_TERM)
    segment = f"/dev/shm/psm_yrpdtest_{uuid.uuid4().hex[:8]}_on_term"
    ready = tmp_path / "ready"
    s = supervised(f"exec {sys.executable} {tmp_path}/on_term.py {Path(segment).name} {ready}")
    try:
        s.wait_for(lambda st: st["state"] == "running" and ready.exists())
        s.proc.send_signal(signal.SIGTERM)  # as `yrpd down` stops a supervisor
        assert s.proc.wait(15) == 0
        assert s.state()["state"] == "stopped"
        assert not os.path.exists(segment), "the segment its program made while stopping is left in /dev/shm"
    finally:
        if os.path.exists(segment):
            os.unlink(segment)


def test_exits_while_what_it_needs_does_not_answer_wait_for_it_and_spend_no_restarts(supervised, tmp_path):
    """The data-system worker exits when etcd stays unreachable; restarted during a network cut it fails again, and
    a cut longer than a few such starts would use up restart.max and leave it down after the network is back."""
    import socket

    port = free_port()
    s = supervised("echo RUN; exit 7", max_restarts=1, needs=[f"127.0.0.1:{port}"])
    waiting = s.wait_for(lambda st: st["state"] == "backoff" and "waiting for" in (st["reason"] or ""))
    assert f"waiting for 127.0.0.1:{port}, which it needs" in waiting["reason"] and waiting["restarts"] == 0
    time.sleep(3)  # it keeps waiting: nothing started, nothing given up
    assert s.state()["state"] == "backoff" and s.log.read_text().count("RUN\n") == 1
    with socket.socket() as listener:  # what it needs answers again
        listener.bind(("127.0.0.1", port))
        listener.listen()
        # restarted once that answers, not counted; exiting with it answering counts, and the one restart allowed
        # is spent before it gives up
        final = s.wait_for(lambda st: st["state"] == "failed", timeout=20)
    assert final["restarts"] == 2 and "after 1 restarts in 600 s" in final["reason"], final
    assert s.log.read_text().count("RUN\n") == 3


def test_without_needs_the_same_command_gives_up_at_once(supervised):
    """The control: the same exits and restart.max, nothing needed: failed after one restart."""
    s = supervised("echo RUN; exit 7", max_restarts=1)
    final = s.wait_for(lambda st: st["state"] == "failed", timeout=20)
    assert final["restarts"] == 1 and s.log.read_text().count("RUN\n") == 2


# -- a gang: the processes of one instance spanning hosts live and die together


def gang(supervised, lost_s: float = 30):
    """A leader and one follower, each running `sleep`, the follower listening on a free loopback port."""
    address = f"127.0.0.1:{free_port()}"
    leader = supervised("exec sleep 300", where="lead",
                        gang={"role": "leader", "members": [["f", address]], "lost_s": lost_s})
    follower = supervised("exec sleep 300", where="follow",
                          gang={"role": "follower", "listen": address, "leader": "lead", "lost_s": lost_s})
    return leader, follower


def test_a_follower_runs_for_its_leaders_run_and_nothing_restarts_while_all_live(supervised):
    leader, follower = gang(supervised)
    lead = leader.wait_for(lambda st: st["state"] == "running")
    follow = follower.wait_for(lambda st: st["state"] == "running")
    assert "starting for lead's run " + lead["run"] in follower.log.read_text()
    time.sleep(5)  # two rounds of the leader's JOIN at least: the same run again starts nothing (the control)
    assert (leader.state()["pid"], leader.state()["restarts"]) == (lead["pid"], 0)
    assert (follower.state()["pid"], follower.state()["run"]) == (follow["pid"], follow["run"])


@pytest.mark.parametrize("killed", ["follower", "leader"])
def test_a_killed_member_restarts_the_whole_gang_once(supervised, killed):
    leader, follower = gang(supervised)
    lead = leader.wait_for(lambda st: st["state"] == "running")
    follow = follower.wait_for(lambda st: st["state"] == "running")
    os.kill((follow if killed == "follower" else lead)["pid"], signal.SIGKILL)
    again = leader.wait_for(lambda st: st["state"] == "running" and st["pid"] != lead["pid"], timeout=20)
    back = follower.wait_for(lambda st: st["state"] == "running" and st["pid"] != follow["pid"], timeout=20)
    assert again["restarts"] == 1 and not alive(follow["pid"])
    assert f"starting for lead's run {again['run']}" in follower.log.read_text()
    if killed == "follower":
        assert "f stopped (killed by signal 9" in leader.log.read_text()
    else:
        assert f"lead started again (run {again['run']})" in follower.log.read_text()
    time.sleep(5)  # and it settles: one restart each, no loop between them
    assert leader.state()["pid"] == again["pid"] and follower.state()["pid"] == back["pid"]


def test_a_follower_whose_leader_went_silent_stops_its_command_and_waits(supervised):
    leader, follower = gang(supervised, lost_s=3)
    leader.wait_for(lambda st: st["state"] == "running")
    follow = follower.wait_for(lambda st: st["state"] == "running")
    leader.close()  # its supervisor stopped: no JOIN comes any more
    waiting = follower.wait_for(lambda st: st["state"] == "backoff", timeout=15)
    assert "no word from lead for" in waiting["reason"] and not alive(follow["pid"])
    assert follower.proc.poll() is None  # it waits for a leader, it does not exit
