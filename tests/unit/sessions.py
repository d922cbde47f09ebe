"""A recorded deployment for unit tests: a session directory with its spec and plan, two CPU hosts h1 and h2, prefill
on h1 and decode on h2, and host answers in the shape the host scripts print."""

from __future__ import annotations

from pathlib import Path

from yrpd.deployment import Deployment, inventory_from_json, save_deployment
from yrpd.placement import make_plan
from yrpd.session import SessionPhase, SessionStore
from yrpd.spec import build_spec

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


def processes_answer(host: str, names: list[str], dead: tuple[str, ...] = ()) -> dict:
    return {"host": {"hostname": host, "session_dir_exists": True, "load": [0.5, 0.4, 0.3],
                     "mem_available_gb": 12.0},
            "processes": [{"name": n, "pid": 100 + i, "alive": n not in dead, "rss_mb": 512.0 if n not in dead else None,
                           "command": f"vllm serve ({n})" if n not in dead else None} for i, n in enumerate(names)],
            "session_pids": [100 + i for i, n in enumerate(names) if n not in dead], "other_pids": []}


def cluster_answer(master: bool, restarts: int = 0) -> dict:
    names = ["etcd", "ds_master", "ds_worker"] if master else ["ds_worker"]
    return {"present": True, "mode": "ds_only",
            "components": {n: {"state": "RUNNING", "pid": 200 + i, "alive": True,
                               "restarts": restarts if n == "ds_worker" else 0} for i, n in enumerate(names)},
            "ports": {"ds_worker": True, **({"etcd_client": True, "ds_master": True} if master else {})}}


def instance_probe(name: str, healthy: bool = True, loaded: int = 0) -> dict:
    return {"name": name, "healthy": healthy, "requests_running": 0.0, "requests_waiting": 0.0,
            "prompt_tokens": 300.0, "external_cache_hit_tokens": float(loaded), "external_cache_query_tokens": 300.0,
            "prompt_tokens_computed": 300.0 - loaded, "prompt_tokens_local_cache": 0.0,
            "prompt_tokens_loaded": float(loaded),
            "connector": {"ds_healthy": True, "counters": {"loaded_blocks": loaded // 128, "saved_blocks": 2}},
            **({} if healthy else {"error": "connection refused"})}
