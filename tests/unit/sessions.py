"""A recorded deployment for unit tests: a session directory with its spec and plan, two CPU hosts h1 and h2, prefill
on h1 and decode on h2, and host answers in the shape the host scripts print (`scripted()` plays both hosts
answering `yrpd status`'s query)."""

from __future__ import annotations

import json
from pathlib import Path

from yrpd.deployment import Deployment, inventory_from_json, save_deployment
from yrpd.placement import make_plan
from yrpd.session import SessionPhase, SessionStore
from yrpd.spec import build_spec
from yrpd.testing import ScriptedHosts

IPS = {"h1": "10.0.0.1", "h2": "10.0.0.2"}


def recorded(tmp_path: Path, phase: SessionPhase = SessionPhase.deployed, cluster_started: bool = True) -> Deployment:
    spec = build_spec({}, {"hosts": "h1,h2", "devices": "0-3", "device_kind": "cpu", "model": "/models/m",
                           "dtype": "float32", "session_root": str(tmp_path / "sessions")})
    inventory = inventory_from_json({h: {"kind": "cpu", "devices": [0, 1, 2, 3], "ip": ip} for h, ip in IPS.items()})
    plan = make_plan(spec, inventory)
    session = SessionStore(tmp_path / "sessions").create()
    save_deployment(session, spec, inventory, plan)
    session.set_state(phase)
    if cluster_started:
        for step, host in (("cluster.start_master", "h1"), ("cluster.start_agent", "h2")):
            session.journal(step="start", run=step, host=host, outcome="done")
    return Deployment(session, spec, inventory, plan)


def processes_answer(host: str, names: list[str], dead: tuple[str, ...] = (), restarting: tuple[str, ...] = (),
                     failed: tuple[str, ...] = (), restarts: int = 0) -> dict:
    """What deploy_scripts/session_processes.py answers: each process as its supervisor sees it."""
    def entry(i: int, n: str) -> dict:
        up = n not in dead + restarting + failed
        state = "running" if up else "backoff" if n in restarting else "failed" if n in failed else "dead"
        reason = {"backoff": "killed by signal 9", "failed": "exited with status 1 after 3 restarts in 600 s; "
                  "not restarting it again (`yrpd deploy` starts it anew once the cause is fixed)"}.get(state)
        return {"name": n, "pid": 100 + i if up else None, "alive": up, "rss_mb": 512.0 if up else None,
                "command": f"vllm serve ({n})" if up else None,
                "supervisor": 90 + i if state in ("running", "backoff") else None, "state": state,
                "restarts": restarts + (1 if n in restarting else 0) + (3 if n in failed else 0), "reason": reason,
                "last_log": None if up else ["Traceback (most recent call last):",
                                             f"OSError: {n}: no model at /models/x"]}

    return {"host": {"hostname": host, "session_dir_exists": True, "load": [0.5, 0.4, 0.3],
                     "mem_available_gb": 12.0},
            "processes": [entry(i, n) for i, n in enumerate(names)],
            "session_pids": [100 + i for i, n in enumerate(names) if n not in dead + failed], "other_pids": []}


def cluster_answer(master: bool, restarts: int = 0, disk_free: int | None = None) -> dict:
    names = ["etcd", "ds_master", "ds_worker"] if master else ["ds_worker"]
    return {"present": True, "mode": "ds_only",
            "components": {n: {"state": "RUNNING", "pid": 200 + i, "alive": True,
                               "restarts": restarts if n == "ds_worker" else 0} for i, n in enumerate(names)},
            "ports": {"ds_worker": True, **({"etcd_client": True, "ds_master": True} if master else {})},
            # as deploy_scripts/yr_cluster.py reads the worker's resource.log (a 256 MiB worker with 1 GiB of disk)
            "cache": {"at": "2026-11-23T15:59:31", "memory_used": 200 << 20 if master else 10 << 20,
                      "memory_limit": 256 << 20, "disk_used": 300 << 20 if master else 0, "disk_limit": 1 << 30,
                      "objects": 42, "hits_memory": 7, "hits_disk": 3, "hits_remote": 1, "misses": 2,
                      **({} if disk_free is None else {"disk_free": disk_free})}}


def instance_probe(name: str, healthy: bool = True, loaded: int = 0, missed: int = 0,
                   ds_healthy: bool = True) -> dict:
    return {"name": name, "healthy": healthy, "requests_running": 0.0, "requests_waiting": 0.0,
            "prompt_tokens": 300.0, "external_cache_hit_tokens": float(loaded), "external_cache_query_tokens": 300.0,
            "prompt_tokens_computed": 300.0 - loaded, "prompt_tokens_local_cache": 0.0,
            "prompt_tokens_loaded": float(loaded),
            "connector": {"ds_healthy": ds_healthy, "counters": {"loaded_blocks": loaded // 128, "saved_blocks": 2,
                                                            "handoff_missed_blocks": missed}},
            **({} if healthy else {"error": "connection refused"})}


def answer(host: str, dead=(), restarts=0, unhealthy=(), proxy_ok=True, cluster=True, restarting=(), failed=(),
           process_restarts=0, missed=0, disk_free=None, ds_unreached=(), degraded=None, kv_index=None) -> str:
    """What `recorded()`'s host answers to the status query (yrpd.status.query), with the faults asked for:
    `dead` processes, ds_worker `restarts`, instances whose /health does not answer, a proxy that sees decode down,
    processes their supervisor is `restarting` or has given up on (`failed`), earlier `process_restarts`, KV blocks
    prefill handed over that the host's instance `missed` in the data system, the bytes free (`disk_free`) on the
    filesystem of its worker's disk tier, instances whose connector reports the data system out of reach
    (`ds_unreached`), the proxy's word that PD is `degraded` ({"since", "missing", "message"}), its KV index's state of
    prefill-0 (`kv_index`, yrpd.proxy.kvfeed.Feeds.state)."""
    names = {"h1": ["prefill-0", "proxy"], "h2": ["decode-0"]}[host]
    instance = {"h1": "prefill-0", "h2": "decode-0"}[host]
    serving = {"instances": [instance_probe(instance, healthy=instance not in unhealthy,
                                            loaded=256 if instance == "decode-0" else 0, missed=missed,
                                            ds_healthy=instance not in ds_unreached)],
               "proxy": None}
    if host == "h1":
        serving["proxy"] = {"healthy": proxy_ok, "status": {"instances": [
            {"url": "http://10.0.0.1:8100", "up": True, "in_flight": 1, "requests": 7, "prefix_routed": 3,
             "ms_per_chunk": 28.4,
             **({"kv_index": kv_index} if kv_index else {})},
            {"url": "http://10.0.0.2:8100", "up": proxy_ok, "in_flight": 0, "requests": 6, "prefix_routed": 0}],
            "degraded": degraded, "migrations": {"sent again": 1, "carried over": 2, "ended by the proxy": 0,
                                                 "not carried over": 0},
            "routing": {"policy": "prefix", "bound": 2, "load_ms_per_chunk": 6.5}}}
    return json.dumps({"processes": processes_answer(host, names, dead, restarting, failed, process_restarts),
                       "cluster": cluster_answer(host == "h1", restarts, disk_free) if cluster else None, "serving": serving})


def scripted(**faults) -> ScriptedHosts:
    """Hosts h1 and h2 answering the status query; `faults` per host name are `answer()`'s keyword arguments."""
    hosts = ScriptedHosts()
    for host in ("h1", "h2"):
        hosts.on("serving_status", stdout=answer(host, **faults.get(host, {})), host=host)
    return hosts
