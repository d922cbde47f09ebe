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

from tests.unit.sessions import processes_answer

IPS = {"h1": "10.0.0.1", "h2": "10.0.0.2"}
MEMBERS = r"proxy-members\.json"
#: the reconciler's look at the hosts' processes (yrpd.status.dead_instances: one interpreter for the query's parts)
LOOK = r'"action": "status"'


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


def scripted(deployment: Deployment, drain_exit: int = 0, dead=lambda host: ()) -> ScriptedHosts:
    """Hosts whose membership writes, drains and stops succeed, and where every instance the session stores runs
    but those `dead(host)` names (gone with their supervisors) at each look."""
    hosts = ScriptedHosts()

    def look(host, _):
        plan = Deployment.load(Session(deployment.session.path)).plan
        names = [i.name for i in plan.instances if i.host == host]
        return json.dumps({"processes": processes_answer(host, names, dead=tuple(dead(host)))}), "", 0

    hosts.on(LOOK, answer=look)
    hosts.on(MEMBERS)
    hosts.on(r"deploy_scripts/proxy_drain\.py", exit_code=drain_exit,
             stdout=json.dumps({"drained": drain_exit == 0, "in_flight": {}, "seconds": 0.1}),
             stderr="" if drain_exit == 0 else "not drained after 120 s: still in flight on http://10.0.0.2:8101 (1)")
    hosts.on(r"deploy_scripts/session_processes\.py", stdout=json.dumps({"stopped": ["decode-1"]}))
    return hosts


def test_scaling_in_drains_the_instance_through_the_proxy_before_it_stops_it_and_keeps_the_new_plan(tmp_path):
    deployment = one_p_two_d(tmp_path)
    gone = deployment.plan.instance("decode-1")
    with scripted(deployment) as hosts:
        done = api.scale(deployment, decode=1)
    assert done.removed == ["decode-1"] and done.added == []
    calls = [(name, cmd) for name, cmd in hosts.calls]
    kinds = [("look" if re.search(LOOK, c.script) else "write" if re.search(MEMBERS, c.script)
              else "drain" if "proxy_drain.py" in c.script else "stop" if "session_processes.py" in c.script else "?",
              name) for name, c in calls]
    # the reconciler looks at both hosts' processes before its step and after it (nothing found dead)
    looks = [("look", "h1"), ("look", "h2")]
    assert sorted(kinds[:2]) == looks and sorted(kinds[-2:]) == looks
    assert kinds[2:-2] == [("write", "h1"), ("drain", "h1"), ("write", "h1"), ("stop", gone.host)]
    calls = [(name, c) for name, c in calls if not re.search(LOOK, c.script)]
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


def test_an_instance_found_dead_on_its_host_starts_again_before_anything_drains(tmp_path):
    """decode-0 gone with its supervisor (as when its container went): the reconciler's look at the hosts finds it,
    starts it again where it was, and only then drains decode-1. The test above is the control: all running, no
    start."""
    deployment = one_p_two_d(tmp_path)
    looks = {"h1": 0, "h2": 0}

    def dead(host):
        looks[host] += 1
        return ("decode-0",) if host == "h2" and looks[host] == 1 else ()  # until the restart

    hosts = scripted(deployment, dead=dead)
    hosts.default_exit = 0  # every step's check passes: what the playbook starts runs
    with hosts:
        done = api.scale(deployment, decode=1)
    assert done.removed == ["decode-1"]
    events = [(e["event"], e.get("again") or e.get("instances")) for e in deployment.session.journal_entries()
              if e.get("event") in ("found dead", "start", "drain", "stopped")]
    assert events == [("found dead", ["decode-0"]), ("start", ["decode-0"]), ("drain", ["decode-1"]),
                      ("stopped", ["decode-1"])]
    assert Session(deployment.session.path).state["instances"] == {"decode-0": "serving"}


def test_an_instance_that_dies_again_after_its_restart_stops_the_change_naming_it_before_anything_drains(tmp_path):
    deployment = one_p_two_d(tmp_path)
    hosts = scripted(deployment, dead=lambda host: ("decode-0",))  # at every look
    hosts.default_exit = 0
    with hosts, pytest.raises(YrpdError, match=r"^decode-0 died again after this command started it again; nothing "
                                                r"drained since\. `yrpd logs decode-0` says why"):
        api.scale(deployment, decode=1)
    events = [e["event"] for e in deployment.session.journal_entries() if "event" in e]
    assert events == ["change", "found dead", "start"]  # once started again, then stopped: no drain
    assert not any("proxy_drain.py" in c.script for _, c in hosts.calls)


def test_heal_starts_again_only_what_died_beyond_its_supervisor_and_changes_nothing_else(tmp_path):
    """The planner's pass at each look (yrpd.live.heal): decode-1 gone is started again, nothing drains; the
    control, every process running, runs no step at all."""
    from yrpd import live

    deployment = one_p_two_d(tmp_path)
    with scripted(deployment) as calm:
        assert live.heal(deployment) == []
    # it looked at both hosts' processes, and did nothing
    assert sorted(name for name, c in calm.calls if re.search(LOOK, c.script)) == ["h1", "h2"] == \
        sorted(name for name, _ in calm.calls)
    host = deployment.plan.instance("decode-1").host
    looks = {"n": 0}

    def dead(h):
        looks["n"] += h == host
        return ("decode-1",) if h == host and looks["n"] == 1 else ()

    hosts = scripted(deployment, dead=dead)
    hosts.default_exit = 0
    with hosts:
        assert live.heal(deployment) == ["decode-1"]
    others = [c.script for _, c in hosts.calls if not re.search(LOOK, c.script)]
    assert others and not any(re.search(r"proxy_drain\.py", c) for c in others)  # nothing drained
    assert any(re.search(r"preflight\.ok", c) for c in others)  # the deploy playbook's checks ran
    events = [e["event"] for e in deployment.session.journal_entries() if "event" in e]
    assert events == ["found dead", "start"]


def test_heal_leaves_a_deployment_alone_while_another_command_changes_it(tmp_path):
    """A change in flight, a join stopped half-way or an instance draining: heal looks at no host (the change is
    that command's); the control, nothing in flight, looks."""
    from yrpd import live

    deployment = one_p_two_d(tmp_path)
    for state in ({"change": "decode: 2 -> 1 (scale)"}, {"joining": ["h3"]}, {"instances": {"decode-1": "draining"}}):
        deployment.session.set_state(**state)
        with scripted(deployment, dead=lambda h: ("decode-0",)) as hosts:
            assert live.heal(deployment) == [] and live.in_flight(deployment)
        assert hosts.calls == []
        deployment.session.set_state(change=None, joining=None, instances={})
    assert live.in_flight(deployment) is None
    with scripted(deployment) as hosts:
        assert live.heal(deployment) == []
    assert hosts.calls


def test_an_instance_that_does_not_drain_in_time_is_put_back_and_nothing_is_stopped(tmp_path):
    deployment = one_p_two_d(tmp_path)
    with scripted(deployment, drain_exit=1) as hosts:
        with pytest.raises(YrpdError, match="not drained after 120 s.*\\n.*nothing was stopped"):
            api.scale(deployment, decode=1)
    assert not hosts.ran("h2", r'"action": "stop"') and not hosts.ran("h1", r'"action": "stop"')
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
    hosts = scripted(deployment)
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
    broken = scripted(deployment)
    broken.on(r"ds_kv_check\.py", exit_code=1, stderr="cannot reach 10.0.0.1:31501", host=new)
    broken.default_exit = 0
    with broken:
        with pytest.raises(YrpdError, match="127.0.0.3"):
            api.scale(deployment, hosts=[new])
    stopped = Deployment.load(Session(deployment.session.path))
    assert [h.name for h in stopped.spec.hosts] == ["h1", "h2", new]  # stored: `yrpd down` knows the host
    assert Session(deployment.session.path).state["joining"] == [new]
    fixed = scripted(deployment)
    fixed.default_exit = 0
    with fixed:
        done = api.scale(stopped, hosts=[new])  # the host is in the spec now: only the unfinished join goes on
    assert done.lines == [f"join {new}: stopped half-way, it goes on"]
    assert fixed.ran(new, r"ds_kv_check\.py") and Session(deployment.session.path).state["joining"] is None
    with ScriptedHosts() as untouched:  # the control: once joined, the same command has nothing to do
        quiet = api.scale(Deployment.load(Session(deployment.session.path)), hosts=[new])
    assert untouched.calls == [] and quiet.lines == [] and quiet.added == []
