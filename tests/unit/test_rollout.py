"""A changed spec against a running plan (yrpd.rollout), the placement a change relies on, and what `live.change`
refuses before it touches a host. The lab test (tests/lab/test_rollout_lab.py) runs the changes for real under load."""

from __future__ import annotations

from pathlib import Path

import pytest

from yrpd import api, live, rollout
from yrpd.deployment import Deployment, inventory_from_json, save_deployment
from yrpd.errors import SpecError
from yrpd.placement import HostInventory, make_plan
from yrpd.session import SessionPhase, SessionStore
from yrpd.spec import DeviceKind, build_spec
from yrpd.testing import ScriptedHosts


def spec(**over):
    base = {"hosts": "h1,h2,h3", "model": "/models/m", "device_kind": "npu", "ptp": 4, "dtp": 4}
    return build_spec({}, {**base, **over})


def inventory(n=8, hosts=("h1", "h2", "h3")):
    return {h: HostInventory(DeviceKind.npu, tuple(range(n)), ip=f"10.0.0.{i + 1}") for i, h in enumerate(hosts)}


def test_each_changed_field_is_sorted_into_what_rolls_scales_takes_effect_or_needs_recreate():
    old = spec()
    new = spec(engine_args=["--max-num-seqs", "8"], decode=2, startup_timeout_s=1200, datasystem_memory_mb=4096)
    kinds = {c.field: c.kind for c in rollout.diff(old, new)}
    assert kinds == {"engine_args": rollout.ChangeKind.roll, "decode": rollout.ChangeKind.scale,
                     "startup_timeout_s": rollout.ChangeKind.free,
                     "datasystem_memory_mb": rollout.ChangeKind.recreate}
    assert rollout.diff(old, spec()) == []  # the control: the same spec changes nothing


def test_hosts_added_after_the_others_join_and_any_other_change_of_the_hosts_needs_recreate():
    old = spec(hosts="h1,h2")
    [joined] = rollout.diff(old, spec(hosts="h1,h2,h3"))
    assert (joined.kind, joined.line()) == (rollout.ChangeKind.join, "hosts: ['h1', 'h2'] -> ['h1', 'h2', 'h3'] (join)")
    assert rollout.joined_hosts(old, spec(hosts="h1,h2,h3,h4")) == ["h3", "h4"]
    # the master (the first host) would change, a host would go, or a running host's settings would change
    for other in ("h3,h1,h2", "h1", "h1,h3", "h2,h1,h3"):
        assert [c.kind for c in rollout.diff(old, spec(hosts=other))] == [rollout.ChangeKind.recreate], other
    moved = build_spec({"hosts": [{"address": "h1"}, {"address": "h2", "ip": "10.9.9.9"}, {"address": "h3"}]},
                       {"model": "/models/m", "device_kind": "npu", "ptp": 4, "dtp": 4})
    assert rollout.joined_hosts(old, moved) == [] and rollout.diff(old, moved)[0].kind is rollout.ChangeKind.recreate
    same_names = build_spec({"hosts": [{"address": "h1"}, {"address": "h2", "ip": "10.9.9.9"}]},
                            {"model": "/models/m", "device_kind": "npu", "ptp": 4, "dtp": 4})
    assert rollout.diff(old, same_names)[0].line() == \
        "hosts: [{'address': 'h2'}] -> [{'address': 'h2', 'ip': '10.9.9.9'}] (recreate)"  # what differs, named
    lines = rollout.describe(rollout.diff(old, spec(hosts="h1,h2,h3")), make_plan(old, inventory(hosts=("h1", "h2"))),
                             spec(hosts="h1,h2,h3"), 0)
    assert lines[1] == "join h3: its data system worker joins the cluster, nothing that runs restarts"


def test_an_instance_is_stale_once_its_settings_differ_and_a_model_change_changes_its_group():
    plan = make_plan(spec(), inventory())
    assert rollout.stale(plan, spec()) == []
    flag = spec(engine_args=["--max-num-seqs", "8"])
    assert [i.name for i in rollout.stale(plan, flag)] == ["prefill-0", "decode-0"]  # prefill first
    assert flag.model_group == spec().model_group  # the same model: old and new instances may pair
    other = spec(model="/models/other")
    assert other.model_group != spec().model_group and other.model_group.startswith("other#")


def test_a_roles_own_engine_args_roll_that_roles_instances_alone():
    plan = make_plan(spec(), inventory())
    assert [i.name for i in rollout.stale(plan, spec(decode_engine_args=["--max-num-seqs", "64"]))] == ["decode-0"]
    assert [i.name for i in rollout.stale(plan, spec(prefill_engine_args=["--max-num-seqs", "4"]))] == ["prefill-0"]
    # a session recorded before the role fields existed does not roll for them while they stay empty: the digest is
    # the one of the six fields it was made of then
    from yrpd.spec import _digest
    before = _digest({k: getattr(spec(), k) for k in ("model", "served_model_name", "dtype", "prefix_reuse",
                                                       "engine_args", "connector")})
    assert spec().instance_config("decode") == spec().instance_config("prefill") == before
    assert [c.kind.value for c in rollout.diff(spec(), spec(decode_engine_args=["--max-num-seqs", "64"]))] == ["roll"]


def test_a_new_instance_takes_the_lowest_free_index_and_kept_ones_keep_their_settings():
    running = make_plan(spec(decode=2), inventory())
    flag = spec(decode=2, engine_args=["--max-num-seqs", "8"])
    # decode-0 replaced: a third decode instance started beside the two, then decode-0 retired
    grown = make_plan(rollout.with_counts(flag, running, decode=1), inventory(), keep=running.instances)
    assert [i.name for i in grown.instances] == ["prefill-0", "decode-0", "decode-1", "decode-2"]
    assert [i.config == flag.instance_config(i.role) for i in grown.instances] == [False, False, False, True]
    rest = [i for i in grown.instances if i.name != "decode-0"]
    after = make_plan(flag, inventory(), keep=rest)
    assert [i.name for i in after.instances] == ["prefill-0", "decode-1", "decode-2"]
    assert [(i.host, i.devices, i.port) for i in after.instances] == \
        [(i.host, i.devices, i.port) for i in rest]  # nothing moved
    # scaling out again fills the gap
    again = make_plan(rollout.with_counts(flag, after, decode=1), inventory(), keep=after.instances)
    assert [i.name for i in again.instances] == ["prefill-0", "decode-0", "decode-1", "decode-2"]


def test_a_drained_host_keeps_what_runs_there_but_takes_nothing_new():
    inv = {h: HostInventory(DeviceKind.npu, tuple(range(n))) for h, n in (("h1", 4), ("h2", 8), ("h3", 4))}
    running = make_plan(spec(), inv)
    assert [(i.name, i.host) for i in running.instances] == [("prefill-0", "h2"), ("decode-0", "h1")]
    kept = make_plan(spec(), inv, keep=running.instances, cordoned=["h2"])
    assert kept.instances == running.instances  # the plan still names what runs there
    grow = rollout.with_counts(spec(), running, decode=1)
    assert make_plan(grow, inv, keep=running.instances).instance("decode-1").host == "h2"  # the control
    assert make_plan(grow, inv, keep=running.instances, cordoned=["h2"]).instance("decode-1").host == "h3"
    with pytest.raises(SpecError, match=r"\(h2, h3 drained: `yrpd undrain` brings it back\)"):
        make_plan(grow, inv, keep=running.instances, cordoned=["h2", "h3"])


def test_max_unavailable_defaults_to_zero_only_where_one_more_instance_of_each_replaced_role_fits():
    flag = spec(engine_args=["--max-num-seqs", "8"])
    roomy = make_plan(spec(), inventory())  # 3 hosts of 8 NPUs, 8 used: a spare prefill and decode fit
    assert rollout.default_max_unavailable(flag, inventory(), roomy) == 0
    tight = make_plan(spec(hosts="h1,h2"), inventory(4, hosts=("h1", "h2")))  # 2 hosts of 4 NPUs, all used
    assert rollout.default_max_unavailable(spec(hosts="h1,h2", engine_args=["--x"]),
                                           inventory(4, hosts=("h1", "h2")), tight) == 1
    lines = rollout.describe(rollout.diff(spec(), flag), roomy, flag, 0)
    assert lines == ["engine_args: [] -> ['--max-num-seqs', '8'] (roll)",
                     "replace prefill-0, decode-0 one by one (start each new instance, then drain and stop the old one)"]


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
