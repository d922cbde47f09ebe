"""A deployment's status, collected from every host in parallel into one `StatusReport`.

The report is what `yrpd status` renders (yrpd.render.status_tables) and what `yrpd status --json` prints
(`StatusReport.to_json()`); the JSON schema is documented in docs/architecture.md. Each host answers one JSON
object (its processes, its openYuanrong components when a cluster was started, what its instances and proxy
answer); the judging is done here, in pure functions of those answers (`judge`), unit-tested without hosts.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

from yrpd.deployment import Deployment
from yrpd.hostgroup import CONTAINER_DOWN, Command, HostResult
from yrpd.placement import HostPlan, InstancePlan
from yrpd.serving import PROXY_NAME, instance_launches, instance_url, proxy_url
from yrpd.session import SessionPhase
from yrpd.spec import DeploySpec
from yrpd.steps import (
    ScriptCall,
    StepContext,
    cluster,
    host_python_parts,
    processes,
    resolve,
)
from yrpd.steps.vllm_env import paths as vllm_paths
from yrpd.tags import ComponentState, Condition, InstanceState, ProcessState

#: what an instance's probe reports, copied as is (vLLM's metrics, summed over its ranks)
PROBE_FIELDS = ("requests_running", "requests_waiting", "prompt_tokens", "external_cache_hit_tokens",
                "external_cache_query_tokens", "prompt_tokens_computed", "prompt_tokens_local_cache",
                "prompt_tokens_loaded")


@dataclass
class HostStatus:
    name: str
    address: str
    role: str  # master | worker
    reachable: bool
    healthy: bool = False
    error: str | None = None
    facts: dict[str, Any] | None = None  # hostname, load, memory, whether the session directory exists
    session_pids: int | None = None  # processes carrying the session's marker


@dataclass
class ProcessStatus:
    """A process yrpd started, as its supervisor (deploy_scripts/supervise.py) sees it."""

    host: str
    name: str
    pid: int | None  # the process itself (not its supervisor)
    alive: bool
    rss_mb: float | None = None
    command: str | None = None
    supervisor: int | None = None  # None: nothing watches it (not started, stopped, or given up)
    state: str = ProcessState.dead  # a ProcessState value (yrpd.tags)
    restarts: int = 0
    reason: str | None = None  # why it last ended
    last_log: list[str] | None = None  # the last lines its command logged, while it is not running

    @property
    def condition(self) -> Condition:
        """What `yrpd status` shows."""
        if self.alive:
            return Condition.running
        if self.supervisor is not None and self.state in (ProcessState.backoff, ProcessState.starting,
                                                          ProcessState.running):
            return Condition.restarting
        return Condition.failed if self.state == ProcessState.failed else Condition.dead


@dataclass
class ComponentStatus:
    """One openYuanrong component on one host; healthy when running, alive and its ports listen (`yr health` alone
    says RUNNING through crash loops); `restarts` counts what openYuanrong's daemon brought back."""

    host: str
    component: str
    state: str
    pid: int | None
    restarts: int | None
    ports: dict[str, bool]
    mode: str | None
    healthy: bool
    alive: bool = False
    cache: dict[str, Any] | None = None  # ds_worker only: its resource.log line (hostlib.ds_resource), or {"error": ...}
    #: ds_worker only: what the proxy's index of the data system says the worker holds (yrpd.proxy.kvindex
    #: Store.state's entry for its host: blocks, on_disk where a disk tier is behind it, sight), None where not followed
    indexed: dict[str, Any] | None = None


@dataclass
class ClusterStatus:
    mode: str | None
    master: str
    etcd: str
    healthy: bool
    components: list[ComponentStatus]


@dataclass
class InstanceStatus:
    name: str
    role: str
    host: str
    devices: list[int]
    tp: int
    dp: int
    port: int
    url: str
    pid: int | None
    state: str  # running | restarting | failed | dead | not deployed
    healthy: bool
    restarts: int = 0  # by its supervisor; information, not illness
    probe: dict[str, float | None] = field(default_factory=dict)  # PROBE_FIELDS, when the instance was probed
    connector: dict[str, Any] | None = None  # ds_healthy and the connector's counters
    #: the proxy's view of it: requests sent there, in flight now, errors, prefix_routed (yrpd.proxy.pool.Instance)
    routed: dict[str, Any] | None = None
    #: every host its DP ranks run on, the head (`host`) first
    hosts: list[str] = field(default_factory=list)
    error: str | None = None
    #: where a change has it (InstanceState, as the session keeps it): serving, or starting, draining, stopping and
    #: failed while a change runs or after it stopped half-way
    life: str = InstanceState.serving.value


@dataclass
class ProxyStatus:
    url: str
    host: str
    pid: int | None
    state: str
    healthy: bool
    restarts: int = 0
    instances_up: dict[str, bool] | None = None
    in_flight: int | None = None
    #: PD degraded, as the proxy says: {"since": epoch s, "missing": [role], "message": ...}; None while PD serves
    degraded: dict | None = None
    #: requests whose instance broke off, by what the proxy did (yrpd.proxy.metrics.MIGRATION_OUTCOMES)
    migrations: dict[str, int] | None = None
    #: how it routes, as it says: the policy, and prefix routing's measures (yrpd.proxy.pool.Pool.routing_state)
    routing: dict | None = None
    #: what it sees of the data system's holdings, from the workers' own KV events (yrpd.proxy.kvindex.Store.state),
    #: where it follows the caches' events
    store_index: dict | None = None


@dataclass
class StatusReport:
    session: str
    phase: SessionPhase
    healthy: bool
    problems: list[str]
    hosts: list[HostStatus]
    processes: list[ProcessStatus]
    instances: list[InstanceStatus]
    proxy: ProxyStatus | None
    cluster: ClusterStatus | None
    #: what serves but costs time or cache, with its fix; does not make the deployment unhealthy
    warnings: list[str] = field(default_factory=list)
    #: 1 as deployed, one more for each change of the running deployment (`yrpd scale`, a rolling change, a drain)
    generation: int = 1
    #: a change of the running deployment under way (or stopped half-way: the same command goes on with it)
    change: str | None = None
    #: hosts in maintenance (`yrpd drain HOST`): they take no instance
    drained: list[str] = field(default_factory=list)
    #: the SLA planner's last decision (`yrpd planner`): action, role, reason, at
    planner: dict | None = None

    def to_json(self) -> dict:
        """`yrpd status --json`: the report's fields; an instance's probe fields sit on the instance itself and
        optional fields that have no value are left out."""
        def clean(obj: Any) -> Any:
            if isinstance(obj, InstanceStatus):
                data = {k: clean(v) for k, v in dataclasses.asdict(obj).items()
                        if k != "probe" and (v is not None or k not in ("error", "connector", "routed"))}
                data.update(obj.probe)  # what the probe got, nulls included, only when it was probed
                return data
            if dataclasses.is_dataclass(obj):
                data = {f.name: clean(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
                optional = {"error", "facts", "session_pids", "instances_up", "in_flight"}
                return {k: v for k, v in data.items() if v is not None or k not in optional}
            if isinstance(obj, list):
                return [clean(v) for v in obj]
            if isinstance(obj, SessionPhase):
                return obj.value
            return obj

        return clean(self)


# -- collecting --------------------------------------------------------------------------------------

def _serving_call(ctx: StepContext, host: HostPlan) -> ScriptCall:
    instances = [{"name": i.name, "url": instance_url(ctx.plan, i)} for i in ctx.plan.instances if i.host == host.name]
    proxy = {"url": proxy_url(ctx.spec, ctx.plan)} if host.name == ctx.plan.proxy_host and ctx.spec.disaggregated else None
    return ScriptCall("serving_status.py", {**ctx.layout.for_scripts(), "instances": instances, "proxy": proxy},
                      timeout=20)


def query(ctx: StepContext, host: HostPlan, with_cluster: bool) -> Command:
    """One round trip and one interpreter per host, answering one JSON object: {"processes": .., "serving": ..,
    "cluster": .. (only when asked)}, each a host script's JSON line; a part that fails is named on stderr."""
    parts = {"processes": processes.status_call(ctx, host), "serving": _serving_call(ctx, host)}
    if with_cluster:
        parts["cluster"] = cluster.status_call(ctx, host)
    return host_python_parts(parts)


def parse_answer(stdout: str) -> dict:
    """The host's JSON object (the last line that is one)."""
    line = next(line for line in reversed(stdout.strip().splitlines()) if line.startswith("{"))
    return json.loads(line)


def cluster_started(deployment: Deployment) -> bool:
    starts = (cluster.start_master, cluster.start_agent)
    return any(_runs(e.get("run"), starts) and e.get("outcome") in ("done", "skipped")
               for e in deployment.session.journal_entries())


def _runs(ref: str | None, functions: tuple) -> bool:
    try:
        return ref is not None and resolve(ref) in functions
    except (ValueError, ImportError):
        return False


def collect_status(deployment: Deployment) -> StatusReport:
    ctx = deployment.context()
    by_name = {h.name: h for h in deployment.plan.hosts}
    with_cluster = cluster_started(deployment)
    with deployment.group() as group:
        results = group.run(lambda host: query(ctx, by_name[host.name], with_cluster))
    return judge(deployment, dict(results), with_cluster)


def dead_instances(deployment: Deployment, group) -> frozenset[str]:
    """The plan's instances of which a process (its API server, or a headless engine where its DP ranks span hosts)
    neither runs nor is being restarted: its supervisor gave up (restart's bound), or went with it (a container
    gone, a host rebuilt). What the reconciler of a live change or the planner starts again; `group` reaches the
    plan's hosts as its steps do. A host that does not answer says nothing (nothing could be started there either);
    one whose container is not running answers that nothing of the session runs there."""
    ctx = deployment.context()
    by_name = {h.name: h for h in deployment.plan.hosts}
    results = group.run(lambda host: host_python_parts({"processes": processes.status_call(ctx, by_name[host.name])}))
    paths = vllm_paths(ctx)
    launches = {i.name: [(launch.host, launch.name) for launch in instance_launches(deployment.spec,
                                                                                     deployment.plan, i, paths)]
                for i in deployment.plan.instances}
    return dead_in(launches, dict(results))


def dead_in(launches: dict[str, list[tuple[str, str]]], results: dict[str, HostResult]) -> frozenset[str]:
    """dead_instances from each host's answer (pure); `launches`: each instance's processes as (host, name)."""
    seen: dict[tuple[str, str], ProcessStatus] = {}
    answered = set()
    for host, result in results.items():
        if result.exit_code == CONTAINER_DOWN and "is not running on" in result.stdout + result.stderr:
            answered.add(host)  # its container is gone or stopped: nothing of the session runs there
            continue
        if not result.ok:
            continue
        try:
            own = parse_answer(result.stdout)["processes"]
        except (StopIteration, ValueError, KeyError, TypeError):
            continue
        answered.add(host)
        for proc in own["processes"]:
            seen[(host, proc["name"])] = ProcessStatus(host=host, **proc)
    gone = (Condition.dead, Condition.failed)
    return frozenset(name for name, procs in launches.items()
                     if any(host in answered and ((host, proc) not in seen or seen[(host, proc)].condition in gone)
                            for host, proc in procs))


# -- judging (pure) ------------------------------------------------------------------------------------

def judge(deployment: Deployment, results: dict[str, HostResult], with_cluster: bool) -> StatusReport:
    """The report from each host's answer: what is healthy, and every problem in one line."""
    phase = deployment.session.phase
    deployed = phase is SessionPhase.deployed
    problems: list[str] = []
    if not deployed:
        problems.append(f"session is {phase}" + (" (run yrpd deploy to resume)" if phase.resumable else ""))
    hosts: list[HostStatus] = []
    procs: list[ProcessStatus] = []
    components: list[ComponentStatus] = []
    serving: dict[str, dict] = {}
    proxy_probe: dict | None = None
    for plan_host in deployment.plan.hosts:
        result = results[plan_host.name]
        entry = HostStatus(plan_host.name, plan_host.address, "master" if plan_host.is_master else "worker",
                           result.reachable)
        hosts.append(entry)
        if not result.reachable:
            entry.error = result.error
            problems.append(f"{plan_host.name} unreachable")
            continue
        if not result.ok:
            entry.error = result.tail()
            problems.append(f"{plan_host.name}: status query failed ({result.tail(2) or f'exit {result.exit_code}'})")
            continue
        answer = parse_answer(result.stdout)
        own = answer["processes"]
        if with_cluster:
            components.extend(_components(plan_host, answer["cluster"], deployed, problems))
        serving.update({p["name"]: p for p in answer["serving"]["instances"]})
        if answer["serving"]["proxy"] is not None:
            proxy_probe = answer["serving"]["proxy"]
        entry.facts = own["host"]
        entry.session_pids = len(own["session_pids"])
        for proc in own["processes"]:
            p = ProcessStatus(host=plan_host.name, **proc)
            procs.append(p)
            if not p.alive and phase is not SessionPhase.down:
                problems.append(_process_problem(p, plan_host.name))
            elif p.state == ProcessState.unsupervised and phase is not SessionPhase.down:
                problems.append(f"{p.name} on {plan_host.name} runs without its supervisor (killed?): nothing restarts "
                                f"it if it dies; `yrpd deploy` puts it under a new one (restarting it)")
        if deployed and not own["host"]["session_dir_exists"]:
            problems.append(f"{plan_host.name}: session directory missing")
        entry.healthy = all(p["alive"] for p in own["processes"])
    live = {(p.host, p.name): p for p in procs}
    warnings: list[str] = [w for w in (_spill_full(deployment.spec, c) for c in components) if w]
    ds_caches = {c.host: c.cache for c in components if c.component == "ds_worker" and c.cache}
    instances = [_instance(deployment, inst, live.get((inst.host, inst.name)), serving.get(inst.name), deployed,
                           problems, warnings, ds_caches.get(inst.host)) for inst in deployment.plan.instances]
    proxy = _proxy(deployment, live.get((deployment.plan.proxy_host, PROXY_NAME)), proxy_probe, deployed, problems)
    seen_by_proxy = {i["url"]: i for i in (((proxy_probe or {}).get("status") or {}).get("instances") or [])}
    for row in instances:
        if row.url in seen_by_proxy:
            seen = seen_by_proxy[row.url]
            row.routed = {k: seen.get(k) for k in ("requests", "in_flight", "errors", "prefix_routed")}
            if "ms_per_chunk" in seen:  # prefix routing's measure of the instance (yrpd.proxy.pool)
                row.routed["ms_per_chunk"] = seen["ms_per_chunk"]
            if "kv_index" in seen:  # where the proxy follows KV-cache events (yrpd.proxy.kvfeed)
                row.routed["kv_index"] = seen["kv_index"]
            index = row.routed.get("kv_index") or {}
            if index.get("sight") == "blind":  # routed on the estimate meanwhile: not an illness, but said
                warnings.append(f"{row.name}: the proxy cannot see its prefix cache exactly ({index.get('why')}); "
                                f"routed on the estimate until its KV-cache events are back")
    indexed = ((proxy.store_index if proxy else None) or {}).get("workers", {})
    by_ip = {h.ip: h.name for h in deployment.plan.hosts}
    # keyed by the host its instances' URLs name: an address, or the name itself
    indexed_on = {by_ip.get(host, host): worker for host, worker in indexed.items()}
    for c in components:
        if c.component == "ds_worker":
            c.indexed = indexed_on.get(c.host)
    for host, worker in sorted(indexed.items()):
        if worker.get("sight") == "blind":  # loads routed on the estimate meanwhile: said, as an instance's is
            warnings.append(f"the proxy cannot see what the data system on {host} holds exactly ({worker.get('why')}); "
                            "loads from it are routed on the estimate")
    cluster_report = None
    if with_cluster:
        master = next(h for h in deployment.plan.hosts if h.is_master)
        modes = sorted({c.mode for c in components if c.mode})
        cluster_report = ClusterStatus(
            mode=modes[0] if len(modes) == 1 else ",".join(modes) or None,
            master=f"{master.name} ({master.ip})", etcd=f"{master.ip}:{deployment.spec.ports.etcd}",
            healthy=bool(components) and all(c.healthy for c in components), components=components)
    return StatusReport(session=deployment.session.id, phase=phase, healthy=not problems, problems=problems,
                        hosts=hosts, processes=procs, instances=instances, proxy=proxy, cluster=cluster_report,
                        warnings=warnings, generation=int(deployment.session.state.get("generation", 1)),
                        change=deployment.session.state.get("change"),
                        drained=list(deployment.session.state.get("drained", [])),
                        planner=deployment.session.state.get("planner"))


def _process_problem(p: ProcessStatus, host: str) -> str:
    condition = p.condition
    if condition == Condition.restarting:
        return f"{p.name} on {host} is restarting (restart {p.restarts}; {p.reason or 'it ended'})"
    if condition == Condition.failed:
        last = f"; its log ends: {p.last_log[-1]}" if p.last_log else ""
        return f"{p.name} on {host} failed: {p.reason}{last} (`yrpd logs {p.name}` shows more)"
    return f"{p.name} on {host} is not running" + (f" ({p.reason})" if p.reason else "")


def _instance(deployment: Deployment, inst: InstancePlan, proc: ProcessStatus | None, probe: dict | None,
              deployed: bool, problems: list[str], warnings: list[str],
              ds_cache: dict | None = None) -> InstanceStatus:
    """`ds_cache`: what the data system worker on the instance's host says of its memory (ComponentStatus.cache)."""
    state = "not deployed" if proc is None else proc.condition
    answered = bool(probe and probe.get("healthy"))
    row = InstanceStatus(name=inst.name, role=inst.role, host=inst.host, devices=list(inst.devices), tp=inst.tp,
                         dp=inst.dp, port=inst.port, url=instance_url(deployment.plan, inst),
                         pid=proc.pid if proc else None, state=state, healthy=state == Condition.running and answered,
                         restarts=proc.restarts if proc else 0, hosts=list(inst.hosts),
                         life=(deployment.session.state.get("instances") or {}).get(inst.name,
                                                                                    InstanceState.serving.value))
    if row.life == InstanceState.failed:
        problems.append(f"{inst.name}'s start failed in a change that stopped half-way; run the same command again "
                        "to go on with the change")
    if probe:
        row.probe = {key: probe.get(key) for key in PROBE_FIELDS}
        counters = probe["connector"]["counters"]
        row.connector = {"ds_healthy": probe["connector"]["ds_healthy"], **counters}
        if counters.get("handoff_refused"):
            problems.append(f"{inst.name} refused {int(counters['handoff_refused'])} KV hand-over(s) computed with "
                            f"another dtype or model (`yrpd logs {inst.name}` says which)")
        if counters.get("save_failed_blocks"):
            warnings.append(_save_failed(deployment, inst, int(counters["save_failed_blocks"]),
                                         int(counters.get("save_failed_memory_full_blocks") or 0), ds_cache))
        if counters.get("handoff_missed_blocks"):
            warnings.append(_handoff_missed(deployment, inst, int(counters["handoff_missed_blocks"])))
        row.error = probe.get("error")
    if deployed and state == Condition.running and not answered:
        problems.append(f"{inst.name} on {inst.host} does not answer /health"
                        + (f" ({probe['error']})" if probe and probe.get("error") else ""))
    elif deployed and answered and probe["connector"]["ds_healthy"] is False:
        # it answers, but computes every prompt: a worker that came back is served again only once the connector
        # reconnects (a few seconds after), and nothing handed over reaches it meanwhile
        problems.append(f"{inst.name}'s KV connector on {inst.host} cannot reach the data system (it computes "
                        f"every prompt meanwhile; `yrpd logs {inst.name}` says why)")
    return row


#: free space under which a disk tier's filesystem counts as full (a few KV blocks of a large model)
SPILL_FULL_BYTES = 64 << 20


def _spill_full(spec: DeploySpec, comp: ComponentStatus) -> str | None:
    """A warning when the filesystem of a worker's disk tier has less room than the worker may still spill (and
    under SPILL_FULL_BYTES): its spills fail and what would have gone there is computed again."""
    cache = comp.cache or {}
    free = cache.get("disk_free")
    if free is None or "disk_limit" not in cache:
        return None
    if free >= min(cache["disk_limit"] - cache["disk_used"], SPILL_FULL_BYTES):
        return None
    where = spec.datasystem_spill_dir or "the session directory"
    return (f"ds_worker on {comp.host}: the disk tier's filesystem ({where}) has {free >> 10} KiB free, while "
            f"datasystem_spill_mb allows {(cache['disk_limit'] - cache['disk_used']) >> 20} MB more: spills beyond it "
            f"fail and those KV blocks are computed again; free space there, or lower datasystem_spill_mb to what it "
            f"holds")


def _save_failed(deployment: Deployment, inst: InstancePlan, failed: int, full: int, cache: dict | None) -> str:
    """KV blocks the instance's connector could not put into the data system (save_failed_blocks, counted since it
    started): nothing to hand over or reuse, so they are computed again. `full` of them found its worker without room
    (save_failed_memory_full_blocks): it refused them (out of memory), or took them and evicted them within a moment,
    which a worker does when its memory is full of entries it may not evict (another client's, written in the
    client's default write mode): the new blocks are all it may evict."""
    what = f"{inst.name} failed to save {failed} KV block(s) to the data system"
    again = "decode computes those prompts again" if inst.role == "prefill" else "they are computed again"
    if not full:
        return f"{what} (it was out of reach or refused them; `yrpd logs {inst.name}` says why): {again}"
    spec = deployment.spec
    used = ""
    if cache and cache.get("memory_limit") and cache.get("memory_used") is not None:
        used = f"{cache['memory_used'] / 2**20:,.0f} of {cache['memory_limit'] / 2**20:,.0f} MB of memory in use now: "
    more = f"give it more (datasystem_memory_mb, {spec.datasystem_memory_mb} MB a host now)"
    if not spec.datasystem_spill_mb:
        more += " or a disk tier (datasystem_spill_mb)"
    return (f"{what}, {full} of them because the data system on {inst.host} had no room for them ({used}it refused "
            f"them, or took them and evicted them within a moment, as it does when its memory is full of entries it "
            f"may not evict: another client's?): {again}; free that memory or {more}")


def _handoff_missed(deployment: Deployment, inst: InstancePlan, blocks: int) -> str:
    # A data system smaller than the hand-overs in flight evicts them before decode reads them: serving goes on,
    # answers stay right, but decode computes those prompts again, which is PD's gain lost.
    spec = deployment.spec
    more = f"give the data system more memory (datasystem_memory_mb, {spec.datasystem_memory_mb} MB a host now)"
    if not spec.datasystem_spill_mb:
        more += " or a disk tier (datasystem_spill_mb)"
    return (f"{inst.name} computed {blocks} KV block(s) again that prefill had handed over (gone from the data "
            f"system before it read them: evicted, or late): {more}")


def _proxy(deployment: Deployment, proc: ProcessStatus | None, probe: dict | None, deployed: bool,
           problems: list[str]) -> ProxyStatus | None:
    if proc is None and probe is None:
        return None
    state = "not deployed" if proc is None else proc.condition
    row = ProxyStatus(url=proxy_url(deployment.spec, deployment.plan), host=deployment.plan.proxy_host,
                      pid=proc.pid if proc else None, state=state, restarts=proc.restarts if proc else 0,
                      healthy=state == Condition.running and bool(probe and probe.get("healthy")))
    detail = (probe or {}).get("status") or {}
    if detail:
        row.instances_up = {i["url"]: i["up"] for i in detail.get("instances", [])}
        row.in_flight = sum(i.get("in_flight", 0) for i in detail.get("instances", []))
        row.degraded, row.migrations = detail.get("degraded"), detail.get("migrations")
        row.routing = detail.get("routing")
        row.store_index = detail.get("kv_store_index")
        if deployed and row.degraded:
            since = time.strftime("%H:%M:%S", time.localtime(row.degraded["since"]))
            problems.append(f"serving degraded since {since} ({time.time() - row.degraded['since']:.0f} s): "
                            f"{row.degraded['message']}")
    if deployed and state == Condition.running and not row.healthy:
        problems.append(f"proxy at {row.url} is not healthy" + (f" ({probe['error']})" if probe and probe.get("error") else ""))
    return row


def _components(host: HostPlan, snap: dict, deployed: bool, problems: list[str]) -> list[ComponentStatus]:
    """One row per openYuanrong component on the host."""
    port_state = dict(snap.get("ports", {}))
    if not snap.get("present"):
        if deployed:
            problems.append(f"openYuanrong is not running on {host.name}")
        return [ComponentStatus(host=host.name, component="-", state="absent", pid=None, restarts=None, ports={},
                                mode=snap.get("mode"), healthy=False)]
    rows = []
    for name, comp in snap["components"].items():
        ports = {p: up for p, up in port_state.items() if p.startswith(name) or (name == "etcd" and p.startswith("etcd"))}
        # restarts are information (openYuanrong's daemon restarts what dies): up means running and listening
        healthy = comp["state"] == ComponentState.running and comp["alive"] and all(ports.values())
        if not healthy and deployed:
            why = comp["state"].lower()
            if not comp["alive"]:
                why = "exited"
            elif not all(ports.values()):
                why = "port not listening: " + ", ".join(p for p, up in ports.items() if not up)
            problems.append(f"{name} on {host.name} {why}")
        rows.append(ComponentStatus(host=host.name, component=name, state=comp["state"], pid=comp["pid"],
                                    restarts=comp["restarts"], ports=ports, mode=snap.get("mode"), healthy=healthy,
                                    alive=comp["alive"], cache=snap.get("cache") if name == "ds_worker" else None))
    return rows
