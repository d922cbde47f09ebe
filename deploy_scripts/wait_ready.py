"""Wait until processes a yrpd session started answer HTTP, or say precisely why not (run by yrpd, stdlib only).

Args: one JSON object {"pidfile": .., "log": .., "state": .., "kv_stats": .. (yrpd.layout's templates with
{name}), "timeout": seconds, "targets": [{"name", "url", "ds_link": bool, "members": [url], "status_url": url}]}.
A target with ds_link is ready once it answers and the stats files its live processes' KV connector writes all say
the data system is reachable: the instances start before openYuanrong, and their connector links up in the
background once it runs. A target with members (the proxy) is ready once its status_url lists each of them up: a
change drains the old instances only after the proxy routes to the new ones. A target whose supervisor says it ended (restarting, given up) fails at
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

from hostlib import BACKOFF, EXITED, FAILED, live_stats

args = json.loads(sys.argv[1])
pidfile, logfile = args["pidfile"], args["log"]
started = time.monotonic()
deadline = started + float(args["timeout"])


def ended(name):
    """How the target's command ended, if its supervisor says it did (deploy_scripts/supervise.py), else None. The
    state of an earlier supervisor (one that gave up before this start) is not this one's: the new one writes its
    own only once it has started the command, a while after on a busy host."""
    try:
        with open(args["state"].format(name=name)) as fh:
            state = json.load(fh)
    except (OSError, ValueError, KeyError):
        return None
    if state.get("supervisor") != supervisor(name):
        return None
    if state.get("state") in (BACKOFF, FAILED, EXITED):
        return state.get("reason") or state.get("state")
    return None


def supervisor(name):
    """The pid the start step wrote: the target's supervisor."""
    try:
        return int(open(pidfile.format(name=name)).read().strip())
    except (OSError, ValueError):
        return None


def alive(name):
    pid = supervisor(name)
    try:
        os.kill(pid, 0)
        return True
    except (OSError, TypeError):
        return False


def answers(url):
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def ds_link(name):
    """(linked, why not): every live connector process of the target reaches its data system worker."""
    docs = [doc for _, doc in live_stats(args["kv_stats"].format(name=name))]  # not an earlier run's files
    if not docs:
        return False, "its KV connector has written no stats yet"
    down = [d for d in docs if d.get("ds_healthy") is False]
    if down:
        d = down[0]
        engine = f" of DP engine {d['dp']}" if d.get("dp") else ""
        return False, (f"its KV connector ({d.get('side')} rank {d.get('rank')}{engine}) cannot reach the data system "
                       f"at {d.get('ds_address')}: {d.get('ds_last_error') or 'down'}")
    return True, ""


def members_up(target):
    """(all up, why not): the proxy's status lists every one of the target's members as up."""
    try:
        with urllib.request.urlopen(target["status_url"], timeout=3) as resp:
            report = json.load(resp)
        listed = {i["url"]: i for i in report.get("instances", [])}
        refused = (report.get("membership") or {}).get("error")
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return False, f"its status cannot be read ({exc})"
    down = [u for u in target["members"] if not listed.get(u, {}).get("up")]
    if down:
        why = f"; it refused its membership file: {refused}" if refused else ""
        return False, f"it does not route to {', '.join(down)} yet (not up in its status{why})"
    return True, ""


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
needs_link = {t["name"] for t in args["targets"] if t.get("ds_link")}
needs_members = {t["name"]: t for t in args["targets"] if t.get("members")}
unlinked = {}  # name -> why its connector is not linked yet, once it answers
ready = {}
failed = []
while pending:
    for name, url in list(pending.items()):
        if answers(url):
            linked, why = ds_link(name) if name in needs_link else (True, "")
            if linked and name in needs_members:
                linked, why = members_up(needs_members[name])
            if linked:
                ready[name] = round(time.monotonic() - started, 1)
                del pending[name]
                continue
            unlinked[name] = why
        elif not alive(name) or ended(name):
            how = ended(name)
            failed.append(f"{name} {'ended (' + how + ')' if how else 'exited'} before answering {url}; last log "
                          f"lines ({logfile.format(name=name)}):\n{log_tail(name)}")
            del pending[name]
    if not pending:
        break
    if time.monotonic() > deadline:
        for name, url in pending.items():
            what = f"answers {url} but {unlinked[name]}" if name in unlinked else f"did not answer {url}"
            failed.append(f"{name} {what} within {args['timeout']}s; last log lines "
                          f"({logfile.format(name=name)}):\n{log_tail(name)}")
        break
    time.sleep(1)

print(json.dumps(ready))
for message in failed:
    print(message, file=sys.stderr)
sys.exit(1 if failed else 0)
