"""openYuanrong's components on this host: start them with the `yr` CLI, wait for health, report status, stop.

Run with the host's python3; one JSON argument (built by yrpd/steps/cluster.py):
  {"action": "start"|"wait"|"status"|"stop", "deploy": DIR, "logs": DIR, "session": ID,
   "start": [argv], "stop": [argv], "force_stop": [argv], "env": {..},
   "ports": {name: [component, port]}, "expect": [component], "host_ip": IP, "timeout": s}
or, where the mode is picked on the host: {"mode_file": PATH, "by_mode": {mode: the object above}} (the mode the
file names; ds_only without it).
Launcher dscli ("launcher": "dscli", no start/stop argv): the components run under yrpd's supervisors, which the
steps start and stop; here they are read from the supervisors' state files ("state": {component: path}) and the
worker counts as up once its ready file exists ("ready": {component: path}); "stop" only drops the state on disk.
Prints one JSON line; problems go to stderr, naming the component and the last lines of its log.
"""
import glob
import json
import os
import signal
import socket
import sys
import time

from hostlib import COMING_UP, DOWN, RUNNING, UP, ds_resource, proc_alive, proc_cmdline, proc_stat, proc_table

args = json.loads(sys.argv[1])
if "by_mode" in args:
    try:
        with open(args["mode_file"]) as fh:
            picked = fh.read().strip()
    except OSError:
        picked = "ds_only"
    if picked not in args["by_mode"]:
        print(f"{args['mode_file']} names mode {picked!r}; this deployment has "
              f"{', '.join(sorted(args['by_mode']))} (run `yrpd deploy` again)", file=sys.stderr)
        sys.exit(2)
    args = args["by_mode"][picked]
deploy, logs = args["deploy"], args["logs"]
session_file = os.path.join(deploy, "session.json")


def env(extra=None):
    # the yr CLI gets its own library path; the host's (CANN's on NPU hosts) is handed on to the data
    # system processes by the start shim (yrpd/cluster/yrconfig.py)
    e = dict(os.environ)
    inherited = e.pop("LD_LIBRARY_PATH", "")
    if inherited:
        e["YRPD_INHERITED_LD_LIBRARY_PATH"] = inherited
    e.update(args.get("env", {}))
    e.update(extra or {})
    return e


def tail(path, n=8):
    try:
        with open(path, errors="replace") as fh:
            return [line.rstrip("\n") for line in fh.readlines()[-n:]]
    except OSError:
        return []


def component_log(name):
    """The most telling log of a component: its stdout log, or the data system's own INFO log."""
    candidates = [os.path.join(deploy, "logs", f"{name}_stdout.log"), os.path.join(logs, f"{name}.log")]
    if name in ("ds_worker", "ds_master"):
        sub = "worker" if name == "ds_worker" else "master"
        candidates += sorted(glob.glob(os.path.join(deploy, "logs", "data_system", "*", "*.INFO.log")))
        candidates += sorted(glob.glob(os.path.join(deploy, "logs", "data_system", sub, "*.INFO.log")))
    best = None
    for path in candidates:
        if os.path.isfile(path) and os.path.getsize(path) > 0:
            best = path
    return best


def diagnose(names):
    lines = []
    for name in names:
        path = component_log(name)
        if path:
            # the data system logs its shutdown after the error: show the error lines, not the plain tail
            errors = [l for l in tail(path, 400) if " | E | " in l or "fail" in l.lower()][-5:]
            lines.append(f"{name}: {'error lines' if errors else 'last lines'} of {path}:")
            lines += ["    " + line[-300:] for line in (errors or tail(path))]
    daemon = os.path.join(deploy, "logs", "yr_daemon.log")
    errors = [l for l in tail(daemon, 200) if "exited with code" in l or "ERROR" in l][-4:]
    if errors:
        lines.append(f"from {daemon}:")
        lines += ["    " + l.strip()[-240:] for l in errors]
    return lines


def read_session():
    """-> (yr's session.json of this deploy as a dict, or None, why not)."""
    if not os.path.isfile(session_file):
        return None, "no session.json"
    error = ""
    for attempt in range(3):  # yr's daemon may be rewriting it
        try:
            with open(session_file) as fh:
                return json.load(fh), ""
        except ValueError as exc:
            error = f"session.json unreadable: {exc}"
            time.sleep(0.1)
        except OSError as exc:
            return None, f"session.json unreadable: {exc}"
    return None, error


DSCLI = args.get("launcher") == "dscli"


def supervised():
    """-> (components, raw) of the dscli launcher, from the supervisors' state files (deploy_scripts/supervise.py):
    RUNNING while the supervisor says running and the pid lives (and, for the worker, once its ready file exists),
    else the supervisor's state; restarts are the supervisor's count."""
    comps, states = {}, {}
    for name, path in args["state"].items():
        try:
            with open(path) as fh:
                st = json.load(fh)
        except (OSError, ValueError):
            continue
        states[name] = st.get("state")
        pid = int(st.get("pid") or 0)
        running = st.get("state") == RUNNING and pid and signal_ok(pid)
        ready = args.get("ready", {}).get(name)
        state = UP if running and (not ready or os.path.exists(ready)) else \
            COMING_UP if running else str(st.get("state") or "unknown").upper()
        comps[name] = {"state": state, "pid": pid or None, "restarts": int(st.get("restarts") or 0)}
    return comps, json.dumps(states)


def health():
    """-> (components, raw); components: name -> {state, pid, restarts}, read from the session.json `yr start` wrote
    and yr's daemon rewrites on each restart: what `yr health -f` prints, without its interpreter (0.35 s of CPU a
    host, the larger part of a status). STOPPED when the pid is gone, as `yr health` says (a zombie is RUNNING
    there: `snapshot` adds whether it is alive)."""
    if DSCLI:
        return supervised()
    info, error = read_session()
    if info is None:
        return {}, error
    comps = {}
    for name, c in (info.get("components") or {}).items():
        try:
            pid = int(c.get("pid") or 0)
        except (TypeError, ValueError):
            pid = 0
        if pid:
            comps[name] = {"state": UP if signal_ok(pid) else DOWN, "pid": pid,
                           "restarts": int(c.get("restart_count") or 0)}
    return comps, json.dumps(info)[-400:]


def signal_ok(pid):
    try:
        os.kill(pid, 0)
        return True
    except PermissionError:
        return True
    except OSError:
        return False


def pid_alive(pid):
    """Alive, not a zombie (a stopped process counts as alive)."""
    return proc_alive(pid)


def parent_of(pid):
    """The parent pid of a live process, None when it is gone."""
    stat = proc_stat(pid)
    return stat[1] if stat else None


def kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def port_open(port):
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((args["host_ip"], port)) == 0


def cache_use():
    """The data system worker's last resource line (resource.log, written every log_monitor_interval_ms): memory and
    disk-tier use, objects, hits by tier (hostlib.ds_resource)."""
    path = os.path.join(deploy, "logs", "data_system", "worker", "resource.log")
    last = tail(path, 1)
    if not last:
        return None
    try:
        use = ds_resource(last[0])
    except ValueError:
        return {"error": f"unexpected line in {path}: ...{last[0][-300:]}"}
    if args.get("spill_dir"):
        # the worker counts against its own limit only: a filesystem that fills first (other files, a smaller
        # disk than the limit) makes its spills fail while its figures show room
        try:
            fs = os.statvfs(args["spill_dir"])
            use["disk_free"] = fs.f_bavail * fs.f_frsize
        except OSError:
            use["disk_free"] = None
    return use


def snapshot():
    comps, raw = health()
    for c in comps.values():
        c["alive"] = bool(c["pid"]) and pid_alive(c["pid"])
    ports = {name: port_open(port) for name, (_, port) in args.get("ports", {}).items()}
    present = bool(comps) if DSCLI else os.path.isfile(session_file)
    return {"present": present, "components": comps, "ports": ports,
            "mode": read(os.path.join(deploy, "mode")), "raw": raw[-400:] if not comps else "",
            "cache": cache_use() if "ds_worker" in comps else None}


def read(path):
    try:
        return open(path).read().strip()
    except OSError:
        return None


def problems_of(snap, expected):
    problems = []
    # a component absent because the whole file is: say what is wrong with the file
    if DSCLI:
        absent = "not started (no supervisor state)"
    elif not snap["present"]:
        absent = f"no {session_file}"
    elif not snap["components"]:
        absent = f"{session_file} names no component ({snap['raw'][-160:]})"
    else:
        absent = "missing from session.json"
    for name in expected:
        c = snap["components"].get(name)
        if c is None:
            problems.append((name, absent))
        elif c["state"] != UP or not c["alive"]:
            problems.append((name, f"{c['state'].lower()} (pid {c['pid']}{', exited' if not c['alive'] else ''})"))
        # a restart count is not a problem: openYuanrong's daemon restarts what dies, and that one is back
    for name, up in snap["ports"].items():
        component, port = args["ports"][name]
        if not up and component not in {n for n, _ in problems}:
            problems.append((component, f"port {port} ({name}) not listening"))
    return problems


def say(problems):
    """'etcd/ds_master: why; ds_worker: another why': the components that share a reason named once with it."""
    by_reason = {}
    for name, problem in problems:
        by_reason.setdefault(problem, []).append(name)
    return "; ".join(f"{'/'.join(names)}: {problem}" for problem, names in by_reason.items())


def wait():
    deadline = time.monotonic() + args.get("timeout", 60)
    expected = args.get("expect", [])
    while True:
        snap = snapshot()
        problems = problems_of(snap, expected)
        if not problems:
            return snap, []
        if time.monotonic() > deadline:
            return snap, problems
        time.sleep(1)


def recorded():
    """(daemon pid, component pids) that yr's session.json of this deploy names."""
    info, _ = read_session()
    if info is None:
        return None, []
    daemon = (info.get("cluster_info", {}).get("daemon") or info.get("daemon") or {}).get("pid")
    return daemon, [c.get("pid") for c in info.get("components", {}).values() if c.get("pid")]


def ours(pid):
    """A live process of this deploy: started with its config or data paths on the command line. After a host
    restart the numbers session.json holds belong to other processes, which must never be signalled."""
    if not pid or not pid_alive(pid):
        return False
    return deploy in proc_cmdline(pid)


def daemon_pid():
    """The pid of this session's running yr daemon (which restarts the components it started), or None."""
    daemon, _ = recorded()
    return daemon if ours(daemon) else None


def clear_stale():
    """Components left without their daemon: kill those that are ours, then put session.json aside (yr's forced
    stop would kill every pid it names, whoever has that number now)."""
    daemon, pids = recorded()
    kill([pid for pid in [daemon, *pids] if ours(pid)])
    deadline = time.monotonic() + 10
    while any(ours(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    if os.path.isfile(session_file):
        os.replace(session_file, f"{session_file}.stale-{int(time.time())}")


STUCK_GRACE_S = 10  # a healthy session written this long ago, and `yr start` still waits: it is stuck


def children(pid):
    return [child for child, _, parent, _, _ in proc_table() if parent == pid]


def run_yr_start(log):
    """`yr start`'s exit code, or None when it did not return within the timeout (it is killed then).

    Works around a hang in yr itself (openyuanrong's SystemLauncher._daemonize): the middle process of its double
    fork ends with sys.exit, and a child forked from a process that runs brpc's bvar sampler and jemalloc's
    background thread can hang in that exit, while `yr start` waits for it before reading the session. Seen twice
    in the lab with the model loads starving the cores: daemon and components up, session.json written, `yr
    start` still waiting at its timeout. So once our own check has passed for STUCK_GRACE_S while `yr start`
    runs, its children (that middle process; killed by pid, since it leads the session the daemon runs in) are
    killed, and `yr start` goes on and returns by itself."""
    import subprocess
    timeout = args.get("timeout", 120)
    deadline = time.monotonic() + timeout
    with open(log, "ab") as out:
        proc = subprocess.Popen(args["start"], env=env({"YRPD_SESSION": args["session"]}), stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, cwd=deploy, start_new_session=True)
        healthy_since, freed = None, False
        while proc.poll() is None:
            now = time.monotonic()
            if now > deadline:
                kill(children(proc.pid) + [proc.pid])
                proc.wait()
                return None
            if not freed and os.path.isfile(session_file):
                if problems_of(snapshot(), args.get("expect", [])):
                    healthy_since = None
                elif healthy_since is None:
                    healthy_since = now
                elif now - healthy_since >= STUCK_GRACE_S:
                    stuck = children(proc.pid)
                    out.write(f"yrpd: the cluster is up but `yr start` has not returned for {STUCK_GRACE_S} s: "
                              f"killing its stuck fork {stuck} (a hang in yr's daemonizing)\n".encode())
                    out.flush()
                    kill(stuck)
                    freed = True
            time.sleep(1)
        return proc.returncode


def start():
    """Converge: a session whose yr daemon runs is waited for, not started again (a second `yr start` would
    collide with its own components' ports); components left without their daemon are stopped first."""
    import subprocess
    os.makedirs(logs, exist_ok=True)
    if daemon_pid() is not None:
        snap, problems = wait()
        if not problems:
            return snap, []
        report = [f"openYuanrong's daemon runs on this host but its components are not up: "
                  + say(problems)]
        return snap, report + diagnose([n for n, _ in problems])
    if os.path.isfile(session_file):
        clear_stale()
    log = os.path.join(logs, "yr-start.log")
    code = run_yr_start(log)
    if code == 0:
        snap, problems = wait()
        if not problems:
            return snap, []
    else:
        snap = snapshot()
        problems = [("yr start", f"exited {code}" if code is not None
                     else f"did not return within {args.get('timeout', 120)} s (killed)")]
    report = [f"openYuanrong did not come up on this host: " + say(problems)]
    report += [f"last lines of {log}:"] + ["    " + l[-240:] for l in tail(log)]
    report += diagnose([n for n, _ in problems if n != "yr start"] or args.get("expect", []))
    # leave nothing half-started: the yr daemon would restart a failing component forever
    subprocess.run(args["force_stop"], env=env(), capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    return snap, report


def ancestors():
    found, pid = set(), os.getpid()
    while pid and pid > 1 and pid not in found:
        found.add(pid)
        pid = parent_of(pid)
    return found


def drop_data():
    """Remove what the stopped cluster kept on disk that no later session reads (the data system's rocksdb state,
    etcd's data, the disk tier under the session): about 0.5 GB per session. Its logs stay."""
    import shutil  # here, as subprocess in start/stop: `status`, run at each `yrpd status`, needs neither
    for path in glob.glob(os.path.join(deploy, "ds_*_*", "rocksdb")) + [os.path.join(deploy, "third_party", "etcd"),
                                                                      os.path.join(deploy, "ds-spill")]:
        shutil.rmtree(path, ignore_errors=True)


def stop():
    import subprocess
    report = {"stopped": False, "forced": False}
    daemon, pids = recorded()
    if os.path.isfile(session_file) and not any(ours(p) for p in [daemon, *pids]):
        clear_stale()  # nothing of it runs (a host restart): yr's stop would signal whoever has those numbers now
    if os.path.isfile(session_file):
        try:
            subprocess.run(args["stop"], env=env(), capture_output=True, timeout=args.get("timeout", 40), stdin=subprocess.DEVNULL)
            report["stopped"] = True
        except subprocess.TimeoutExpired:
            pass
        if any(ours(p) for p in pids) and os.path.isfile(session_file):
            subprocess.run(args["force_stop"], env=env(), capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
            report["forced"] = True
    # yr keeps host-wide pointers to the last session in /tmp/yr_sessions; drop ours
    for link in ("/tmp/yr_sessions/latest",):
        if os.path.islink(link) and os.path.realpath(link) == os.path.realpath(deploy):
            os.unlink(link)
    info = "/tmp/yr_sessions/yr_current_master_info"
    if os.path.isfile(info) and deploy in (read(info) or ""):
        os.unlink(info)
    # only once nothing of it runs (by its paths on a command line, session.json may be gone): a live worker owns
    # its files, and `processes.stop_all` comes next for anything yr's stop left
    mine = ancestors()  # the shell that runs this script names the deploy path on its command line too
    if not any(ours(pid) for pid, *_ in proc_table() if pid not in mine):
        drop_data()
        report["data_removed"] = True
    return report


if __name__ == "__main__":
    action = args["action"]
    if action == "status":
        print(json.dumps(snapshot()))
    elif action == "wait":
        snap, problems = wait()
        print(json.dumps(snap))
        if problems:
            print(say(problems), file=sys.stderr)
            for line in diagnose(sorted({n for n, _ in problems})):
                print(line, file=sys.stderr)
        sys.exit(1 if problems else 0)
    elif action == "start":
        snap, report = start()
        print(json.dumps(snap))
        for line in report:
            print(line, file=sys.stderr)
        sys.exit(1 if report else 0)
    elif action == "stop":
        print(json.dumps(stop()))
