"""A model change rolled onto a running deployment under load, on 4 fake hosts (issue 34): builtin:tiny-qwen2 ->
builtin:bench-qwen2 under the same served name, so clients keep sending what they sent. `yrpd deploy` starts a new
prefill and decode pair on h3 and h4 before the old pair drains; meanwhile every request must be answered, whole, by
one model: its prefill and decode legs (the proxy's log line names both) go to instances of one model, and its
answer is the one that model gives alone."""

from __future__ import annotations

import json
import re
import time

import pytest

from lab.hosts import assert_nothing_left
from lab.traffic import TwoHosts
from tests.lab.test_scale_lab import PACE_S, PROMPTS, Load

pytestmark = pytest.mark.lab

REPORT_VARIABLE = "YRPD_MODEL_CHANGE_REPORT"


def test_a_model_change_never_mixes_two_models_in_one_answer(fake_lab, tmp_path, lab_figures):
    lab = fake_lab(4)
    d = TwoHosts(lab, tmp_path, n=4)
    d.config.write_text(d.config.read_text() + "served_model_name: tiny-qwen2\n")
    figures = lab_figures
    try:
        figures["deploy_s"] = round(d.deploy(), 1)
        old = {p: d.ask(p, 16, timeout=120).text for p in PROMPTS}
        before, _ = d.healthy()
        old_urls = {i["url"] for i in before["instances"]}
        changed = tmp_path / "changed.yaml"
        changed.write_text(d.config.read_text().replace("model: builtin:tiny-qwen2", "model: builtin:bench-qwen2"))
        with Load(d.proxy, old, pace_s=PACE_S) as load:
            time.sleep(5)
            t0 = time.monotonic()
            rolled = d.cli("deploy", "--hosts", ",".join(d.names), "--config", str(changed), timeout=1500)
            figures["roll_s"] = round(time.monotonic() - t0, 1)
            assert "model: 'builtin:tiny-qwen2' -> 'builtin:bench-qwen2' (roll)" in rolled.stderr, rolled.stderr
            time.sleep(5)
        after, _ = d.healthy()
        new_urls = {i["url"] for i in after["instances"]}
        assert not old_urls & new_urls and {i["host"] for i in after["instances"]} == {"h3", "h4"}
        new = {p: d.ask(p, 16, timeout=120).text for p in PROMPTS}
        assert new != old  # the control: the two models answer differently, so an answer tells which one gave it
        calls = load.calls
        failed = [(c.status, c.failure, c.raw[:200]) for c in calls if c.status != 200 or c.error_event]
        mixed = [c.text for c in calls if c.status == 200 and c.text not in (old[c.body["prompt"]],
                                                                            new[c.body["prompt"]])]
        # every request's legs, as the proxy logged them: prefill and decode of one model
        lines = d.cli("logs", "proxy", "-n", "100000", timeout=300).stdout.splitlines()
        legs = [(m.group(1), m.group(2)) for m in (re.search(r" prefill=(\S+) .*decode=(\S+)", line) for line in lines)
                if m]
        crossed = [pair for pair in legs if (pair[0] in old_urls) != (pair[1] in old_urls)]
        figures.update(requests=len(calls), failed=len(failed), answers_of_neither_model=len(mixed),
                       legs_logged=len(legs), legs_crossing_models=len(crossed),
                       answered_by_new=sum(1 for c in calls if c.text == new[c.body["prompt"]] != old[c.body["prompt"]]))
        print(f"measured: model change: {json.dumps(figures)}")
        assert failed == [] and mixed == [] and crossed == [], (failed[:3], mixed[:3], crossed[:3])
        assert figures["answered_by_new"] > 0 and len(legs) >= len(calls)
        down = d.cli("down", timeout=300)
        assert "is down" in down.stderr
        assert_nothing_left(lab)
    finally:
        d.cli("down", check=None, timeout=300)
