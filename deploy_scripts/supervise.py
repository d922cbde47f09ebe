"""Keep one process of a yrpd session running: start it, restart it when it dies, never leave a part of it behind.

Run by yrpd on the host (stdlib only), detached, as the process the session's pid file names. One JSON argument:
  {"name": .., "command": a bash command line, "state": path of this process's state file,
   "max_restarts": N (0: never restart), "window_s": seconds, "grace_s": seconds,
   "env_file": optional path of KEY=VALUE lines (the deployment's secrets) added to the command's environment at
   every start, so they are on no command line,
   "health": optional {"url": an HTTP URL the command answers while it works (any status), "hang_after_s": N},
   "needs": optional ["HOST:PORT", ..], what the command cannot start without (the data-system worker: etcd)}
The command runs in a process group of its own (in this supervisor's unix session). When it exits, the rest of its group is stopped too (a vLLM API
server killed with -9 leaves its EngineCore and workers behind, holding memory, ports and devices), then it is
started again after a backoff of 1, 2, 4 .. 30 s, unless it was already restarted max_restarts times within the last
window_s seconds: then the state file says `failed` with the reason and this supervisor exits (`yrpd deploy` starts
a new one). TERM or INT: stop the group (TERM, KILL after grace_s) and exit 0, restarting nothing.

An exit while something in "needs" does not accept a TCP connection is not the command's fault, and starting it
again before that answers only fails again: the supervisor waits (state backoff, the reason naming the address)
until it answers, then restarts the command, without counting that restart against max_restarts. Otherwise a
network cut longer than a few failed starts (openYuanrong's worker gives up on an unreachable etcd after about a
minute) would use up the restarts and leave the worker down after the network is back.

A command that is alive but hung (stopped, deadlocked, spinning) never exits, so exits alone do not catch it: given a
health URL, the supervisor probes it every few seconds once it has answered once (a starting server is not judged;
any HTTP status is an answer), and watches its group for stopped processes (state T: an engine process stopped
this way leaves the API server answering). When it has not answered, or a member has stayed stopped, for
hang_after_s seconds, the whole group is killed and restarted like a crash, with the reason "hung".

Shared memory: the POSIX segments the group maps under /dev/shm (Python's multiprocessing names them psm_*; vLLM's
message queues between its API server, engine and workers are such segments; its named semaphores sem.mp-*) are
noted while it runs, in the state file too (the group's maps and open files are read every SHM_SCAN_S, and at once
whenever a new name appears in /dev/shm: vLLM's engine and workers die within milliseconds of their API server's
kill -9, so what they made since the last scan would be nobody's to remove); once the group is gone, those no live
process maps or holds open are removed. Only what the group was seen to hold: a segment nobody holds at some moment is
not garbage (vLLM hands some to a process it is starting by name). A process killed with -9
cannot unlink its own segments, and on a host that restarts instances for weeks they would pile up.

Gang: the processes of one instance that spans hosts (vLLM's head on one host, its headless nodes or Ray's nodes on
the others) live and die together, as vLLM cannot take a lost node back: a head whose node died fails at its next
request, and a node whose head died waits forever. One of them leads: "gang": {"role": "leader", "members": [[name,
"IP:PORT"], ..]}; each other one follows: "gang": {"role": "follower", "listen": "IP:PORT", "leader": name}. Every
2 s the leader sends each member "JOIN <its run>"; a follower starts its command for that run (stopping the one it
runs for an older run) and answers with its state. A follower whose command exits waits for its leader; a follower
that hears nothing for GANG_LOST_S ("lost_s", default 30) stops its command and waits too. The leader restarts its own command (counted
like a crash) when a member's command exits or restarts, or its supervisor does not answer for GANG_LOST_S; its
new run makes every follower start again. The leader alone decides; no loop of restarts between them.

This process is a child subreaper: what the command's processes leave behind is re-parented here and reaped, so no
zombie outlives its group. The state file (JSON, rewritten atomically) holds: state (running | backoff | failed |
exited | stopped), pid (the command's), restarts (in total), last_exit, reason, since, shm (the segments of the
current run).
"""
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from hostlib import BACKOFF, EXITED, FAILED, RUNNING, SHM_DIR, STARTING, STOPPED, proc_table, shm_held, \
    shm_present, unlink_unheld

args = json.loads(sys.argv[1])
name, state_path = args["name"], args["state"]
max_restarts, window_s, grace_s = int(args.get("max_restarts", 3)), float(args.get("window_s", 600)), float(args.get("grace_s", 15))
health = args.get("health") or {}
needs = [tuple(a.rsplit(":", 1)) for a in args.get("needs") or []]
hang_after_s = float(health.get("hang_after_s") or 0) if health.get("url") else 0.0
# a probe every third of the hang bound (at most 5 s), each given as long to answer
probe_every = min(5.0, hang_after_s / 3) if hang_after_s else 0.0
SHM_SCAN_S = 10.0
#: the command leads a process group of its own; without a preexec_fn where Python can (3.11), as a gang's
#: supervisor runs a thread and a fork between a thread's locks is unsafe
OWN_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
gang = args.get("gang") or {}
GANG_POLL_S, GANG_LOST_S = 2.0, float(gang.get("lost_s", 30.0))
#: a follower's view of its leader: the run it asks for and when it last asked; a leader's: its members' runs
heard = {"wanted": None, "at": None, "joined": None}
heard_lock = threading.Lock()
stopping = False
#: the segments /dev/shm held at the supervisor's last look: a new one makes it read the group's at once
shm_listed = set()
state = {"state": STARTING, "pid": None, "restarts": 0, "last_exit": None, "reason": None, "since": time.time(),
         "supervisor": os.getpid(), "shm": []}


def say(text):
    print(f"[yrpd supervisor {time.strftime('%H:%M:%S')}] {name}: {text}", flush=True)


def write(**changes):
    state.update(changes, since=time.time())
    tmp = f"{state_path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(state, fh)
    os.replace(tmp, state_path)


def on_signal(signum, _frame):
    global stopping
    stopping = True


def group_members(pgid, sid=None):
    """Live processes of the process group (and, given `sid`, of that unix session only)."""
    return [pid for pid, st, _, group, session in proc_table()
            if group == pgid and st not in "ZX" and (sid is None or session == sid)]


def command_env():
    """This process's environment plus the env file's values (read at every start: the file may be replaced)."""
    env = dict(os.environ)
    path = args.get("env_file")
    if path:
        with open(path) as fh:
            for line in fh:
                key, sep, value = line.rstrip("\n").partition("=")
                if sep and key:
                    env[key] = value
    return env


def note_shm(pgid):
    """Add the segments the group maps or holds open now to those of this run (in the state file: `yrpd down` reads
    them too)."""
    seen = shm_held(group_members(pgid)) - set(state["shm"])
    if seen:
        write(shm=sorted(set(state["shm"]) | seen))


def note_new_shm(pgid, anyway=False):
    """note_shm, where /dev/shm has a name it did not have at the last look, or `anyway` (a listing costs little;
    reading the group's maps is done only then)."""
    global shm_listed
    present = shm_present()
    if anyway or present - shm_listed:
        note_shm(pgid)
    shm_listed = present


def start(env):
    """Start a run of the command, leading a process group of its own."""
    global shm_listed
    shm_listed = shm_present()
    return subprocess.Popen(["bash", "-c", args["command"]], **OWN_GROUP, stdin=subprocess.DEVNULL, env=env)


def remove_shm(segments):
    """Unlink the segments no live process maps or holds; those still in use stay listed."""
    if not segments:
        return
    removed = unlink_unheld(segments)
    gone = [p for p in removed if p in state["shm"]]
    if gone:
        say(f"removed {len(gone)} shared-memory segments its processes left in {SHM_DIR}")
    write(shm=sorted(set(segments) - set(removed)))


def probe(url):
    """True when the URL gives any HTTP answer within probe_every seconds: a 503 ("no decode instance is up") comes
    from a server that works, and restarting it would not help. No proxy: the URL is this host's own."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=max(1.0, probe_every)):
            return True
    except urllib.error.HTTPError:
        return True
    except Exception:  # refused, reset, timed out: no answer
        return False


def stopped_members(pgid):
    """Members of the group stopped by a signal (SIGSTOP, SIGTSTP) or a tracer: alive, doing nothing. vLLM's
    /health is answered by its API server alone, so an engine process stopped this way is seen only here."""
    return [pid for pid, st, _, group, _ in proc_table() if group == pgid and st in "Tt"]


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def stop_group(pgid, grace=None):
    """TERM the whole group, wait up to `grace` (grace_s) for it to go, then KILL what is left."""
    for s, wait in ((signal.SIGTERM, grace_s if grace is None else grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, s)
        except OSError:
            pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            reap()
            note_new_shm(pgid)  # what it makes as it shuts down
            if not group_members(pgid):
                return
            time.sleep(0.1)


def exit_reason(code):
    if code is None:
        return "unknown exit"
    return f"killed by signal {-code}" if code < 0 else f"exited with status {code}"


def run_id():
    return f"{os.getpid()}.{state['restarts']}.{time.time():.3f}"


def serve_gang(address):
    """A follower's listener: each connection sends "JOIN <run>" and gets this follower's state as one JSON line."""
    host, port = address.rsplit(":", 1)
    listener = socket.create_server((host.strip("[]"), int(port)), reuse_port=False)
    listener.settimeout(1.0)

    def loop():
        while not stopping:
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(2.0)
                    words = conn.makefile().readline().split()
                    if len(words) == 2 and words[0] == "JOIN":
                        with heard_lock:
                            heard.update(wanted=words[1], at=time.monotonic())
                    with heard_lock:
                        reply = {"run": state.get("run"), "joined": heard["joined"], "state": state["state"],
                                 "reason": state.get("reason")}
                    conn.sendall((json.dumps(reply) + "\n").encode())
                except OSError:
                    pass

    threading.Thread(target=loop, daemon=True).start()


def ask_member(address, run):
    """A member's answer to JOIN `run` (a dict), or None when its supervisor does not answer."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0) as conn:
            conn.settimeout(2.0)
            conn.sendall(f"JOIN {run}\n".encode())
            return json.loads(conn.makefile().readline())
    except (OSError, ValueError):
        return None


class GangWatch:
    """The leader's check of its members during one run of its command: why the instance must restart, or None."""

    def __init__(self, run):
        self.run, self.started, self.next = run, time.monotonic(), 0.0
        self.seen = {}  # member -> its run for ours, once it runs
        self.answered = {}  # member -> when its supervisor last answered

    def broken(self):
        now = time.monotonic()
        if now < self.next:
            return None
        self.next = now + GANG_POLL_S
        for member, address in gang["members"]:
            reply = ask_member(address, self.run)
            if reply is None:
                silent = now - self.answered.get(member, self.started)
                if silent >= GANG_LOST_S:
                    return f"{member} (supervisor at {address}) has not answered for {silent:.0f} s"
                continue
            self.answered[member] = now
            if reply.get("joined") != self.run:
                continue  # it starts for this run now
            if reply.get("state") != RUNNING:
                return f"{member} stopped ({reply.get('reason') or reply.get('state')})"
            if self.seen.setdefault(member, reply.get("run")) != reply.get("run"):
                return f"{member} restarted"
        return None


def follow():
    """A follower's life: run its command for each run its leader asks for; never restart on its own."""
    try:
        serve_gang(gang["listen"])
    except OSError as exc:  # its port taken: say so, rather than leave the leader to find it silent
        write(state=FAILED, pid=None, reason=f"cannot listen on {gang['listen']} for its gang: {exc}")
        return 0
    leader = gang["leader"]
    write(state=BACKOFF, pid=None, reason=f"waiting for {leader} to start it")
    while True:
        if idle_until(lambda: heard["wanted"] is not None and heard["wanted"] != heard["joined"], every=0.5):
            write(state=STOPPED, pid=None, reason="stopped by yrpd")
            return 0
        target = heard["wanted"]
        try:
            env = command_env()
        except OSError as exc:
            write(state=FAILED, pid=None, reason=f"cannot read its environment file: {exc}")
            return 0
        say(f"starting for {leader}'s run {target}")
        child = start(env)
        with heard_lock:  # one change for the leader's JOIN to see: joined its run and running, never one alone
            heard["joined"] = target
            write(state=RUNNING, pid=child.pid, shm=[], run=run_id())
        code, why = wait_for(child)
        note_shm(child.pid)
        stop_group(child.pid, grace=min(grace_s, 3.0) if (why or code is not None) else None)
        remove_shm(state["shm"])
        if code is None and not why:
            write(state=STOPPED, pid=None, reason="stopped by yrpd")
            return 0
        reason = why or exit_reason(code)
        if why is None:
            state["restarts"] += 1
        if max_restarts <= 0 and why is None:
            say(f"{reason}; automatic restart is off (restart.max 0): `yrpd deploy` starts it again")
            write(state=EXITED, pid=None, last_exit=code, reason=reason)
            return 0
        say(f"{reason}; waiting for {leader} to start the instance again")
        write(state=BACKOFF, pid=None, last_exit=code, reason=f"{reason}; waiting for {leader} to start it again")
        if why and why.startswith("no word from"):
            with heard_lock:  # the leader went silent: its next JOIN, even for the same run, starts it again
                heard["joined"] = None


def main():
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:  # PR_SET_CHILD_SUBREAPER: orphans of the group come to us, not to init
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    try:  # a previous supervisor of this process that was killed leaves its command running: stop that first
        with open(state_path) as fh:
            before = json.load(fh)
    except (OSError, ValueError):
        before = {}
    # only a group in the dead supervisor's own session: after a host restart the numbers mean other processes
    if before.get("pid") and before.get("supervisor") and group_members(before["pid"], before["supervisor"]):
        say(f"stopping what is left of its previous run (process group {before['pid']})")
        stop_group(before["pid"])
        state["restarts"] = before.get("restarts", 0)
    remove_shm(before.get("shm") or [])  # the previous run's, whichever way it ended
    if gang.get("role") == "follower":
        return follow()
    recent = []
    while True:
        if stopping:  # TERM arrived while cleaning up or backing off: start nothing
            write(state=STOPPED, pid=None, reason="stopped by yrpd")
            return 0
        # a process group of its own, inside this supervisor's unix session: teardown finds every member by that
        # session even after vLLM's workers overwrite their environment (setproctitle)
        try:
            env = command_env()
        except OSError as exc:
            reason = f"cannot read its environment file: {exc}"
            say(reason)
            write(state=FAILED, pid=None, reason=reason)
            return 0
        child = start(env)
        write(state=RUNNING, pid=child.pid, shm=[], run=run_id())
        code, hung = wait_for(child, GangWatch(state["run"]) if gang.get("role") == "leader" else None)
        note_shm(child.pid)  # what the survivors map, before they go
        if code is None and not hung:
            stop_group(child.pid)
            remove_shm(state["shm"])
            write(state=STOPPED, pid=None, reason="stopped by yrpd")
            return 0
        if hung:
            say(f"{hung}; stopping its process group")
            # a stopped or deadlocked process would not act on TERM; a gang's break leaves the command well
            stuck = hung.startswith("hung")
            stop_group(child.pid, grace=0 if stuck else min(grace_s, 3.0))
            code = -signal.SIGKILL if stuck else None
        left = group_members(child.pid)
        if left:
            say(f"{exit_reason(code)}; stopping what is left of it ({len(left)} processes)")
        # what outlives a dead command is of no use: a short grace, so the restart comes sooner
        stop_group(child.pid, grace=min(grace_s, 3.0))
        remove_shm(state["shm"])
        reason = hung or exit_reason(code)
        now = time.monotonic()
        recent = [t for t in recent if now - t < window_s]
        if max_restarts <= 0:
            say(f"{reason}; automatic restart is off (restart.max 0): `yrpd deploy` starts it again")
            write(state=EXITED, pid=None, last_exit=code, reason=reason)
            return 0
        gone = unanswered()
        if gone:
            say(f"{reason} while {gone}, which it needs, does not answer; restarting it once that answers "
                f"(not counted against the {max_restarts} restarts)")
            write(state=BACKOFF, pid=None, last_exit=code, reason=f"{reason}; waiting for {gone}, which it needs")
            if idle_until(lambda: not unanswered(), every=2.0):
                write(state=STOPPED, reason="stopped by yrpd")
                return 0
            say(f"{gone} answers again: restarting {name}")
            state["restarts"] += 1
            continue
        if len(recent) >= max_restarts:
            reason = (f"{reason} after {len(recent)} restarts in {int(window_s)} s; not restarting it "
                      f"again (`yrpd deploy` starts it anew once the cause is fixed)")
            say(reason)
            write(state=FAILED, pid=None, last_exit=code, reason=reason)
            return 0
        delay = min(30.0, 2.0 ** len(recent))
        say(f"{reason}; restart {len(recent) + 1} of at most {max_restarts} in {int(window_s)} s, "
            f"in {delay:.0f} s")
        write(state=BACKOFF, pid=None, last_exit=code, reason=reason)
        deadline = time.monotonic() + delay
        if idle_until(lambda: time.monotonic() >= deadline):
            write(state=STOPPED, reason="stopped by yrpd")
            return 0
        recent.append(time.monotonic())
        state["restarts"] += 1


def idle_until(done, every=0.1):
    """Reap re-parented orphans until done() (asked every `every` s) or TERM/INT; True when asked to stop."""
    next_check = 0.0
    while not stopping:
        if time.monotonic() >= next_check:
            if done():
                return False
            next_check = time.monotonic() + every
        reap()
        time.sleep(0.1)
    return True


def unanswered():
    """The first address of `needs` that does not accept a TCP connection now, or None."""
    for host, port in needs:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()  # [v6]:port too
        except OSError:
            return f"{host}:{port}"
    return None


def wait_for(child, watch=None):
    """(exit code, None) when the command exits (negative: killed by that signal); (None, None) once TERM/INT asks
    us to stop; (None, why) when it is alive but has not answered its health probe for hang_after_s, or its gang
    broke (`watch`, a leader's GangWatch; a follower's leader moved on or went silent). Orphans re-parented to us
    are reaped on the way; the group's shared memory is noted every SHM_SCAN_S, and as soon as a new segment appears."""
    now = time.monotonic()
    next_probe, next_scan = now + probe_every, now + 1.0
    last_ok = None  # judged only once it has answered: a starting server may take minutes
    stopped_since = None
    while not stopping:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return child.poll(), None
        if pid == child.pid:
            child.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            return child.returncode, None
        if pid:
            continue
        now = time.monotonic()
        if watch is not None:
            why = watch.broken()
            if why:
                return None, f"{why}: the instance spanning hosts restarts whole"
        elif gang.get("role") == "follower":
            with heard_lock:
                wanted, at = heard["wanted"], heard["at"]
            if wanted != heard["joined"]:
                return None, f"{gang['leader']} started again (run {wanted})"
            if now - at >= GANG_LOST_S:
                return None, f"no word from {gang['leader']} for {now - at:.0f} s"
        note_new_shm(child.pid, anyway=now >= next_scan)
        if now >= next_scan:
            next_scan = now + SHM_SCAN_S
        if probe_every and now >= next_probe:
            if stopped_members(child.pid):
                stopped_since = stopped_since or now
                if now - stopped_since >= hang_after_s:
                    return None, (f"hung: its processes stopped (state T) for {now - stopped_since:.0f} s "
                                  f"(restart.hang_after_s {hang_after_s:.0f})")
            else:
                stopped_since = None
            if probe(health["url"]):
                last_ok = time.monotonic()
            elif last_ok is not None and time.monotonic() - last_ok >= hang_after_s:
                return None, (f"hung: alive but no answer from {health['url']} for "
                              f"{time.monotonic() - last_ok:.0f} s (restart.hang_after_s {hang_after_s:.0f})")
            next_probe = time.monotonic() + probe_every
        time.sleep(0.2)
    return None, None


if __name__ == "__main__":
    sys.exit(main())
