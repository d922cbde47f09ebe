"""Collect a deployment's status from every host in parallel into one JSON-able report."""

from __future__ import annotations

import json

from yrpd.deployment import Deployment
from yrpd.hostgroup import Command
from yrpd.serving import PROXY_NAME, instance_url, proxy_url
from yrpd.steps import cluster, host_python, processes


def _serving_probe(ctx, host) -> Command:
    instances = [{"name": i.name, "url": instance_url(ctx.plan, i)} for i in ctx.plan.instances if i.host == host.name]
    proxy = {"url": proxy_url(ctx.spec, ctx.plan)} if host.name == ctx.plan.proxy_host and ctx.spec.disaggregated else None
    return host_python("serving_status.py", {**ctx.layout.for_scripts(), "instances": instances, "proxy": proxy},
                       timeout=20)


def _query(ctx, host, with_cluster: bool) -> Command:
    """One round trip per host: its processes, the cluster's health when the deploy started one, and what its
    instances and proxy answer."""
    parts = [processes.status(ctx, host)]
    if with_cluster:
        parts.append(cluster.status(ctx, host))
    parts.append(_serving_probe(ctx, host))
    return Command("\n".join(p.script for p in parts), timeout=sum(p.timeout for p in parts))


def cluster_started(deployment: Deployment) -> bool:
    return any(e.get("run") in ("cluster.start_master", "cluster.start_agent") and e.get("outcome") in ("done", "skipped")
               for e in deployment.session.journal_entries())


def collect_status(deployment: Deployment) -> dict:
    ctx = deployment.context()
    by_name = {h.name: h for h in deployment.plan.hosts}
    with_cluster = cluster_started(deployment)
    with deployment.group() as group:
        results = group.run(lambda host: _query(ctx, by_name[host.name], with_cluster))
    phase = deployment.session.phase
    cluster_rows: list[dict] = []
    problems: list[str] = []
    if phase != "deployed":
        problems.append(f"session is {phase}" + (" (run yrpd deploy to resume)" if phase in ("failed", "deploying") else ""))
    hosts, procs = [], []
    serving: dict[str, dict] = {}
    proxy_probe: dict | None = None
    for plan_host in deployment.plan.hosts:
        result = results[plan_host.name]
        entry = {"name": plan_host.name, "address": plan_host.address, "role": "master" if plan_host.is_master else "worker",
                 "reachable": result.reachable, "healthy": False}
        if not result.reachable:
            entry["error"] = result.error
            problems.append(f"{plan_host.name} unreachable")
        elif not result.ok:
            entry["error"] = result.tail()
            problems.append(f"{plan_host.name}: status query failed")
        else:
            lines = [line for line in result.stdout.strip().splitlines() if line.startswith("{")]
            data = json.loads(lines[0])
            if with_cluster:
                cluster_rows.extend(_cluster_rows(plan_host, json.loads(lines[1]), phase, problems))
            probes = json.loads(lines[-1])
            serving.update({p["name"]: p for p in probes["instances"]})
            if probes["proxy"] is not None:
                proxy_probe = probes["proxy"]
            entry["facts"] = data["host"]
            entry["session_pids"] = len(data["session_pids"])
            for proc in data["processes"]:
                procs.append({"host": plan_host.name, **proc})
                if not proc["alive"] and phase != "down":
                    problems.append(f"{proc['name']} on {plan_host.name} is not running")
            if phase == "deployed" and not data["host"]["session_dir_exists"]:
                problems.append(f"{plan_host.name}: session directory missing")
            entry["healthy"] = all(p["alive"] for p in data["processes"])
        hosts.append(entry)
    live = {(p["host"], p["name"]): p for p in procs}
    instances = [_instance_row(deployment, inst, live.get((inst.host, inst.name)), serving.get(inst.name), phase, problems)
                 for inst in deployment.plan.instances]
    proxy = _proxy_row(deployment, live.get((deployment.plan.proxy_host, PROXY_NAME)), proxy_probe, phase, problems)
    master = next(h for h in deployment.plan.hosts if h.is_master)
    cluster_report = None
    if with_cluster:
        modes = sorted({r["mode"] for r in cluster_rows if r.get("mode")})
        cluster_report = {
            "mode": modes[0] if len(modes) == 1 else ",".join(modes) or None,
            "master": f"{master.name} ({master.ip})",
            "etcd": f"{master.ip}:{deployment.spec.ports.etcd}",
            "healthy": all(r["healthy"] for r in cluster_rows) and bool(cluster_rows),
            "components": cluster_rows,
        }
    return {
        "session": deployment.session.id,
        "phase": phase,
        "healthy": not problems,
        "problems": problems,
        "hosts": hosts,
        "processes": procs,
        "instances": instances,
        "proxy": proxy,
        "cluster": cluster_report,
    }


def _instance_row(deployment: Deployment, inst, proc: dict | None, probe: dict | None, phase: str,
                  problems: list[str]) -> dict:
    state = "not deployed" if proc is None else ("running" if proc["alive"] else "dead")
    answered = bool(probe and probe.get("healthy"))
    row = {
        "name": inst.name, "role": inst.role, "host": inst.host, "devices": list(inst.devices), "tp": inst.tp,
        "dp": inst.dp, "port": inst.port, "url": instance_url(deployment.plan, inst),
        "pid": proc["pid"] if proc else None, "state": state, "healthy": state == "running" and answered,
    }
    if probe:
        for key in ("requests_running", "requests_waiting", "prompt_tokens", "external_cache_hit_tokens",
                    "external_cache_query_tokens", "prompt_tokens_computed", "prompt_tokens_local_cache",
                    "prompt_tokens_loaded"):
            row[key] = probe.get(key)
        counters = probe["connector"]["counters"]
        row["connector"] = {"ds_healthy": probe["connector"]["ds_healthy"], **counters}
        if counters.get("handoff_refused"):
            problems.append(f"{inst.name} refused {int(counters['handoff_refused'])} KV hand-over(s) computed with "
                            f"another dtype or model (`yrpd logs {inst.name}` says which)")
        if probe.get("error"):
            row["error"] = probe["error"]
    if phase == "deployed" and state == "running" and not answered:
        problems.append(f"{inst.name} on {inst.host} does not answer /health"
                        + (f" ({probe['error']})" if probe and probe.get("error") else ""))
    return row


def _proxy_row(deployment: Deployment, proc: dict | None, probe: dict | None, phase: str, problems: list[str]) -> dict | None:
    if proc is None and probe is None:
        return None
    state = "not deployed" if proc is None else ("running" if proc["alive"] else "dead")
    row = {"url": proxy_url(deployment.spec, deployment.plan), "host": deployment.plan.proxy_host,
           "pid": proc["pid"] if proc else None, "state": state,
           "healthy": state == "running" and bool(probe and probe.get("healthy"))}
    detail = (probe or {}).get("status") or {}
    if detail:
        row["instances_up"] = {i["url"]: i["up"] for i in detail.get("instances", [])}
        row["in_flight"] = sum(i.get("in_flight", 0) for i in detail.get("instances", []))
    if phase == "deployed" and state == "running" and not row["healthy"]:
        problems.append(f"proxy at {row['url']} is not healthy" + (f" ({probe['error']})" if probe and probe.get("error") else ""))
    return row


def _cluster_rows(host, snap: dict, phase: str, problems: list[str]) -> list[dict]:
    """One row per openYuanrong component on the host, judged healthy only if running, alive, never
    restarted and its ports listen (yr health alone says RUNNING through crash loops)."""
    rows = []
    port_state = {name: up for name, up in snap.get("ports", {}).items()}
    if not snap.get("present"):
        if phase == "deployed":
            problems.append(f"openYuanrong is not running on {host.name}")
        return [{"host": host.name, "component": "-", "state": "absent", "pid": None, "restarts": None,
                 "ports": {}, "mode": snap.get("mode"), "healthy": False}]
    for name, comp in snap["components"].items():
        ports = {p: up for p, up in port_state.items() if p.startswith(name) or (name == "etcd" and p.startswith("etcd"))}
        healthy = comp["state"] == "RUNNING" and comp["alive"] and comp["restarts"] == 0 and all(ports.values())
        if not healthy and phase == "deployed":
            why = ("restarted %d time(s)" % comp["restarts"]) if comp["restarts"] else comp["state"].lower()
            if not comp["alive"]:
                why = "exited"
            elif not all(ports.values()):
                why = "port not listening: " + ", ".join(p for p, up in ports.items() if not up)
            problems.append(f"{name} on {host.name} {why}")
        rows.append({"host": host.name, "component": name, "state": comp["state"], "pid": comp["pid"],
                     "restarts": comp["restarts"], "alive": comp["alive"], "ports": ports,
                     "mode": snap.get("mode"), "healthy": healthy})
    return rows
