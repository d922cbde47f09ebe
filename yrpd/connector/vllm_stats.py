"""The connector's counters in vLLM's own metrics pipeline.

Each step vLLM asks the connector (worker and scheduler side) for `get_kv_connector_stats()`;
we hand over the counter increments since the previous call. vLLM sums them across workers,
logs them with its periodic "KV Transfer metrics" line and, through `build_prom_metrics`,
exports `vllm:yrpd_kv_<counter>_total` Prometheus counters on /metrics.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from yrpd.connector.stats import COUNTERS

PROM_PREFIX = "vllm:yrpd_kv_"


class YuanrongKVStats(KVConnectorStats):
    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for k, v in (other.data or {}).items():
            if isinstance(v, (int, float)):
                merged[k] = merged.get(k, 0) + v
        return YuanrongKVStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in sorted(self.data.items()) if isinstance(v, (int, float)) and v}

    def is_empty(self) -> bool:
        return not any(v for v in self.data.values() if isinstance(v, (int, float)))


def delta_stats(connector: Any) -> YuanrongKVStats | None:
    """Counter increments since the previous call on this connector instance."""
    snap = connector.stats.snapshot()["counters"]
    with connector._stats_lock:
        last = connector._last_vllm_stats
        delta = {k: v - last.get(k, 0) for k, v in snap.items() if v != last.get(k, 0)}
        connector._last_vllm_stats = snap
    if not delta:
        return None
    return YuanrongKVStats(data=delta)


class YuanrongPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name in COUNTERS:
            counter = self._counter_cls(
                name=f"{PROM_PREFIX}{name}",
                documentation=f"yrpd openYuanrong KV connector: {name.replace('_', ' ')}",
                labelnames=labelnames,
            )
            self._counters[name] = {idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name, value in (transfer_stats_data or {}).items():
            per_engine = self._counters.get(name)
            if per_engine is None or not isinstance(value, (int, float)) or value <= 0:
                continue
            metric = per_engine.get(engine_idx)
            if metric is not None:
                metric.inc(value)
