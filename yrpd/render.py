"""Tables and text shown to the user (rich renderables); no logic beyond presentation."""

from __future__ import annotations

from typing import Iterable

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from yrpd.placement import describe_devices, unit_name
from yrpd.playbook import PlannedStep
from yrpd.spec import ClusterLauncher, Dtype, KvConnector, MultiNodeBackend, Runtime
from yrpd.status import StatusReport
from yrpd.steps import NotNeeded, StepContext
from yrpd.tags import Condition, InstanceState, ProcessState
from yrpd.wheels import WheelSet
from yrpd.exposure import Guard, PortAccess


def plan_view(view) -> list:
    """What `yrpd plan` and `yrpd deploy --dry-run` show of an api.PlanView: what a deploy would change in the running
    session, the placement, who may reach each port, and each step's command on each host."""
    changes = [Text(line) for line in view.changes] + ([Text("")] if view.changes else [])
    return [*changes, *plan_table(view.ctx, view.ports, view.brought), Text(""), *plan_commands(view.steps)]


def plan_table(ctx: StepContext, access: list[PortAccess], brought: list[WheelSet]) -> list:
    """The placement, the hosts, how the deployment runs there (dtype, runtime, the wheels `brought` to them) and
    who may reach each port (`access`)."""
    spec, plan = ctx.spec, ctx.plan
    kinds = {h.kind for h in plan.hosts}
    units = unit_name(kinds.pop()) if len(kinds) == 1 else "devices"
    def shape(role: str) -> str:
        tp, dp = spec.parallelism(role)
        pp = spec.pipeline(role)
        return f"dp {dp}, tp {tp}" + (f", pp {pp}" if pp > 1 else "")

    summary = Text(f"Placement: {spec.prefill} prefill x ({shape('prefill')}), {spec.decode} decode x "
                   f"({shape('decode')}); proxy on {plan.proxy_host}:{plan.proxy_port}", style="bold")
    table = Table()
    for column in ("host", "instance", "role", units, "http port", "coordination port", "hccl ports"):
        table.add_column(column)
    for inst in plan.instances:
        first = 0  # an instance spanning hosts: its global ranks on each host, in host order
        for host in inst.hosts:
            devices = tuple(d for r in inst.ranks if r.host == host for d in r.devices)
            ranks = [r.dp_rank for r in inst.ranks if r.host == host]
            head = host == inst.host
            if inst.split:
                name = f"{inst.name} (ranks {first}-{first + inst.node_ranks - 1}{', head' if head else ''})"
                first += inst.node_ranks
            else:
                name = inst.name if inst.dp == 1 else f"{inst.name} (dp {','.join(map(str, ranks))})"
            table.add_row(
                host, name, inst.role, describe_devices(devices),
                str(inst.port) if head else "-", str(inst.kv_port) if head and inst.spans_hosts else "-",
                f"{inst.hccl_port}-{inst.hccl_port + 15}" if head else "-",
            )
    hosts = Table()
    for column in ("host", "address", "role", "kind", units, "in use", "service ports"):
        hosts.add_column(column)
    for h in plan.hosts:
        hosts.add_row(h.name, h.address, "master" if h.is_master else "worker", h.kind.value,
                      describe_devices(h.devices), describe_devices(h.used),
                      ", ".join(f"{k} {v}" for k, v in h.ports.items()))
    how = f"{plan.dtype.reason}; --dtype overrides" if spec.dtype is Dtype.auto else "set with --dtype"
    lines = [summary, Text(f"dtype: {plan.dtype.shown} - {how}")]
    for inst in plan.instances:
        if inst.split:
            nics = ", ".join(f"{h.name} {h.nic or 'not detected yet'}" for h in plan.hosts if h.name in inst.hosts)
            how_run = ("a Ray cluster of its own (head on its first host), vllm serve --distributed-executor-backend "
                       "ray there" if spec.multi_node(plan.host(inst.host).kind) is MultiNodeBackend.ray else
                       "vLLM's multi-node launcher (--nnodes, --headless on all but its first host)")
            lines.append(Text(f"{inst.name} spans {', '.join(inst.hosts)} (tp {inst.tp} x pp {inst.pp}): {how_run}; "
                              f"its ranks talk over {nics}; one dead process restarts all of them"))
    spill = (f", then {spec.datasystem_spill_mb} MB on disk ({spec.datasystem_spill_dir or 'in the session directory'})"
             if spec.datasystem_spill_mb else "; full memory evicts the oldest KV (no disk tier)")
    lines.append(Text(f"KV cache in the data system: {spec.datasystem_memory_mb} MB shared memory per host{spill}"))
    if spec.kv_connector is KvConnector.ascend_store:
        lines.append(Text("KV connector: ascend-store, vllm-ascend's AscendStoreConnector (backend yuanrong) keeps KV "
                          "in the data system" + (", its MooncakeConnectorV1 hands it from prefill to decode"
                                                  if spec.disaggregated else "")))
    if spec.runtime is Runtime.docker:
        lines.append(Text(f"runtime: docker, one container of {spec.image} per host (the default on NPU hosts; "
                          "--runtime host runs the processes on the hosts)"))
        profile = ctx.profile
        cluster_py, cluster_version = profile.cluster_interpreter
        if spec.launcher is ClusterLauncher.dscli:
            cluster = (f"the data system (launcher dscli, no yr CLI) in the venv {spec.env_root}/ds made from "
                       f"{cluster_py} (Python {cluster_version}), etcd's static binary in {spec.env_root}/etcd")
        else:
            cluster = (f"openYuanrong venvs {spec.env_root}/{{yr,ds}} (launcher yr) made from {cluster_py} "
                       f"(Python {cluster_version})")
        lines.append(Text(f"containers ({profile.name}, vllm-ascend {profile.vllm_ascend or 'unknown'}): instances "
                          f"and proxy run the image's {profile.python} (Python {profile.python_version}); {cluster}"))
        for ws in brought:
            lines.append(Text(f"  wheels fetched here and copied to the hosts: {' '.join(ws.requirements)} for "
                              f"cp{ws.python_version.replace('.', '')} {ws.arch}{'' if ws.deps else ' (no dependencies)'}"
                              + (f", also from {', '.join(ws.find_links)}" if ws.find_links else "")
                              + f" - {ws.purpose}"))
    else:
        lines.append(Text("runtime: host, the processes run on the hosts (NPU hosts default to docker with the "
                          "vllm-ascend image; --runtime docker --image IMAGE elsewhere)"))
    ports = Table(title="Who may reach each port", title_justify="left")
    for column in ("host", "port", "what", "listens on", "needed by", "a caller must present"):
        ports.add_column(column)
    for row in access:
        guard = f"[red]{row.guard.value}[/red]" if row.guard is Guard.nothing else row.guard.value
        ports.add_row(row.host, row.port, row.what, row.listens_on, row.callers, guard)
    return [*lines, table, Text("Hosts", style="bold"), hosts, ports]


def outcome_line(outcome) -> str:
    """One step's progress line, after it ran: where it was done, already done, not needed (and why), failed."""
    parts = []
    ok = [h for h in outcome.ran if outcome.results[h].ok]
    if ok:
        parts.append(f"done on {', '.join(ok)}")
    if outcome.skipped:
        parts.append(f"already done on {', '.join(outcome.skipped)}")
    for reason in sorted(set(outcome.not_needed.values())):
        hosts = sorted(h for h, r in outcome.not_needed.items() if r == reason)
        parts.append(f"not needed on {', '.join(hosts)}: {reason}")
    failed = sorted(outcome.results.failed)
    if failed:
        parts.append(f"[red]failed on {', '.join(failed)}[/red]")
    return f"{'; '.join(parts) or 'nothing to do'} ({outcome.seconds:.1f}s)"


def warning_lines(outcome) -> list[str]:
    """What a step that succeeded still wants the user to know: its hosts' `warning: ...` lines on stderr."""
    return [f"{host}: {line.strip()}" for host in outcome.ran if outcome.results[host].ok
            for line in (outcome.results[host].stderr or "").splitlines() if line.strip().startswith("warning: ")]


def plan_commands(steps: list[PlannedStep]) -> Iterable:
    yield Text("Commands per host, in order (deploy runs each step on its hosts in parallel; "
               "SESSION_ID is assigned at deploy):", style="bold")
    for number, planned in enumerate(steps, 1):
        commands = planned.actions
        yield Text(f"\n[{number}] {planned.step.name}", style="bold")
        if not commands:
            yield Text("    (nothing to do on any host)")
        for host, command in commands.items():
            if isinstance(command, NotNeeded):
                yield Text(f"  {host}: {command}")
                continue
            yield Text(f"  {host}:")
            for line in str(command).splitlines():
                yield Text(f"    $ {line}" if line else "")


def yes_no(value: bool | None, good: str = "yes", bad: str = "no") -> str:
    if value is None:
        return "[dim]-[/dim]"
    return f"[green]{good}[/green]" if value else f"[red]{bad}[/red]"


def status_tables(report: StatusReport) -> list[Table | Text]:
    changed = f", generation {report.generation}" if report.generation > 1 else ""
    hosts = Table(title=f"Hosts (session {report.session}, {report.phase}{changed})", title_justify="left")
    for column in ("host", "role", "reachable", "load", "mem avail GB", "session dir", "processes"):
        hosts.add_column(column)
    for h in report.hosts:
        facts = h.facts or {}
        procs = [p for p in report.processes if p.host == h.name]
        alive = sum(1 for p in procs if p.alive)
        hosts.add_row(
            h.name, h.role,
            yes_no(h.reachable) if h.reachable else f"[red]no[/red]: {escape(h.error or '')}",
            " ".join(f"{x:.2f}" for x in facts.get("load", [])) or "-",
            str(facts.get("mem_available_gb", "-")),
            yes_no(facts.get("session_dir_exists"), "present", "missing") if h.reachable else "-",
            f"{alive}/{len(procs)} running" if procs else "-",
        )
    tables = [hosts]
    if report.processes:
        procs = Table(title="Processes", title_justify="left")
        for column in ("host", "name", "pid", "state", "restarts", "rss MB"):
            procs.add_column(column)
        for p in report.processes:
            state = yes_no(p.alive, "running", p.condition) if p.condition != Condition.restarting else "[yellow]restarting[/yellow]"
            if p.state == ProcessState.unsupervised:
                state = "[yellow]unsupervised[/yellow]"
            procs.add_row(p.host, p.name, str(p.pid or "-"), state, str(p.restarts), str(p.rss_mb or "-"))
        tables.append(procs)
    cluster = report.cluster
    if cluster:
        table = Table(title=f"openYuanrong cluster ({cluster.mode} mode, master {cluster.master}, "
                            f"etcd {cluster.etcd})", title_justify="left")
        for column in ("host", "component", "pid", "state", "restarts", "ports"):
            table.add_column(column)
        for row in cluster.components:
            gone = row.state != "absent" and not row.alive
            state = yes_no(row.healthy, row.state.lower(), "exited" if gone else row.state.lower())
            ports = ", ".join(f"{p} {'up' if up else '[red]down[/red]'}" for p, up in row.ports.items()) or "-"
            table.add_row(row.host, row.component, str(row.pid or "-"), state,
                          str(row.restarts) if row.restarts is not None else "-", ports)
        tables.append(table)
        caches = [row for row in cluster.components if row.cache]
        if caches:
            cache = Table(title="KV cache (data system workers; memory, then disk)", title_justify="left")
            # the proxy's own picture of each worker beside the worker's counters: a gap says routing's view is off
            followed = any(row.indexed for row in caches)
            for column in ("host", "memory MB", "disk MB", "objects", "hits memory/disk/remote", "misses",
                           *(["proxy's index: blocks (on disk)"] if followed else [])):
                cache.add_column(column)
            for row in caches:
                c = row.cache
                index = [_indexed(row.indexed)] if followed else []
                if "error" in c:
                    cache.add_row(row.host, f"[red]{escape(c['error'])}[/red]", "", "", "", "", *index)
                    continue
                mb = (lambda used, limit: f"{used / 2**20:,.0f} / {limit / 2**20:,.0f}" if limit else "-")
                cache.add_row(row.host, mb(c["memory_used"], c["memory_limit"]), mb(c["disk_used"], c["disk_limit"]),
                              str(c["objects"]), f"{c['hits_memory']}/{c['hits_disk']}/{c['hits_remote']}",
                              str(c["misses"]), *index)
            tables.append(cache)
    if report.instances:
        inst = Table(title="Instances", title_justify="left")
        for column in ("instance", "role", "host", "devices", "port", "pid", "health", "restarts", "running/waiting",
                       "via proxy (prefix)", "KV blocks loaded", "KV blocks saved", "external hit tokens"):
            inst.add_column(column)
        for i in report.instances:
            if i.state == Condition.running:
                health = yes_no(i.healthy, "healthy", "no answer")
            elif i.state == Condition.restarting:
                health = "[yellow]restarting[/yellow]"
            else:
                health = f"[red]{i.state}[/red]" if i.state in (Condition.dead, Condition.failed) else f"[dim]{i.state}[/dim]"
            if i.life != InstanceState.serving:  # a change has it starting, draining, stopping, or its start failed
                health += f" [yellow]({i.life})[/yellow]"
            conn = i.connector or {}
            running = i.probe.get("requests_running")
            load = f"{_num(running)}/{_num(i.probe.get('requests_waiting'))}" if running is not None else "-"
            routed = f"{_num(i.routed.get('requests'))} ({_num(i.routed.get('prefix_routed'))})" if i.routed else "-"
            saved = _num(conn.get("saved_blocks"))
            if conn.get("save_failed_blocks"):  # the data system refused or dropped them (a warning says why)
                saved += f" [yellow]({_num(conn['save_failed_blocks'])} failed)[/yellow]"
            inst.add_row(i.name, i.role, "+".join(i.hosts) or i.host, describe_devices(i.devices), str(i.port),
                         str(i.pid or "-"), health, str(i.restarts), load, routed, _num(conn.get("loaded_blocks")),
                         saved, _num(i.probe.get("external_cache_hit_tokens")))
        tables.append(inst)
    proxy = report.proxy
    if proxy:
        table = Table(title="Proxy", title_justify="left")
        for column in ("url", "host", "pid", "health", "in flight", "instances up", "carried over"):
            table.add_column(column)
        up = proxy.instances_up or {}
        health = yes_no(proxy.healthy, "healthy", proxy.state if proxy.state != "running" else "unhealthy")
        if proxy.degraded:
            health = f"[yellow]degraded: no {' or '.join(proxy.degraded['missing'])}[/yellow]"
        moved = proxy.migrations or {}
        table.add_row(proxy.url, proxy.host, str(proxy.pid or "-"), health, _num(proxy.in_flight),
                      f"{sum(up.values())}/{len(up)}" if up else "-",
                      _num(moved.get("carried over", 0) + moved.get("sent again", 0)) if proxy.migrations is not None
                      else "-")
        tables.append(table)
    tables.extend(_log_tails(report))
    return tables


def _log_tails(report: StatusReport) -> list[Text]:
    """What a failed or ended process last logged, so the cause is on screen without `yrpd logs`."""
    out = []
    for p in report.processes:
        if not p.alive and p.last_log and p.condition in (Condition.failed, Condition.dead):
            out.append(Text(f"{p.name} on {p.host} ({p.condition}), last lines of its log:", style="bold"))
            out.extend(Text(f"  {line}", style="dim") for line in p.last_log)
    return out


#: what `yrpd status --watch` shows per second between two looks: (column, where on InstanceStatus, key)
RATE_COLUMNS = (("requests/s", "routed", "requests"), ("prompt tok/s", "probe", "prompt_tokens"),
                ("computed tok/s", "probe", "prompt_tokens_computed"), ("loaded tok/s", "probe", "prompt_tokens_loaded"),
                ("errors/s", "routed", "errors"))


def rates_table(before: StatusReport, now: StatusReport, seconds: float) -> Table:
    """Per instance, how fast its counters grew between two reports `seconds` apart ("-" where either look lacks
    it, or it went back: the instance restarted)."""
    table = Table(title=f"Rates over the last {seconds:.1f} s", title_justify="left")
    for column in ("instance", *(c for c, _, _ in RATE_COLUMNS)):
        table.add_column(column, justify="left" if column == "instance" else "right")
    earlier = {i.name: i for i in before.instances}
    for inst in now.instances:
        cells = []
        for _, where, key in RATE_COLUMNS:
            a = (getattr(earlier.get(inst.name), where, None) or {}).get(key) if inst.name in earlier else None
            b = (getattr(inst, where) or {}).get(key)
            cells.append(f"{(b - a) / seconds:.1f}" if a is not None and b is not None and b >= a and seconds > 0
                         else "-")
        table.add_row(inst.name, *cells)
    return table


def status_verdict(report: StatusReport) -> str:
    verdict = "[green]healthy[/green]" if report.healthy else "[red]unhealthy[/red]: " + "; ".join(report.problems)
    notes = [f"[yellow]changing[/yellow]: {escape(report.change)}"] if report.change else []
    notes += [f"[yellow]drained[/yellow] (maintenance, no instances; `yrpd undrain HOST`): {', '.join(report.drained)}"
              ] if report.drained else []
    if report.planner:
        p = report.planner
        notes.append(escape(f"planner ({p.get('at')}): {p.get('action')}{' ' + p['role'] if p.get('role') else ''}: "
                            f"{p.get('reason')}"))
    return "\n".join([verdict, *notes, *(f"[yellow]warning[/yellow]: {w}" for w in report.warnings)])


def _indexed(worker: dict | None) -> str:
    """The proxy's count of a worker's blocks, those it infers spilled in brackets where a disk tier is behind it."""
    if not worker:
        return "-"
    if worker.get("sight") == "never":  # nothing heard from it yet: the count says nothing
        return "[dim]no events yet[/dim]"
    shown = f"{worker.get('blocks', 0):,}" + (f" ({worker['on_disk']:,})" if "on_disk" in worker else "")
    return f"[yellow]blind[/yellow], {shown}" if worker.get("sight") == "blind" else shown


def _num(value) -> str:
    if value is None:
        return "-"
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"
