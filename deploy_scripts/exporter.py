"""One host's Prometheus metrics (run by yrpd under its supervisor, stdlib only): the data system worker's figures
from its resource.log and the KV connector's counters from the stats files its instances on this host write.

Args: one JSON object {"host": address to listen on, "port": N, "host_name": the plan's name of this host,
"resource_log": the worker's resource.log, "stats": glob of the connector's stats files}, or the path of a file
holding it (how yrpd starts it: the cluster's teardown keeps its data while a process names the cluster's directory
on its command line, and the resource.log path would). Serves GET /metrics in the
Prometheus text format (computed on each scrape from the files: nothing runs between scrapes) and GET /health.
"""
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hostlib import ds_resource, live_stats

_arg = sys.argv[1]
if _arg.lstrip().startswith("{"):
    args = json.loads(_arg)
else:
    with open(_arg) as _fh:
        args = json.load(_fh)
HOST_LABEL = args["host_name"]

DS_GAUGES = (("memory_used", "yrpd_ds_memory_used_bytes", "Shared memory the data system worker holds objects in."),
             ("memory_limit", "yrpd_ds_memory_limit_bytes", "The worker's shared memory limit."),
             ("disk_used", "yrpd_ds_disk_used_bytes", "Bytes in the worker's disk tier (spill)."),
             ("disk_limit", "yrpd_ds_disk_limit_bytes", "The worker's disk tier limit."),
             ("objects", "yrpd_ds_objects", "Objects the worker holds."))
DS_HITS = (("hits_memory", "memory"), ("hits_disk", "disk"), ("hits_remote", "remote"))


def family(out, name, kind, text, samples):
    out.append(f"# HELP {name} {text}")
    out.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        shown = ",".join(f'{k}="{str(v)}"' for k, v in labels.items())
        out.append(f"{name}{{{shown}}} {value}")


def last_line(path):
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 8192))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    return lines[-1] if lines else None


def render():
    out = []
    host = {"host": HOST_LABEL}
    line = last_line(args["resource_log"])
    use = None
    if line:
        try:
            use = ds_resource(line)
        except ValueError:
            use = None
    family(out, "yrpd_ds_up", "gauge", "1 while the worker's resource.log has a line this exporter can read.",
           [(host, int(use is not None))])
    if use is not None:
        for key, name, text in DS_GAUGES:
            family(out, name, "gauge", text, [(host, use[key])])
        family(out, "yrpd_ds_hits_total", "counter", "Object reads the worker served, by the tier they came from.",
               [({**host, "tier": tier}, use[key]) for key, tier in DS_HITS])
        family(out, "yrpd_ds_misses_total", "counter", "Object reads the worker found nothing for.",
               [(host, use["misses"])])
    counters, latencies = {}, {}
    for path, doc in live_stats(args["stats"]):
        instance = os.path.basename(path)[len("kv-"):].rsplit(f"-{doc.get('side')}-", 1)[0]
        labels = {**host, "yrpd_instance": instance, "side": doc.get("side", "?"), "dp": doc.get("dp", 0),
                  "rank": doc.get("rank", 0)}
        for key, value in (doc.get("counters") or {}).items():
            counters.setdefault(key, []).append((labels, value))
        for key, lat in (doc.get("latency_ms") or {}).items():
            latencies.setdefault(key, []).append((labels, lat))
        counters.setdefault("ds_healthy", []).append((labels, int(bool(doc.get("ds_healthy")))))
    for key, samples in sorted(counters.items()):
        if key == "ds_healthy":
            family(out, "yrpd_connector_ds_healthy", "gauge", "1 while the connector reaches its data system worker.",
                   samples)
        else:
            family(out, f"yrpd_connector_{key}_total", "counter", f"The KV connector's {key.replace('_', ' ')}.",
                   samples)
    for key, samples in sorted(latencies.items()):
        family(out, f"yrpd_connector_{key}_seconds_total", "counter", f"Time the connector spent in {key} calls.",
               [(labels, lat.get("total", 0) / 1000) for labels, lat in samples])
        family(out, f"yrpd_connector_{key}_calls_total", "counter", f"The connector's {key} calls.",
               [(labels, lat.get("count", 0)) for labels, lat in samples])
    return "\n".join(out) + "\n"


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.split("?")[0] == "/metrics":
            body, kind = render().encode(), "text/plain; version=0.0.4; charset=utf-8"
        elif self.path == "/health":
            body, kind = b"ok\n", "text/plain"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_):
        pass  # one line per scrape would fill the log


if __name__ == "__main__":
    ThreadingHTTPServer((args["host"], args["port"]), Handler).serve_forever()
