"""Detached processes owned by a session: started under a supervisor with a pid file, found again by their environment.

Each process runs under deploy_scripts/supervise.py (in its own session, setsid), which restarts it by the spec's
restart policy and stops its whole process group when it dies; the pid file names the supervisor. Output goes to
its log file (yrpd.layout), and YRPD_SESSION=<id> is in its environment so status and teardown find it and
everything it forks.
"""

from __future__ import annotations

import json
import re
import shlex

from yrpd.assets import deploy_script
from yrpd.hostgroup import Command
from yrpd.placement import HostPlan, ports_on_host
from yrpd.steps import NotNeeded, ScriptCall, StepContext, host_python, shell_command

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
#: variables whose value yrpd puts in front of what the environment already holds
PREPENDED = ("PYTHONPATH",)


def _alive_test(ctx: StepContext, name: str) -> str:
    """True while the pid file names this session's supervisor of `name`. Both markers: a host that lost every
    process (rebooted, its pid namespace new) keeps its pid files, and the same start order hands the old pids to
    other processes of the session again."""
    pidfile = shlex.quote(ctx.layout.pidfile(name))
    markers = " ".join(f"-e {shlex.quote(m)}" for m in (f"YRPD_SESSION={ctx.session_id}", f"YRPD_PROCESS={name}"))
    return (
        f'pid=$(cat {pidfile} 2>/dev/null) && [ -n "$pid" ] && '
        f'[ "$(tr "\\0" "\\n" < /proc/$pid/environ 2>/dev/null | grep -cxF {markers})" = 2 ]'
    )


def supervisor_install(ctx: StepContext) -> str:
    """Shell lines that write the session's supervisor script (deploy_scripts/supervise.py) into place, atomically:
    a supervisor already running keeps the code it loaded."""
    q = shlex.quote
    sup = q(ctx.layout.supervisor)
    body = deploy_script("supervise.py")
    assert "YRPD_SUPERVISOR_END" not in body
    return (f"mkdir -p {' '.join(q(x) for x in ctx.layout.dirs)}\n"
            f"cat > {sup}.$$ <<'YRPD_SUPERVISOR_END' && mv -f {sup}.$$ {sup}\n{body}\nYRPD_SUPERVISOR_END")


def start_scripts(ctx: StepContext, starts: list[dict]) -> str:
    """Several start_script()s in one command, the supervisor written once: a host's shell takes the whole command
    as one argument, which Linux bounds (MAX_ARG_STRLEN, 128 KiB), and the supervisor is most of each start."""
    return "\n".join([supervisor_install(ctx), *(start_script(ctx, installed=True, **start) for start in starts)])


def start_script(ctx: StepContext, name: str, command: str, env: dict | None = None, settle: float = 0.5,
                 env_file: str | None = None, health_url: str | None = None, installed: bool = False,
                 needs: list[str] | None = None, gang: dict | None = None) -> str:
    """Shell lines that start `command` detached as `name` unless it is already running; `env_file` (secrets)
    is read by its supervisor, so its values are on no command line; `health_url` is what its supervisor probes
    to find it hung (restart.hang_after_s); `needs`, HOST:PORT addresses it cannot start without, which its
    supervisor waits for before a restart instead of spending restart.max on starts that must fail; `gang`, the
    processes on other hosts it lives and dies with (yrpd.serving.Launch.gang). `installed`: the
    command wrote the supervisor already (supervisor_install), else these lines write it when they start the
    process."""
    if not _NAME_RE.match(name):
        raise ValueError(f"process name {name!r} must be letters, digits, . _ -")
    layout = ctx.layout
    d = layout.dir
    q = shlex.quote
    exports = {**ctx.spec.env, **(env or {}), "YRPD_SESSION": ctx.session_id, "YRPD_PROCESS": name}
    # search paths are extended, not replaced: a container image's own (CANN's PYTHONPATH) must stay in force
    env_words = " ".join(f"{k}={q(v)}" + (f'"${{{k}:+:${k}}}"' if k in PREPENDED else "") for k, v in exports.items())
    log, pidfile = q(layout.log(name)), q(layout.pidfile(name))
    policy = ctx.spec.restart
    supervised = json.dumps({"name": name, "command": command, "state": layout.state(name),
                             "max_restarts": policy.max, "window_s": policy.window_s, "grace_s": policy.grace_s,
                             **({"env_file": env_file} if env_file else {}),
                             **({"needs": needs} if needs else {}),
                             **({"gang": gang} if gang else {}),
                             **({"health": {"url": health_url, "hang_after_s": policy.hang_after_s}}
                                if health_url and policy.hang_after_s else {})})
    sup = q(layout.supervisor)
    install = [] if installed else ["  " + supervisor_install(ctx).split("\n", 1)[1]]  # its mkdir is the first line
    return "\n".join([
        f"mkdir -p {' '.join(q(x) for x in layout.dirs)}",
        f"if {_alive_test(ctx, name)}; then echo '{name} already running (pid '$pid')'; else",
        *install,
        # only the supervisor goes to the background: $! is its pid, and nothing else holds our stdout
        f"  (cd {q(d)} || exit 1",
        f"   env {env_words} setsid nohup python3 -I {sup} {q(supervised)} >> {log} 2>&1 < /dev/null &",
        f"   echo $! > {pidfile})",
        f"  sleep {settle}; pid=$(cat {pidfile})",
        f"  if ! kill -0 $pid 2>/dev/null; then echo '{name} exited right after start; last log lines:' >&2; "
        f"tail -n 20 {log} >&2; exit 1; fi",
        f"  echo '{name} started (pid '$pid')'",
        "fi",
    ])


def start(ctx: StepContext, host: HostPlan, name: str, command: str, env: dict | None = None,
          settle: float = 0.5) -> Command:
    """Start `command` detached on the host unless it is already running."""
    script = start_script(ctx, name, command, env, settle)
    return shell_command(script, display=f"start {name} detached: {command}  (log {ctx.layout.log(name)})")


def running(ctx: StepContext, host: HostPlan, name: str, **_: object) -> Command:
    return shell_command(_alive_test(ctx, name))


def stop(ctx: StepContext, host: HostPlan, names: list[str], grace: float = 10) -> Command | NotNeeded:
    """Stop the named processes of the session (and everything they forked); no-op for names not started."""
    if not names:
        return NotNeeded("nothing of this kind on this host")
    grace = _grace(ctx, grace)
    args = {**ctx.layout.for_scripts(), "id": ctx.session_id, "action": "stop", "grace": grace, "names": names}
    return host_python("session_processes.py", args, timeout=grace + 30)


def _grace(ctx: StepContext, grace: float) -> float:
    # the supervisors give their groups restart.grace_s after TERM: teardown must not KILL them sooner
    return max(grace, ctx.spec.restart.grace_s + 5)


def stop_all(ctx: StepContext, host: HostPlan, grace: float = 10) -> Command:
    """Stop every process of the session on the host (TERM, then KILL after `grace` s) and prove none is left."""
    grace = _grace(ctx, grace)
    args = {**ctx.layout.for_scripts(), "id": ctx.session_id, "action": "stop", "grace": grace,
            "ports": [[port, what] for port, what in ports_on_host(ctx.plan, host.name, ctx.spec)]}
    return host_python("session_processes.py", args, timeout=grace + 30)


def status_call(ctx: StepContext, host: HostPlan) -> ScriptCall:
    """The processes' part of the host's status query (yrpd.status)."""
    return ScriptCall("session_processes.py", {**ctx.layout.for_scripts(), "id": ctx.session_id, "action": "status"})
