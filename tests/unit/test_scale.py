"""`yrpd scale` (yrpd.api.scale) against scripted hosts: what it asks the hosts, in which order, and what the session
keeps. The lab test (tests/lab/test_scale_lab.py) runs it for real under load."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from yrpd import api
from yrpd.deployment import Deployment, inventory_from_json, save_deployment
from yrpd.errors import YrpdError
from yrpd.placement import make_plan
from yrpd.session import Session, SessionPhase, SessionStore
from yrpd.spec import build_spec
from yrpd.testing import ScriptedHosts

IPS = {"h1": "10.0.0.1", "h2": "10.0.0.2"}
MEMBERS = r"proxy-members\.json"


def one_p_two_d(tmp_path: Path) -> Deployment:
    spec = build_spec({}, {"hosts": "h1,h2", "devices": "0-3", "device_kind": "cpu", "model": "/models/m",
                           "dtype": "float32", "decode": 2, "session_root": str(tmp_path / "sessions")})
    inventory = inventory_from_json({h: {"kind": "cpu", "devices": [0, 1, 2, 3], "ip": ip} for h, ip in IPS.items()})
    session = SessionStore(tmp_path / "sessions").create()
    plan = make_plan(spec, inventory)
    save_deployment(session, spec, inventory, plan)
    session.set_state(SessionPhase.deployed)
    return Deployment(session, spec, inventory, plan)


def membership_written(command) -> dict:
    """The JSON a membership write puts in the file (its printf argument)."""
    return json.loads(re.search(r"printf '%s\\n' '(.*?)' >", command.script, re.S).group(1))


def scripted(drain_exit: int = 0) -> ScriptedHosts:
    hosts = ScriptedHosts()
    hosts.on(MEMBERS)
    hosts.on(r"deploy_scripts/proxy_drain\.py", exit_code=drain_exit,
             stdout=json.dumps({"drained": drain_exit == 0, "in_flight": {}, "seconds": 0.1}),
             stderr="" if drain_exit == 0 else "not drained after 120 s: still in flight on http://10.0.0.2:8101 (1)")
    hosts.on(r"deploy_scripts/session_processes\.py", stdout=json.dumps({"stopped": ["decode-1"]}))
    return hosts


def test_scaling_in_drains_the_instance_through_the_proxy_before_it_stops_it_and_keeps_the_new_plan(tmp_path):
    deployment = one_p_two_d(tmp_path)
    gone = deployment.plan.instance("decode-1")
    with scripted() as hosts:
        done = api.scale(deployment, decode=1)
    assert done.removed == ["decode-1"] and done.added == []
    calls = [(name, cmd) for name, cmd in hosts.calls]
    kinds = [("write" if re.search(MEMBERS, c.script) else "drain" if "proxy_drain.py" in c.script
              else "stop" if "session_processes.py" in c.script else "?", name) for name, c in calls]
    assert kinds == [("write", "h1"), ("drain", "h1"), ("write", "h1"), ("stop", gone.host)]
    first, second = (membership_written(c) for _, c in calls if re.search(MEMBERS, c.script))
    assert {i["name"]: i["draining"] for i in first["instances"]} == {"prefill-0": False, "decode-0": False,
                                                                      "decode-1": True}
    assert [i["name"] for i in second["instances"]] == ["prefill-0", "decode-0"]
    drain = json.loads(shlex.split(next(c for _, c in calls if "proxy_drain.py" in c.script).display)[-1])
    assert drain["urls"] == [f"http://{IPS[gone.host]}:{gone.port}"]
    stop = json.loads(shlex.split(next(c for _, c in calls if "session_processes.py" in c.script).display)[-1])
    assert stop["names"] == ["decode-1"] and stop["action"] == "stop"
    again = Deployment.load(Session(deployment.session.path))
    assert again.spec.decode == 1 and [i.name for i in again.plan.instances] == ["prefill-0", "decode-0"]
    events = [e["event"] for e in deployment.session.journal_entries() if "event" in e]
    assert events == ["change", "drain", "stopped", "changed"]
    assert Session(deployment.session.path).state["generation"] == 2


def test_an_instance_that_does_not_drain_in_time_is_put_back_and_nothing_is_stopped(tmp_path):
    deployment = one_p_two_d(tmp_path)
    with scripted(drain_exit=1) as hosts:
        with pytest.raises(YrpdError, match="not drained after 120 s.*\\n.*nothing was stopped"):
            api.scale(deployment, decode=1)
    assert not hosts.ran("h2", r"session_processes\.py") and not hosts.ran("h1", r"session_processes\.py")
    last = membership_written([c for _, c in hosts.calls if re.search(MEMBERS, c.script)][-1])
    assert not any(i["draining"] for i in last["instances"]) and len(last["instances"]) == 3  # back in routing
    assert Deployment.load(Session(deployment.session.path)).spec.decode == 2


def test_scale_refuses_what_it_cannot_do_before_touching_a_host(tmp_path):
    deployment = one_p_two_d(tmp_path)
    with ScriptedHosts() as hosts:
        with pytest.raises(YrpdError, match="scale: nothing to change"):
            api.scale(deployment)
        deployment.session.set_state(SessionPhase.down)
        with pytest.raises(YrpdError, match="is down; deploy it first"):
            api.scale(deployment, decode=1)
    assert hosts.calls == []


def test_hosts_added_by_scale_join_the_cluster_first_and_take_the_added_instance(tmp_path):
    """`yrpd scale --hosts NEW --decode 3`: the deploy playbook runs on every host (those that run skip what runs), so
    the new one joins the cluster; then the added decode instance is placed on the one host with free devices."""
    deployment = one_p_two_d(tmp_path)  # h1 and h2: 4 cores each, 3 instances
    new = "127.0.0.3"  # resolves to itself: the address the other hosts use
    hosts = scripted()
    hosts.default_exit = 0  # every step's check passes: the hosts run it already ...
    hosts.on(r'"action": "wait", .*"timeout": 0}', exit_code=1, host=new)  # ... but the new one runs no cluster yet
    with hosts:
        done = api.scale(deployment, decode=3, hosts=[new])
    assert done.added == ["decode-2"] and done.removed == []
    assert done.deployment.plan.instance("decode-2").host == new
    assert {"hosts: ['h1', 'h2'] -> ['h1', 'h2', '127.0.0.3'] (join)", "decode: 2 -> 3 (scale)",
            "join 127.0.0.3: its data system worker joins the cluster, nothing that runs restarts"} <= set(done.lines)
    # its data system worker started, joined to the master's etcd, and the cache was checked across hosts with it
    assert hosts.ran(new, r"datasystem_worker\W+ --worker_address=127\.0\.0\.3:\d+ --etcd_address=10\.0\.0\.1:")
    assert not hosts.ran("h1", r"datasystem_worker\W+ --worker_address") and \
        not hosts.ran("h2", r"datasystem_worker\W+ --worker_address")  # the running ones were skipped
    assert hosts.ran(new, r"ds_kv_check\.py")
    assert not any(hosts.ran(h, r"\"action\": \"stop\"") for h in ("h1", "h2"))  # nothing that ran was stopped
    again = Deployment.load(Session(deployment.session.path))
    assert [h.name for h in again.spec.hosts] == ["h1", "h2", new] and again.spec.decode == 3
    assert again.inventory[new].ip == new and Session(deployment.session.path).state.get("joining") is None
    starts = [e for e in deployment.session.journal_entries() if e.get("event") == "start"]
    assert [(e["instances"], e.get("hosts")) for e in starts] == [([], [new]), (["decode-2"], None)]


def test_a_join_stopped_half_way_is_finished_by_the_same_command(tmp_path):
    deployment = one_p_two_d(tmp_path)
    new = "127.0.0.3"
    broken = scripted()
    broken.on(r"ds_kv_check\.py", exit_code=1, stderr="cannot reach 10.0.0.1:31501", host=new)
    broken.default_exit = 0
    with broken:
        with pytest.raises(YrpdError, match="127.0.0.3"):
            api.scale(deployment, hosts=[new])
    stopped = Deployment.load(Session(deployment.session.path))
    assert [h.name for h in stopped.spec.hosts] == ["h1", "h2", new]  # stored: `yrpd down` knows the host
    assert Session(deployment.session.path).state["joining"] == [new]
    fixed = scripted()
    fixed.default_exit = 0
    with fixed:
        done = api.scale(stopped, hosts=[new])  # the host is in the spec now: only the unfinished join goes on
    assert done.lines == [f"join {new}: stopped half-way, it goes on"]
    assert fixed.ran(new, r"ds_kv_check\.py") and Session(deployment.session.path).state["joining"] is None
    with ScriptedHosts() as untouched:  # the control: once joined, the same command has nothing to do
        quiet = api.scale(Deployment.load(Session(deployment.session.path)), hosts=[new])
    assert untouched.calls == [] and quiet.lines == [] and quiet.added == []
