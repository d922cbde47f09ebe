"""Counters the proxy keeps, written in the Prometheus text format by hand (no client library on the hosts)."""

from __future__ import annotations

import statistics
import time
from collections import Counter, deque

from .pool import INDEX_OUTCOMES, Pool

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
OWN_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
RECENT = 2000  # own-overhead samples kept for percentiles
DEGRADED_HOW = ("decode alone", "prefill alone", "prefill leg failed")
MIGRATION_OUTCOMES = ("sent again", "carried over", "ended by the proxy", "not carried over")
LATENCY_KEPT_S = 600.0  # how far back the TTFT/ITL windows of /yrpd/status may look (the SLA planner's input)


class Histogram:
    def __init__(self, buckets=TTFT_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)  # cumulative, as Prometheus wants them
        self.sum = 0.0
        self.count = 0

    def samples(self) -> list:
        """(suffix, labels, value) rows of this histogram in the Prometheus text format."""
        return [*(("_bucket", {"le": _number(b)}, c) for b, c in zip(self.buckets, self.counts)),
                ("_bucket", {"le": "+Inf"}, self.count), ("_sum", {}, self.sum), ("_count", {}, self.count)]

    def observe(self, value: float) -> None:
        for n, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[n] += 1
        self.sum += value
        self.count += 1


class Metrics:
    def __init__(self):
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> count
        #: requests whose leg broke, by what the proxy did: "sent again" (nothing had reached the client), "carried
        #: over" (a stream going on elsewhere), "ended by the proxy" (its last token was out), "not carried over"
        self.migrations: Counter[str] = Counter()
        #: answers without a hand-over: "decode alone" / "prefill alone" (the other role had no instance up),
        #: "prefill leg failed" (decode computed the prompt)
        self.degraded_answers: Counter[str] = Counter()
        self.degraded_s = 0.0  # seconds PD was degraded, the spells that ended
        self.ttft = Histogram()
        #: successful prefill legs, sent to answered: the part of a first token's wait that prefill routing chooses
        #: (the rest is decode's: its queue, the load of the hand-over, the prompt's last partial block)
        self.prefill = Histogram()
        self.own = Histogram(OWN_BUCKETS)
        self._recent_own: deque[float] = deque(maxlen=RECENT)
        #: (monotonic time, seconds) of streamed requests: time to first token, mean time between later tokens
        self._ttft_at: deque[tuple[float, float]] = deque()
        self._itl_at: deque[tuple[float, float]] = deque()

    def observe_stream(self, now: float, ttft: float | None = None, itl: float | None = None) -> None:
        for kept, value in ((self._ttft_at, ttft), (self._itl_at, itl)):
            if value is None:
                continue
            kept.append((now, value))
            while kept and kept[0][0] < now - LATENCY_KEPT_S:
                kept.popleft()

    def latency(self, window_s: float, now: float) -> dict:
        """p50/p90 in ms of TTFT and ITL over the streamed requests of the last `window_s` seconds."""
        out = {"window_s": window_s}
        for name, kept in (("ttft_ms", self._ttft_at), ("itl_ms", self._itl_at)):
            values = sorted(v for t, v in kept if t >= now - window_s)
            pick = (lambda q: round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 1))
            out[name] = {"n": len(values), "p50": pick(0.5) if values else None, "p90": pick(0.9) if values else None}
        return out

    def observe_own(self, seconds: float) -> None:
        self.own.observe(seconds)
        self._recent_own.append(seconds)

    def own_percentiles(self) -> dict:
        """p50/p90/p99 in ms of the proxy's own time over the last RECENT successful generations."""
        values = sorted(self._recent_own)
        if not values:
            return {"n": 0, "p50": None, "p90": None, "p99": None}
        pick = (lambda q: round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 2))
        return {"n": len(values), "p50": round(statistics.median(values) * 1000, 2), "p90": pick(0.9),
                "p99": pick(0.99)}

    def render(self, pool: Pool, degraded_since: float | None = None, kv_index: dict[str, dict] | None = None,
               store: dict | None = None) -> str:
        """The exposition text; `kv_index`: each instance's KV index state by URL (yrpd.proxy.kvfeed), where the
        proxy follows KV-cache events; `store`: the data system's index state (kvindex.Store.state)."""
        out: list[str] = []

        def family(name: str, kind: str, help_: str, samples) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{suffix}{_labels(labels)} {_number(value)}" for suffix, labels, value in samples)

        family("yrpd_proxy_requests_total", "counter", "Requests answered by the proxy, by endpoint and HTTP status.",
               [("", {"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())])
        instances = [({"instance": i.url, "role": i.role}, i) for i in pool.instances]
        family("yrpd_proxy_in_flight", "gauge", "Requests in flight to an instance.",
               [("", labels, i.in_flight) for labels, i in instances])
        family("yrpd_proxy_instance_up", "gauge", "1 while the instance is in rotation.",
               [("", labels, int(i.up)) for labels, i in instances])
        family("yrpd_proxy_upstream_errors_total", "counter",
               "Failed requests to an instance (connection error, 5xx, timeout, broken stream).",
               [("", labels, i.errors) for labels, i in instances])
        family("yrpd_proxy_upstream_requests_total", "counter", "Requests sent to an instance.",
               [("", labels, i.requests) for labels, i in instances])
        if kv_index is not None:
            family("yrpd_proxy_kv_index_blind", "gauge",
                   "1 while the proxy cannot see the instance's prefix cache exactly (no KV-cache events, a gap, "
                   "silence after a leg that stored blocks, the instance down): it is routed on the estimate then.",
                   [("", labels, int(kv_index.get(i.url, {}).get("sight") != "seeing")) for labels, i in instances])
            family("yrpd_proxy_kv_index_blocks", "gauge", "KV blocks the instance's events say its prefix cache holds.",
                   [("", labels, kv_index.get(i.url, {}).get("blocks", 0)) for labels, i in instances])
            family("yrpd_proxy_kv_index_gaps_total", "counter",
                   "Times the proxy went blind to the instance's prefix cache.",
                   [("", labels, kv_index.get(i.url, {}).get("gaps", 0)) for labels, i in instances])
            family("yrpd_proxy_kv_index_checked_blocks_total", "counter",
                   "Prompt blocks of prefill legs routed on the instance's KV-cache events, against what its prefix "
                   "cache had when the leg was scheduled (its connector says): right (the index said held), "
                   "claimed_absent (said held, not there), held_unclaimed (there, not said).",
                   [("", {**labels, "outcome": k}, i.index_checked[k]) for labels, i in instances
                    if i.role == "prefill" for k in INDEX_OUTCOMES])
        if store is not None:
            workers = sorted((store.get("workers") or {}).items())
            family("yrpd_proxy_store_index_blind", "gauge",
                   "1 while the proxy cannot see what the host's data-system worker holds of the connector's blocks "
                   "exactly (a batch of its events missed, or joined after it had stored): loads are routed on the "
                   "estimate then.",
                   [("", {"host": host}, int(w.get("sight") == "blind")) for host, w in workers])
            family("yrpd_proxy_store_index_blocks", "gauge",
                   "Blocks the host's data-system worker holds of the connector's, as its own KV events say.",
                   [("", {"host": host}, w.get("blocks", 0)) for host, w in workers])
            tiered = [(host, w) for host, w in workers if "on_disk" in w]
            if tiered:
                family("yrpd_proxy_store_index_on_disk_blocks", "gauge",
                       "Of those, the blocks the proxy takes for spilled to the worker's disk tier (the least recently "
                       "stored or loaded beyond what its memory holds): their loads are costed as disk reads.",
                       [("", {"host": host}, w["on_disk"]) for host, w in tiered])
            family("yrpd_proxy_store_index_gaps_total", "counter",
                   "Times the proxy went blind to the host's data-system worker.",
                   [("", {"host": host}, w.get("gaps", 0)) for host, w in workers])
        family("yrpd_proxy_migrations_total", "counter",
               "Requests whose instance broke off, by what the proxy did: sent again (nothing had reached the client), "
               "carried over (a stream going on on another instance), ended by the proxy (its last token was out), "
               "not carried over (the stream ended with an error event).",
               [("", {"outcome": k}, self.migrations[k]) for k in MIGRATION_OUTCOMES])
        family("yrpd_proxy_degraded_answers_total", "counter",
               "Answers without a hand-over: by one role alone (the other had no instance up) or after the prefill "
               "leg failed (decode computed the prompt).",
               [("", {"how": k}, self.degraded_answers[k]) for k in DEGRADED_HOW])
        family("yrpd_proxy_degraded", "gauge", "1 while one role has no instance up and the other answers alone.",
               [("", {}, int(degraded_since is not None))])
        family("yrpd_proxy_degraded_seconds_total", "counter", "Seconds PD serving was degraded.",
               [("", {}, round(self.degraded_s + (time.time() - degraded_since if degraded_since else 0.0), 3))])
        family("yrpd_proxy_ttft_seconds", "histogram",
               "Streamed requests: seconds from the request's arrival to the first byte from decode.",
               self.ttft.samples())
        family("yrpd_proxy_prefill_seconds", "histogram",
               "Successful prefill legs: seconds from sending the leg to its answer (the prefill instance's queue and "
               "compute, the part of the first token's wait that prefill routing chooses).", self.prefill.samples())
        family("yrpd_proxy_own_seconds", "histogram",
               "Successful generations: seconds the proxy itself spent before the first token (streamed) or the "
               "answer, not counting the waits for prefill and decode.", self.own.samples())
        return "\n".join(out) + "\n"


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)
