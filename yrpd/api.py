"""The deployment library: what `yrpd plan|deploy|status|logs|down` do, as functions.

The CLI parses flags, calls these and renders what they return; the bench deploys its targets through them; tests
call them directly. Nothing here prints: progress goes to a `Progress` (the CLI's writes to the terminal), results
come back as named types. (Ray's launcher keeps `create_or_update_cluster`/`teardown_cluster` in one library module
that both its CLI and its SDK call; this is that module.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from yrpd.assets import playbook_path
from yrpd.deployment import Deployment, host_group, resolve_inventory, runtime_group, save_deployment
from yrpd.errors import SpecError
from yrpd.hostgroup import Command, GroupFailure, GroupResult, SshOptions, as_run_in, env_preamble
from yrpd.placement import HostInventory, Plan, make_plan
from yrpd.playbook import Playbook, PlaybookFailed, PlaybookRunner, PlannedStep, StepEnded, StepFailed, StepOutcome, \
    StepSpec, StepStarted, describe, load_playbook
from yrpd.session import Session, SessionPhase, SessionStore, default_root, resolve_root
from yrpd.spec import DeploySpec, Runtime, stored_spec
from yrpd.status import StatusReport, collect_status
from yrpd.steps import NotNeeded, RunOptions, StepContext, host_python, processes, proxy, spec_fingerprint
from yrpd import credentials
from yrpd.containers import container_name, container_profile
from yrpd.exposure import exposure
from yrpd.logtail import TailSplitter, tail_script
from yrpd.serving import endpoint_url, instance_url, proxy_url


class Progress(Protocol):
    """What a long operation tells its caller while it runs."""

    def message(self, text: str) -> None: ...

    def step_started(self, number: int, total: int, step: StepSpec) -> None: ...

    def step_finished(self, step: StepSpec, outcome: StepOutcome) -> None: ...


class Quiet:
    """A Progress that keeps everything to itself."""

    def message(self, text: str) -> None:
        pass

    def step_started(self, number: int, total: int, step: StepSpec) -> None:
        pass

    def step_finished(self, step: StepSpec, outcome: StepOutcome) -> None:
        pass


# -- plan ------------------------------------------------------------------------------------------

@dataclass
class PlanView:
    """What a deploy of the spec would do: placement, and per step the command on each host (or why none)."""

    spec: DeploySpec
    inventory: dict[str, HostInventory]
    plan: Plan
    steps: list[PlannedStep]

    def to_dict(self) -> dict:
        data = self.plan.to_dict()
        data["steps"] = [{"name": s.step.name, "hosts": {host: str(cmd) for host, cmd in s.actions.items()}}
                         for s in self.steps]
        data["ports"] = [row.to_dict() for row in exposure(self.spec, self.plan)]
        return data


def _playbook(playbook_file: str | Path | None, default: str = "deploy") -> Playbook:
    return load_playbook(Path(playbook_file) if playbook_file else playbook_path(default))


def plan(spec: DeploySpec, playbook_file: str | Path | None = None) -> PlanView:
    """Touches no host unless devices, the dtype's CPU or (deploying) the architecture must be detected."""
    playbook = _playbook(playbook_file)
    inventory = resolve_inventory(spec)
    spec = with_runtime(spec, inventory)
    placement = make_plan(spec, inventory)
    ctx = StepContext(spec=spec, plan=placement)
    return PlanView(spec, inventory, placement, _as_run(spec, ctx, describe(playbook, ctx)))


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


def check_container_actions(spec: DeploySpec, actions: ContainerActions | None) -> ContainerActions:
    actions = actions or ContainerActions()
    if spec.runtime is not Runtime.docker:
        for flag, given in (("recreate", actions.recreate), ("pull", actions.pull != "never")):
            if given:
                raise SpecError(f"--{flag}", "only applies to runtime docker", "drop it, or pass --runtime docker")
    return actions


def deploy(spec: DeploySpec, *, playbook_file: str | Path | None = None, new_session: bool = False,
           actions: ContainerActions | None = None, progress: Progress | None = None) -> Deployed:
    """Deploy the spec, or resume the latest session if it has the same spec. Raises StepFailed with the step and
    every host's result (the session is then `failed`: the same call resumes it)."""
    progress = progress or Quiet()
    if spec.runtime is not Runtime.auto:  # auto: checked once resolved, before any host is changed
        actions = check_container_actions(spec, actions)
    started = time.monotonic()
    playbook = _playbook(playbook_file)
    store = SessionStore(resolve_root(spec.session_root))
    with host_group(spec) as group:
        inventory = resolve_inventory(spec, group, deploying=True)
        spec = with_runtime(spec, inventory)  # before the session lookup: a session holds the resolved spec
        actions = check_container_actions(spec, actions)
        session = None if new_session else reusable_session(store, spec)
        resumed = session is not None
        placement = make_plan(spec, inventory)
        # runtime docker: the wheels the containers get from here, downloaded before any host is changed
        from yrpd.steps.brought import prepare

        prepare(StepContext(spec=spec, plan=placement))
        if session is None:
            session = store.create()
            progress.message(f"session {session.id} ({session.path})")
        else:
            progress.message(f"resuming session {session.id}: finished steps are skipped")
        save_deployment(session, spec, inventory, placement)
        session.set_state(SessionPhase.deploying, playbook=str(playbook_file or "deploy"))
        master = next(h for h in placement.hosts if h.is_master)
        secrets = credentials.ensure(session.path, spec.proxy_key(), etcd_ips=[master.reach_ip])
        ctx = StepContext(spec=spec, plan=placement, session_id=session.id,
                          options=RunOptions(recreate=actions.recreate, pull=actions.pull, secrets_dir=str(secrets)))
        try:
            outcomes = _run(playbook, runtime_group(group, spec, session.id), ctx, session, progress)
        except StepFailed as failure:
            session.set_state(SessionPhase.failed, failed_step=failure.step.name)
            failure.args = (f"{failure}\nfix the cause and run the same `yrpd deploy` again to resume session "
                            f"{session.id} (finished steps are skipped), or `yrpd down` to remove what was started",)
            raise
    session.set_state(SessionPhase.deployed, failed_step=None)
    endpoint = None
    if any(step.function is proxy.start for step in playbook.steps):
        endpoint = endpoint_url(spec, placement) + "/v1"
    return Deployed(session, Deployment(session, spec, inventory, placement), endpoint, resumed,
                    time.monotonic() - started, outcomes)


def _run(playbook: Playbook, group, ctx: StepContext, session: Session, progress: Progress,
         keep_going: bool = False) -> list[StepOutcome]:
    steps = playbook.steps

    def report(event: StepStarted | StepEnded) -> None:
        if isinstance(event, StepStarted):
            progress.step_started(steps.index(event.step) + 1, len(steps), event.step)
        else:
            progress.step_finished(event.step, event.outcome)

    return PlaybookRunner(group, ctx, session, report).run(playbook, keep_going=keep_going)


def reusable_session(store: SessionStore, spec: DeploySpec) -> Session | None:
    """The latest session if it is still up with the same deployment spec; None if a new one is needed.

    A different spec while the latest session is still up is refused: two deployments would fight over
    the same ports and devices.
    """
    latest = store.latest()
    if latest is None or not latest.phase.up:
        return None
    try:
        previous = stored_spec(latest.spec_data)
    except Exception as exc:  # noqa: BLE001 - one line for whatever is wrong with the file
        # it may still run: a second deployment beside it would fight over its ports and devices
        raise SpecError("deploy", f"session {latest.id} is still {latest.phase} but its stored spec cannot be read "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
                        f"tear it down with `yrpd down --session {latest.id}` (or remove {latest.path} once its "
                        "processes are gone), or pass --new-session to deploy alongside it") from None
    if spec_fingerprint(previous) == spec_fingerprint(spec):
        return latest
    old, new = previous.model_dump(mode="json", exclude={"ssh"}), spec.model_dump(mode="json", exclude={"ssh"})
    changed = sorted(k for k in new if old.get(k) != new.get(k))
    raise SpecError(
        "deploy",
        f"session {latest.id} is still {latest.phase} with a different spec (changed: {', '.join(changed)})",
        "run `yrpd down` first, or pass --new-session to deploy alongside it",
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


@dataclass
class Down:
    session: Session
    hosts: list[str]
    seconds: float
    was_down: bool  # it had been torn down before: this was a check again


def down(deployment: Deployment, *, purge: bool = False, progress: Progress | None = None) -> Down:
    """Run the teardown on every host and prove nothing of the session is left; raises PlaybookFailed naming
    every host that still holds something (the session is then `down-failed`: the same call retries)."""
    progress = progress or Quiet()
    started = time.monotonic()
    session = deployment.session
    was_down = session.phase is SessionPhase.down
    playbook = _playbook(None, "teardown")
    # docker runtime: a container that is gone or stopped has nothing of the session running in it
    with deployment.group(absent_ok=True) as group:
        try:
            _run(playbook, group, deployment.context(RunOptions(purge=purge)), session, progress, keep_going=True)
        except PlaybookFailed as failure:
            session.set_state(SessionPhase.down_failed)
            failure.args = (f"{failure}\nfix the cause (or bring the host back) and run `yrpd down` again",)
            raise
    credentials.remove(session.path)  # the hosts' copies went with the teardown
    session.set_state(SessionPhase.down, purged=purge)
    return Down(session, [h.name for h in deployment.plan.hosts], time.monotonic() - started, was_down)


@dataclass
class Scaled:
    session: Session
    added: list[str]  # instances started, serving once their probe answered
    removed: list[str]  # instances drained (their requests in flight ended) and stopped
    seconds: float
    deployment: Deployment


#: how long `scale` waits for a removed instance's requests in flight to end before it refuses to stop it
DRAIN_TIMEOUT_S = 120.0


def scale(deployment: Deployment, *, prefill: int | None = None, decode: int | None = None,
          drain_timeout_s: float = DRAIN_TIMEOUT_S, progress: Progress | None = None) -> Scaled:
    """Change how many prefill and decode instances a running deployment has, without failing a request.

    What runs stays where it is (make_plan's `keep`). Added instances are started by the deploy playbook, which
    waits until each answers and its connector reaches the data system, then writes the proxy's membership: the
    proxy routes to them from its next probe round. Removed instances are first marked draining in the membership
    (no new request goes there), waited for until their requests in flight have ended (`drain_timeout_s`, else
    SpecError and nothing is stopped), left out of the membership, then stopped. The session keeps the new spec
    and plan, and its journal every step."""
    progress = progress or Quiet()
    started = time.monotonic()
    session = deployment.session
    if not session.phase.up:
        raise SpecError("scale", f"session {session.id} is {session.phase}", "deploy it first (`yrpd deploy`)")
    if not deployment.spec.disaggregated:
        raise SpecError("scale", "the deployment runs plain instances (disaggregated: false): no proxy routes "
                        "around them while they change", "change `prefill` and deploy again")
    counts = {k: v for k, v in (("prefill", prefill), ("decode", decode)) if v is not None}
    if not counts:
        raise SpecError("scale", "nothing to change", "pass --prefill N and/or --decode N")
    spec = DeploySpec.model_validate({**deployment.spec.model_dump(mode="json"), **counts}).check()
    plan = make_plan(spec, deployment.inventory, keep=deployment.plan.instances)
    before = {i.name for i in deployment.plan.instances}
    after = {i.name for i in plan.instances}
    added = [i.name for i in plan.instances if i.name not in before]
    removed = [i.name for i in deployment.plan.instances if i.name not in after]
    scaled = Deployment(session, spec, deployment.inventory, plan)
    if not added and not removed:
        return Scaled(session, [], [], time.monotonic() - started, deployment)
    master = next(h for h in plan.hosts if h.is_master)
    session.journal(event="scale", prefill=spec.prefill, decode=spec.decode, adding=added, removing=removed)
    with host_group(spec) as group:
        hosts = runtime_group(group, spec, session.id)
        if removed:
            old = deployment.context()
            progress.message(f"draining {', '.join(removed)}: no new request goes there; waiting for those in flight")
            _on(hosts, master.name, proxy.write_members(old, master, draining=frozenset(removed)),
                "take the removed instances out of routing")
            urls = [instance_url(deployment.plan, deployment.plan.instance(n)) for n in removed]
            drain = host_python("proxy_drain.py", {"status_url": proxy_url(spec, plan) + "/yrpd/status",
                                                   "urls": urls, "timeout": drain_timeout_s},
                                timeout=drain_timeout_s + 30)
            try:
                _on(hosts, master.name, drain, f"drain {', '.join(removed)}")
            except GroupFailure as failure:
                # nothing was stopped: they go back into routing, and the deployment stays as it was
                _on(hosts, master.name, proxy.write_members(old, master), "put them back into routing")
                session.journal(event="scale refused", removing=removed, why=str(failure).splitlines()[0])
                failure.args = (f"{failure}\nnothing was stopped and {', '.join(removed)} serve again; raise "
                                "--drain-timeout, or scale again once the long requests have ended",)
                raise
            _on(hosts, master.name, proxy.write_members(scaled.context(), master), "leave them out of routing")
            by_host: dict[str, list[str]] = {}
            for name in removed:
                by_host.setdefault(deployment.plan.instance(name).host, []).append(name)
            for host, names in by_host.items():
                progress.message(f"stopping {', '.join(names)} on {host}")
                _on(hosts, host, processes.stop(old, next(h for h in plan.hosts if h.name == host), names, grace=20),
                    f"stop {', '.join(names)}")
        # the removed ones are gone; the added ones are in the plan the playbook below resumes from
        save_deployment(session, spec, deployment.inventory, plan)
        if added:
            secrets = credentials.ensure(session.path, spec.proxy_key(), etcd_ips=[master.reach_ip])
            ctx = StepContext(spec=spec, plan=plan, session_id=session.id,
                              options=RunOptions(secrets_dir=str(secrets)))
            progress.message(f"starting {', '.join(added)}; the proxy routes to them once they answer")
            try:
                _run(_playbook(None), hosts, ctx, session, progress)
            except StepFailed as failure:
                failure.args = (f"{failure}\nthe instances already running serve on; fix the cause and run the same "
                                "`yrpd scale` again",)
                raise
    session.journal(event="scaled", prefill=spec.prefill, decode=spec.decode, added=added, removed=removed)
    session.set_state(SessionPhase.deployed, generation=int(session.state.get("generation", 1)) + 1)
    return Scaled(session, added, removed, time.monotonic() - started, scaled)


def _on(group, host: str, command: Command | NotNeeded, what: str) -> None:
    """Run one command on one host of the deployment; a failure is a StepFailed-like error naming it."""
    if isinstance(command, NotNeeded):
        return
    group.subset([host]).run(command).raise_on_failure(what)


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
