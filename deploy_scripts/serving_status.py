"""Probe this host's vLLM instances and proxy for `yrpd status` (run by yrpd, stdlib only).

Args: one JSON object {"dir": host session dir, "instances": [{"name", "url"}], "proxy": {"url"} or null}.
Prints one JSON line: per instance its /health answer, requests running/waiting and external-cache hits
from /metrics, and the KV connector's counters from the stats files its running processes write; for the proxy
/health and /yrpd/status.
"""
import json
import sys
import threading

from hostlib import live_stats

args = json.loads(sys.argv[1])
kv_stats = args["kv_stats"]  # yrpd.layout's template: {name} is the instance
TIMEOUT = 2.0


def fetch(url):
    """(status, body) or (None, error text)."""
    # imported here: most hosts of a large deployment run no instance, and urllib costs them 20 ms of CPU a query
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return None, str(getattr(exc, "reason", exc))


def metric_sums(text, names):
    """Sum of each named metric over its label sets; `name{source}` keys split a metric by its source label."""
    sums = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        source = line.split('source="', 1)[1].split('"', 1)[0] if 'source="' in line else None
        key = f"{name}{{{source}}}" if source and f"{name}{{{source}}}" in names else name
        if key in names:
            try:
                sums[key] = sums.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return sums


METRICS = {
    "vllm:num_requests_running": "requests_running",
    "vllm:num_requests_waiting": "requests_waiting",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:external_prefix_cache_hits_total": "external_cache_hit_tokens",
    "vllm:external_prefix_cache_queries_total": "external_cache_query_tokens",
    # where each prompt token's KV came from (vLLM >= 0.11): computed, this instance's prefix cache, a connector
    "vllm:prompt_tokens_by_source_total{local_compute}": "prompt_tokens_computed",
    "vllm:prompt_tokens_by_source_total{local_cache_hit}": "prompt_tokens_local_cache",
    "vllm:prompt_tokens_by_source_total{external_kv_transfer}": "prompt_tokens_loaded",
}


def connector_counters(name):
    totals, files = {}, live_stats(kv_stats.format(name=name))
    healthy = None
    for _, doc in files:
        for key, value in doc.get("counters", {}).items():
            if isinstance(value, (int, float)):
                totals[key] = totals.get(key, 0) + value
        # the connector's time by kind (stage: what saving cost the engine's own steps), summed like the counters
        for key, lat in (doc.get("latency_ms") or {}).items():
            if isinstance(lat, dict) and isinstance(lat.get("total"), (int, float)):
                totals[f"{key}_ms"] = round(totals.get(f"{key}_ms", 0) + lat["total"], 3)
        if "ds_healthy" in doc:
            healthy = doc["ds_healthy"] if healthy is None else (healthy and doc["ds_healthy"])
    return {"counters": totals, "ds_healthy": healthy, "files": len(files)}


def probe_instance(inst, out):
    status, body = fetch(inst["url"] + "/health")
    entry = {"name": inst["name"], "health_status": status, "healthy": status == 200}
    if status is None:
        entry["error"] = body
    if status == 200:
        m_status, text = fetch(inst["url"] + "/metrics")
        if m_status == 200:
            sums = metric_sums(text, METRICS)
            entry.update({label: sums.get(name) for name, label in METRICS.items()})
    entry["connector"] = connector_counters(inst["name"])
    out.append(entry)


def probe_proxy(proxy, out):
    status, body = fetch(proxy["url"] + "/health")
    entry = {"health_status": status, "healthy": status == 200}
    if status is None:
        entry["error"] = body
    s_status, text = fetch(proxy["url"] + "/yrpd/status")
    if s_status == 200:
        try:
            entry["status"] = json.loads(text)
        except ValueError:
            pass
    out.append(entry)


instances, proxies = [], []
threads = [threading.Thread(target=probe_instance, args=(i, instances)) for i in args["instances"]]
if args.get("proxy"):
    threads.append(threading.Thread(target=probe_proxy, args=(args["proxy"], proxies)))
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"instances": instances, "proxy": proxies[0] if proxies else None}))
