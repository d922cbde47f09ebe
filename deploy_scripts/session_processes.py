"""List or stop the processes a yrpd session started on this host.

Args: one JSON object {"dir": host session dir, "pidfile", "state" and "log": the pid, supervisor state and log
files as templates with {name} (yrpd.layout), "id": session id, "action": "status"|"stop", "grace": seconds,
"port_wait": seconds to wait for ports to close,
"names": [only these processes and what they forked], "ports": [[port, what], ...] that must not listen after}.
A process belongs to the session when its environment holds YRPD_SESSION=<id>: this also finds children
that left their process group, so teardown can prove nothing is left.
"""
import glob
import json
import os
import signal
import sys
import time

from hostlib import DEAD, EXITED, FAILED, PROCESS_KEYS, RUNNING, STARTING, UNSUPERVISED, host_load, \
    listening_sockets, proc_alive, proc_cmdline, proc_environ, proc_rss_mb, proc_stat, proc_table, shaped, unlink_unheld

args = json.loads(sys.argv[1])
session_dir, session_id = args["dir"], args["id"]
pid_prefix, pid_suffix = args["pidfile"].split("{name}")
marker = f"YRPD_SESSION={session_id}".encode()
# children inherit YRPD_PROCESS=<name> from the process yrpd started: it selects a process with its whole tree
only = {f"YRPD_PROCESS={n}".encode() for n in args.get("names") or []}


def environ_has_marker(pid):
    env = proc_environ(pid)
    if env is None:
        return False
    return marker in env and (not only or any(o in env for o in only))


def carries(pid, name):
    """The process is one yrpd started as `name` (or a child of it): its environment names both."""
    env = proc_environ(pid) or []
    return marker in env and f"YRPD_PROCESS={name}".encode() in env


def process_ids(pid):
    """(process group, unix session) of a process, or (None, None)."""
    stat = proc_stat(pid)
    return (stat[2], stat[3]) if stat else (None, None)


def session_pids():
    """Processes of the session: those carrying the marker, plus members of the unix sessions yrpd started
    (setsid). The second catches children that renamed themselves with setproctitle, which overwrites
    /proc/PID/environ (vLLM's "VLLM::Worker" does) and outlive a killed parent."""
    # a pid file's number counts only while it is still ours (a supervisor that gave up leaves its pid file, and
    # the number may since belong to anyone's login session); the groups of supervisors that died are known from
    # their state files as (process group, session) pairs, which a reused number cannot both match
    leaders = {pid for pid in managed().values() if pid and environ_has_marker(pid)}
    orphaned = set()
    for name in managed():
        sup = supervised(name)
        if sup.get("pid") and sup.get("supervisor"):
            orphaned.add((sup["pid"], sup["supervisor"]))
    found = []
    for pid, _, _, group, session in proc_table():
        if pid == os.getpid():
            continue
        if environ_has_marker(pid) or session in leaders or (group, session) in orphaned:
            found.append(pid)
    return sorted(found)


def managed():
    """name -> pid from the session's pid files."""
    found = {}
    for path in sorted(glob.glob(glob.escape(pid_prefix) + "*" + glob.escape(pid_suffix))):
        name = path[len(pid_prefix):len(path) - len(pid_suffix)]
        if not only or f"YRPD_PROCESS={name}".encode() in only:
            try:
                found[name] = int(open(path).read().strip())
            except (OSError, ValueError):
                found[name] = None
    return found


def host_facts():
    facts = {"hostname": os.uname().nodename, "session_dir_exists": os.path.isdir(session_dir), **host_load()}
    return facts


def supervised(name):
    """What the process's supervisor (deploy_scripts/supervise.py) last wrote, or {}."""
    try:
        with open(args["state"].format(name=name)) as fh:
            return json.load(fh)
    except (OSError, ValueError, KeyError):
        return {}


def log_tail(name, lines=5):
    """The last lines its command wrote, for a process that is not running: the supervisor's own lines left out (its
    reason is reported apart), so a crash shows its traceback's end."""
    try:
        with open(args["log"].format(name=name), "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 65536))
            text = fh.read().decode("utf-8", "replace")
    except (OSError, KeyError):
        return None
    own = [l.rstrip()[:300] for l in text.splitlines() if l.strip() and not l.startswith("[yrpd supervisor ")]
    return own[-lines:]


def status():
    live = set(session_pids())
    processes = []
    for name, supervisor in managed().items():
        # the pid file's number counts only while it names this process's supervisor: a host that lost every
        # process keeps its pid files, and the new pid namespace hands the same numbers to the session's others
        watched = supervisor is not None and supervisor in live and carries(supervisor, name)
        sup = supervised(name)
        if watched and sup.get("supervisor") not in (None, supervisor):
            # an earlier supervisor's ending (one that gave up before this start): the new one writes its own only
            # once it has started the command, a while after on a busy host
            sup = {"pid": None, "state": STARTING, "restarts": 0}
        if watched and not sup:  # started before yrpd supervised its processes: the pid file names the process
            sup = {"pid": supervisor, "state": RUNNING, "restarts": 0}
        pid = sup.get("pid") if watched else None
        alive = watched and pid is not None and pid in live and sup.get("state") == RUNNING
        if not watched and sup.get("state") == RUNNING and sup.get("pid") in live \
                and process_ids(sup["pid"]) == (sup["pid"], sup.get("supervisor")):
            # its supervisor was killed, the command runs on (in that supervisor's session): it serves, but
            # nothing would restart it; the next `yrpd deploy` starts a supervisor that takes it over
            pid, alive = sup["pid"], True
            sup = {**sup, "state": UNSUPERVISED}
        processes.append(shaped(
            PROCESS_KEYS, name=name, pid=pid, alive=alive, rss_mb=proc_rss_mb(pid) if alive else None,
            command=proc_cmdline(pid) if alive else None, supervisor=supervisor if watched else None,
            state=sup.get("state") if watched or sup.get("state") in (FAILED, EXITED, UNSUPERVISED) else DEAD,
            restarts=sup.get("restarts", 0), reason=sup.get("reason"), last_log=None if alive else log_tail(name)))
    leaders = {p["pid"] for p in processes} | {p["supervisor"] for p in processes}
    others = [pid for pid in live if pid not in leaders]
    return {"host": host_facts(), "processes": processes, "session_pids": sorted(live), "other_pids": others}


def exited(pid):
    """Gone or a zombie. A killed process whose memory is still being freed has an unreadable environ (so
    session_pids() no longer lists it) but still holds its sockets: only this says it is really gone."""
    return not proc_alive(pid)


def stop(grace):
    """TERM the processes yrpd started (their own shutdown stops their children in order), then TERM what is
    left of the session, then KILL; wait until every one of them is really gone."""
    stopped = []
    signalled = set(session_pids())
    for name, pid in managed().items():
        if pid is not None and pid in signalled:
            try:
                os.kill(pid, signal.SIGTERM)
            except OSError:
                pass
            stopped.append(name)
    deadline = time.monotonic() + grace
    while session_pids() and time.monotonic() < deadline:
        leaders_left = [pid for pid in managed().values() if pid and not exited(pid)]
        if not leaders_left:
            # orphans of a crashed leader, or children a leader left behind: their turn
            for pid in session_pids():
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass
            deadline = min(deadline, time.monotonic() + 3)
        time.sleep(0.2)
    killed = []
    for pid in session_pids():
        killed.append(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    while (session_pids() or not all(exited(p) for p in signalled)) and time.monotonic() < deadline:
        time.sleep(0.1)
    still = set(session_pids()) | {p for p in signalled if not exited(p)}
    remaining = [{"pid": pid, "command": proc_cmdline(pid) or "(exiting)"} for pid in sorted(still)]
    # a killed process's sockets close a moment after it is gone: judge the ports after waiting for that
    deadline = time.monotonic() + float(args.get("port_wait", 20))
    while True:
        listening = set(listening_sockets())
        ports = [{"port": port, "what": what} for port, what in args.get("ports", []) if port in listening]
        if not ports or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    if not remaining:
        # a supervisor removes its group's shared memory when it stops it; one that was killed itself could not
        left = sorted({path for name in managed() for path in supervised(name).get("shm") or []})
        shm_removed = unlink_unheld(left)
        for name in managed():
            for path in (args["pidfile"].format(name=name), args["state"].format(name=name)):
                if os.path.exists(path):
                    os.unlink(path)
    return {"stopped": stopped, "killed_after_grace": killed, "remaining": remaining, "ports_listening": ports,
            "shm_removed": shm_removed if not remaining else []}


if args["action"] == "status":
    print(json.dumps(status()))
else:
    report = stop(float(args.get("grace", 10)))
    print(json.dumps(report))
    for proc in report["remaining"]:
        print(f"still running after SIGKILL: pid {proc['pid']} {proc['command']}", file=sys.stderr)
    for port in report["ports_listening"]:
        print(f"port {port['port']} ({port['what']}) is still listening after teardown", file=sys.stderr)
    sys.exit(1 if report["remaining"] or report["ports_listening"] else 0)
