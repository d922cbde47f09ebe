"""yrpd/status.py: one query per host, judged into a StatusReport (scripted hosts: no sshd, no root)."""

from __future__ import annotations

import json
import subprocess

from yrpd import api
from yrpd.hostgroup import Command
from yrpd.session import SessionPhase
from yrpd.status import query
from yrpd.testing import ScriptedHosts

from tests.unit.sessions import cluster_answer, instance_probe, processes_answer, recorded


def answer(host: str, dead=(), restarts=0, unhealthy=(), proxy_ok=True, cluster=True) -> str:
    names = {"h1": ["prefill-0", "proxy"], "h2": ["decode-0"]}[host]
    instance = {"h1": "prefill-0", "h2": "decode-0"}[host]
    serving = {"instances": [instance_probe(instance, healthy=instance not in unhealthy,
                                            loaded=256 if instance == "decode-0" else 0)],
               "proxy": None}
    if host == "h1":
        serving["proxy"] = {"healthy": proxy_ok, "status": {"instances": [
            {"url": "http://10.0.0.1:8100", "up": True, "in_flight": 1},
            {"url": "http://10.0.0.2:8200", "up": proxy_ok, "in_flight": 0}]}}
    return json.dumps({"processes": processes_answer(host, names, dead),
                       "cluster": cluster_answer(host == "h1", restarts) if cluster else None, "serving": serving})


def scripted(**faults) -> ScriptedHosts:
    hosts = ScriptedHosts()
    for host in ("h1", "h2"):
        hosts.on("serving_status", stdout=answer(host, **faults.get(host, {})), host=host)
    return hosts


def test_a_healthy_deployment_reports_every_part(tmp_path):
    deployment = recorded(tmp_path)
    with scripted() as hosts:
        report = api.status(deployment)
    assert report.healthy and report.problems == []
    assert report.phase is SessionPhase.deployed
    assert [(h.name, h.role, h.healthy, h.session_pids) for h in report.hosts] == \
        [("h1", "master", True, 2), ("h2", "worker", True, 1)]
    decode = next(i for i in report.instances if i.role == "decode")
    assert (decode.host, decode.state, decode.healthy, decode.probe["prompt_tokens_loaded"]) == ("h2", "running", True, 256)
    assert report.proxy.healthy and report.proxy.in_flight == 1 and report.proxy.instances_up["http://10.0.0.2:8200"]
    assert report.cluster.healthy and report.cluster.mode == "ds_only" and report.cluster.master == "h1 (10.0.0.1)"
    assert {c.component for c in report.cluster.components} == {"etcd", "ds_master", "ds_worker"}
    # one round trip per host, and the cluster asked because the journal says it was started
    assert len(hosts.calls) == 2 and all(hosts.ran(h, "yr_cluster") for h in ("h1", "h2"))


def test_json_is_the_report_with_probe_fields_on_the_instance(tmp_path):
    with scripted():
        data = api.status(recorded(tmp_path)).to_json()
    assert data["phase"] == "deployed" and data["healthy"] is True
    decode = next(i for i in data["instances"] if i["name"] == "decode-0")
    assert decode["prompt_tokens_loaded"] == 256 and decode["connector"]["loaded_blocks"] == 2
    assert "probe" not in decode and "error" not in decode
    assert "error" not in data["hosts"][0] and data["hosts"][0]["facts"]["hostname"] == "h1"
    json.dumps(data)  # serialisable as is


def test_a_dead_instance_an_unanswering_one_and_an_unreachable_host_are_each_one_problem(tmp_path):
    deployment = recorded(tmp_path)
    with scripted(h1={"dead": ("prefill-0",), "proxy_ok": False}) as hosts:
        hosts.unreachable("h2")
        report = api.status(deployment)
    assert not report.healthy
    assert "prefill-0 on h1 is not running" in report.problems
    assert "h2 unreachable" in report.problems
    assert any(p.startswith("proxy at ") and "not healthy" in p for p in report.problems)
    prefill = next(i for i in report.instances if i.name == "prefill-0")
    assert prefill.state == "dead" and not prefill.healthy
    decode = next(i for i in report.instances if i.name == "decode-0")
    assert decode.state == "not deployed"  # nothing known about h2
    assert report.hosts[1].error and not report.hosts[1].reachable


def test_a_restarting_cluster_component_is_unhealthy_though_yr_says_running(tmp_path):
    with scripted(h2={"restarts": 3}):
        report = api.status(recorded(tmp_path))
    assert "ds_worker on h2 restarted 3 time(s)" in report.problems
    assert not report.cluster.healthy


def test_an_instance_that_does_not_answer(tmp_path):
    with scripted(h2={"unhealthy": ("decode-0",)}):
        report = api.status(recorded(tmp_path))
    assert report.problems == ["decode-0 on h2 does not answer /health (connection refused)"]


def test_a_failed_session_says_how_to_resume_and_a_down_one_expects_nothing(tmp_path):
    with scripted():
        failed = api.status(recorded(tmp_path / "a", SessionPhase.failed))
    assert failed.problems[0] == "session is failed (run yrpd deploy to resume)"
    with scripted(h1={"dead": ("prefill-0", "proxy")}, h2={"dead": ("decode-0",)}):
        down = api.status(recorded(tmp_path / "b", SessionPhase.down))
    assert down.problems == ["session is down"]  # dead processes are what down means


def test_without_a_started_cluster_it_is_not_asked(tmp_path):
    with scripted(h1={"cluster": False}, h2={"cluster": False}) as hosts:
        report = api.status(recorded(tmp_path, cluster_started=False))
    assert report.cluster is None and report.healthy
    assert not hosts.ran("h1", "yr_cluster")


def test_query_joins_the_parts_into_one_object_and_names_a_failed_part(monkeypatch):
    """The shell that runs on the host (bash here): each part's last JSON line, keyed; a failing part fails it."""
    from yrpd import status

    parts = {"processes": "echo starting; echo '{\"a\": 1}'", "cluster": "echo '{\"c\": 2}'",
             "serving": "echo '{\"s\": 3}'"}
    monkeypatch.setattr(status.processes, "status", lambda ctx, host: Command(parts["processes"], timeout=1))
    monkeypatch.setattr(status.cluster, "status", lambda ctx, host: Command(parts["cluster"], timeout=1))
    monkeypatch.setattr(status, "_serving_probe", lambda ctx, host: Command(parts["serving"], timeout=1))

    def run(with_cluster: bool) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", query(None, None, with_cluster).script], capture_output=True, text=True)

    assert json.loads(run(True).stdout) == {"processes": {"a": 1}, "cluster": {"c": 2}, "serving": {"s": 3}}
    assert json.loads(run(False).stdout)["cluster"] is None
    parts["serving"] = "echo '{\"s\": 3}'; exit 4"
    failed = run(False)
    assert failed.returncode == 1 and "the serving part failed" in failed.stderr
