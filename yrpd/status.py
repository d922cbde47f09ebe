"""Collect a deployment's status from every host in parallel into one JSON-able report."""

from __future__ import annotations

import json

from yrpd.deployment import Deployment
from yrpd.hostgroup import Command
from yrpd.steps import cluster, processes


def _query(ctx, host, with_cluster: bool) -> Command:
    """One round trip per host: its processes, and the cluster's health when the deploy started one."""
    parts = [processes.status(ctx, host)]
    if with_cluster:
        parts.append(cluster.status(ctx, host))
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
    instances = []
    for inst in deployment.plan.instances:
        proc = live.get((inst.host, inst.name))
        state = "not deployed" if proc is None else ("running" if proc["alive"] else "dead")
        instances.append({
            "name": inst.name, "role": inst.role, "host": inst.host, "devices": list(inst.devices),
            "port": inst.port, "state": state, "healthy": state == "running",
        })
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
        "cluster": cluster_report,
    }


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
