"""The deployment library: what `yrpd plan|deploy|status|logs|down` do, as functions.

The CLI parses flags, calls these and renders what they return; the bench deploys its targets through them; tests
call them directly. Nothing here prints: progress goes to a `Progress` (the CLI's writes to the terminal), results
come back as named types. (Ray's launcher keeps `create_or_update_cluster`/`teardown_cluster` in one library module
that both its CLI and its SDK call; this is that module.)
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Callable

from yrpd import live
from yrpd.deployment import Deployment
from yrpd.errors import SpecError
from yrpd.hostgroup import Command, GroupResult, SshOptions
# changing a running deployment, deploying one and tearing it down live in yrpd.live (the reconciler's side); the
# library's callers find them here
from yrpd.live import (DRAIN_TIMEOUT_S, Changed, ContainerActions, Deployed, Down, PlanView, Wanted,  # noqa: F401
                       change, check_container_actions, down, drain_host, run_planner, scale, undrain_host)
from yrpd.logtail import LogLine, TailSplitter, grep_lines, grep_script, in_time_order, tail_script
from yrpd.runner import Progress, Quiet
from yrpd.session import SessionStore, default_root
from yrpd.spec import DeploySpec, Runtime
from yrpd.status import StatusReport, collect_status


def plan(spec: DeploySpec, playbook_file: str | Path | None = None) -> PlanView:
    """What `yrpd deploy` of `spec` would do (yrpd.live.preview). Touches no host unless devices, the dtype's CPU or
    (deploying) the architecture must be detected."""
    return live.preview(Wanted(spec, playbook_file))


# -- deploy ----------------------------------------------------------------------------------------

def deploy(spec: DeploySpec, *, playbook_file: str | Path | None = None, new_session: bool = False,
           actions: ContainerActions | None = None, progress: Progress | None = None,
           max_unavailable: int | None = None, drain_timeout_s: float = live.DRAIN_TIMEOUT_S) -> Deployed:
    """Bring the hosts to the spec: deploy it, or resume the latest session if it has the same spec (the deploy
    playbook's checks skip what holds and start what died), or change the latest session to it while it serves
    (a rolling change; `actions.recreate`: down, then deploy anew, for what cannot roll). It only says what it wants
    (`Wanted`); yrpd.live.converge takes it from there through the reconciler. Raises StepFailed with the step and
    every host's result (the session is then `failed`: the same call resumes it)."""
    if spec.runtime is not Runtime.auto:  # auto: checked once resolved, before any host is changed
        actions = check_container_actions(spec, actions)
    wanted = Wanted(spec, playbook_file, new_session=new_session, actions=actions or ContainerActions(),
                    max_unavailable=max_unavailable, drain_timeout_s=drain_timeout_s)
    return live.converge(wanted, progress or Quiet())


# -- a session's deployment: status, logs, down ------------------------------------------------------

def open_deployment(session_id: str | None = None, ssh: SshOptions | dict | None = None) -> Deployment:
    """The deployment of a session (the latest by default), reached with `ssh` where given: the user may reach
    the hosts differently now than when deploying."""
    deployment = Deployment.load(SessionStore(default_root()).get(session_id))
    changes = ssh.model_dump(exclude_unset=True) if isinstance(ssh, SshOptions) else \
        {k: v for k, v in (ssh or {}).items() if v is not None}
    if changes:
        spec = deployment.spec
        deployment.spec = spec.model_copy(update={"ssh": spec.ssh.model_copy(update=changes)})
    return deployment


def status(deployment: Deployment) -> StatusReport:
    return collect_status(deployment)


def logs(deployment: Deployment, emit: Callable[[str, str, str], None], *, name: str | None = None,
         lines: int = 20, follow: bool = False, hosts: list[str] | None = None) -> GroupResult:
    """Tail the session's log files on the hosts; `emit(host, log name, line)` per line as it arrives, one call
    at a time. Returns each host's result (tail's exit status; 130/143 when interrupted)."""
    import threading

    known = [h.name for h in deployment.plan.hosts]
    for host in hosts or []:
        if host not in known:
            raise SpecError("--host", f"{host!r} is not a host of session {deployment.session.id} "
                                      f"({', '.join(known)})", "pick one of them")
    # on the host itself: under the docker runtime the session directory is mounted from there, so logs stay
    # readable after the container is gone
    command = Command(tail_script(deployment.context().layout, name, lines, follow),
                      timeout=7 * 24 * 3600 if follow else 60, on_host=True)
    splitters: dict[str, TailSplitter] = {}
    lock = threading.Lock()

    def on_line(host: str, line: str) -> None:
        for log, text in splitters.setdefault(host, TailSplitter()).feed(line):
            with lock:
                emit(host, log, text)

    group = deployment.group().subset(hosts or known)
    try:
        return group.run(command, on_line=on_line)
    finally:
        group.close()


def request_lines(deployment: Deployment, request_id: str) -> tuple[list[LogLine], GroupResult]:
    """Every log line of the session that names `request_id` (the proxy's X-Request-Id, which vLLM and yrpd's
    connector carry in their request ids), from every host, in time order; and each host's result."""
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{3,}$", request_id):
        raise SpecError("--request", f"{request_id!r} is not a request id", "give the X-Request-Id the proxy logged "
                        "(id=...) or the client sent: letters, digits, _ . : - and at least 4 characters")
    command = Command(grep_script(deployment.context().layout, request_id), timeout=60, on_host=True)
    group = deployment.group()
    try:
        results = group.run(command)
    finally:
        group.close()
    year = datetime.date.today().year
    lines = [line for host, result in results.items() if result.ok for line in grep_lines(host, result.stdout, year)]
    return in_time_order(lines), results
