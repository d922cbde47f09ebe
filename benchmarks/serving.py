"""Serving benchmarks against a running deployment (benchmark, not a test).

    .venv/bin/python benchmarks/serving.py deploy-split [--session-dir DIR]
    .venv/bin/python benchmarks/serving.py proxy-overhead [--requests 20] [--prompt-words 600]
    .venv/bin/python benchmarks/serving.py dtype [--dtypes auto,bfloat16,float32] [--prompt-tokens 2500]
        [--requests 3] [--output-tokens 65] [--env KEY=VALUE ...]

deploy-split: reads a session's journal and splits the deploy's wall time into installs, model build,
openYuanrong start, vLLM instance start (process start to /health) and the rest (yrpd's orchestration: SSH
round trips, checks, the proxy).

proxy-overhead: time to first token of streamed completions (a) through the proxy, (b) the same two legs
driven by this client straight against prefill and decode (what the proxy does, minus the proxy), and
(c) decode alone (no disaggregation). (a) - (b) is the proxy's cost as the client sees it; the proxy's own
time (its TTFT minus its waits for prefill and decode, kept by the proxy itself) is printed beside it. Prompts are unique per request
(distinct prefixes) so neither the local prefix cache nor the data system short-cuts later requests.

dtype: for each dtype in turn, `yrpd deploy --hosts localhost --dtype D --new-session` (the embedded default,
builtin:smollm2), then streamed completions of unique, uncached prompts of about --prompt-tokens tokens through
the proxy: time to first token (prefill on one core, the KV hand-over, decode's first token) and time per output
token after it; then `yrpd down`. One table, medians, ratios against bfloat16. `--env` goes to every deploy
(e.g. ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI keeps oneDNN off a CPU's bf16 instructions).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

GROUPS = {
    "installs": ("cluster.install", "vllm_env.install", "vllm_env.ship_code"),
    "model build": ("model.build",),
    "openYuanrong start + checks": ("cluster.configure", "cluster.start_master", "cluster.start_agent",
                                    "cluster.wait_healthy", "cluster.check_kv"),
    "vLLM instance start (to /health)": ("instances.start", "instances.wait_healthy"),
}


def deploy_split(session_dir: Path) -> None:
    entries = [json.loads(line) for line in (session_dir / "journal.jsonl").read_text().splitlines()]
    teardown = ("proxy.stop", "instances.stop", "cluster.stop", "processes.stop_all", "host_session.purge")
    cut = next((i for i, e in enumerate(entries) if e.get("run") in teardown), len(entries))
    entries = entries[:cut]  # the deploy only
    # steps run host-parallel: a step costs its slowest host
    per_step: dict[str, float] = {}
    for e in entries:
        if "seconds" in e:
            per_step[e["run"]] = max(per_step.get(e["run"], 0.0), e["seconds"])
    first = min(e["time"] for e in entries)
    last = max(e["time"] for e in entries)
    fmt = "%Y-%m-%dT%H:%M:%S"
    wall = time.mktime(time.strptime(last, fmt)) - time.mktime(time.strptime(first, fmt))
    print(f"session {session_dir.name}: journal spans {wall:.0f}s (1 s resolution)")
    for group, runs in GROUPS.items():
        seconds = sum(per_step.get(r, 0.0) for r in runs)
        print(f"  {group:34s} {seconds:7.1f}s")
    rest = sum(s for r, s in per_step.items() if not any(r in runs for runs in GROUPS.values()))
    print(f"  {'other steps (preflight, session, proxy)':34s} {rest:7.1f}s")
    print(f"  {'orchestration (checks, SSH, waits)':34s} {wall - sum(per_step.values()):7.1f}s  (span minus steps)")


def headers(token: str | None) -> dict:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}


def ttft(url: str, body: dict, token: str | None = None) -> float:
    data = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(url, data=data, headers=headers(token))
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            if raw.startswith(b"data: ") and b'"text":""' not in raw:
                first = time.perf_counter() - started
                break
        for _ in resp:
            pass
    return first


def two_legs(prefill: str, decode: str, body: dict, token: str | None) -> float:
    started = time.perf_counter()
    leg = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    req = urllib.request.Request(f"{prefill}/v1/completions", data=json.dumps(leg).encode(),
                                 headers=headers(token))
    with urllib.request.urlopen(req, timeout=600) as resp:
        params = json.load(resp).get("kv_transfer_params")
    return time.perf_counter() - started + ttft(f"{decode}/v1/completions", {**body, "kv_transfer_params": params},
                                                token)


def proxy_overhead(n: int, words: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from yrpd.credentials import instance_token
    from yrpd.session import SessionStore, default_root

    session = SessionStore(default_root()).get(None)
    token = instance_token(session.path)  # the instances want the deployment's token; the proxy a key, if any
    plan = json.loads((session.path / "plan.json").read_text())
    spec = json.loads((session.path / "spec.json").read_text())
    ip = {h["name"]: h["ip"] for h in plan["hosts"]}
    url = {i["role"]: f"http://{ip[i['host']]}:{i['port']}" for i in plan["instances"]}
    proxy = f"http://{ip[plan['proxy']['host']]}:{plan['proxy']['port']}"
    text = Path(os.__file__).read_text().split()
    key = os.environ.get(spec["api_key_env"]) if spec.get("api_key_env") else None
    model = spec.get("served_model_name") or (spec.get("model") or "builtin:smollm2").rstrip("/").split("/")[-1].removeprefix("builtin:")
    results: dict[str, list[float]] = {"proxy": [], "client-driven PD legs": [], "decode alone": []}
    for i in range(n):
        for name in results:
            # a distinct leading word per request and path: no prefix is ever reused
            prompt = f"{name} {i} " + " ".join(text[i * 7:i * 7 + words])
            body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            if name == "proxy":
                results[name].append(ttft(f"{proxy}/v1/completions", body, key))
            elif name == "decode alone":
                results[name].append(ttft(f"{url['decode']}/v1/completions", body, token))
            else:
                results[name].append(two_legs(url["prefill"], url["decode"], body, token))
    print(f"TTFT over {n} streamed completions of ~{words} words (session {session.id}):")
    for name, values in results.items():
        print(f"  {name:24s} median {statistics.median(values) * 1000:7.1f} ms   "
              f"p90 {sorted(values)[int(0.9 * (len(values) - 1))] * 1000:7.1f} ms")
    overhead = statistics.median(results["proxy"]) - statistics.median(results["client-driven PD legs"])
    print(f"  proxy's cost seen by the client (median difference): {overhead * 1000:.1f} ms")
    with urllib.request.urlopen(f"{proxy}/yrpd/status", timeout=10) as resp:
        own = json.load(resp)["own_overhead_ms"]
    # measured inside the proxy: its time to first token minus the time it waited for prefill and decode, so the
    # instances' own variance (which dominates the difference above) is not part of it
    print(f"  proxy's own time to first token, measured in the proxy over its last {own['n']} generations: "
          f"p50 {own['p50']} ms, p90 {own['p90']} ms, p99 {own['p99']} ms")


def streamed(url: str, body: dict) -> tuple[float, float, int, int]:
    """(time to first token, mean time per later token, prompt tokens, output tokens) of one streamed request."""
    data = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    first = last = None
    usage = {}
    with urllib.request.urlopen(req, timeout=1200) as resp:
        for raw in resp:
            if not raw.startswith(b"data: ") or raw.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(raw[6:])
            usage = chunk.get("usage") or usage
            if any(c.get("text") for c in chunk.get("choices") or ()):
                last = time.perf_counter()
                first = first or last
    out = usage.get("completion_tokens", 0)
    return first - started, (last - first) / max(1, out - 1), usage.get("prompt_tokens", 0), out


def dtype_bench(dtypes: list[str], prompt_tokens: int, n: int, output_tokens: int, env: list[str]) -> None:
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(repo))
    from yrpd.session import SessionStore, default_root

    yrpd = [sys.executable, "-m", "yrpd"]
    words = Path(os.__file__).read_text().split() + Path(json.__file__).read_text().split()
    rows = {}
    for d in dtypes:
        extra = [a for kv in env for a in ("--env", kv)]
        deploy = subprocess.run([*yrpd, "deploy", "--hosts", "localhost", "--dtype", d, "--new-session", *extra],
                                capture_output=True, text=True, cwd=repo, stdin=subprocess.DEVNULL)
        if deploy.returncode != 0:
            print(deploy.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"deploy with --dtype {d} failed")
        session = SessionStore(default_root()).get(None)
        chosen = json.loads((session.path / "plan.json").read_text())["dtype"]["dtype"]
        url = deploy.stdout.strip().splitlines()[-1] + "/v1/completions"
        try:
            results = []
            for i in range(n):
                # about 2 SmolLM2 tokens per word of this text; a distinct head per dtype and request: nothing
                # is cached
                prompt = f"{d} {i} " + " ".join(words[i * 11:i * 11 + int(prompt_tokens / 2.0)])
                body = {"model": "smollm2", "prompt": prompt, "max_tokens": output_tokens, "temperature": 0,
                        "ignore_eos": True}
                results.append(streamed(url, body))
        finally:
            subprocess.run([*yrpd, "down"], capture_output=True, cwd=repo, stdin=subprocess.DEVNULL)
        rows[d] = {"dtype": chosen, "ttft": statistics.median(r[0] for r in results),
                   "tpot": statistics.median(r[1] for r in results),
                   "prompt": statistics.median(r[2] for r in results), "out": results[0][3]}
    flags = open("/proc/cpuinfo").read()
    print(f"dtype through `yrpd deploy --hosts localhost` (SmolLM2, {n} uncached prompts each, medians; CPU bf16 "
          f"instructions: {'yes' if 'avx512_bf16' in flags or 'amx_bf16' in flags else 'no'}; env {env or '-'}):")
    base = rows.get("bfloat16")
    for d, r in rows.items():
        ratio = f"  TTFT {r['ttft'] / base['ttft']:.2f}x, TPOT {r['tpot'] / base['tpot']:.2f}x of bfloat16" if base else ""
        print(f"  --dtype {d:9s} -> {r['dtype']:9s} prompt {r['prompt']:.0f} tok: TTFT {r['ttft']:6.2f} s, "
              f"TPOT {r['tpot'] * 1000:6.1f} ms over {r['out']} tokens{ratio}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    split = sub.add_parser("deploy-split")
    split.add_argument("--session-dir", type=Path)
    over = sub.add_parser("proxy-overhead")
    over.add_argument("--requests", type=int, default=20)
    over.add_argument("--prompt-words", type=int, default=600)
    dt = sub.add_parser("dtype")
    dt.add_argument("--dtypes", default="auto,bfloat16,float32")
    dt.add_argument("--prompt-tokens", type=int, default=2500)
    dt.add_argument("--requests", type=int, default=3)
    dt.add_argument("--output-tokens", type=int, default=65)
    dt.add_argument("--env", action="append", default=[])
    args = ap.parse_args()
    if args.what == "dtype":
        dtype_bench(args.dtypes.split(","), args.prompt_tokens, args.requests, args.output_tokens, args.env)
    elif args.what == "deploy-split":
        if args.session_dir is None:
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from yrpd.session import SessionStore, default_root

            args.session_dir = SessionStore(default_root()).get(None).path
        deploy_split(args.session_dir)
    else:
        proxy_overhead(args.requests, args.prompt_words)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
