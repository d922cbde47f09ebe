"""Collect a deployment's status from every host in parallel into one JSON-able report."""

from __future__ import annotations

import json

from yrpd.deployment import Deployment
from yrpd.steps import processes


def collect_status(deployment: Deployment) -> dict:
    ctx = deployment.context()
    by_name = {h.name: h for h in deployment.plan.hosts}
    with deployment.group() as group:
        results = group.run(lambda host: processes.status(ctx, by_name[host.name]))
    phase = deployment.session.phase
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
            data = json.loads(result.stdout.strip().splitlines()[-1])
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
    return {
        "session": deployment.session.id,
        "phase": phase,
        "healthy": not problems,
        "problems": problems,
        "hosts": hosts,
        "processes": procs,
        "instances": instances,
    }
