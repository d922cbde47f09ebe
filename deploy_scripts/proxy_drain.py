"""Wait until the proxy has taken instances out of routing and their requests in flight have ended (run by yrpd on
the master host, stdlib only).

Args: one JSON object {"status_url": the proxy's /yrpd/status, "urls": [instance URLs], "timeout": seconds}.
Drained: the proxy lists each of them as draining (it has read the file that says so, so no new request goes there)
with nothing in flight, or no longer lists it. Prints one JSON line
{"drained": bool, "in_flight": {url: n}, "seconds": s}; exits 1 when the timeout passed first, naming what is still
in flight, so the caller can decide whether to stop those instances anyway.
"""
import json
import sys
import time
import urllib.error
import urllib.request

args = json.loads(sys.argv[1])
started = time.monotonic()
deadline = started + float(args["timeout"])
wanted = set(args["urls"])


def status():
    with urllib.request.urlopen(args["status_url"], timeout=5) as resp:
        return json.load(resp)


in_flight, error = {}, None
while True:
    try:
        report = status()
        error = None
    except (OSError, ValueError) as exc:  # the proxy restarting: it reads the same file when it is back
        report, error = None, f"{type(exc).__name__}: {exc}"
    if report is not None:
        seen = {i["url"]: i for i in report.get("instances", [])}
        in_flight = {u: seen[u]["in_flight"] for u in wanted if u in seen}
        # an instance already gone from the proxy's list has nothing in flight there
        if all(seen[u].get("draining") for u in in_flight) and not any(in_flight.values()):
            break
    if time.monotonic() > deadline:
        print(json.dumps({"drained": False, "in_flight": in_flight, "seconds": round(time.monotonic() - started, 1)}))
        what = ", ".join(f"{u} ({n})" for u, n in sorted(in_flight.items()) if n) or (error or "the proxy's status")
        print(f"not drained after {args['timeout']} s: still in flight on {what}", file=sys.stderr)
        sys.exit(1)
    time.sleep(0.25)
print(json.dumps({"drained": True, "in_flight": in_flight, "seconds": round(time.monotonic() - started, 1)}))
