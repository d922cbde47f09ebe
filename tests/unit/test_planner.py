"""The SLA planner: its decision (yrpd.planner.decide) and its loop (yrpd.live.run_planner) on a recorded session,
with the proxy's status given and the change it asks for recorded. The lab test (tests/lab/test_planner_lab.py)
runs it against a real deployment under a load step."""

from __future__ import annotations

from pathlib import Path

import pytest

from yrpd import live
from yrpd.deployment import Deployment, inventory_from_json, save_deployment
from yrpd.errors import SpecError
from yrpd.placement import make_plan
from yrpd.planner import Action, Observed, decide
from yrpd.session import Session, SessionPhase, SessionStore
from yrpd.spec import PlannerSettings, build_spec

SETTINGS = PlannerSettings(ttft_p90_ms=1000, itl_p90_ms=100, max_prefill=2, max_decode=2, cooldown_s=60,
                           min_samples=5)
def ROOM(counts):  # every count fits
    return True
ONE_EACH = {"prefill": 1, "decode": 1}


def seen(ttft, itl=50, n=20):
    return Observed(ttft, itl, n)


def test_ttft_over_target_adds_prefill_and_itl_over_target_adds_decode():
    d = decide(SETTINGS, seen(1500), ONE_EACH, ROOM, 999)
    assert (d.action, d.role) == (Action.add, "prefill") and d.counts(ONE_EACH) == {"prefill": 2, "decode": 1}
    assert "TTFT p90 1500 ms (target 1000)" in d.reason
    d = decide(SETTINGS, seen(900, itl=180), ONE_EACH, ROOM, 999)
    assert (d.action, d.role) == (Action.add, "decode")
    d = decide(SETTINGS, seen(1200, itl=300), ONE_EACH, ROOM, 999)  # both over: the one further over
    assert (d.action, d.role) == (Action.add, "decode")
    assert decide(SETTINGS, seen(900), ONE_EACH, ROOM, 999).action is Action.hold  # the control: within target


def test_nothing_happens_while_cooling_down_or_with_too_few_samples():
    d = decide(SETTINGS, seen(5000), ONE_EACH, ROOM, 30)
    assert d.action is Action.hold and d.reason.startswith("cooling down: 30 of 60 s")
    d = decide(SETTINGS, seen(5000, n=3), ONE_EACH, ROOM, 999)
    assert d.action is Action.hold and d.reason.startswith("3 streamed requests in the last 30 s: judged from 5")


def test_without_a_free_device_a_comfortable_role_gives_an_instance_up_else_it_holds():
    counts = {"prefill": 1, "decode": 2}
    def tight(c):  # only as many instances as run now
        return sum(c.values()) <= 3
    d = decide(SETTINGS, seen(1500, itl=30), counts, tight, 999)
    assert (d.action, d.role) == (Action.move, "prefill") and d.counts(counts) == {"prefill": 2, "decode": 1}
    d = decide(SETTINGS, seen(1500, itl=80), counts, tight, 999)  # decode not comfortable (80 of 100 ms)
    assert d.action is Action.hold and "prefill cannot grow (no device is free)" in d.reason
    d = decide(SETTINGS, seen(1500, itl=30), {"prefill": 2, "decode": 2}, ROOM, 999)
    assert d.action is Action.hold and "at its maximum" in d.reason
    # a move that would not fit (a prefill instance takes more devices than a decode one frees) is not made
    d = decide(SETTINGS, seen(1500, itl=30), counts, lambda c: c == counts, 999)
    assert d.action is Action.hold and "no device is free" in d.reason


def test_a_role_well_under_target_gives_an_instance_back_down_to_its_minimum():
    d = decide(SETTINGS, seen(300, itl=80), {"prefill": 2, "decode": 2}, ROOM, 999)
    assert (d.action, d.role) == (Action.remove, "prefill")
    d = decide(SETTINGS, seen(300, itl=30), {"prefill": 1, "decode": 2}, ROOM, 999)
    assert (d.action, d.role) == (Action.remove, "decode")
    assert decide(SETTINGS, seen(300, itl=30), ONE_EACH, ROOM, 999).action is Action.hold  # at the minimum
    assert decide(SETTINGS, seen(700, itl=30), {"prefill": 2, "decode": 1}, ROOM, 999).action is Action.hold


def test_decode_is_not_judged_without_itl_samples_and_without_an_itl_target_only_for_giving_back():
    counts = {"prefill": 1, "decode": 2}
    d = decide(SETTINGS, seen(300, itl=None), counts, ROOM, 999)
    assert d.action is Action.hold  # no ITL sample: decode keeps its instances
    d = decide(SETTINGS, seen(300, itl=30), counts, ROOM, 999)
    assert (d.action, d.role) == (Action.remove, "decode")  # the control: with samples it gives one back
    no_itl = SETTINGS.model_copy(update={"itl_p90_ms": None})
    assert decide(no_itl, seen(300, itl=None), counts, ROOM, 999).action is Action.remove  # judged by TTFT
    assert decide(no_itl, seen(700, itl=None), counts, ROOM, 999).action is Action.hold  # 0.7 of the target
    d = decide(no_itl, seen(1500, itl=900), ONE_EACH, ROOM, 999)
    assert (d.action, d.role) == (Action.add, "prefill")  # TTFT over asks for prefill, never decode


def test_bounds_that_cross_are_refused_naming_the_field():
    with pytest.raises(SpecError, match=r"planner.min_decode: is above planner.max_decode"):
        build_spec({"planner": {"ttft_p90_ms": 500, "min_decode": 3, "max_decode": 2}}, {"hosts": "localhost"})


def deployed(tmp_path: Path, **planner) -> Deployment:
    spec = build_spec({"planner": {"ttft_p90_ms": 1000, "max_prefill": 2, "cooldown_s": 60, "min_samples": 5,
                                   **planner}},
                      {"hosts": "h1,h2,h3", "devices": "0-3", "device_kind": "npu", "model": "/models/m", "ptp": 4,
                       "dtp": 4, "session_root": str(tmp_path / "sessions")})
    inv = inventory_from_json({h: {"kind": "npu", "devices": [0, 1, 2, 3], "ip": f"10.0.0.{i + 1}"}
                               for i, h in enumerate(("h1", "h2", "h3"))})
    session = SessionStore(tmp_path / "sessions").create()
    plan = make_plan(spec, inv)
    save_deployment(session, spec, inv, plan)
    session.set_state(SessionPhase.deployed)
    return Deployment(session, spec, inv, plan)


def test_the_loop_acts_once_then_cools_down_and_records_every_decision(tmp_path, monkeypatch):
    deployment = deployed(tmp_path)
    ttft = iter([400, 1800, 1800, 1800, 1800, 1800])  # p90 seen at each look
    now = [0.0]
    changed: list[dict] = []

    def fetch(url, window):
        assert url == "http://10.0.0.1:8000" and window == 30
        return {"latency": {"ttft_ms": {"n": 20, "p90": next(ttft)}, "itl_ms": {"n": 20, "p90": 20}}}

    def change(d, spec, **kw):  # the real change is what `yrpd scale` runs (tests/lab/test_scale_lab.py)
        changed.append({"prefill": spec.prefill, "decode": spec.decode})
        plan = make_plan(spec, d.inventory, keep=d.plan.instances)
        return live.Changed(d.session, [], [], 1.0, Deployment(d.session, spec, d.inventory, plan))

    monkeypatch.setattr(live, "change", change)
    healed: list[float] = []  # the reconciler's restarts-only pass (tests/unit/test_scale.py runs it on hosts)
    monkeypatch.setattr(live, "heal", lambda d, **kw: healed.append(now[0]) or [])

    def sleep(s):
        now[0] += s

    decisions = live.run_planner(deployment, seconds=30, fetch=fetch, sleep=sleep, clock=lambda: now[0])
    assert [d.action for d in decisions] == [Action.hold, Action.add, Action.hold, Action.hold, Action.hold,
                                             Action.hold]
    assert len(healed) == 5  # at each look that changed nothing: what died beyond its supervisor comes back
    assert changed == [{"prefill": 2, "decode": 1}]  # once: then it cools down
    assert decisions[2].reason.startswith("cooling down")
    state = Session(deployment.session.path).state["planner"]
    assert state["action"] == "hold" and state["reason"].startswith("cooling down")
    journal = [e for e in deployment.session.journal_entries() if e.get("event") == "planner"]
    # each change, and each hold whose reason (not just its figures) is new: within target, cooling down
    assert [e["action"] for e in journal] == ["hold", "add", "hold"]
    assert journal[0]["reason"].endswith("within target") and journal[1]["role"] == "prefill"
    assert journal[2]["reason"].startswith("cooling down")


def test_the_planner_refuses_a_spec_without_targets_before_reading_anything(tmp_path):
    deployment = deployed(tmp_path)
    deployment.spec = deployment.spec.model_copy(update={"planner": None})
    with pytest.raises(SpecError, match=r"^planner: session .* sets no planner targets; add `planner:"):
        live.run_planner(deployment, seconds=1, fetch=lambda *a: pytest.fail("read the proxy"))
