"""The deployment library: what `yrpd plan|deploy|status|logs|down` do, as functions.

The CLI parses flags, calls these and renders what they return; the bench deploys its targets through them; tests
call them directly. Nothing here prints: progress goes to a `Progress` (the CLI's writes to the terminal), results
come back as named types. (Ray's launcher keeps `create_or_update_cluster`/`teardown_cluster` in one library module
that both its CLI and its SDK call; this is that module.)
"""

from __future__ import annotations

import datetime
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from yrpd import live, rollout
from yrpd.containers import container_name, container_profile
from yrpd.deployment import Deployment, drained_hosts, host_group, resolve_inventory
from yrpd.errors import SessionError, SpecError
from yrpd.exposure import exposure
from yrpd.hostgroup import Command, GroupResult, SshOptions, as_run_in, env_preamble
# changing a running deployment, and tearing it down, live in yrpd.live; the library's callers find them here
from yrpd.live import (DRAIN_TIMEOUT_S, Changed, Down, change, down, drain_host, run_planner, scale,  # noqa: F401
                       undrain_host)
from yrpd.logtail import LogLine, TailSplitter, grep_lines, grep_script, in_time_order, tail_script
from yrpd.placement import HostInventory, Plan, make_plan
from yrpd.playbook import PlannedStep, StepOutcome, describe, named_playbook
from yrpd.runner import Progress, Quiet
from yrpd.session import Session, SessionPhase, SessionStore, default_root, resolve_root
from yrpd.serving import endpoint_url
from yrpd.spec import DeploySpec, Runtime, stored_spec
from yrpd.reconcile import Desired, reconcile
from yrpd.status import StatusReport, collect_status
from yrpd.steps import NotNeeded, RunOptions, StepContext, proxy, spec_fingerprint


@dataclass
class PlanView:
    """What a deploy of the spec would do: placement, and per step the command on each host (or why none)."""

    spec: DeploySpec
    inventory: dict[str, HostInventory]
    plan: Plan
    steps: list[PlannedStep]
    #: a deploy of it would change the running session instead (pending_change); [] otherwise
    changes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        data = self.plan.to_dict()
        if self.changes:
            data["changes"] = self.changes
        data["steps"] = [{"name": s.step.name, "hosts": {host: str(cmd) for host, cmd in s.actions.items()}}
                         for s in self.steps]
        data["ports"] = [row.to_dict() for row in exposure(self.spec, self.plan)]
        return data


def plan(spec: DeploySpec, playbook_file: str | Path | None = None) -> PlanView:
    """Touches no host unless devices, the dtype's CPU or (deploying) the architecture must be detected."""
    playbook = named_playbook(playbook_file)
    inventory = resolve_inventory(spec)
    spec = with_runtime(spec, inventory)
    placement = make_plan(spec, inventory)
    ctx = StepContext(spec=spec, plan=placement)
    return PlanView(spec, inventory, placement, _as_run(spec, ctx, describe(playbook, ctx)),
                    pending_change(spec, inventory))


def pending_change(spec: DeploySpec, inventory: dict[str, HostInventory] | None = None) -> list[str]:
    """What `yrpd deploy` of `spec` would change in the latest session while it serves (rollout.describe), read
    from the session store (and `inventory` for hosts it adds); [] where it would deploy or resume instead."""
    store = SessionStore(resolve_root(spec.session_root))
    latest = store.latest()
    if latest is None or latest.phase is not SessionPhase.deployed:
        return []
    try:
        running = Deployment.load(latest)
    except (SessionError, SpecError, ValueError):
        return []
    if same_deployment(running, spec):
        return []
    changes = rollout.diff(running.spec, spec)
    cordoned = drained_hosts(latest)
    unavailable = rollout.default_max_unavailable(spec, {**(inventory or {}), **running.inventory}, running.plan,
                                                  cordoned)
    lines = [f"session {latest.id} runs: `yrpd deploy` changes it while it serves"]
    lines += rollout.describe(changes, running.plan, spec, unavailable)
    blocked = [c.field for c in changes if c.kind is rollout.ChangeKind.recreate]
    if blocked:
        lines.append(f"{', '.join(blocked)} cannot change under it: deploy refuses unless given --recreate")
    return lines


def with_runtime(spec: DeploySpec, inventory: dict[str, HostInventory]) -> DeploySpec:
    """The spec with runtime auto resolved by the hosts' device kinds (DeploySpec.resolve_runtime)."""
    return spec.resolve_runtime({inv.kind for inv in inventory.values()})


def _as_run(spec: DeploySpec, ctx: StepContext, steps: list[PlannedStep]) -> list[PlannedStep]:
    """Runtime docker: the commands as deploy runs them, inside the container (`docker exec`)."""
    if spec.runtime is not Runtime.docker:
        return steps
    name, engine = container_name(ctx.session_id), spec.container_engine.value
    preamble = env_preamble(container_profile(spec).env_scripts)
    return [PlannedStep(s.step, {host: cmd if isinstance(cmd, NotNeeded) else as_run_in(cmd, name, engine,
                                                                                         preamble=preamble)
                                 for host, cmd in s.actions.items()}) for s in steps]


# -- deploy ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ContainerActions:
    """What this deploy may do to containers (runtime docker); not part of the deployment's identity."""

    recreate: bool = False  # replace a container of this session whose spec differs (else refuse)
    pull: str = "never"  # never | missing | always


@dataclass
class Deployed:
    session: Session
    deployment: Deployment
    endpoint: str | None  # the OpenAI-compatible base URL, when the playbook started the proxy
    resumed: bool
    seconds: float
    outcomes: list[StepOutcome] = field(default_factory=list)
    #: a changed spec rolled onto the running session: what changed (yrpd.rollout.describe)
    changes: list[str] = field(default_factory=list)


def check_container_actions(spec: DeploySpec, actions: ContainerActions | None) -> ContainerActions:
    actions = actions or ContainerActions()
    if spec.runtime is not Runtime.docker and actions.pull != "never":
        raise SpecError("--pull", "only applies to runtime docker", "drop it, or pass --runtime docker")
    return actions


def deploy(spec: DeploySpec, *, playbook_file: str | Path | None = None, new_session: bool = False,
           actions: ContainerActions | None = None, progress: Progress | None = None,
           max_unavailable: int | None = None, drain_timeout_s: float = live.DRAIN_TIMEOUT_S) -> Deployed:
    """Bring the hosts to the spec: deploy it, or resume the latest session if it has the same spec (the deploy
    playbook's checks skip what holds and start what died), or change the latest session to it while it serves
    (yrpd.live.change: a rolling change; `actions.recreate`: down, then deploy anew, for what cannot roll). It only
    says what it wants (yrpd.reconcile.Desired); the reconciler takes the steps. Raises StepFailed with the step and
    every host's result (the session is then `failed`: the same call resumes it)."""
    progress = progress or Quiet()
    if spec.runtime is not Runtime.auto:  # auto: checked once resolved, before any host is changed
        actions = check_container_actions(spec, actions)
    actions = actions or ContainerActions()
    started = time.monotonic()
    playbook = named_playbook(playbook_file)  # a playbook that cannot be read is refused before any host
    store = SessionStore(resolve_root(spec.session_root))
    with host_group(spec) as group:
        inventory = resolve_inventory(spec, group, deploying=True)
        spec = with_runtime(spec, inventory)  # before the session lookup: a session holds the resolved spec
        actions = check_container_actions(spec, actions)
        session, running = (None, None) if new_session else latest_up(store, spec)
        changing = running is not None and not same_deployment(running, spec)
        if changing and not actions.recreate:
            changed = live.change(running, spec, max_unavailable=max_unavailable,
                                  drain_timeout_s=drain_timeout_s, progress=progress, inventory=inventory)
            endpoint = endpoint_url(spec, changed.deployment.plan) + "/v1"
            return Deployed(changed.session, changed.deployment, endpoint, True, time.monotonic() - started,
                            changes=changed.lines)
        desired = Desired(spec, cordoned=tuple(drained_hosts(session)) if session and not changing else (),
                          whole=True, anew=changing)
        hands = live.Hands(desired, group, progress, deployment=running, session=session, store=store,
                           inventory=inventory, playbook=playbook, playbook_name=str(playbook_file or "deploy"),
                           options=RunOptions(recreate=actions.recreate, pull=actions.pull))
        reconcile(desired, hands.observe, hands.act)
    deployment = hands.now
    endpoint = None
    if any(step.function is proxy.start for step in playbook.steps):
        endpoint = endpoint_url(spec, deployment.plan) + "/v1"
    return Deployed(deployment.session, deployment, endpoint, not hands.new, time.monotonic() - started,
                    hands.outcomes)


def same_deployment(running: Deployment, spec: DeploySpec) -> bool:
    """The running deployment is `spec`'s, every instance started with its settings: a deploy resumes it."""
    return spec_fingerprint(running.spec) == spec_fingerprint(spec) and not rollout.stale(running.plan, spec)


def latest_up(store: SessionStore, spec: DeploySpec) -> tuple[Session | None, Deployment | None]:
    """The latest session if something of it may still run, and its deployment where it has a plan; (None, None)
    if a new session is needed.

    Its spec differing is for the caller (a rolling change); a session whose spec cannot be read, or that stopped
    before it had a plan, is refused when the spec differs: a second deployment beside it would fight over the
    same ports and devices."""
    latest = store.latest()
    if latest is None or not latest.phase.up:
        return None, None
    try:
        previous = stored_spec(latest.spec_data)
    except Exception as exc:  # noqa: BLE001 - one line for whatever is wrong with the file
        raise SpecError("deploy", f"session {latest.id} is still {latest.phase} but its stored spec cannot be read "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
                        f"tear it down with `yrpd down --session {latest.id}` (or remove {latest.path} once its "
                        "processes are gone), or pass --new-session to deploy alongside it") from None
    try:
        running = Deployment.load(latest)
    except SessionError:
        running = None
    if running is not None and (latest.phase is SessionPhase.deployed or same_deployment(running, spec)):
        return latest, running
    if spec_fingerprint(previous) == spec_fingerprint(spec):
        return latest, None  # it stopped before planning: resumed from its stored spec, planned anew
    old, new = previous.model_dump(mode="json", exclude={"ssh"}), spec.model_dump(mode="json", exclude={"ssh"})
    changed = sorted(k for k in new if old.get(k) != new.get(k))
    raise SpecError(
        "deploy",
        f"session {latest.id} is still {latest.phase} with a different spec (changed: {', '.join(changed)}): "
        "only a deployed session changes while it runs",
        "run the same `yrpd deploy` as before to finish it, `yrpd down` first, or pass --new-session to deploy "
        "alongside it",
    )


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
