"""The reconciler's hands, and the commands that change a deployment without failing a request: scale, rolling spec
changes, host maintenance, the planner's loop.

Each command here (`yrpd deploy`'s too: `Wanted`, then `converge`) says what it wants (yrpd.reconcile.Desired: the spec, the hosts no
new instance goes to, how many instances a roll may take down, whether the whole deploy playbook must be checked) and
the reconciler takes the steps from what runs to that; `Hands` carries each out on the hosts. *Bring up* runs the
deploy playbook on every host (a first deploy, a resume: each step's check skips what holds); *join* and *start* run
it on a plan with the new hosts or more instances (each added instance starts, answers /health and reaches the data
system before the membership file the proxy reads names it); *retire* marks instances draining in that file (no new
request goes there), waits until their requests in flight have ended, leaves them out, then stops them; *tear down*
runs the teardown playbook. Before each step of a live change the hands look at the hosts' processes: an instance
that died beyond its supervisor's reach (a container gone, a host rebuilt) is started again first. The session
stores the spec and plan after each step, its journal every step and each instance's InstanceState, so a change
that fails half-way is resumed by running the same command again, and `yrpd down` always knows everything that runs.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from yrpd import credentials, placement, planner
from yrpd.reconcile import (DOWN, BringUp, Desired, Join, Lifecycle, Observed, Restart, Retire, Start, Step, TearDown,
                            reconcile)
from yrpd.deployment import (Deployment, drained_hosts, host_group, resolve_inventory, runtime_group, save_deployment,
                             session_container)
from yrpd.errors import RemoteError, SessionError, SpecError
from yrpd.exposure import PortAccess, exposure
from yrpd.hostgroup import GroupFailure, HostGroup, as_run_in
from yrpd.placement import HostInventory, Plan, make_plan
from yrpd.playbook import PlannedStep, Playbook, PlaybookFailed, StepFailed, StepOutcome, describe, named_playbook
from yrpd.runner import Progress, Quiet, run_on, run_playbook
from yrpd.session import Session, SessionPhase, SessionStore, resolve_root
from yrpd.status import dead_instances
from yrpd.steps.brought import every_set, prepare
from yrpd.tags import InstanceState
from yrpd.wheels import WheelSet
from yrpd.spec import (COUNT_FIELDS, Change, ChangeKind, DeploySpec, HostSpec, Runtime, joined_hosts,
                       refuse_unrollable, spec_diff, stored_spec)
from yrpd.steps import NotNeeded, RunOptions, StepContext, host_python, processes, proxy
from yrpd.steps.vllm_env import paths as vllm_paths
from yrpd.serving import instance_launches, instance_url, proxy_url

#: how long a removed instance's requests in flight may take to end before the change gives up (stopping nothing)
DRAIN_TIMEOUT_S = 120.0


@dataclass
class Changed:
    session: Session
    added: list[str]  # instances started, serving once their probe answered
    removed: list[str]  # instances drained (their requests in flight ended) and stopped
    seconds: float
    deployment: Deployment
    #: what changed, as `yrpd plan` and `yrpd deploy` show it before acting
    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


class Hands:
    """Carries the reconciler's steps out on the hosts, on a deployment that advances with each. What it observes:
    that deployment as its session stores it (None before a first deploy has a plan), the session's unfinished
    joins and each instance's InstanceState, and, with `look`, the hosts' own word on which instances died beyond
    their supervisors' reach (yrpd.status.dead_instances)."""

    def __init__(self, desired: Desired, group: HostGroup, progress: Progress, *,
                 deployment: Deployment | None = None, session: Session | None = None,
                 store: SessionStore | None = None, inventory: dict | None = None, playbook: Playbook | None = None,
                 playbook_name: str = "deploy", options: RunOptions | None = None,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S, look: bool = False):
        self.desired, self.group, self.progress, self.drain_timeout_s = desired, group, progress, drain_timeout_s
        self.now = deployment
        self.session = session or (deployment.session if deployment else None)
        self.store, self.options, self.look = store, options or RunOptions(), look
        self.playbook, self.playbook_name = playbook, playbook_name  # bring up's (default: deploy's)
        self.inventory = inventory if inventory is not None else deployment.inventory
        self.new = self.checked = False
        self.outcomes: list = []
        self.added: list[str] = []
        self.removed: list[str] = []
        self.restarted: list[str] = []
        self._views: dict[str, HostGroup] = {}

    @property
    def life(self) -> Lifecycle:
        session = self.session
        return Lifecycle(session.state.get("instances") or {},
                         save=lambda states: session.set_state(instances=states))

    @property
    def hosts(self) -> HostGroup:
        """The group as the session's steps see it (in its containers under the docker runtime)."""
        sid = self.session.id
        if sid not in self._views:
            self._views[sid] = runtime_group(self.group, self.desired.spec, sid)
        return self._views[sid]

    def observe(self) -> Observed:
        if self.now is None:
            return Observed(None, new=self.new)
        up = self.session.phase is SessionPhase.deployed
        if self.look and up:
            dead = dead_instances(self.now, self.hosts.subset([h.name for h in self.now.plan.hosts]))
            life = self.life  # read after the look: another command may have moved one meanwhile
            found = [name for name in dead if life.state(name) is InstanceState.serving]
            again = [name for name in found if name in self.restarted]
            if again:  # started again in this command and dead once more: the cause is the instance's own
                raise RemoteError(f"{', '.join(again)} died again after this command started "
                                  f"{'it' if len(again) == 1 else 'them'} again; nothing drained since. "
                                  f"`yrpd logs {again[0]}` says why; fix it and run the same command again")
            if found:
                self.session.journal(event="found dead", instances=found)
                where = "its host" if len(found) == 1 else "their hosts"
                self.progress.message(f"{', '.join(found)} found dead on {where} (nothing restarts it there): "
                                      "started again first")
                life.move(found, InstanceState.dead)
        life = self.life
        down = frozenset(i.name for i in self.now.plan.instances if life.state(i.name) in DOWN)
        return Observed(self.now.plan, joining=tuple(self.session.state.get("joining") or ()), down=down, up=up,
                        checked=self.checked, new=self.new)

    def act(self, step: Step) -> None:
        spec = self.desired.spec
        if isinstance(step, TearDown):
            self._tear_down()
        elif isinstance(step, BringUp):
            self._bring_up(spec)
        elif isinstance(step, Join):
            self._start(spec, {}, joining=list(step.hosts))
        elif isinstance(step, Start):
            self._start(spec, step.counts)
        elif isinstance(step, Retire):
            self._retire(list(step.names), spec)
        elif isinstance(step, Restart):
            self._start(spec, {}, again=list(step.names))
        else:
            raise TypeError(f"not a step: {step!r}")

    def _master(self, plan: Plan):
        return next(h for h in plan.hosts if h.is_master)

    def _tear_down(self) -> None:
        self.progress.message(f"--recreate: tearing session {self.session.id} down first (requests fail until the "
                              "new one serves)")
        down(self.now, progress=self.progress)
        self.now = self.session = None

    def _bring_up(self, spec: DeploySpec) -> None:
        """The deploy playbook on every host of the spec's plan: what runs keeps its place (a change may have moved
        it); a session is created where there is none, else resumed (finished steps are skipped)."""
        placement = make_plan(spec, self.inventory, keep=self.now.plan.instances if self.now else (),
                              cordoned=self.desired.cordoned)
        # runtime docker: the wheels the containers get from here, downloaded before any host is changed
        prepare(StepContext(spec=spec, plan=placement))
        if self.session is None:
            self.session, self.new = self.store.create(), True
            self.progress.message(f"session {self.session.id} ({self.session.path})")
        else:
            self.progress.message(f"resuming session {self.session.id}: finished steps are skipped")
        session = self.session
        save_deployment(session, spec, self.inventory, placement)
        session.set_state(SessionPhase.deploying, playbook=self.playbook_name)
        self.now = Deployment(session, spec, self.inventory, placement)
        master = self._master(placement)
        secrets = credentials.ensure(session.path, spec.proxy_key(), etcd_ips=[master.reach_ip])
        ctx = StepContext(spec=spec, plan=placement, session_id=session.id,
                          options=replace(self.options, secrets_dir=str(secrets)))
        try:
            self.outcomes = run_playbook(self.playbook or named_playbook(None), self.hosts, ctx, session,
                                         self.progress)
        except StepFailed as failure:
            session.set_state(SessionPhase.failed, failed_step=failure.step.name)
            failure.args = (f"{failure}\nfix the cause and run the same `yrpd deploy` again to resume session "
                            f"{session.id} (finished steps are skipped), or `yrpd down` to remove what was started",)
            raise
        # the whole playbook ran on every host: every instance of the plan serves (no change left one down)
        session.set_state(SessionPhase.deployed, failed_step=None, joining=None, instances={})
        self.checked = True

    def _start(self, spec: DeploySpec, add: dict[str, int], joining: list[str] = (), again: list[str] = ()) -> None:
        """Start `add` more instances per role, of `spec`'s settings, on free devices of hosts not cordoned; with
        `joining` (hosts new to the deployment, or a join stopped half-way) the playbook also runs where none
        starts, so those hosts join the cluster; `again`: instances of the plan that are down, started where they
        are (the playbook's checks skip what runs)."""
        plan = placement.replan(spec, self.now.inventory, self.now.plan.instances, self.desired.cordoned, **add)
        names = [i.name for i in plan.instances if i.name not in {j.name for j in self.now.plan.instances}]
        self.life.move(again, InstanceState.starting)
        after = Deployment(self.session, placement.with_counts(spec, plan), self.now.inventory, plan)
        if joining:
            # before the spec that names them is stored: a join stopped anywhere from here on is found by the next
            # change, which finishes it
            self.session.set_state(joining=list(joining))
        # stored first: if the start fails half-way, `yrpd down` knows them and the same command resumes
        save_deployment(self.session, after.spec, after.inventory, plan)
        self.session.journal(event="start", instances=names, **({"hosts": list(joining)} if joining else {}),
                             **({"again": list(again)} if again else {}))
        self.life.move(names, InstanceState.starting, default=InstanceState.planned)
        names_all = [*again, *names]
        master = self._master(plan)
        secrets = credentials.ensure(self.session.path, spec.proxy_key(), etcd_ips=[master.reach_ip])
        ctx = StepContext(spec=after.spec, plan=plan, session_id=self.session.id,
                          options=RunOptions(secrets_dir=str(secrets)))
        if joining:
            self.progress.message(f"joining {', '.join(joining)} to the cluster (the hosts that run are skipped)")
        if names_all:
            self.progress.message(f"starting {', '.join(names_all)}; the proxy routes to them once they answer")
        try:
            run_playbook(named_playbook(None), self.hosts, ctx, self.session, self.progress)
        except BaseException as failure:  # an interruption too: what it started is not known to serve
            self.life.move(names_all, InstanceState.failed)
            if isinstance(failure, StepFailed):
                failure.args = (f"{failure}\nthe instances already running serve on; fix the cause and run the "
                                "same command again to go on with the change",)
            raise
        self.life.move(names_all, InstanceState.serving)
        self.restarted += list(again)
        if self.session.state.get("joining"):
            self.session.set_state(joining=None)  # the playbook ran on every host of the plan: each has joined
        self.now = after
        self.added += names

    def _retire(self, names: list[str], spec: DeploySpec) -> None:
        old = self.now
        rest = [i for i in old.plan.instances if i.name not in names]
        plan = placement.replan(spec, old.inventory, rest, self.desired.cordoned)
        after_spec = placement.with_counts(spec, plan)
        after = Deployment(self.session, after_spec, old.inventory, plan)
        master = self._master(plan)
        # a failed start's instance never served: it goes straight to stopping; one a retire cut short is where it
        # was left (draining, stopping)
        self.session.journal(event="drain", instances=names)
        self.life.move([n for n in names if self.life.state(n) is InstanceState.serving], InstanceState.draining)
        self.progress.message(f"draining {', '.join(names)}: no new request goes there; waiting for those in flight")
        run_on(self.hosts, master.name, proxy.write_members(old.context(), master, draining=frozenset(names)),
               "take them out of routing")
        urls = [instance_url(old.plan, old.plan.instance(n)) for n in names]
        drain = host_python("proxy_drain.py", {"status_url": proxy_url(spec, plan) + "/yrpd/status", "urls": urls,
                                               "timeout": self.drain_timeout_s}, timeout=self.drain_timeout_s + 30)
        try:
            run_on(self.hosts, master.name, drain, f"drain {', '.join(names)}")
        except GroupFailure as failure:
            # nothing was stopped: they go back into routing, and the deployment stays as it was
            run_on(self.hosts, master.name, proxy.write_members(old.context(), master), "put them back into routing")
            self.life.move([n for n in names if self.life.state(n) is InstanceState.draining], InstanceState.serving)
            self.session.journal(event="drain refused", instances=names, why=str(failure).splitlines()[0])
            failure.args = (f"{failure}\nnothing was stopped and {', '.join(names)} serve again; raise "
                            "--drain-timeout, or run it again once the long requests have ended",)
            raise
        self.life.move([n for n in names if self.life.state(n) is not InstanceState.stopping], InstanceState.stopping)
        run_on(self.hosts, master.name, proxy.write_members(after.context(), master), "leave them out of routing")
        # every process of them: an instance whose DP ranks span hosts has a headless engine on each other host
        by_host: dict[str, list[str]] = {}
        ctx = old.context()
        for name in names:
            for launch in instance_launches(old.spec, old.plan, old.plan.instance(name), vllm_paths(ctx)):
                by_host.setdefault(launch.host, []).append(launch.name)
        for host, stopping in by_host.items():
            self.progress.message(f"stopping {', '.join(stopping)} on {host}")
            run_on(self.hosts, host, processes.stop(ctx, next(h for h in plan.hosts if h.name == host),
                                                    stopping, grace=20), f"stop {', '.join(stopping)}")
        save_deployment(self.session, after.spec, after.inventory, plan)
        self.session.journal(event="stopped", instances=names)
        self.life.move(names, InstanceState.gone)
        self.now = after
        self.removed += names



# -- what `yrpd deploy` and `yrpd plan` ask, and the way from there -----------------------------------------------

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
    #: a changed spec rolled onto the running session: what changed (describe_change)
    changes: list[str] = field(default_factory=list)


def check_container_actions(spec: DeploySpec, actions: ContainerActions | None) -> ContainerActions:
    actions = actions or ContainerActions()
    if spec.runtime is not Runtime.docker and actions.pull != "never":
        raise SpecError("--pull", "only applies to runtime docker", "drop it, or pass --runtime docker")
    return actions


@dataclass
class PlanView:
    """What a deploy of the spec would do: placement, and per step the command on each host (or why none)."""

    ctx: StepContext  # the spec and its placement, as the steps see them
    inventory: dict[str, HostInventory]
    steps: list[PlannedStep]
    #: a deploy of it would change the running session instead (pending_change); [] otherwise
    changes: list[str] = field(default_factory=list)

    @property
    def spec(self) -> DeploySpec:
        return self.ctx.spec

    @property
    def plan(self) -> Plan:
        return self.ctx.plan

    @property
    def brought(self) -> list[WheelSet]:
        """The wheels a deploy fetches here and copies to the hosts (runtime docker), each set once."""
        return every_set(self.ctx)

    @property
    def ports(self) -> list[PortAccess]:
        """Who may reach each port the deployment opens (yrpd.exposure)."""
        return exposure(self.spec, self.plan)

    def to_dict(self) -> dict:
        data = self.plan.to_dict()
        if self.changes:
            data["changes"] = self.changes
        data["steps"] = [{"name": s.step.name, "hosts": {host: str(cmd) for host, cmd in s.actions.items()}}
                         for s in self.steps]
        data["ports"] = [row.to_dict() for row in self.ports]
        return data



def pending_change(spec: DeploySpec, inventory: dict[str, HostInventory] | None = None) -> list[str]:
    """What `yrpd deploy` of `spec` would change in the latest session while it serves (describe_change), read
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
    changes = spec_diff(running.spec, spec)
    cordoned = drained_hosts(latest)
    unavailable = placement.default_max_unavailable(spec, {**(inventory or {}), **running.inventory}, running.plan,
                                                    cordoned)
    lines = [f"session {latest.id} runs: `yrpd deploy` changes it while it serves"]
    lines += describe_change(changes, running.plan, spec, unavailable)
    blocked = [c.field for c in changes if c.kind is ChangeKind.recreate]
    if blocked:
        lines.append(f"{', '.join(blocked)} cannot change under it: deploy refuses unless given --recreate")
    return lines


def with_runtime(spec: DeploySpec, inventory: dict[str, HostInventory]) -> DeploySpec:
    """The spec with runtime auto resolved by the hosts' device kinds (DeploySpec.resolve_runtime)."""
    return spec.resolve_runtime({inv.kind for inv in inventory.values()})


def _as_run(ctx: StepContext, steps: list[PlannedStep]) -> list[PlannedStep]:
    """Runtime docker: the commands as deploy runs them, inside the container (`docker exec`), as runtime_group's
    view runs them."""
    where = session_container(ctx.spec, ctx.session_id)
    if where is None:
        return steps
    return [PlannedStep(s.step, {host: cmd if isinstance(cmd, NotNeeded) else as_run_in(cmd, where.name, where.engine,
                                                                                         preamble=where.preamble)
                                 for host, cmd in s.actions.items()}) for s in steps]


def same_deployment(running: Deployment, spec: DeploySpec) -> bool:
    """The running deployment is `spec`'s, every instance started with its settings: a deploy resumes it."""
    return running.spec.fingerprint() == spec.fingerprint() and not placement.stale(running.plan, spec)


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
    if previous.fingerprint() == spec.fingerprint():
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


@dataclass(frozen=True)
class Wanted:
    """What one `yrpd deploy` (or `yrpd plan`) asks: the spec, and how this command may bring the hosts to it (not
    the deployment's identity). `converge` takes it from here; nothing before it has touched a host."""

    spec: DeploySpec
    playbook_file: str | Path | None = None
    new_session: bool = False  # deploy beside the latest session even where that one is still up
    actions: ContainerActions = field(default_factory=ContainerActions)
    max_unavailable: int | None = None  # a rolling change's (None: placement.default_max_unavailable)
    drain_timeout_s: float = DRAIN_TIMEOUT_S


def preview(wanted: Wanted) -> PlanView:
    """What `converge` of `wanted` would do: placement, each step's command on each host, and what it would change
    in the running session. Touches no host unless devices, the dtype's CPU or the architecture must be detected."""
    playbook = named_playbook(wanted.playbook_file)
    inventory = resolve_inventory(wanted.spec)
    spec = with_runtime(wanted.spec, inventory)
    ctx = StepContext(spec=spec, plan=make_plan(spec, inventory))
    return PlanView(ctx, inventory, _as_run(ctx, describe(playbook, ctx)), pending_change(spec, inventory))


def converge(wanted: Wanted, progress: Progress) -> Deployed:
    """Bring the hosts to `wanted.spec`: deploy it, or resume the latest session if it has the same spec (the deploy
    playbook's checks skip what holds and start what died), or change the latest session to it while it serves
    (`change`: a rolling change; `actions.recreate`: down, then deploy anew, for what cannot roll). Raises StepFailed
    with the step and every host's result (the session is then `failed`: the same call resumes it)."""
    started = time.monotonic()
    spec, actions = wanted.spec, wanted.actions
    playbook = named_playbook(wanted.playbook_file)  # a playbook that cannot be read is refused before any host
    store = SessionStore(resolve_root(spec.session_root))
    with host_group(spec) as group:
        inventory = resolve_inventory(spec, group, deploying=True)
        spec = with_runtime(spec, inventory)  # before the session lookup: a session holds the resolved spec
        actions = check_container_actions(spec, actions)
        session, running = (None, None) if wanted.new_session else latest_up(store, spec)
        changing = running is not None and not same_deployment(running, spec)
        if changing and not actions.recreate:
            changed = change(running, spec, max_unavailable=wanted.max_unavailable,
                             drain_timeout_s=wanted.drain_timeout_s, progress=progress, inventory=inventory)
            return Deployed(changed.session, changed.deployment, changed.deployment.url + "/v1", True,
                            time.monotonic() - started, changes=changed.lines)
        desired = Desired(spec, cordoned=tuple(drained_hosts(session)) if session and not changing else (),
                          whole=True, anew=changing)
        hands = Hands(desired, group, progress, deployment=running, session=session, store=store,
                      inventory=inventory, playbook=playbook, playbook_name=str(wanted.playbook_file or "deploy"),
                      options=RunOptions(recreate=actions.recreate, pull=actions.pull))
        reconcile(desired, hands.observe, hands.act)
    deployment = hands.now
    endpoint = None
    if any(step.function is proxy.start for step in playbook.steps):
        endpoint = deployment.url + "/v1"
    return Deployed(deployment.session, deployment, endpoint, not hands.new, time.monotonic() - started,
                    hands.outcomes)


def _reconciled(deployment: Deployment, desired: Desired, progress: Progress, drain_timeout_s: float,
                only: tuple[type, ...] | None = None) -> Hands:
    """What runs brought to `desired`, step by step on the hosts; those that died beyond their supervisors' reach are
    started again first."""
    with host_group(desired.spec) as group:
        hands = Hands(desired, group, progress, deployment=deployment, drain_timeout_s=drain_timeout_s, look=True)
        reconcile(desired, hands.observe, hands.act, only=only)
    return hands


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
    playbook = named_playbook(None, "teardown")
    # docker runtime: a container that is gone or stopped has nothing of the session running in it
    with deployment.group(absent_ok=True) as group:
        try:
            run_playbook(playbook, group, deployment.context(RunOptions(purge=purge)), session, progress, keep_going=True)
        except PlaybookFailed as failure:
            session.set_state(SessionPhase.down_failed)
            failure.args = (f"{failure}\nfix the cause (or bring the host back) and run `yrpd down` again",)
            raise
    credentials.remove(session.path)  # the hosts' copies went with the teardown
    session.set_state(SessionPhase.down, purged=purge)
    return Down(session, [h.name for h in deployment.plan.hosts], time.monotonic() - started, was_down)


def _check_live(deployment: Deployment, what: str) -> None:
    session = deployment.session
    if session.phase is not SessionPhase.deployed:
        raise SpecError(what, f"session {session.id} is {session.phase}",
                        "finish its deploy first (run `yrpd deploy` again)" if session.phase.up else
                        "deploy it first (`yrpd deploy`)")
    if not deployment.spec.disaggregated:
        raise SpecError(what, "the deployment runs plain instances (disaggregated: false): no proxy routes around "
                        "them while they change", "run `yrpd down` and deploy again")


def change(deployment: Deployment, spec: DeploySpec, *, max_unavailable: int | None = None,
           drain_timeout_s: float = DRAIN_TIMEOUT_S, progress: Progress | None = None, what: str = "deploy",
           cordoned: list[str] | None = None, inventory: dict | None = None) -> Changed:
    """Bring a running deployment to `spec` without failing a request: instance settings roll (INSTANCE_FIELDS:
    new instance up and serving, then the old one drained and stopped; with `max_unavailable` >= 1 the other way
    round, in batches that leave every role an instance serving), instance counts scale. Anything else is refused
    before a host is touched (refuse_unrollable). A model change starts a new prefill and decode instance
    together: the proxy pairs instances of one model group only, so it never mixes models in one answer."""
    progress = progress or Quiet()
    started = time.monotonic()
    _check_live(deployment, what)
    session = deployment.session
    changes = spec_diff(deployment.spec, spec)
    refuse_unrollable(changes, session.id)
    if not spec.disaggregated:
        raise SpecError(what, "disaggregated cannot change under a running deployment", "pass --recreate")
    joining = joined_hosts(deployment.spec, spec)
    if joining:  # their devices (`inventory`: detected by the caller), before anything is planned on them; the
        # running hosts keep what is stored
        found = inventory if inventory is not None else joined_inventory(spec, joining)
        deployment = Deployment(session, deployment.spec,
                                {**{h: found[h] for h in joining}, **deployment.inventory}, deployment.plan)
    # a join stopped half-way: the reconciler finishes it (the session remembers the hosts)
    unfinished = [h.name for h in spec.hosts if h.name in (session.state.get("joining") or [])]
    cordoned = drained_hosts(session) if cordoned is None else cordoned  # hosts no new instance goes to
    replaced = placement.stale(deployment.plan, spec)
    roles = sorted({i.role for i in replaced})
    counts = placement.counts(deployment.plan)
    if max_unavailable is None:
        max_unavailable = placement.default_max_unavailable(spec, deployment.inventory, deployment.plan, cordoned)
    if replaced and max_unavailable > 0:
        if any(i.group != spec.model_group for i in replaced):
            raise SpecError("--max-unavailable", f"{changes[0].field} changes the model, and a model change needs "
                            "a device spare for a new prefill and a new decode instance beside the old ones (the proxy "
                            "never pairs two models)", "free devices or add hosts, or pass --recreate")
        short = [r for r in roles if counts[r] <= max_unavailable]
        if short:
            raise SpecError("--max-unavailable", f"{max_unavailable} would leave no {short[0]} instance serving (it "
                            f"has {counts[short[0]]} and no device is spare for one more beside them)",
                            f"scale {short[0]} up first (`yrpd scale --{short[0]} {counts[short[0]] + 1}`), free a "
                            "device, or pass --recreate")
    lines = describe_change(changes, deployment.plan, spec, max_unavailable)
    if unfinished:
        lines.append(f"join {', '.join(unfinished)}: stopped half-way, it goes on")
    kept = session.state.get("instances") or {}
    down = [i.name for i in deployment.plan.instances if kept.get(i.name) in DOWN]
    if down:
        lines.append(f"start {', '.join(down)} again: a change that stopped half-way left "
                     f"{'it' if len(down) == 1 else 'them'} down")
    for line in lines:
        progress.message(line)
    if not lines:
        return Changed(session, [], [], time.monotonic() - started, deployment)
    session.journal(event="change", changes=lines, max_unavailable=max_unavailable)
    session.set_state(change="; ".join(lines))
    try:
        # a roll at the counts that run, then the spec's: one instance beyond what runs at most, and no role short
        desired = Desired(spec, tuple(cordoned), max_unavailable=max_unavailable,
                          roll_counts=tuple(placement.counts(deployment.plan).items()))
        hands = _reconciled(deployment, desired, progress, drain_timeout_s)
    except BaseException:
        session.set_state(change="stopped half-way (the same command goes on with it): " + "; ".join(lines))
        raise
    # the free fields (how to reach the hosts, timeouts) and the exact counts asked for
    save_deployment(session, spec, hands.now.inventory, hands.now.plan)
    final = Deployment(session, spec, hands.now.inventory, hands.now.plan)
    session.journal(event="changed", changes=lines, added=hands.added, removed=hands.removed)
    session.set_state(SessionPhase.deployed, change=None, generation=int(session.state.get("generation", 1)) + 1)
    return Changed(session, hands.added, hands.removed, time.monotonic() - started, final, lines)


def joined_inventory(spec: DeploySpec, names: list[str]) -> dict:
    """The devices of the hosts `names` of `spec` (detected on them where the spec does not give them)."""
    return resolve_inventory(spec.model_copy(update={"hosts": [h for h in spec.hosts if h.name in names]}),
                             deploying=True)


def scale(deployment: Deployment, *, prefill: int | None = None, decode: int | None = None,
          hosts: list[str] | None = None, drain_timeout_s: float = DRAIN_TIMEOUT_S,
          progress: Progress | None = None) -> Changed:
    """Change how many prefill and decode instances a running deployment has, without failing a request: what runs
    stays where it is, the highest-indexed instances go, added ones take free devices (`change` with new counts).
    `hosts` join the deployment first (their data system workers join the cluster), so added instances may go
    there; one the deployment has already is left as it is."""
    _check_live(deployment, "scale")
    counts = {k: v for k, v in (("prefill", prefill), ("decode", decode)) if v is not None}
    have = {h.name for h in deployment.spec.hosts}
    added = [] if hosts is None else [h for h in dict.fromkeys(a.strip() for a in hosts if a.strip())]
    if hosts is not None and not added:
        raise SpecError("--hosts", "names no host", "pass --hosts h3,h4 (hosts to add)")
    fresh = [a for a in added if HostSpec(address=a).name not in have]
    if not counts and not added:
        raise SpecError("scale", "nothing to change", "pass --prefill N, --decode N and/or --hosts LIST")
    data = deployment.spec.model_dump(mode="json")
    data["hosts"] = data["hosts"] + [{"address": a} for a in fresh]
    spec = DeploySpec.model_validate({**data, **counts}).check()
    return change(deployment, spec, drain_timeout_s=drain_timeout_s, progress=progress, what="scale")


def drain_host(deployment: Deployment, host: str, *, drain_timeout_s: float = DRAIN_TIMEOUT_S,
               progress: Progress | None = None) -> Changed:
    """Take `host` out for maintenance: each instance there is replaced by one on another host's free devices
    (started first, then the old one drained and stopped); where none is free, it is drained and stopped unless it
    is its role's last one, and the lost capacity is named. The host stays in the deployment (its data system worker
    and, on the master, the proxy run on) and takes no new instance until `undrain_host`."""
    progress = progress or Quiet()
    started = time.monotonic()
    _check_live(deployment, "drain")
    session = deployment.session
    names = [h.name for h in deployment.plan.hosts]
    if host not in names:
        raise SpecError("HOST", f"{host!r} is not a host of session {session.id} ({', '.join(names)})",
                        "pick one of them")
    spec = deployment.spec
    cordoned = sorted({*drained_hosts(session), host})
    moving = [i for i in deployment.plan.instances if host in i.hosts]
    # the moves worked out first, each on what the earlier ones leave: an instance with no room elsewhere is stopped
    # without a replacement, and refused (before anything changes) where it is its role's last
    inventory, running, replaced = deployment.inventory, list(deployment.plan.instances), {}
    for inst in moving:
        rest = [i for i in running if i.name != inst.name]
        try:
            grown = placement.replan(spec, inventory, running, cordoned, **{inst.role: 1})
            running, replaced[inst.name] = [i for i in grown.instances if i.name != inst.name], True
        except SpecError:
            if not placement.counts_of(rest)[inst.role]:
                raise SpecError("drain", f"{inst.name} is the last {inst.role} instance and no other host has "
                                f"{inst.tp * inst.dp} free devices for it", "add a host, or stop the deployment for "
                                "the maintenance (`yrpd down`)") from None
            running, replaced[inst.name] = rest, False
    # a drain run again after stopping half-way keeps the counts from before the first run
    before = session.state.get("drained_counts", {}).get(host) or {"prefill": spec.prefill, "decode": spec.decode}
    session.set_state(drained=cordoned, drained_counts={**session.state.get("drained_counts", {}), host: before})
    session.journal(event="drain host", host=host)
    # what is wanted: every instance off the cordoned hosts, one fewer of a role for each that has no room elsewhere
    fewer = placement.counts_of([i for i in moving if not replaced[i.name]])
    left = {role: n - fewer[role] for role, n in placement.counts(deployment.plan).items()}
    wanted = spec.model_copy(update=left)
    warnings = [f"{inst.name} stopped without a replacement (no free devices elsewhere): {inst.role} runs "
                f"{left[inst.role]} instances until `yrpd undrain {host}`" for inst in moving if not replaced[inst.name]]
    session.set_state(change=f"drain {host}")  # in flight: the planner's heal leaves the deployment alone
    try:
        hands = _reconciled(deployment, Desired(wanted, tuple(cordoned), evacuate=(host,)), progress, drain_timeout_s)
    except BaseException:
        session.set_state(change=f"stopped half-way (the same command goes on with it): drain {host}")
        raise
    for warning in warnings:
        progress.message(warning)
    session.journal(event="drained host", host=host, added=hands.added, removed=hands.removed, warnings=warnings)
    session.set_state(change=None, generation=int(session.state.get("generation", 1)) + 1)
    return Changed(session, hands.added, hands.removed, time.monotonic() - started, hands.now,
                   [f"{host}: drained"], warnings)


def undrain_host(deployment: Deployment, host: str, *, progress: Progress | None = None) -> Changed:
    """Bring `host` back from maintenance: it takes instances again, and the instances its drain stopped for lack
    of room elsewhere start again (on it, most likely, being the emptiest). What moved away stays where it went."""
    progress = progress or Quiet()
    started = time.monotonic()
    _check_live(deployment, "undrain")
    session = deployment.session
    if host not in drained_hosts(session):
        raise SpecError("HOST", f"{host!r} is not drained in session {session.id} (drained: "
                        f"{', '.join(drained_hosts(session)) or 'none'})", "`yrpd status` shows the drained hosts")
    counts = session.state.get("drained_counts", {}).get(host, {})
    back = [h for h in drained_hosts(session) if h != host]
    session.journal(event="undrain host", host=host)
    spec = deployment.spec.model_copy(update={role: max(n, getattr(deployment.spec, role))
                                              for role, n in counts.items()})
    if spec == deployment.spec:
        done = Changed(session, [], [], time.monotonic() - started, deployment, [])
        session.set_state(generation=int(session.state.get("generation", 1)) + 1)
    else:
        done = change(deployment, spec, progress=progress, what="undrain", cordoned=back)
    # only once what it stopped runs again: an undrain that failed half-way is run again as it was
    session.set_state(drained=back, drained_counts={k: v for k, v in session.state.get("drained_counts", {}).items()
                                                    if k != host})
    done.lines.insert(0, f"{host}: back")
    return done


def _reloaded(deployment: Deployment) -> Deployment:
    """The deployment as its session stores it now, reached the way `deployment` reaches its hosts."""
    again = Deployment.load(deployment.session)
    again.spec = again.spec.model_copy(update={"ssh": deployment.spec.ssh})
    return again


def heal(deployment: Deployment, *, progress: Progress | None = None) -> list[str]:
    """Start again the instances that died beyond their supervisors' reach (a container gone, a host rebuilt,
    restarts given up), found on the hosts: the reconciler at what the session stores, restarts only (a change
    another command has in flight is that command's). The names started again."""
    deployment = _reloaded(deployment)
    if in_flight(deployment):
        return []
    desired = Desired(deployment.spec, tuple(drained_hosts(deployment.session)))
    return _reconciled(deployment, desired, progress or Quiet(), DRAIN_TIMEOUT_S, only=(Restart,)).restarted


def in_flight(deployment: Deployment) -> str | None:
    """What another command is doing to the deployment, or left half-way (a change, a join, an instance not
    serving): the reason heal leaves it alone, else None."""
    session = deployment.session
    if session.phase is not SessionPhase.deployed:
        return f"session {session.id} is {session.phase}"
    state = session.state
    if state.get("change"):
        return f"a change: {state['change']}"
    if state.get("joining"):
        return f"joining {', '.join(state['joining'])}"
    busy = {name: s for name, s in (state.get("instances") or {}).items() if s != InstanceState.serving.value}
    if busy:
        return ", ".join(f"{name} {s}" for name, s in sorted(busy.items()))
    return None


def proxy_status(url: str, window_s: float) -> dict:
    """The proxy's /yrpd/status with latency over the last `window_s` seconds, fetched from where yrpd runs."""
    with urllib.request.urlopen(f"{url}/yrpd/status?window={window_s:g}", timeout=10) as resp:
        return json.load(resp)


def run_planner(deployment: Deployment, *, seconds: float | None = None, progress: Progress | None = None,
                fetch: Callable[[str, float], dict] = proxy_status, sleep: Callable[[float], None] = time.sleep,
                clock: Callable[[], float] = time.monotonic) -> list[planner.Decision]:
    """Hold the spec's `planner:` targets (yrpd/planner.py) until interrupted, or for `seconds`: every `interval_s`
    read the proxy's latency over the window, decide, and carry a change out with `change` (new instances serve
    before routing reaches them, removed ones drain first). Every decision goes to the session's state (`yrpd
    status` shows the last) and each change or new reason to its journal. Returns the decisions taken."""
    progress = progress or Quiet()
    _check_live(deployment, "planner")
    settings = deployment.spec.planner
    if settings is None:
        raise SpecError("planner", f"session {deployment.session.id}'s spec sets no planner targets",
                        "add `planner: {ttft_p90_ms: 2000}` (and bounds) to the spec and deploy it (it rolls nothing)")
    session = deployment.session
    url = proxy_url(deployment.spec, deployment.plan)
    started = last_change = clock()
    last_change -= settings.cooldown_s  # the first look may act
    decisions: list[planner.Decision] = []
    said = None
    while seconds is None or clock() - started < seconds:
        try:
            seen = planner.Observed.from_status(fetch(url, settings.window_s)["latency"])
        except (OSError, ValueError, KeyError) as exc:
            decision = planner.Decision(planner.Action.hold, None, f"the proxy's status could not be read: {exc}")
        else:
            # what runs now, as stored: another command (scale, drain, a rolling deploy) may have changed it
            deployment = _reloaded(deployment)
            cordoned = drained_hosts(session)

            def fits(counts: dict[str, int]) -> bool:
                now = placement.counts(deployment.plan)
                try:
                    placement.replan(deployment.spec, deployment.inventory, deployment.plan.instances, cordoned,
                                     **{role: counts[role] - now[role] for role in counts})
                except SpecError:
                    return False
                return True

            decision = planner.decide(settings, seen, placement.counts(deployment.plan), fits, clock() - last_change)
        session.set_state(planner={**decision.to_dict(), "at": time.strftime("%Y-%m-%dT%H:%M:%S")})
        # a hold is journaled when its reason changes, not when only its figures do
        kind = re.sub(r"\d+(\.\d+)?", "#", decision.reason)
        if decision.action is not planner.Action.hold or kind != said:
            session.journal(event="planner", **decision.to_dict())
            said = kind
        decisions.append(decision)
        if decision.action is not planner.Action.hold:
            progress.message(f"planner: {decision.action.value} {decision.role}: {decision.reason}")
            target = decision.counts(placement.counts(deployment.plan))
            spec = DeploySpec.model_validate({**deployment.spec.model_dump(mode="json"), **target}).check()
            deployment = change(deployment, spec, progress=progress, what="planner").deployment
            last_change = clock()
        else:
            try:
                heal(deployment, progress=progress)
            except Exception as exc:  # noqa: BLE001 - the loop goes on; the next look tries again
                progress.message(f"planner: starting again what died failed: {str(exc).splitlines()[0]}")
                session.journal(event="heal failed", why=str(exc).splitlines()[0])
        sleep(settings.interval_s)
    return decisions


def describe_change(changes: list[Change], plan: Plan, spec: DeploySpec, max_unavailable: int) -> list[str]:
    """What a deploy of `spec` does to the running `plan`, line by line (shown before it acts, and by `yrpd plan`)."""
    lines = [c.line() for c in changes]
    for c in changes:
        if c.kind is ChangeKind.join:
            added = c.new[len(c.old):]
            lines.append(f"join {', '.join(added)}: {'its' if len(added) == 1 else 'their'} data system worker joins "
                         "the cluster, nothing that runs restarts")
    replaced = placement.stale(plan, spec)
    if replaced:
        how = ("start each new instance, then drain and stop the old one" if max_unavailable == 0 else
               f"drain and stop up to {max_unavailable} old instance(s) at a time, then start their replacements")
        lines.append(f"replace {', '.join(i.name for i in replaced)} one by one ({how})")
    now = placement.counts(plan)
    for role in COUNT_FIELDS:
        target = getattr(spec, role)
        if target != now[role]:
            lines.append(f"{role}: {now[role]} -> {target} instances")
    return lines
