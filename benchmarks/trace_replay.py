"""Routing judged on a recorded trace: Mooncake's conversation trace, scaled to this machine, replayed against every
routing choice with 2 prefill instances, one run each (benchmark, not a test; issue 46). With --sweep, a controlled
share of prompt tokens seen before instead (0, 50 and 90 %).

    .venv/bin/python benchmarks/trace_replay.py [--trace FILE] [--requests N] [--conversations SHARE]
                                                [--load SHARE | --time-scale F]
                                                [--datasystem-mb MB] [--decode-kv-mb MB]
                                                [--targets LIST]
                                                [--sweep [--shares 0,50,90]] [--out-dir DIR]
                                                [--keep-logs DIR]
                                                [-- extra `yrpd bench run` options]

The trace's time is scaled to this machine unless --time-scale is given: once deployed, a probe (`yrpd bench run
--targets pd` of PROBE_PROMPTS random prompts of the trace's mean input length, PROBE_CONCURRENCY at once, none seen
before) measures the input tokens a second the deployment computes; the trace is then written again with arrivals
spaced so its input tokens come at --load (LOAD) of that, and replayed. The probe's report and calibration.json (the
capacity, the load, the time scale, the scaled trace's figures, the probe's provenance) land in --out-dir beside the
others. A trace scaled for a faster machine overloads a slower one, and an overloaded replay measures queues, not
routing (docs/bench: the 8d91b96 run on an EPYC, every routing's mean TTFT 49-63 s).

Fake hosts (root needed): h1 holds both prefill instances (cores 0 and 1) and the proxy, so the proxy follows both
instances' KV-cache events on unix sockets; h2 holds the decode instance (core 0: the lab's hosts share this
machine's 2 cores). The real SmolLM2 (the dtype the plan picks), max-model-len 4096, `routing: prefix`. `yrpd bench
trace` scales the trace (a share of whole conversations, time compressed; its factors are in the report's dataset
and in <out-dir>/trace.jsonl.meta.json), then one `yrpd bench run` replays it with vLLM's own timed_trace dataset
against each target in turn, each a fresh deployment: `pd-rr` (round-robin), `pd-load` (requests in flight),
`pd-estimate` (prefix routing on what the proxy sent where), `pd` (prefix routing on the instances' KV-cache events)
and `pd-oracle` (the same, brought up to the moment before every leg from the replay socket of each instance
whose events lack an ended leg's last block). The data
system gets --datasystem-mb per host (1024, yrpd's default): it carries the hand-over of every prompt from prefill to
decode as well as the prefixes, so one smaller than the prompts in flight (64 holds about 1,400 float32 tokens of
SmolLM2, concurrency 64 sends dozens of 400-token prompts at once) evicts hand-overs before decode loads them, and
decode computes those prompts again (docs/bench/cpu-smollm2-trace-replay-ds64-report.md: 2 of every 3 blocks).

Beside each report, breakdown.md: each target's mean TTFT over the requests whose blocks were new, partly or mostly
seen before (vLLM's per-request results against the trace).

--sweep: three `yrpd bench run`s of vLLM's prefix_repetition dataset (SWEEP_PROMPTS prompts of 1,024 random tokens,
concurrency 4, 16 output tokens; --targets defaults to pd,pd-load there): 0 % (every prompt its own prefix), 50 %
and 90 % (2 prefixes shared by all prompts, prefix 535 or 962 tokens: prefix / 1,024 x (1 - 2 / SWEEP_PROMPTS) of
prompt tokens seen before; vLLM's cache matches whole 128-token blocks, so 4 and 7 of each prompt's 8 blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.routing import copy_reports, in_workdir, keep_logs  # noqa: E402
from lab.fakehosts import FakeHostLab  # noqa: E402

ENV_ROOT = os.environ.get("YRPD_TEST_ENV_ROOT", "/opt/yrpd/venvs")
TRACE = REPO.parent / "shared/traces/conversation_trace.jsonl"
TARGETS = "pd,pd-oracle,pd-estimate,pd-load,pd-rr"  # pd first: the deployment made for it
SWEEP_TARGETS = "pd,pd-load"
#: the decode instance holds the KV of every request it is generating (up to --max-concurrency 64 of them, prompts up
#: to 3,811 tokens): with yrpd's CPU default of 512 MB (about 11,000 float32 tokens of SmolLM2) it filled up to 93 %
#: in the cf69cf3 run and queued up to 36 requests, and that queue (0.9-15.4 s after the prefill leg, per run) set the
#: TTFT ranking the prefill routings are judged by (docs/bench/cpu-smollm2-trace-replay-cf69cf3-fresh3-stages.md).
#: Sized as a PD recipe sizes decode apart; the prefill instances keep the default, where eviction is what the KV
#: events are for.
DECODE_KV_MB = 2048
SWEEP_PROMPTS = 48
#: the probe that measures the deployment's capacity, and the share of it the scaled trace asks for on average: the
#: trace's arrivals come in bursts, so the busy spells run hotter than this
PROBE_PROMPTS = 24
PROBE_CONCURRENCY = 4
LOAD = 0.6
#: share of prompt tokens seen before -> (prefix tokens, suffix tokens, prefixes) of vLLM's prefix_repetition
SWEEP = {0: (512, 512, SWEEP_PROMPTS), 50: (535, 489, 2), 90: (962, 62, 2)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", type=Path, default=TRACE, help="a Mooncake-format trace [%(default)s]")
    parser.add_argument("--requests", type=int, default=1000, help="the trace's requests looked at [%(default)s]")
    parser.add_argument("--conversations", type=float, default=0.01,
                        help="share of whole conversations kept [%(default)s]")
    parser.add_argument("--time-scale", type=float,
                        help="arrival times x this, instead of scaling them to the capacity the probe measures")
    parser.add_argument("--load", type=float, default=LOAD,
                        help="the share of the measured capacity the trace's input tokens arrive at [%(default)s]")
    parser.add_argument("--datasystem-mb", type=int, default=1024, help="data system memory per host [%(default)s]")
    parser.add_argument("--decode-kv-mb", type=int, default=DECODE_KV_MB,
                        help="the decode instance's own KV pool, MB (prefill's stay yrpd's CPU default) [%(default)s]")
    parser.add_argument("--targets", help=f"[{TARGETS}; with --sweep {SWEEP_TARGETS}]")
    parser.add_argument("--sweep", action="store_true", help="the 0/50/90 %% sweep instead of the trace")
    parser.add_argument("--shares", default=",".join(map(str, SWEEP)),
                        help="with --sweep, the shares of prompt tokens seen before to run [%(default)s]")
    parser.add_argument("--out-dir", type=Path, default=Path("bench-trace"))
    parser.add_argument("--keep-logs", type=Path, metavar="DIR",
                        help="copy every host's session logs (proxy, instances, data system) here at the end")
    parser.add_argument("extra", nargs="*", help="more `yrpd bench run` options (after --)")
    args = parser.parse_args()
    shares = [s.strip() for s in args.shares.split(",") if s.strip()]
    unknown = [s for s in shares if not s.isdigit() or int(s) not in SWEEP]
    if unknown or not shares:
        parser.error(f"--shares: {','.join(unknown) or 'none given'}: choose among {','.join(map(str, SWEEP))}")
    args.shares = [int(s) for s in shares]
    if not args.trace.is_file():
        parser.error(f"--trace: {args.trace} is not a file (the conversation trace is in ../shared/traces/)")
    return in_workdir("yrpd-trace-", run, args)


def run(args: argparse.Namespace, work: Path) -> int:
    hosts = ["h1", "h2"]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "YRPD_HOME": str(work / "home")}

    def yrpd(*argv: str) -> int:
        return subprocess.run([sys.executable, "-m", "yrpd", *argv], env=env, cwd=REPO,
                              stdin=subprocess.DEVNULL).returncode

    if args.sweep:
        return sweep(args, work, hosts, yrpd)
    trace = args.out_dir / "trace.jsonl"

    def write_trace(*timing: str) -> dict | None:
        if yrpd("bench", "trace", "--trace", str(args.trace), "--out", str(trace), "--requests", str(args.requests),
                "--conversations", str(args.conversations), *timing):
            return None
        return json.loads(Path(f"{trace}.meta.json").read_text())

    def replay(meta: dict) -> list[str]:
        return ["--targets", args.targets or TARGETS, "--vllm-dataset", "timed_trace",
                "--num-prompts", str(meta["written"]), "--max-concurrency", "64",
                "--vllm-dataset-args", " ".join(["--dataset-path", str(trace.resolve()), *meta["bench_args"]])]

    if args.time_scale is not None:
        meta = write_trace("--time-scale", str(args.time_scale))
        if meta is None:
            return 1
        code = in_lab(args, work, hosts, yrpd, [replay(meta)])
    else:
        meta = write_trace()  # unscaled in time: its mean input length sizes the probe's prompts
        if meta is None:
            return 1

        def calibrated() -> list[list[str]] | None:
            capacity = probe(args, work, yrpd, meta)
            if capacity is None:
                return None
            scaled = write_trace("--load", str(args.load), "--capacity", f"{capacity['tokens_per_s']:.3f}")
            if scaled is None:
                return None
            capacity.update(load=args.load, time_scale=scaled["time_scale"], span_s=scaled["span_s"], trace=scaled)
            # where it came from: the probe's own provenance, this script's command first
            prov = dict(capacity.pop("provenance"))
            prov["commands"] = [" ".join([".venv/bin/python benchmarks/trace_replay.py", *sys.argv[1:]]),
                                *prov.get("commands", [])]
            (args.out_dir / "calibration.json").write_text(json.dumps({"provenance": prov, **capacity}, indent=2)
                                                           + "\n")
            print(f"calibrated: {capacity['tokens_per_s']:.1f} input tokens/s measured; at load {args.load} the "
                  f"trace's time x{scaled['time_scale']:.4g}, {scaled['written']} requests over {scaled['span_s']} s")
            return [replay(scaled)]

        code = in_lab(args, work, hosts, yrpd, calibrated)
    for run_dir in args.out_dir.iterdir():
        results = run_dir / "results.json"
        if results.is_file() and json.loads(results.read_text())["dataset"].get("vllm_dataset") == "timed_trace":
            (run_dir / "breakdown.md").write_text(breakdown(trace, run_dir))
            print((run_dir / "breakdown.md").read_text())
    return code


#: the per-request breakdown's classes, [low, high): the share of a request's blocks whose leading run earlier
#: requests had (every conversation of the trace opens with the same block: few requests have none seen)
BUCKETS = (("under a quarter seen before", 0.0, 0.25), ("a quarter to three quarters", 0.25, 0.75),
           ("three quarters or more", 0.75, 1.01))


def seen_shares(trace: Path) -> list[float]:
    """Per request of a Mooncake-format trace, in order: the share of its hash ids that lead it and came in earlier
    requests (what a cache that kept everything would hold of it)."""
    seen: set[int] = set()
    shares = []
    for line in trace.read_text().splitlines():
        ids = json.loads(line)["hash_ids"]
        lead = next((n for n, i in enumerate(ids) if i not in seen), len(ids))
        shares.append(lead / len(ids) if ids else 0.0)
        seen.update(ids)
    return shares


def breakdown(trace: Path, run_dir: Path) -> str:
    """Each target's mean TTFT over the requests of each class of BUCKETS, from vLLM's per-request results (in the
    order sent: the trace's), as Markdown. A repeated run (`-- --repeat N`): the median of its runs' means, with
    their range, as the report gives its metrics."""
    shares = seen_shares(trace)
    doc = json.loads((run_dir / "results.json").read_text())
    targets, prov = doc["targets"], doc["provenance"]
    dirty = " (with uncommitted changes)" if prov.get("dirty") else ""
    title = [f"# Per request: mean TTFT by the share of each request's blocks seen before ({trace.name})", "",
             f"From the run beside it (results.json): commit {prov.get('commit')}{dirty}, CPU {prov.get('cpu')} "
             f"({prov.get('cores')} cores). Command: `{(prov.get('commands') or ['?'])[0]}`", ""]
    rows = []
    for label, low, high in BUCKETS:
        picked = [n for n, s in enumerate(shares) if low <= s < high]
        cells = []
        for name in targets:
            if targets[name].get("error"):
                cells.append("-")
                continue
            raws = [run_dir / f"{n}.json" for n in (targets[name].get("runs_named") or [name])]
            raws = [raw for raw in raws if raw.is_file()]
            means = []
            for raw in raws:
                ttfts = json.loads(raw.read_text())["ttfts"]
                got = [ttfts[n] for n in picked if n < len(ttfts) and ttfts[n]]
                if got:
                    means.append(1000 * sum(got) / len(got))
            if not means:
                cells.append("-")
            elif len(means) == 1:
                cells.append(f"{means[0]:,.0f}")
            else:
                cells.append(f"{statistics.median(means):,.0f} ({min(means):,.0f}-{max(means):,.0f})")
        rows.append(f"| {label} | {len(picked)} | " + " | ".join(cells) + " |")
    several = any(len(t.get("runs_named") or []) > 1 for t in targets.values())
    what = "median of the runs' mean TTFT (ms) (range)" if several else "mean TTFT (ms)"
    head = "| requests | count | " + " | ".join(f"{n} {what}" for n in targets) + " |"
    return "\n".join([*title, head, "|---|---|" + "---|" * len(targets), *rows]) + "\n"


def sweep(args: argparse.Namespace, work: Path, hosts: list[str], yrpd) -> int:
    runs = []
    for prefix, suffix, prefixes in (SWEEP[share] for share in args.shares):
        runs.append(["--targets", args.targets or SWEEP_TARGETS, "--vllm-dataset", "prefix_repetition",
                     "--num-prompts", str(SWEEP_PROMPTS), "--max-concurrency", "4",
                     "--vllm-dataset-args", f"--prefix-repetition-prefix-len {prefix} --prefix-repetition-suffix-len "
                     f"{suffix} --prefix-repetition-num-prefixes {prefixes} --prefix-repetition-output-len 16"])
    return in_lab(args, work, hosts, yrpd, runs)


def probe(args: argparse.Namespace, work: Path, yrpd, meta: dict) -> dict | None:
    """The deployment's capacity in input tokens a second: a `yrpd bench run --targets pd` of random prompts of the
    trace's mean input and output lengths, PROBE_CONCURRENCY in flight (none seen before: no reuse counted)."""
    mean_in = max(1, round(meta["input_tokens"]["total"] / meta["written"]))
    mean_out = max(1, round(meta["output_tokens_total"] / meta["written"]))
    def reports() -> set[Path]:  # (resolved: the sessions directory links its latest session too)
        return {r.resolve() for r in (work / "home" / "sessions").glob("*/bench/*/results.json")}

    before = reports()
    if yrpd("bench", "run", "--targets", "pd", "--vllm-dataset", "random", "--num-prompts", str(PROBE_PROMPTS),
            "--max-concurrency", str(PROBE_CONCURRENCY), "--vllm-dataset-args",
            f"--random-input-len {mean_in} --random-output-len {mean_out}",
            "--datasystem-mb", str(args.datasystem_mb), "--no-restore"):
        return None
    new = sorted(reports() - before)
    if len(new) != 1:
        print(f"trace_replay.py: the probe left {len(new)} reports, not one", file=sys.stderr)
        return None
    doc = json.loads(new[0].read_text())
    metrics = doc["targets"]["pd"]["metrics"]
    if metrics.get("failed") or not metrics.get("duration"):
        print(f"trace_replay.py: the probe failed ({metrics.get('failed')} requests failed)", file=sys.stderr)
        return None
    return {"provenance": doc["provenance"],
            "tokens_per_s": metrics["total_input_tokens"] / metrics["duration"], "probe_report": new[0].parent.name,
            "probe": {"prompts": PROBE_PROMPTS, "concurrency": PROBE_CONCURRENCY, "input_len": mean_in,
                      "output_len": mean_out, "duration_s": round(metrics["duration"], 2),
                      "total_input_tokens": metrics["total_input_tokens"],
                      "mean_ttft_ms": round(metrics["mean_ttft_ms"], 1)}}


def in_lab(args: argparse.Namespace, work: Path, hosts: list[str], yrpd, runs) -> int:
    """Deploy on the lab's fake hosts, then one `yrpd bench run` per entry of `runs` (or of what `runs()` returns
    once deployed; None: it failed); the reports into --out-dir."""
    with FakeHostLab(len(hosts), work / "lab") as lab:
        ssh = lab.cli_ssh_args
        config = work / "yrpd.yaml"
        config.write_text("hosts:\n  - {address: h1, devices: [0, 1]}\n  - {address: h2, devices: [0]}\n"
                          f"device_kind: cpu\nmodel: builtin:smollm2\nenv_path: {ENV_ROOT}\n"
                          f"datasystem_memory_mb: {args.datasystem_mb}\ncluster_mode: ds_only\n"
                          "engine_args: ['--max-model-len', '4096']\nrouting: prefix\n"
                          f"decode_engine_args: ['--kv-cache-memory-bytes', '{args.decode_kv_mb << 20}']\n")
        layout = ["--hosts", ",".join(hosts), "--config", str(config), "--prefill", "2", "--decode", "1"]
        try:
            if yrpd("deploy", *layout, *ssh):
                return 1
            if callable(runs):
                runs = runs()
                if runs is None:
                    return 1
            codes = [yrpd("bench", "run", *run, "--datasystem-mb", str(args.datasystem_mb), "--no-restore",
                          *args.extra) for run in runs]
            return max(codes)
        finally:
            copy_reports(work, args.out_dir)
            yrpd("down", *ssh)
            keep_logs(lab, hosts, args.keep_logs)


if __name__ == "__main__":
    sys.exit(main())
