"""Wait until processes a yrpd session started answer HTTP, or say precisely why not (run by yrpd, stdlib only).

Args: one JSON object {"pidfile": .., "log": .., "state": .. (yrpd.layout's templates with {name}), "timeout":
seconds, "targets": [{"name", "url"}]}. A target whose supervisor says it ended (restarting, given up) fails at
once, with how it ended: a start that crashes is reported now, not after every restart the policy allows.
A target whose process has exited fails at once with the last lines of its log; one still silent at the
timeout fails with its log tail. Prints one JSON line {name: seconds to ready}.
"""
import json
import os
import sys
import time
import urllib.error
import urllib.request

args = json.loads(sys.argv[1])
pidfile, logfile = args["pidfile"], args["log"]
started = time.monotonic()
deadline = started + float(args["timeout"])


def ended(name):
    """How the target's command ended, if its supervisor says it did (deploy_scripts/supervise.py), else None."""
    try:
        with open(args["state"].format(name=name)) as fh:
            state = json.load(fh)
    except (OSError, ValueError, KeyError):
        return None
    if state.get("state") in ("backoff", "failed", "exited"):
        return state.get("reason") or state.get("state")
    return None


def alive(name):
    try:
        pid = int(open(pidfile.format(name=name)).read().strip())
        os.kill(pid, 0)
        return True
    except (OSError, ValueError):
        return False


def answers(url):
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def log_tail(name, lines=15):
    try:
        with open(logfile.format(name=name), "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 16384))
            text = fh.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return "  (no log)"
    return "\n".join("  | " + line for line in text)


pending = {t["name"]: t["url"] for t in args["targets"]}
ready = {}
failed = []
while pending:
    for name, url in list(pending.items()):
        if answers(url):
            ready[name] = round(time.monotonic() - started, 1)
            del pending[name]
        elif not alive(name) or ended(name):
            how = ended(name)
            failed.append(f"{name} {'ended (' + how + ')' if how else 'exited'} before answering {url}; last log "
                          f"lines ({logfile.format(name=name)}):\n{log_tail(name)}")
            del pending[name]
    if not pending:
        break
    if time.monotonic() > deadline:
        for name, url in pending.items():
            failed.append(f"{name} did not answer {url} within {args['timeout']}s; last log lines "
                          f"({logfile.format(name=name)}):\n{log_tail(name)}")
        break
    time.sleep(1)

print(json.dumps(ready))
for message in failed:
    print(message, file=sys.stderr)
sys.exit(1 if failed else 0)
