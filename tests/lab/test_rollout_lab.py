"""Host maintenance and a rolling spec change under load on the shared 3-host deployment (issue 34;
tests/lab/fixtures.py `three_hosts`, after the scale test joined h3): `yrpd drain h2` moves h2's decode instance to
h3, `yrpd undrain h2` brings h2 back, then `yrpd deploy` with a changed engine flag replaces every instance one by
one, while clients keep sending requests, none of which may fail or come back different from the answers before
(greedy: the same model and weights answer the same). The changed spec stays the deployment's for the tests after.

    YRPD_ROLLOUT_REPORT=FILE.json writes the figures with their provenance and whether the test passed.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from lab.hosts import session_processes
from tests.doc_commands import commands, moves_a_host, words
from tests.lab.test_scale_lab import PACE_S, PROMPTS, Load

pytestmark = pytest.mark.lab

REPORT_VARIABLE = "YRPD_ROLLOUT_REPORT"

FLAG = ["--max-num-seqs", "8"]


def instances_on(host) -> list[str]:
    """Command lines of the vLLM API servers running on a fake host (their supervisors aside)."""
    return [p for p in session_processes(host)
            if re.search(r"(/vllm|vllm\.entrypoints\.cli\.main) serve ", p) and "supervise" not in p]


def placed(report: dict) -> list[tuple[str, str]]:
    return [(i["name"], i["host"]) for i in report["instances"]]


def test_drain_a_host_then_roll_an_engine_flag_under_load_fails_no_request(three_hosts, lab_figures, tmp_path):
    d, lab, figures = three_hosts, three_hosts.lab, lab_figures
    expected = {p: d.ask(p, 16, timeout=120).text for p in PROMPTS}
    assert all(expected.values()), expected
    before, _ = d.healthy()
    assert placed(before) == [("prefill-0", "h1"), ("decode-0", "h2")]
    assert {c["host"] for c in before["cluster"]["components"]} == {"h1", "h2", "h3"}  # h3 free, in the cluster
    drain, undrain = commands(moves_a_host)  # the README's: yrpd drain h2, yrpd undrain h2
    with Load(d.proxy, expected, pace_s=PACE_S) as load:
        time.sleep(5)
        t0 = time.monotonic()
        out = d.cli(*words(drain), timeout=900)
        figures["drain_s"] = round(time.monotonic() - t0, 1)
        assert "h2 is drained" in out.stderr and "added decode-1; drained and stopped decode-0" in out.stderr, \
            out.stderr
        report, _ = d.healthy()
        assert placed(report) == [("prefill-0", "h1"), ("decode-1", "h3")] and report["drained"] == ["h2"]
        assert instances_on(lab["h2"]) == [] and len(instances_on(lab["h3"])) == 1  # moved, nothing left on h2
        back = d.cli(*words(undrain), timeout=300)
        assert "h2 is back" in back.stderr and "nothing moved" in back.stderr, back.stderr
        time.sleep(5)

        changed = d.spec_now(tmp_path / "changed.yaml", engine_args=FLAG)
        t1 = time.monotonic()
        rolled = d.cli("deploy", "--hosts", ",".join(d.names), "--config", str(changed), timeout=1500)
        figures["roll_s"] = round(time.monotonic() - t1, 1)
        assert "engine_args: [] -> ['--max-num-seqs', '8'] (roll)" in rolled.stderr, rolled.stderr
        assert "changed session" in rolled.stderr and rolled.stdout.strip() == d.proxy, rolled.stdout
        d.config = changed  # the deployment's spec from now on, for the tests that use it after this one
        time.sleep(5)
    after, _ = d.healthy()
    # one instance at a time onto the one free device: prefill to h2, then decode to h1 (freed by prefill-0)
    assert placed(after) == [("prefill-1", "h2"), ("decode-0", "h1")]
    assert after["drained"] == [] and after["generation"] - before["generation"] == 3  # drained, undrained, rolled
    vllm = [p for h in lab.hosts for p in instances_on(h)]
    assert len(vllm) == 2 and all(" ".join(FLAG) in p for p in vllm), vllm
    figures.update(requests=len(load.calls), failed=len(load.bad()),
                   during_roll=sum(1 for c in load.calls if c.started >= t1 - 1))
    print(f"measured: rollout: {json.dumps(figures)}")
    assert load.bad() == [], load.bad()[:5]
    assert figures["during_roll"] > 0
