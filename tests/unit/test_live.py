"""Live changes (yrpd.live): what `live.change`, a drain and `yrpd plan` of a changed spec refuse or show before they
touch a host. tests/unit/test_reconcile.py drives the reconciler through yrpd.live on scripted hosts; the lab tests
(tests/lab/test_rollout_lab.py and others) run the changes for real under load."""

from __future__ import annotations

from pathlib import Path

import pytest

from yrpd import api, live
from yrpd.deployment import Deployment, inventory_from_json, save_deployment
from yrpd.errors import SpecError
from yrpd.placement import make_plan
from yrpd.session import SessionPhase, SessionStore
from yrpd.spec import build_spec
from yrpd.testing import ScriptedHosts


def deployed(tmp_path: Path, hosts: str = "h1,h2", **over) -> Deployment:
    names = hosts.split(",")
    given = {"hosts": hosts, "devices": "0-3", "device_kind": "npu", "model": "/models/m", "ptp": 4, "dtp": 4,
             "session_root": str(tmp_path / "sessions"), **over}
    s = build_spec({}, given)
    inv = inventory_from_json({h: {"kind": "npu", "devices": [0, 1, 2, 3], "ip": f"10.0.0.{i + 1}"}
                               for i, h in enumerate(names)})
    session = SessionStore(tmp_path / "sessions").create()
    plan = make_plan(s, inv)
    save_deployment(session, s, inv, plan)
    session.set_state(SessionPhase.deployed)
    return Deployment(session, s, inv, plan)


def test_a_change_that_would_leave_a_role_without_an_instance_is_refused_before_any_host(tmp_path):
    deployment = deployed(tmp_path)  # 1P1D filling both hosts: no device spare
    flag = deployment.spec.model_copy(update={"engine_args": ["--max-num-seqs", "8"]})
    with ScriptedHosts() as hosts:
        with pytest.raises(SpecError) as exc:
            live.change(deployment, flag)
        assert str(exc.value) == (
            "--max-unavailable: 1 would leave no decode instance serving (it has 1 and no device is spare for one "
            "more beside them); scale decode up first (`yrpd scale --decode 2`), free a device, or pass --recreate")
        model = deployment.spec.model_copy(update={"model": "/models/other"})
        with pytest.raises(SpecError, match="a model change needs a device spare for a new prefill and a new decode"):
            live.change(deployment, model)
        with pytest.raises(SpecError, match="cannot change under it"):
            live.change(deployment, deployment.spec.model_copy(update={"datasystem_memory_mb": 4096}))
    assert hosts.calls == []
    assert deployment.session.journal_entries() == [] or \
        all(e.get("event") is None for e in deployment.session.journal_entries())


def test_drain_refuses_an_unknown_host_and_undrain_a_host_that_is_not_drained(tmp_path):
    deployment = deployed(tmp_path)
    with ScriptedHosts() as hosts:
        with pytest.raises(SpecError, match=r"^HOST: 'h9' is not a host of session .* \(h1, h2\); pick one of them"):
            api.drain_host(deployment, "h9")
        with pytest.raises(SpecError, match=r"^HOST: 'h2' is not drained in session .* \(drained: none\)"):
            api.undrain_host(deployment, "h2")
        # a drain that cannot move the last decode instance anywhere refuses, and the host is not left drained
        with pytest.raises(SpecError, match="decode-0 is the last decode instance and no other host has 4 free"):
            api.drain_host(deployment, "h2")
    assert hosts.calls == []


def test_plan_shows_what_a_deploy_of_a_changed_spec_would_do_to_the_running_session(tmp_path):
    config = {"hosts": [{"address": h, "ip": f"10.0.0.{i + 1}"} for i, h in enumerate(("h1", "h2", "h3"))]}
    given = {"devices": "0-7", "device_kind": "npu", "model": "/models/m", "ptp": 4, "dtp": 4,
             "session_root": str(tmp_path / "sessions")}
    running = build_spec(config, given)
    inv = inventory_from_json({h: {"kind": "npu", "devices": list(range(8)), "ip": f"10.0.0.{i + 1}"}
                               for i, h in enumerate(("h1", "h2", "h3"))})
    session = SessionStore(tmp_path / "sessions").create()
    save_deployment(session, running, inv, make_plan(running, inv))
    session.set_state(SessionPhase.deployed)
    with ScriptedHosts() as hosts:
        assert api.plan(build_spec(config, given)).changes == []  # the control: the same spec
        view = api.plan(build_spec(config, {**given, "engine_args": ["--max-num-seqs", "8"], "decode": 2,
                                            "datasystem_memory_mb": 4096}))
    assert hosts.calls == []
    assert view.changes == [
        f"session {session.id} runs: `yrpd deploy` changes it while it serves",
        "engine_args: [] -> ['--max-num-seqs', '8'] (roll)",
        "datasystem_memory_mb: 1024 -> 4096 (recreate)",
        "decode: 1 -> 2 (scale)",
        "replace prefill-0, decode-0 one by one (start each new instance, then drain and stop the old one)",
        "decode: 1 -> 2 instances",
        "datasystem_memory_mb cannot change under it: deploy refuses unless given --recreate"]
    assert view.to_dict()["changes"] == view.changes


def test_a_drain_works_its_moves_out_one_on_another_and_refuses_to_leave_a_role_without_an_instance(tmp_path):
    """h1 (8 NPUs) runs prefill-0 and decode-0, h2 (4) is free: prefill-0's replacement would take h2, leaving
    decode-0 nowhere to go and no other decode instance: refused before anything changes."""
    s = build_spec({}, {"hosts": "h1,h2", "device_kind": "npu", "model": "/models/m", "ptp": 4, "dtp": 4,
                        "session_root": str(tmp_path / "sessions")})
    inv = inventory_from_json({"h1": {"kind": "npu", "devices": list(range(8)), "ip": "10.0.0.1"},
                               "h2": {"kind": "npu", "devices": [0, 1, 2, 3], "ip": "10.0.0.2"}})
    session = SessionStore(tmp_path / "sessions").create()
    plan = make_plan(s, inv)
    assert {i.host for i in plan.instances} == {"h1"}
    save_deployment(session, s, inv, plan)
    session.set_state(SessionPhase.deployed)
    deployment = Deployment(session, s, inv, plan)
    with ScriptedHosts() as hosts:
        with pytest.raises(SpecError, match="^drain: decode-0 is the last decode instance"):
            api.drain_host(deployment, "h1")
    assert hosts.calls == [] and "drained" not in session.state  # nothing recorded either


def test_plan_shows_a_host_added_to_the_running_session_as_a_join_and_deploy_would_not_refuse_it(tmp_path):
    hosts = [{"address": h, "ip": f"10.0.0.{i + 1}"} for i, h in enumerate(("h1", "h2", "h3", "h4"))]
    given = {"devices": "0-7", "device_kind": "npu", "model": "/models/m", "ptp": 4, "dtp": 4,
             "session_root": str(tmp_path / "sessions")}
    running = build_spec({"hosts": hosts[:3]}, given)
    inv = inventory_from_json({h["address"]: {"kind": "npu", "devices": list(range(8)), "ip": h["ip"]}
                               for h in hosts[:3]})
    session = SessionStore(tmp_path / "sessions").create()
    save_deployment(session, running, inv, make_plan(running, inv))
    session.set_state(SessionPhase.deployed)
    with ScriptedHosts() as calls:
        view = api.plan(build_spec({"hosts": hosts}, given))
    assert calls.calls == []
    assert view.changes == [f"session {session.id} runs: `yrpd deploy` changes it while it serves",
                            "hosts: ['h1', 'h2', 'h3'] -> ['h1', 'h2', 'h3', 'h4'] (join)",
                            "join h4: its data system worker joins the cluster, nothing that runs restarts"]
    # the control: a host taken away cannot change under it
    assert api.plan(build_spec({"hosts": hosts[:2]}, given)).changes[-1] == \
        "hosts cannot change under it: deploy refuses unless given --recreate"
