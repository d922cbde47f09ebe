"""Chaos: greedy streams through a 2-host deployment while its instances are killed at moments nobody chose, a
data-system worker is killed and the decode host's link is cut (benchmark, not a test; issue 44).

    .venv/bin/python benchmarks/chaos.py [--topology 1p1d|2p2d] [--minutes 10] [--concurrency 8] [--kills 20]
                                         [--seed 1] [--out FILE.json]

Two fake hosts (root needed), the tiny model. 1p1d: prefill, the proxy and etcd on h1, decode on h2; 2p2d: two
devices a host, two prefill and two decode instances across them. `--concurrency` clients stream greedy answers of
TOKENS tokens (ignore_eos) back to back, each compared with the answer the deployment streamed before the chaos.
Meanwhile, for at least `--minutes` and until `--kills` instance kills are done: kill -9 of a prefill or decode
instance's API server or EngineCore (chosen at random, `--seed`), a random 2-10 s after the last fault: with one
instance a role (1p1d) once the deployment is healthy again, with two (2p2d) as soon as an instance is up whose role
keeps another up. After a third of the kills h2's data-system worker, after two thirds h2's link down 30 s (each
once the deployment is healthy). The supervisors may restart an instance 100 times in 10 minutes (RESTART).

Reported: streams sent, completed with the unbroken answer, broken (not 200, an error event, cut short, no answer),
wrong (a whole 200 whose text differs), the proxy's migrations and degraded answers (its /metrics, deltas), the
latency a migration adds (the longest gap between two events of each stream the proxy carried over, against the
median longest gap of the others: p50, p99, and by the kind of fault the stream met), every fault with the streams
in flight at it, and after `yrpd down` what /dev/shm holds that it did not before. A run that stops early (the
deployment not healthy again within 300 s) says why under `failed`, with the streams counted so far. Provenance:
yrpd.provenance.record.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lab.fakehosts import FakeHostLab  # noqa: E402
from lab.traffic import LONG, Call, TwoHosts, body  # noqa: E402
from yrpd.provenance import record  # noqa: E402
from yrpd.versions import DEFAULT_ENV_ROOT  # noqa: E402

TOKENS = 64
PROMPTS = [f"{LONG}\n# stream {i}" for i in range(4)] + [f"import module_{i}\n" * (i + 2) for i in range(4)]
#: the proxy's line for one request (yrpd/proxy/app.py `_record`)
PROXY_LINE = re.compile(r"POST /v1/completions (\d+) (\d+)ms (.*)$")


def shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "sem.mp-"))}


def metric(proxy: str, name: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{proxy}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {line.rsplit(" ", 1)[0][len(name):]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith((name + "{", name + " "))}


def instances(report: dict) -> list[tuple[str, str]]:
    """(host, name) of every prefill and decode instance."""
    return [(i["host"], i["name"]) for i in report["instances"]]


def kill_instance(d: TwoHosts, report: dict, host: str, name: str, engine: bool) -> str:
    state = json.loads(d.lab[host].exec(f"cat /tmp/yrpd_sessions/{report['session']}/run/{name}.state.json").stdout)
    pid = state["pid"]
    if engine:
        pid = int(d.lab[host].exec(f"pgrep -P {pid} EngineCor").stdout.split()[0])
    d.lab[host].exec(f"kill -9 {pid}")
    return f"kill -9 {name}{':engine' if engine else ''} on {host}"


def victims(report: dict) -> list[tuple[str, str]]:
    """(host, name) of the healthy instances whose role keeps another healthy instance up."""
    up = [i for i in report["instances"] if i["healthy"]]
    return [(i["host"], i["name"]) for i in up if sum(1 for j in up if j["role"] == i["role"]) > 1]


#: how long h2's link is cut, once
LINK_DOWN_S = 30


def fault_met(call, faults: list[dict], t0: float) -> str:
    """The kind of fault a migrated stream met: the last one between 10 s before it began (a request sent to an
    instance that was dying) and its end, a link cut counted while the link was down."""
    hit = [f for f in faults if call.started - 10 <= t0 + f["at_s"] + (LINK_DOWN_S if "link" in f["what"] else 0)
           and t0 + f["at_s"] <= call.ended]
    if not hit:
        return "none found"
    what = hit[-1]["what"]
    return ("link cut" if "link" in what else "worker kill" if "ds_worker" in what else
            "EngineCore kill" if ":engine" in what else "API server kill")


#: the supervisors' restart cap (spec `restart.max` in `restart.window_s`): the default 3 in 600 s guards against a
#: crash loop, and 20 kills in 10 minutes would pass it, the instance then given up (as a user would want of a loop)
RESTART = "restart: {max: 100, window_s: 600}\n"


def configure(d: TwoHosts, topology: str) -> None:
    text = d.config.read_text()
    if topology == "2p2d":
        for n, h in enumerate(d.names):
            text = text.replace(f"{{address: {h}, devices: [{n % 2}]}}", f"{{address: {h}, devices: [0, 1]}}")
        text += "prefill: 2\ndecode: 2\n"
    d.config.write_text(text + RESTART)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", choices=("1p1d", "2p2d"), default="1p1d")
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    opts = ap.parse_args()
    rng = random.Random(opts.seed)
    report: dict = {"provenance": record([" ".join(["benchmarks/chaos.py", *sys.argv[1:]])],
                                         vllm_venv=Path(DEFAULT_ENV_ROOT) / "vllm"),
                    "topology": opts.topology, "concurrency": opts.concurrency, "tokens": TOKENS}
    shm_before = shm()
    with tempfile.TemporaryDirectory(prefix="yrpd-chaos-") as tmp, FakeHostLab(2, Path(tmp) / "lab") as lab:
        d = TwoHosts(lab, Path(tmp))
        configure(d, opts.topology)
        report["deploy_s"] = round(d.deploy(), 1)
        expected = {}
        for prompt in PROMPTS:
            call = Call(d.proxy, body(prompt, TOKENS, stream=True, ignore_eos=True), timeout=300)
            call.run()
            assert call.status == 200 and call.text and not call.error_event, (call.status, call.raw[:300])
            expected[prompt] = call.text
        healthy, _ = d.healthy()
        report["instances"] = instances(healthy)
        moved0 = metric(d.proxy, "yrpd_proxy_migrations_total")
        degraded0 = metric(d.proxy, "yrpd_proxy_degraded_answers_total")
        calls: list[Call] = []
        stop = threading.Event()
        started = time.monotonic()

        def client(n: int) -> None:
            i = n
            while not stop.is_set():
                call = Call(d.proxy, body(PROMPTS[i % len(PROMPTS)], TOKENS, stream=True, ignore_eos=True),
                            timeout=600, request_id=f"chaos-{n}-{i}")
                calls.append(call)
                call.run()
                i += 1

        threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(opts.concurrency)]
        for t in threads:
            t.start()
        faults: list[dict] = []

        def fault(what: str) -> None:
            faults.append({"at_s": round(time.monotonic() - started, 1), "what": what,
                           "streams_in_flight": sum(1 for c in calls if c.started and not c.ended)})
            print(f"{faults[-1]['at_s']} s: {what} ({faults[-1]['streams_in_flight']} streams in flight)",
                  file=sys.stderr, flush=True)

        done = 0
        try:
            while done < opts.kills or time.monotonic() - started < opts.minutes * 60:
                # the worker kill after a third of the kills, the link cut after two thirds, each once
                due = ("worker" if done == opts.kills // 3 and not any("ds_worker" in f["what"] for f in faults) else
                       "link" if done == 2 * opts.kills // 3 and not any("link" in f["what"] for f in faults) else None)
                if opts.topology == "1p1d" or due:
                    # one instance a role: the next kill once the last one's instance is back (else no role is up)
                    now_report, _ = d.healthy(within=300)
                    time.sleep(rng.uniform(2, 10))
                    choices = instances(now_report)
                else:
                    # two a role: any instance whose role keeps another up, while the last one may still restart
                    time.sleep(rng.uniform(2, 10))
                    deadline = time.monotonic() + 300
                    while not (choices := victims(now_report := d.status()[0])):
                        assert time.monotonic() < deadline, now_report["problems"]
                        time.sleep(2)
                if due == "worker":
                    pid = next(c["pid"] for c in now_report["cluster"]["components"]
                               if (c["host"], c["component"]) == ("h2", "ds_worker"))
                    d.lab["h2"].exec(f"kill -9 {pid}")
                    fault("kill -9 ds_worker on h2")
                    continue
                if due == "link":
                    fault(f"h2's link down {LINK_DOWN_S} s")
                    d.lab.cut("h2")
                    try:
                        time.sleep(LINK_DOWN_S)
                    finally:
                        d.lab.mend("h2")
                    continue
                host, name = rng.choice(choices)
                fault(kill_instance(d, now_report, host, name, engine=rng.random() < 0.5))
                done += 1
        except Exception as e:  # noqa: BLE001 - the streams so far are still counted and the deployment torn down
            report["failed"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"chaos stopped: {report['failed']}", file=sys.stderr, flush=True)
        if "failed" not in report:
            d.healthy(within=300)
            time.sleep(5)
        stop.set()
        for t in threads:
            t.join(700)
        report["seconds"] = round(time.monotonic() - started, 1)
        moved = {k: v - moved0.get(k, 0) for k, v in metric(d.proxy, "yrpd_proxy_migrations_total").items()}
        degraded = {k: v - degraded0.get(k, 0) for k, v in metric(d.proxy, "yrpd_proxy_degraded_answers_total").items()}
        migrated, lines = {}, {}
        for line in d.cli("logs", "proxy", "-n", "100000", timeout=600).stdout.splitlines():
            m = PROXY_LINE.search(line)
            if m:
                notes = dict(kv.split("=", 1) for kv in m.group(3).split() if "=" in kv)
                if notes.get("id", "").startswith("chaos-"):
                    lines[notes["id"]] = line  # the instances each leg went to, what failed, how it went on
                    if "migrated" in notes:
                        migrated[notes["id"]] = int(notes["migrated"])
        ended = [c for c in calls if c.ended]
        broken = [c for c in ended if c.status != 200 or c.error_event or c.failure or not c.text]
        wrong = [c for c in ended if c not in broken and c.text != expected[c.body["prompt"]]]
        plain_gaps = [c.max_gap for c in ended if c not in broken and c.request_id not in migrated]
        base = statistics.median(plain_gaps) if plain_gaps else 0.0
        added = sorted(c.max_gap - base for c in ended if c.request_id in migrated and c not in broken)

        def pick(q: float, values: list[float] = added) -> float | None:
            return round(values[min(len(values) - 1, int(q * len(values)))], 2) if values else None

        by_fault: dict[str, list[float]] = {}
        for c in ended:
            if c.request_id in migrated and c not in broken:
                by_fault.setdefault(fault_met(c, faults, started), []).append(c.max_gap - base)

        report.update(
            streams=len(ended), identical=sum(1 for c in ended if c not in broken and c not in wrong),
            broken=len(broken), wrong=len(wrong), instance_kills=done, faults=faults,
            migrations=moved, degraded_answers=degraded, streams_carried_over=len(migrated),
            migration_added_s={"p50": pick(0.5), "p99": pick(0.99), "n": len(added),
                               "median_longest_gap_unbroken_s": round(base, 3)},
            migration_added_by_fault={kind: {"n": len(v), "p50": pick(0.5, sorted(v)), "p99": pick(0.99, sorted(v)),
                                             "max": round(max(v), 2)} for kind, v in sorted(by_fault.items())},
            broken_detail=[{"id": c.request_id, "status": c.status, "error_event": c.error_event,
                            "chunks": c.chunks, "failure": c.failure, "raw": c.raw[:200],
                            "proxy_line": lines.get(c.request_id)} for c in broken][:10],
            wrong_detail=[{"id": c.request_id, "migrated": migrated.get(c.request_id),
                           "proxy_line": lines.get(c.request_id),
                           "want": expected[c.body["prompt"]], "got": c.text} for c in wrong][:5])
        d.cli("down", timeout=600)
    report["dev_shm_left_after_down"] = sorted(shm() - shm_before)
    text = json.dumps(report, indent=1)
    if opts.out:
        Path(opts.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
