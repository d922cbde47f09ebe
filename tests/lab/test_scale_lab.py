"""`yrpd scale` under load on 3 fake hosts (issue 34): 1 prefill + 1 decode on h1 and h2 -> 1P2D with h3 added to the
deployment by the same command -> 1P1D while clients keep sending requests, none of which may fail or come back wrong;
the new decode instance serves within its start time plus 10 s; the removed one is drained before it stops (its last
requests end with their full answers).

    YRPD_SCALE_REPORT=FILE.json writes the figures with their provenance.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from lab.hosts import assert_nothing_left, session_processes
from lab.report import report_and_down
from lab.traffic import LONG, Call, TwoHosts, body
from tests.doc_commands import commands, scales_a_deployment, words

pytestmark = pytest.mark.lab

PROMPTS = [f"{LONG}\n# scale {i}" for i in range(3)] + ["The capital of France is", "import os\nimport sys\n"]


class Load:
    """`clients` threads sending greedy requests in turn (every other one streamed) until stopped; each answer is
    compared with the one the deployment gave before the load."""

    def __init__(self, proxy: str, expected: dict[str, str], clients: int = 4) -> None:
        self.proxy, self.expected = proxy, expected
        self.calls: list[Call] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(n,), daemon=True) for n in range(clients)]

    def _client(self, n: int) -> None:
        i = n
        while not self.stop.is_set():
            prompt = list(self.expected)[i % len(self.expected)]
            call = Call(self.proxy, body(prompt, 16, stream=i % 2 == 1), timeout=120)
            call.run()
            self.calls.append(call)
            i += 1

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(150)

    def bad(self, since: float = 0.0) -> list[tuple]:
        return [(c.body["prompt"][-20:], c.status, c.failure, c.error_event, c.text[:40], c.raw[:200])
                for c in self.calls if c.started >= since and
                (c.status != 200 or c.error_event or c.text != self.expected[c.body["prompt"]])]


def proxy_instances(d: TwoHosts) -> dict[str, dict]:
    report, _ = d.status()
    return {i["name"]: i for i in report["instances"]}, report


def test_scale_out_and_back_in_under_load_fails_no_request(fake_lab, tmp_path):
    lab = fake_lab(3)
    d = TwoHosts(lab, tmp_path, n=3)
    figures: dict = {}
    try:
        figures["deploy_s"] = round(d.deploy(on=2), 1)  # h3 joins with the scale-out
        expected = {p: d.ask(p, 16, timeout=120).text for p in PROMPTS}
        assert all(expected.values()), expected
        before, _ = d.healthy()
        assert [i["name"] for i in before["instances"]] == ["prefill-0", "decode-0"]
        with Load(d.proxy, expected) as load:
            time.sleep(5)
            t0 = time.monotonic()
            [documented] = commands(scales_a_deployment)  # the README's: 1 decode instance -> 2, h3 added
            out = d.cli(*words(documented), timeout=900)
            figures["scale_out_s"] = round(time.monotonic() - t0, 1)
            assert "now runs 1 prefill and 2 decode instances: added decode-1" in out.stderr, out.stderr
            assert "join h3: its data system worker joins the cluster" in out.stderr, out.stderr
            # it serves: the proxy routes requests to it, within its start plus 10 s
            served_at = None
            while served_at is None and time.monotonic() - t0 < figures["scale_out_s"] + 10:
                instances, report = proxy_instances(d)
                if (instances.get("decode-1") or {}).get("routed", {}).get("requests"):
                    served_at = time.monotonic() - t0
                else:
                    time.sleep(0.5)
            assert served_at is not None, instances.get("decode-1")
            figures["decode_1_first_request_s"] = round(served_at, 1)
            assert instances["decode-1"]["host"] == "h3" and report["healthy"], report["problems"]
            time.sleep(10)
            routed = proxy_instances(d)[0]["decode-1"]["routed"]["requests"]
            t1 = time.monotonic()
            back = d.cli("scale", "--decode", "1", timeout=900)
            figures["scale_in_s"] = round(time.monotonic() - t1, 1)
            assert "drained and stopped decode-1" in back.stderr, back.stderr
            time.sleep(5)
        after, _ = d.healthy()
        assert [i["name"] for i in after["instances"]] == ["prefill-0", "decode-0"]
        # h3 stays in the deployment: its data system worker is part of the cluster, in status and torn down by down
        assert {c["host"] for c in after["cluster"]["components"]} == {"h1", "h2", "h3"}
        assert (before.get("generation"), after.get("generation")) == (1, 3)  # deployed, scaled out, scaled in
        figures.update(requests=len(load.calls), failed=len(load.bad()), decode_1_requests=routed,
                       during_scale_in=sum(1 for c in load.calls if c.started >= t1 - 1))
        print(f"measured: scale: {json.dumps(figures)}")
        assert load.bad() == [], load.bad()[:5]
        assert routed > 0
        h3 = lab["h3"]
        assert not [p for p in session_processes(h3) if "decode-1" in p], session_processes(h3)
        down = d.cli("down", timeout=300)
        assert "is down" in down.stderr
        assert_nothing_left(lab)
    finally:
        report_and_down(d, figures, "YRPD_SCALE_REPORT", "tests/lab/test_scale_lab.py")
