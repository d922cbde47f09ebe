"""`yrpd scale` under load on the shared 3-host deployment (issue 34; tests/lab/fixtures.py `three_hosts`, which this
test is the first to use): 1 prefill + 1 decode on h1 and h2 -> 1P2D with h3 added to the deployment by the same
command -> 1P1D while clients keep sending requests, none of which may fail or come back wrong; the new decode instance
serves within its start time plus 10 s; the removed one is drained before it stops: the proxy takes it out of routing
(no request is routed to it from then on) and it leaves only once nothing is in flight on it, so its last requests
end with their full answers.

    YRPD_SCALE_REPORT=FILE.json writes the figures with their provenance and whether the test passed.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
import uuid

import pytest

from lab.hosts import session_processes
from lab.traffic import LONG, Call, TwoHosts, body
from tests.doc_commands import commands, scales_a_deployment, words

pytestmark = pytest.mark.lab

REPORT_VARIABLE = "YRPD_SCALE_REPORT"

PROMPTS = [f"{LONG}\n# scale {i}" for i in range(3)] + ["The capital of France is", "import os\nimport sys\n"]


#: each client's pause between answers where a change is made under traffic (scale, rollout, model change): requests
#: go on arriving through every step, a few a second, without the clients holding both cores of the CI machine for
#: the minutes a change takes (back to back they did: the other lane's tests waited on the CPU)
PACE_S = 0.5


class Load:
    """`clients` threads sending greedy requests in turn (every other one streamed, or `request(prompt, i)`'s body)
    until stopped, each waiting `pace_s` after an answer before its next request (0: back to back); each answer is
    compared with the one the deployment gave before the load."""

    def __init__(self, proxy: str, expected: dict[str, str], clients: int = 4, request=None,
                 timeout: float = 120, pace_s: float = 0.0) -> None:
        self.proxy, self.expected = proxy, expected
        self.request = request or (lambda prompt, i: body(prompt, 16, stream=i % 2 == 1))
        self.timeout, self.pace_s = timeout, pace_s
        self.calls: list[Call] = []
        self.current: dict[int, Call] = {}  # each client's call in flight, or its last one
        self.tag = uuid.uuid4().hex[:6]
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(n,), daemon=True) for n in range(clients)]

    def _client(self, n: int) -> None:
        i = n
        while not self.stop.is_set():
            prompt = list(self.expected)[i % len(self.expected)]
            # a request id of its own: `yrpd logs --request` and the proxy's log lines name it
            call = Call(self.proxy, self.request(prompt, i), timeout=self.timeout,
                        request_id=f"load-{self.tag}-{n}-{i}")
            self.current[n] = call
            call.run()
            self.calls.append(call)
            i += 1
            self.stop.wait(self.pace_s)

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


class Routing(threading.Thread):
    """The proxy's view of one instance, sampled every 0.1 s until stopped: (time, present, draining, in flight,
    legs routed to it so far)."""

    def __init__(self, proxy: str, url: str) -> None:
        super().__init__(daemon=True)
        self.proxy, self.url = proxy, url
        self.samples: list[tuple[float, bool, bool, int, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(f"{self.proxy}/yrpd/status", timeout=5) as resp:
                    seen = {i["url"]: i for i in json.load(resp)["instances"]}
            except OSError:
                continue
            i = seen.get(self.url)
            self.samples.append((time.monotonic(), i is not None, bool(i and i["draining"]),
                                 i["in_flight"] if i else 0, i["requests"] if i else -1))
            self.stop.wait(0.1)

    def drained_first(self) -> dict:
        """What the samples show of the drain: when it began, what was in flight then, whether anything was routed
        to the instance after it, and whether it left the proxy's list only once nothing was in flight on it."""
        draining = [s for s in self.samples if s[1] and s[2]]
        assert draining, f"the proxy never listed {self.url} as draining: {self.samples[-5:]}"
        first, last = draining[0], draining[-1]
        gone = [s for s in self.samples if s[0] > last[0] and not s[1]]
        return {"in_flight_when_draining_began": first[3],
                "routed_after_draining_began": max(s[4] for s in draining) - first[4],
                "in_flight_when_last_seen": last[3], "left_the_proxy": bool(gone),
                "draining_seen_s": round(last[0] - first[0], 1)}


def test_scale_out_and_back_in_under_load_fails_no_request(three_hosts, lab_figures):
    d, lab, figures = three_hosts, three_hosts.lab, lab_figures
    expected = {p: d.ask(p, 16, timeout=120).text for p in PROMPTS}
    assert all(expected.values()), expected
    before, _ = d.healthy()
    assert [i["name"] for i in before["instances"]] == ["prefill-0", "decode-0"]
    assert {c["host"] for c in before["cluster"]["components"]} == {"h1", "h2"}  # h3 joins with the scale-out
    with Load(d.proxy, expected, pace_s=PACE_S) as load:
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
        watch = Routing(d.proxy, instances["decode-1"]["url"])
        watch.start()
        t1 = time.monotonic()
        back = d.cli("scale", "--decode", "1", timeout=900)
        figures["scale_in_s"] = round(time.monotonic() - t1, 1)
        assert "drained and stopped decode-1" in back.stderr, back.stderr
        time.sleep(5)
        watch.stop.set()
        watch.join(10)
    after, _ = d.healthy()
    assert [i["name"] for i in after["instances"]] == ["prefill-0", "decode-0"]
    # h3 stays in the deployment: its data system worker is part of the cluster, in status and torn down by down
    assert {c["host"] for c in after["cluster"]["components"]} == {"h1", "h2", "h3"}
    assert after["generation"] - before["generation"] == 2  # scaled out, scaled in
    drain = watch.drained_first()
    figures.update(requests=len(load.calls), failed=len(load.bad()), decode_1_requests=routed,
                   during_scale_in=sum(1 for c in load.calls if c.started >= t1 - 1), drain=drain)
    print(f"measured: scale: {json.dumps(figures)}")
    assert load.bad() == [], load.bad()[:5]
    assert routed > 0
    # drained first: out of routing (nothing routed to it from then on) and gone from the proxy only once nothing was
    # in flight on it; the requests it still had then ended whole (load.bad above)
    assert drain["routed_after_draining_began"] == 0 and drain["left_the_proxy"], drain
    assert drain["in_flight_when_last_seen"] == 0, drain
    assert figures["during_scale_in"] > 0  # the load went on through the scale-in
    h3 = lab["h3"]
    assert not [p for p in session_processes(h3) if "decode-1" in p], session_processes(h3)
