"""Each target's first-token wait split into the prefill leg and the rest, per run, from the proxy logs a routing
benchmark kept (benchmarks/trace_replay.py --keep-logs DIR): for runs made before `yrpd bench run` measured the split
itself (yrpd.bench.run.stages). The proxy logs one line per answered request with the prefill instance it chose, the
leg's time (prefill_ms) and its own time to first token (ttft_ms, arrival to the first byte from decode).

    .venv/bin/python benchmarks/proxy_stages.py RESULTS_JSON KEPT_LOGS_DIR [--proxy-host h1] [--quarters]

Prints Markdown: per target and run, the legs each prefill instance got, the mean prefill leg, the mean proxy TTFT and
what came after the leg; then each target's medians over its runs. --quarters: the same per quarter of each run's
requests (in the order sent), where a trace's bursts and the routing's lean over a run show.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import Counter
from pathlib import Path

LINE = re.compile(r"id=bench-(?P<run>\w+)-(?P<n>\d+) prefill=(?P<prefill>\S+) prefill_ms=(?P<leg>\d+) "
                  r"(?:\S+ )*?decode=\S+ ttft_ms=(?P<ttft>\d+)")


def runs_of(log: Path, parts: int = 1) -> list[dict]:
    """The runs in one proxy log, in the order they started: each its requests' prefill instances, mean leg, mean TTFT
    at the proxy and what came after the leg; with `parts` > 1 also those of each of `parts` equal slices of its
    requests in the order sent (`parts`)."""
    runs: dict[str, list[tuple[int, str, int, int]]] = {}
    for line in log.read_text().splitlines():
        m = LINE.search(line)
        if m:
            runs.setdefault(m["run"], []).append((int(m["n"]), m["prefill"], int(m["leg"]), int(m["ttft"])))
    out = []
    for rows in runs.values():
        rows.sort()
        run = _summary(rows)
        if parts > 1:
            size = len(rows) // parts
            run["parts"] = [_summary(rows[i * size:(i + 1) * size if i < parts - 1 else len(rows)])
                            for i in range(parts)]
        out.append(run)
    return out


def _summary(rows: list[tuple[int, str, int, int]]) -> dict:
    legs = Counter(url for _, url, _, _ in rows)
    leg = statistics.mean(r[2] for r in rows)
    ttft = statistics.mean(r[3] for r in rows)
    return {"requests": len(rows), "legs": dict(sorted(legs.items())), "leg_ms": leg, "ttft_ms": ttft,
            "after_ms": ttft - leg}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", type=Path)
    parser.add_argument("logs", type=Path)
    parser.add_argument("--proxy-host", default="h1")
    parser.add_argument("--quarters", action="store_true", help="also per quarter of each run's requests")
    args = parser.parse_args()
    doc = json.loads(args.results.read_text())
    prov = doc["provenance"]
    print(f"# Per run: the first token's wait split at the prefill leg ({args.results.parent.name})\n")
    print(f"From the proxy logs of the run beside it (results.json): commit {prov.get('commit')}, CPU {prov.get('cpu')} "
          f"({prov.get('cores')} cores). Command of the run: `{(prov.get('commands') or ['?'])[0]}`. Split by "
          f"`.venv/bin/python benchmarks/proxy_stages.py results.json KEPT_LOGS{' --quarters' * args.quarters}`: the "
          f"proxy's own times (arrival to "
          f"the first byte from decode), so its TTFT is a little below vLLM's client-side one.\n")
    print("| target | run | prefill legs per instance | mean prefill leg (ms) | mean TTFT at the proxy (ms) | "
          "of it after the leg (ms) |")
    print("|---|---|---|---|---|---|")
    medians = {}
    for name, target in doc["targets"].items():
        if target.get("error"):
            continue
        # run in rounds (--interleave), a target was deployed anew for each of its runs: a session, and a log, each
        logs = [args.logs / args.proxy_host / s / "proxy.log" for s in target.get("sessions") or [target["session"]]]
        runs = [r for log in logs if log.is_file() for r in runs_of(log, 4 if args.quarters else 1)]
        # a run of another size on the same deployment is not one of the target's (trace_replay.py's capacity probe)
        prompts = doc["dataset"].get("prompts")
        runs = [r for r in runs if not prompts or r["requests"] == prompts]
        if not runs:
            print(f"| {name} | - | no proxy log lines of a bench run in {', '.join(map(str, logs))} | - | - | - |")
            continue
        for n, r in enumerate(runs, 1):
            legs = ", ".join(f"{url.rsplit(':', 1)[-1]}: {k}" for url, k in r["legs"].items())
            print(f"| {name} | {n} | {legs} | {r['leg_ms']:,.0f} | {r['ttft_ms']:,.0f} | {r['after_ms']:,.0f} |")
            for q, part in enumerate(r.get("parts", ()), 1):
                legs = ", ".join(f"{url.rsplit(':', 1)[-1]}: {k}" for url, k in part["legs"].items())
                print(f"| {name} | {n}, quarter {q} | {legs} | {part['leg_ms']:,.0f} | {part['ttft_ms']:,.0f} | "
                      f"{part['after_ms']:,.0f} |")
        medians[name] = {k: statistics.median(r[k] for r in runs) for k in ("leg_ms", "ttft_ms", "after_ms")}
    print("\n| target | median prefill leg (ms) | median TTFT at the proxy (ms) | median after the leg (ms) |")
    print("|---|---|---|---|")
    for name, m in medians.items():
        print(f"| {name} | {m['leg_ms']:,.0f} | {m['ttft_ms']:,.0f} | {m['after_ms']:,.0f} |")
    if "pd" in medians:
        print()
        for other in [n for n in medians if n != "pd"]:
            print(f"- pd/{other} median prefill leg: **{medians['pd']['leg_ms'] / medians[other]['leg_ms']:.3f}**, "
                  f"median TTFT at the proxy: {medians['pd']['ttft_ms'] / medians[other]['ttft_ms']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
