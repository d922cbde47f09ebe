"""Connector counters: thread-safe, logged once per interval, dumped to a JSON file for `yrpd status`.

The file is rewritten atomically (write to a temp file, rename) so a reader never sees half a
document. Schema (version 1):

    {"schema": "yrpd.connector.stats/1", "time": <unix s>, "started": <unix s>, "pid": ..,
     "side": "scheduler"|"worker", "role": "kv_producer"|.., "rank": 0, "dp": 0, "namespace": "<16 hex>",
     "ds_address": "host:port", "ds_healthy": true,
     "counters": {"saved_blocks": .., "saved_bytes": .., ...},
     "latency_ms": {"save": {"count": .., "total": .., "max": .., "last": ..}, "load": {...}}}
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from typing import Any, Callable

SCHEMA = "yrpd.connector.stats/1"

COUNTERS = (
    # producer (worker side)
    "saved_blocks", "saved_bytes", "save_skipped_existing", "save_failed_blocks", "save_dropped_blocks",
    # ... of save_failed_blocks, those the worker had no room for: refused (out of memory), or taken without error
    # and evicted at once or by the writer's next write (its memory full of entries it may not evict; saver.py)
    "save_failed_memory_full_blocks",
    # producer (scheduler side): blocks of requests that stay on the instance, not copied out again because it
    # saved them within resave_after_s
    "save_skipped_recent_blocks",
    # consumer (scheduler side): blocks asked about / found / not found before promising tokens
    "lookup_requests", "lookup_blocks", "lookup_hit_blocks", "lookup_miss_blocks", "lookup_errors",
    "lookup_waits", "handoff_missed_blocks", "handoff_refused",
    # consumer (worker side)
    "loaded_blocks", "loaded_bytes", "load_failed_blocks", "deleted_blocks",
    # transport
    "ds_errors", "ds_reconnects",
)
#: save: the writer's job (beside the engine); load; lookup (the scheduler's, in its step); stage: what a step's
#: saves cost the engine itself (copying the blocks out of the paged cache before it samples)
LATENCIES = ("save", "load", "lookup", "stage")


class Latency:
    __slots__ = ("count", "total", "max", "last")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.max = 0.0
        self.last = 0.0

    def add(self, ms: float) -> None:
        self.count += 1
        self.total += ms
        self.last = ms
        if ms > self.max:
            self.max = ms

    def as_dict(self) -> dict:
        avg = self.total / self.count if self.count else 0.0
        return {"count": self.count, "total": round(self.total, 3), "avg": round(avg, 3),
                "max": round(self.max, 3), "last": round(self.last, 3)}


class ConnectorStats:
    def __init__(self, side: str, role: str, rank: int = 0, namespace: str = "", ds_address: str = "") -> None:
        self.side = side
        self.role = role
        self.rank = rank
        self.dp = 0
        self.namespace = namespace
        self.ds_address = ds_address
        self.ds_healthy = True
        self.started = time.time()
        self._lock = threading.Lock()
        self._counters = {name: 0 for name in COUNTERS}
        self._lat = {name: Latency() for name in LATENCIES}
        self._last_logged: dict[str, int] = {}

    def inc(self, name: str, n: int = 1) -> None:
        if not n:
            return
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + n

    def observe(self, name: str, ms: float) -> None:
        with self._lock:
            self._lat.setdefault(name, Latency()).add(ms)

    def get(self, name: str) -> int:
        with self._lock:
            return self._counters.get(name, 0)

    def snapshot(self) -> dict:
        with self._lock:
            counters = dict(self._counters)
            lat = {k: v.as_dict() for k, v in self._lat.items()}
        return {
            "schema": SCHEMA, "time": round(time.time(), 3), "started": round(self.started, 3),
            "pid": os.getpid(), "side": self.side, "role": self.role, "rank": self.rank,
            "dp": self.dp, "namespace": self.namespace, "ds_address": self.ds_address, "ds_healthy": self.ds_healthy,
            "counters": counters, "latency_ms": lat,
        }

    def summary_line(self) -> str | None:
        """One INFO line with what changed since the last call (None if nothing did)."""
        snap = self.snapshot()
        counters = snap["counters"]
        changed = {k: v for k, v in counters.items() if v != self._last_logged.get(k, 0)}
        if not changed:
            return None
        self._last_logged = counters
        parts = [f"{k}={v}" for k, v in counters.items() if v]
        for name, lat in snap["latency_ms"].items():
            if lat["count"]:
                parts.append(f"{name}_ms_avg={lat['avg']} {name}_ms_max={lat['max']}")
        dp = f" dp{self.dp}" if self.dp else ""
        return (f"yrpd connector [{self.side} {self.role}{dp} rank{self.rank} ns={self.namespace}"
                f"{'' if self.ds_healthy else ' DS DOWN'}]: " + " ".join(parts))


def write_json_atomic(path: str, data: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".stats-", dir=directory)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, sort_keys=True)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_stats_file(path: str) -> dict | None:
    """For status tools: the last counters a connector wrote, or None if absent/unreadable."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return None
    return data


class StatsReporter:
    """Daemon thread: at start, every interval and when woken (the data system went down or came back), log the
    counters at INFO and rewrite the stats file. The deploy waits on the file's ds_healthy (wait_ready.py), so a
    link that comes up shows within a moment, not an interval."""

    def __init__(self, stats: ConnectorStats, interval_s: float, path: str | None,
                 logger: logging.Logger, extra: Callable[[], dict[str, Any]] | None = None) -> None:
        self.stats = stats
        self.interval_s = interval_s
        self.path = path
        self.logger = logger
        self.extra = extra
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"yrpd-kv-stats-{stats.side}", daemon=True)

    def start(self) -> "StatsReporter":
        self._thread.start()
        return self

    def flush(self) -> None:
        line = self.stats.summary_line()
        if line:
            self.logger.info(line)
        if self.path:
            data = self.stats.snapshot()
            if self.extra:
                try:
                    data.update(self.extra())
                except Exception:  # never let reporting break the engine
                    pass
            try:
                write_json_atomic(self.path, data)
            except OSError as e:
                self.logger.warning("yrpd connector: cannot write stats file %s: %s", self.path, e)

    def wake(self) -> None:
        """Rewrite the file now, from the reporter's thread."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.flush()
            except Exception as e:  # pragma: no cover - defensive
                self.logger.warning("yrpd connector: stats reporter error: %s", e)
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        try:
            self.flush()
        except Exception:
            pass
