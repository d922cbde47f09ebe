"""Keep one process of a yrpd session running: start it, restart it when it dies, never leave a part of it behind.

Run by yrpd on the host (stdlib only), detached, as the process the session's pid file names. One JSON argument:
  {"name": .., "command": a bash command line, "state": path of this process's state file,
   "max_restarts": N (0: never restart), "window_s": seconds, "grace_s": seconds,
   "env_file": optional path of KEY=VALUE lines (the deployment's secrets) added to the command's environment at
   every start, so they are on no command line}
The command runs in a process group of its own (in this supervisor's unix session). When it exits, the rest of its group is stopped too (a vLLM API
server killed with -9 leaves its EngineCore and workers behind, holding memory, ports and devices), then it is
started again after a backoff of 1, 2, 4 .. 30 s, unless it was already restarted max_restarts times within the last
window_s seconds: then the state file says `failed` with the reason and this supervisor exits (`yrpd deploy` starts
a new one). TERM or INT: stop the group (TERM, KILL after grace_s) and exit 0, restarting nothing.

This process is a child subreaper: what the command's processes leave behind is re-parented here and reaped, so no
zombie outlives its group. The state file (JSON, rewritten atomically) holds: state (running | backoff | failed |
exited | stopped), pid (the command's), restarts (in total), last_exit, reason, since.
"""
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

args = json.loads(sys.argv[1])
name, state_path = args["name"], args["state"]
max_restarts, window_s, grace_s = int(args.get("max_restarts", 3)), float(args.get("window_s", 600)), float(args.get("grace_s", 15))
stopping = False
state = {"state": "starting", "pid": None, "restarts": 0, "last_exit": None, "reason": None, "since": time.time(),
         "supervisor": os.getpid()}


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


def processes():
    """(pid, state, ppid, pgid, sid) of every process, from /proc/PID/stat."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            yield int(entry), fields[0], int(fields[1]), int(fields[2]), int(fields[3])


def group_members(pgid, sid=None):
    """Live processes of the process group (and, given `sid`, of that unix session only)."""
    return [pid for pid, st, _, group, session in processes()
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
            if not group_members(pgid):
                return
            time.sleep(0.1)


def exit_reason(code):
    if code is None:
        return "unknown exit"
    return f"killed by signal {-code}" if code < 0 else f"exited with status {code}"


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
    recent = []
    while True:
        if stopping:  # TERM arrived while cleaning up or backing off: start nothing
            write(state="stopped", pid=None, reason="stopped by yrpd")
            return 0
        # a process group of its own, inside this supervisor's unix session: teardown finds every member by that
        # session even after vLLM's workers overwrite their environment (setproctitle)
        try:
            env = command_env()
        except OSError as exc:
            reason = f"cannot read its environment file: {exc}"
            say(reason)
            write(state="failed", pid=None, reason=reason)
            return 0
        child = subprocess.Popen(["bash", "-c", args["command"]], preexec_fn=os.setpgrp, stdin=subprocess.DEVNULL,
                                 env=env)
        write(state="running", pid=child.pid)
        code = wait_for(child)
        if code is None:
            stop_group(child.pid)
            write(state="stopped", pid=None, reason="stopped by yrpd")
            return 0
        left = group_members(child.pid)
        if left:
            say(f"{exit_reason(code)}; stopping what is left of it ({len(left)} processes)")
        # what outlives a dead command is of no use: a short grace, so the restart comes sooner
        stop_group(child.pid, grace=min(grace_s, 3.0))
        now = time.monotonic()
        recent = [t for t in recent if now - t < window_s]
        if max_restarts <= 0:
            say(f"{exit_reason(code)}; automatic restart is off (restart.max 0): `yrpd deploy` starts it again")
            write(state="exited", pid=None, last_exit=code, reason=exit_reason(code))
            return 0
        if len(recent) >= max_restarts:
            reason = (f"{exit_reason(code)} after {len(recent)} restarts in {int(window_s)} s; not restarting it "
                      f"again (`yrpd deploy` starts it anew once the cause is fixed)")
            say(reason)
            write(state="failed", pid=None, last_exit=code, reason=reason)
            return 0
        delay = min(30.0, 2.0 ** len(recent))
        say(f"{exit_reason(code)}; restart {len(recent) + 1} of at most {max_restarts} in {int(window_s)} s, "
            f"in {delay:.0f} s")
        write(state="backoff", pid=None, last_exit=code, reason=exit_reason(code))
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and not stopping:
            reap()
            time.sleep(0.1)
        if stopping:
            write(state="stopped", reason="stopped by yrpd")
            return 0
        recent.append(time.monotonic())
        state["restarts"] += 1


def wait_for(child):
    """The command's exit code (negative: killed by that signal), or None once TERM/INT asks us to stop. Orphans
    re-parented to us are reaped on the way, without scanning /proc."""
    while not stopping:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return child.poll()
        if pid == 0:
            time.sleep(0.2)
        elif pid == child.pid:
            child.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            return child.returncode
    return None


if __name__ == "__main__":
    sys.exit(main())
