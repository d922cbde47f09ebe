"""The reconciler (yrpd.reconcile): every move of an instance's life, and the steps it takes from what runs to what
is wanted, on a cluster scripted here (its plan changes only by the steps it is given). tests/unit/test_scale.py and
test_live.py drive the same reconciler through yrpd.live on scripted hosts; the lab tests on fake hosts."""

from __future__ import annotations

import itertools

import pytest

from yrpd import placement
from yrpd.placement import HostInventory, Plan, make_plan
from yrpd.reconcile import (TRANSITIONS, BringUp, Desired, IllegalTransition, Join, Lifecycle, Observed, Restart,
                            Retire, Start, TearDown, next_step, reconcile)
from yrpd.spec import DeviceKind, build_spec
from yrpd.tags import InstanceState


def spec(hosts="h1,h2,h3", **over):
    return build_spec({}, {"hosts": hosts, "model": "/models/m", "device_kind": "npu", "ptp": 4, "dtp": 4, **over})


def inventory(n=8, hosts=("h1", "h2", "h3", "h4")):
    return {h: HostInventory(DeviceKind.npu, tuple(range(n)), ip=f"10.0.0.{i + 1}") for i, h in enumerate(hosts)}


# -- the table -----------------------------------------------------------------------------------------------------

def test_every_state_has_its_moves_in_the_table_and_each_move_is_allowed_or_refused_as_the_table_says():
    assert set(TRANSITIONS) == set(InstanceState)
    allowed = refused = 0
    for now, to in itertools.product(InstanceState, InstanceState):
        life = Lifecycle({"x": now.value} if now is not InstanceState.gone else {})
        if now is InstanceState.gone:  # gone is not kept: an instance the table no longer knows
            continue
        if to in TRANSITIONS[now]:
            life.move(["x"], to)
            assert life.state("x", default=InstanceState.gone) is to
            allowed += 1
        else:
            with pytest.raises(IllegalTransition, match=f"instance x: {now.value} -> {to.value} is not a move"):
                life.move(["x"], to)
            assert life.state("x") is now  # refused: nothing moved
            refused += 1
    assert allowed == sum(len(v) for k, v in TRANSITIONS.items() if k is not InstanceState.gone) == 12
    assert refused == 7 * 8 - 12
    assert TRANSITIONS[InstanceState.gone] == frozenset()  # the end


def test_a_life_walks_from_planned_to_gone_and_is_saved_at_each_move():
    saved = []
    life = Lifecycle(save=saved.append)
    for to in (InstanceState.starting, InstanceState.serving, InstanceState.draining, InstanceState.serving,
               InstanceState.draining, InstanceState.stopping, InstanceState.gone):
        life.move(["d1"], to, default=InstanceState.planned)
    assert [s.get("d1") for s in saved] == ["starting", "serving", "draining", "serving", "draining", "stopping",
                                            None]
    # one refused name of several moves none of them
    life = Lifecycle({"a": "serving", "b": "planned"})
    with pytest.raises(IllegalTransition, match="instance b: planned -> draining"):
        life.move(["a", "b"], InstanceState.draining)
    assert life.state("a") is InstanceState.serving
    # an instance the first deploy started has no state kept: it serves
    assert Lifecycle().state("prefill-0") is InstanceState.serving


# -- the steps -----------------------------------------------------------------------------------------------------

class Cluster:
    """What runs, changed only by the steps it is given, as hosts would carry them out (placement as yrpd.live
    places: placement.replan)."""

    def __init__(self, plan: Plan | None, inv, desired: Desired, up: bool = True):
        self.plan, self.inv, self.desired, self.up = plan, inv, desired, up
        self.down: set[str] = set()
        self.joining: tuple[str, ...] = ()
        self.taken: list[str] = []
        self.checked = self.new = False
        self.sessions = 1 if plan is not None else 0

    def observe(self) -> Observed:
        return Observed(self.plan, joining=self.joining, down=frozenset(self.down), up=self.up,
                        checked=self.checked, new=self.new)

    def act(self, step) -> None:
        d = self.desired
        if isinstance(step, TearDown):
            self.plan, self.down = None, set()
        elif isinstance(step, BringUp):  # the whole playbook: the spec's plan, what runs kept where it is
            if self.plan is None:
                self.sessions, self.new = self.sessions + 1, True
            self.plan = make_plan(d.spec, self.inv, keep=self.plan.instances if self.plan else (), cordoned=d.cordoned)
            self.up, self.checked, self.down, self.joining = True, True, set(), ()
        elif isinstance(step, Join):
            with_hosts = d.spec.model_copy(update=placement.counts(self.plan))
            self.plan = make_plan(with_hosts, self.inv, keep=self.plan.instances, cordoned=d.cordoned)
            self.joining = ()
        elif isinstance(step, Start):
            self.plan = placement.replan(d.spec, self.inv, self.plan.instances, d.cordoned, **step.counts)
        elif isinstance(step, Retire):
            rest = [i for i in self.plan.instances if i.name not in step.names]
            self.plan = placement.replan(d.spec, self.inv, rest, d.cordoned)
        elif isinstance(step, Restart):
            self.down -= set(step.names)
        self.taken.append(step.line())

    def run(self, desired: Desired) -> list[str]:
        """One command: it has checked nothing yet, and its session is not new to it."""
        self.desired, self.taken, self.checked, self.new = desired, [], False, False
        reconcile(desired, self.observe, self.act)
        return self.taken

    def where(self) -> list[tuple[str, str]]:
        return [(i.name, i.host) for i in self.plan.instances]


def test_scale_out_and_in_adds_what_is_missing_and_retires_the_highest_indexed_first():
    s = spec()
    cluster = Cluster(make_plan(s, inventory()), inventory(), Desired(s))
    assert cluster.run(Desired(s)) == []  # the control: nothing wanted that does not run
    assert cluster.run(Desired(spec(decode=3, prefill=2))) == ["start 1 prefill, 2 decode"]
    assert placement.counts(cluster.plan) == {"prefill": 2, "decode": 3}
    assert cluster.run(Desired(spec(decode=1, prefill=2))) == ["drain and stop decode-1, decode-2"]
    assert [i.name for i in cluster.plan.instances if i.role == "decode"] == ["decode-0"]


def test_a_roll_starts_each_new_instance_before_its_old_one_drains_prefill_first():
    s = spec(decode=2)
    cluster = Cluster(make_plan(s, inventory()), inventory(), Desired(s))
    flag = spec(decode=2, engine_args=["--max-num-seqs", "8"])
    assert cluster.run(Desired(flag)) == [
        "start 1 prefill", "drain and stop prefill-0",
        "start 1 decode", "drain and stop decode-0", "start 1 decode", "drain and stop decode-1"]
    assert placement.stale(cluster.plan, flag) == [] and placement.counts(cluster.plan) == {"prefill": 1, "decode": 2}


def test_a_roll_without_a_spare_device_drains_first_in_batches_of_max_unavailable():
    s = spec(hosts="h1,h2", decode=3)  # 4 instances of 4 NPUs on 2 hosts of 8: nothing spare
    inv = inventory(hosts=("h1", "h2"))
    cluster = Cluster(make_plan(s, inv), inv, Desired(s))
    flag = spec(hosts="h1,h2", decode=3, engine_args=["--x"])
    assert cluster.run(Desired(flag, max_unavailable=2)) == [
        "drain and stop prefill-0", "start 1 prefill",
        "drain and stop decode-0, decode-1", "start 2 decode", "drain and stop decode-2", "start 1 decode"]
    assert placement.stale(cluster.plan, flag) == []


def test_a_model_change_starts_a_new_pair_before_the_old_pair_drains():
    s = spec()
    cluster = Cluster(make_plan(s, inventory()), inventory(), Desired(s))
    other = spec(model="/models/other")
    assert cluster.run(Desired(other)) == ["start 1 prefill, 1 decode", "drain and stop prefill-0",
                                           "drain and stop decode-0"]
    assert {i.group for i in cluster.plan.instances} == {other.model_group}


def test_a_drain_moves_what_runs_on_the_host_and_keeps_new_instances_off_it():
    s = spec(decode=2)
    cluster = Cluster(make_plan(s, inventory()), inventory(), Desired(s))
    host = cluster.plan.instance("decode-1").host
    moving = sorted(i.name for i in cluster.plan.instances if i.host == host)
    steps = cluster.run(Desired(s, cordoned=(host,), evacuate=(host,)))
    assert len(steps) == 2 * len(moving) and all(f"drain and stop {n}" in steps for n in moving)
    assert all(i.host != host for i in cluster.plan.instances) and placement.counts(cluster.plan) == \
        {"prefill": 1, "decode": 2}
    assert cluster.run(Desired(s, cordoned=(host,), evacuate=(host,))) == []  # done: a second run takes no step


def test_a_cordoned_host_only_keeps_new_instances_off_and_a_drain_without_room_retires_without_replacement():
    s = spec(decode=2)
    inv = inventory(4, hosts=("h1", "h2", "h3"))  # one instance a host, all taken
    cluster = Cluster(make_plan(s, inv), inv, Desired(s))
    host = cluster.plan.instance("decode-1").host
    # a change with the host cordoned (a drain that stopped half-way) moves nothing off it
    assert cluster.run(Desired(s, cordoned=(host,))) == []
    # the drain of it wants one decode fewer (no room elsewhere): decode-1 retires without a replacement
    assert cluster.run(Desired(spec(decode=1), cordoned=(host,), evacuate=(host,))) == ["drain and stop decode-1"]
    assert all(i.host != host for i in cluster.plan.instances)


def test_a_roll_that_also_scales_rolls_at_the_running_counts_first():
    # 2P2D -> 1P2D with a flag change and max_unavailable 1: the prefill role never runs out
    s = spec(hosts="h1,h2", prefill=2, decode=2)  # 4 instances of 4 NPUs on 2 hosts of 8: nothing spare
    inv = inventory(hosts=("h1", "h2"))
    cluster = Cluster(make_plan(s, inv), inv, Desired(s))
    lowest = []
    flagged = spec(hosts="h1,h2", prefill=1, decode=2, engine_args=["--x"])
    act = cluster.act
    cluster.act = lambda step: (act(step), lowest.append(placement.counts(cluster.plan)["prefill"]))
    cluster.run(Desired(flagged, max_unavailable=1, roll_counts=(("prefill", 2), ("decode", 2))))
    assert min(lowest) == 1 and placement.counts(cluster.plan) == {"prefill": 1, "decode": 2}
    # 1P1D -> 3P1D with a flag change on 16 NPUs: one instance beyond what runs at a time, then the scale
    s = spec(hosts="h1,h2")
    inv = inventory(hosts=("h1", "h2"))
    cluster = Cluster(make_plan(s, inv), inv, Desired(s))
    steps = cluster.run(Desired(spec(hosts="h1,h2", prefill=3, engine_args=["--x"]),
                                roll_counts=(("prefill", 1), ("decode", 1))))
    assert steps == ["start 1 prefill", "drain and stop prefill-0", "start 1 decode", "drain and stop decode-0",
                     "start 2 prefill"]


def test_a_down_instance_starts_again_where_it_was_and_a_joined_host_comes_first():
    s = spec()
    cluster = Cluster(make_plan(s, inventory()), inventory(), Desired(s))
    before = cluster.where()
    cluster.down = {"decode-0"}
    assert cluster.run(Desired(s)) == ["start decode-0 again"] and cluster.where() == before
    # a host the spec adds joins before the instances it may take start
    assert cluster.run(Desired(spec(hosts="h1,h2,h3,h4", decode=2))) == ["join h4", "start 1 decode"]
    # a join that stopped half-way (the session remembers it) is finished first, though the plan names the host
    cluster.joining = ("h4",)
    assert next_step(Desired(spec(hosts="h1,h2,h3,h4", decode=2)), cluster.observe()) == Join(("h4",))


def test_deploy_brings_up_what_is_not_placed_resumes_what_stopped_and_checks_what_runs_once_per_command():
    """`yrpd deploy` writes Desired(whole=True): the deploy playbook runs once in each command (its checks are what
    observes every step on every host), and a changed spec that cannot roll (`anew`) is torn down first."""
    s, inv = spec(), inventory()
    cluster = Cluster(None, inv, Desired(s))
    bring = "run the deploy playbook on every host (each step's check skips what holds)"
    assert cluster.run(Desired(s, whole=True)) == [bring] and cluster.sessions == 1
    placed = cluster.where()
    assert placed == [(i.name, i.host) for i in make_plan(s, inv).instances]
    assert cluster.run(Desired(s, whole=True)) == [bring] and cluster.where() == placed  # a re-run: checked again
    assert cluster.run(Desired(s)) == []  # the control: a live change's desire, nothing to do
    cluster.up = False  # a deploy that stopped half-way is resumed in its session, what it placed kept
    assert cluster.run(Desired(s)) == [bring] and cluster.sessions == 1 and cluster.where() == placed
    # what the playbook cannot do in one go follows in the same command: a host added then (a join), a dead instance
    cluster.down, cluster.checked = {"decode-0"}, False  # a new command
    assert next_step(Desired(s, whole=True), cluster.observe()) == BringUp()
    assert cluster.run(Desired(s, whole=True)) == [bring]  # its checks start decode-0 again: no second step
    # --recreate: torn down, then a new session
    changed = spec(ptp=2, dtp=2)
    assert cluster.run(Desired(changed, whole=True, anew=True)) == [
        "tear what runs down (requests fail until the new session serves)", bring]
    assert cluster.sessions == 2 and all(i.tp == 2 for i in cluster.plan.instances if i.role == "prefill")
    # within the command the new session is not torn down again (the two steps above, then none); the next deploy
    # of the same spec finds nothing that differs (api.deploy: anew only for a running deployment of another spec)
    assert cluster.run(Desired(changed, whole=True)) == [bring] and cluster.sessions == 2


def test_plain_instances_are_brought_up_by_the_playbook_and_nothing_else():
    """disaggregated: false (role single, what the bench's baseline deploys): the playbook places them; the
    reconciler takes no step of a live change after it (counts are prefill's and decode's)."""
    s, inv = spec(disaggregated=False, prefill=2), inventory()
    cluster = Cluster(None, inv, Desired(s))
    assert cluster.run(Desired(s, whole=True)) == ["run the deploy playbook on every host (each step's check skips "
                                                   "what holds)"]
    assert {i.role for i in cluster.plan.instances} == {"single"}
    assert next_step(Desired(s), cluster.observe()) is None


def test_a_step_that_changes_nothing_fails_loudly_instead_of_looping():
    s = spec()
    cluster = Cluster(make_plan(s, inventory()), inventory(), Desired(s))
    with pytest.raises(RuntimeError, match="does not converge: start 1 decode again"):
        reconcile(Desired(spec(decode=2)), cluster.observe, lambda step: None)


# -- the same reconciler through yrpd.live, on scripted hosts -------------------------------------------------------

def test_live_changes_take_the_reconcilers_steps_on_the_hosts_and_keep_each_instances_state(tmp_path):
    """Scale out, a roll, a drain and a scale in of one deployment (3 CPU hosts of 4 cores) through the library, on
    hosts that answer every check as done (what runs is skipped) and drain at once: the journal's steps are the
    reconciler's, the stored plan follows them, and the session keeps every instance that ran as serving."""
    import json

    from yrpd import api, live
    from yrpd.deployment import Deployment, inventory_from_json, save_deployment
    from yrpd.session import Session, SessionPhase, SessionStore
    from yrpd.testing import ScriptedHosts

    ips = {"h1": "10.0.0.1", "h2": "10.0.0.2", "h3": "10.0.0.3"}
    s = build_spec({}, {"hosts": ",".join(ips), "devices": "0-3", "device_kind": "cpu", "model": "/models/m",
                        "dtype": "float32", "session_root": str(tmp_path / "sessions")})
    inv = inventory_from_json({h: {"kind": "cpu", "devices": [0, 1, 2, 3], "ip": ip} for h, ip in ips.items()})
    session = SessionStore(tmp_path / "sessions").create()
    save_deployment(session, s, inv, make_plan(s, inv))
    session.set_state(SessionPhase.deployed)
    hosts = ScriptedHosts(default_exit=0)
    hosts.on(r"deploy_scripts/proxy_drain\.py", stdout=json.dumps({"drained": True, "in_flight": {}, "seconds": 0.1}))

    def steps(since: int) -> list[tuple[str, list[str]]]:
        return [(e["event"], e["instances"]) for e in session.journal_entries()[since:]
                if e.get("event") in ("start", "drain")]

    def now() -> Deployment:
        return Deployment.load(Session(session.path))

    with hosts:
        mark = len(session.journal_entries())
        done = api.scale(now(), decode=2)
        assert steps(mark) == [("start", ["decode-1"])] and done.added == ["decode-1"]
        mark = len(session.journal_entries())
        flag = now().spec.model_copy(update={"engine_args": ["--max-num-seqs", "8"]})
        done = live.change(now(), flag)
        assert steps(mark) == [("start", ["prefill-1"]), ("drain", ["prefill-0"]), ("start", ["decode-2"]),
                               ("drain", ["decode-0"]), ("start", ["decode-0"]), ("drain", ["decode-1"])]
        assert placement.stale(now().plan, flag) == []
        host = now().plan.instance("decode-2").host  # (a name a retired instance left is taken again)
        mark = len(session.journal_entries())
        moving = [i.name for i in now().plan.instances if i.host == host]
        done = api.drain_host(now(), host)
        assert [name for event, names in steps(mark) if event == "drain" for name in names] == moving
        assert all(i.host != host for i in now().plan.instances)
        mark = len(session.journal_entries())
        done = api.scale(now(), decode=1)
        assert [e for e, _ in steps(mark)] == ["drain"] and len(done.removed) == 1
    states = Session(session.path).state["instances"]
    assert sorted(states) == sorted(i.name for i in now().plan.instances)  # the gone are not kept
    assert set(states.values()) == {"serving"}
    assert hosts.ran(host, r"session_processes\.py")  # the drained host's instances were stopped there


def test_a_start_left_failed_is_started_again_before_anything_drains(tmp_path):
    """A roll stopped at its first start (prefill-1 placed and stored, its start failed): the same deploy run again
    starts prefill-1 again first, then goes on, and every instance ends serving."""
    import json

    from yrpd import live
    from yrpd.deployment import Deployment, inventory_from_json, save_deployment
    from yrpd.session import Session, SessionPhase, SessionStore
    from yrpd.testing import ScriptedHosts

    ips = {"h1": "10.0.0.1", "h2": "10.0.0.2", "h3": "10.0.0.3"}
    s = build_spec({}, {"hosts": ",".join(ips), "devices": "0-3", "device_kind": "cpu", "model": "/models/m",
                        "dtype": "float32", "session_root": str(tmp_path / "sessions")})
    inv = inventory_from_json({h: {"kind": "cpu", "devices": [0, 1, 2, 3], "ip": ip} for h, ip in ips.items()})
    flag = s.model_copy(update={"engine_args": ["--max-num-seqs", "8"]})
    stopped = placement.replan(flag, inv, make_plan(s, inv).instances, prefill=1)  # as the failed start stored it
    session = SessionStore(tmp_path / "sessions").create()
    save_deployment(session, placement.with_counts(flag, stopped), inv, stopped)
    session.set_state(SessionPhase.deployed, instances={"prefill-1": "failed"})
    hosts = ScriptedHosts(default_exit=0)
    hosts.on(r"deploy_scripts/proxy_drain\.py", stdout=json.dumps({"drained": True, "in_flight": {}, "seconds": 0.1}))
    with hosts:
        done = live.change(Deployment.load(Session(session.path)), flag)
    assert "start prefill-1 again: a change that stopped half-way left it down" in done.lines
    events = [(e["event"], e.get("again") or e["instances"]) for e in session.journal_entries()
              if e.get("event") in ("start", "drain")]
    assert events[0] == ("start", ["prefill-1"]) and events[1][0] == "start"  # again first, before any drain
    assert placement.stale(done.deployment.plan, flag) == [] and placement.counts(done.deployment.plan) == \
        {"prefill": 1, "decode": 1}
    assert set(Session(session.path).state["instances"].values()) == {"serving"}
