"""`yrpd bench run`: drive `vllm bench serve` against the deployment and against its baselines.

Targets, each a deployment of the same model on the same hosts and devices:
- `pd`: the PD deployment with prefix reuse (prefill `kv_both`, vLLM's local prefix cache on);
- `pd-load`: the `pd` deployment with the proxy routing by load alone (`routing: load`); `pd` routes as the
  spec says. With several prefill instances and `routing: prefix` in the spec, the two show what cache-aware
  routing gains (benchmarks/routing.py);
- `pd-noreuse`: the same PD deployment with prefix reuse off (prefill `kv_producer`, no local prefix cache):
  every prompt is prefilled in full, decode still loads it through the data system;
- `single`: one plain vLLM instance (no disaggregation, no connector, vLLM defaults) on all the devices the
  PD instances use;
- `single-yr`: the same instance with the yrpd connector as a prefix store (kv_both): what its own KV pool
  cannot hold is looked up in the data system (memory, then its disk tier);
- `peer-example-pd`: the `pd` deployment with vLLM's reference `ExampleConnector` in place of yrpd's: the
  handoff (and reuse of a whole prompt seen before) goes through safetensors files on the host's disk, what a
  user gets from vLLM alone. One host only;
- `peer-lmcache`: the `single` instance with LMCache's multi-process server as its prefix store (LMCache 0.5.6 in
  a venv of its own; its memory is the data system's, `datasystem_memory_mb`). CPU hosts.
- `peer-ascend-store`: the `pd` deployment with vllm-ascend's own AscendStoreConnector (backend yuanrong) on the
  same data system and its Mooncake hand-over (`kv_connector: ascend-store`). NPU hosts in the vllm-ascend image
  whose release it serves (refused before anything is deployed elsewhere).

A target that is not what is deployed now is deployed for the run (`yrpd down` of the current session, then
`yrpd deploy --new-session` with the variant spec) and torn down after; the original spec is deployed again at
the end. Everything goes through the same library calls (yrpd.api) the CLI makes, so the numbers measure what
users get.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from yrpd.serving import STATS_INTERVAL_S
from yrpd.spec import DeploySpec, DeviceKind

TARGETS = {
    "pd": "PD + prefix reuse",
    "pd-load": "PD + prefix reuse, load-only routing",
    "pd-noreuse": "PD, prefix reuse off",
    "single": "single instance, same devices",
    "single-yr": "single instance, KV also in the data system",
    "peer-example-pd": "PD through vLLM's ExampleConnector (files)",
    "peer-lmcache": "single instance, KV also in LMCache's server",
    "peer-ascend-store": "PD through vllm-ascend's AscendStoreConnector + Mooncake",
}
#: the KV connector each target runs with
CONNECTORS = {"peer-example-pd": "example", "peer-lmcache": "lmcache", "peer-ascend-store": "ascend-store"}


def variant(spec: DeploySpec, target: str, kind: DeviceKind, kv_cache_mb: int | None = None,
            datasystem_mb: int | None = None, datasystem_spill_mb: int | None = None) -> DeploySpec:
    """The spec a target runs with; `kv_cache_mb` sizes each PD instance's own KV pool (the `overflow` workload:
    a working set larger than the pools, so only a store beyond them keeps the reuse). A single instance runs on
    the devices of all PD instances and gets their pools together. `datasystem_mb`/`datasystem_spill_mb` size the
    data system's memory and disk tiers on every host (a data system smaller than the working set evicts, or
    spills to disk)."""
    data = spec.model_dump(mode="json")
    if datasystem_mb is not None:
        data["datasystem_memory_mb"] = datasystem_mb
    if datasystem_spill_mb is not None:
        data["datasystem_spill_mb"] = datasystem_spill_mb
    engine_args = list(spec.engine_args)
    if kv_cache_mb:
        pools = spec.prefill + spec.decode if target in ("single", "single-yr", "peer-lmcache") else 1
        engine_args += ["--kv-cache-memory-bytes", str((kv_cache_mb * pools) << 20)]
    if target == "pd-noreuse":
        engine_args.append("--no-enable-prefix-caching")
    data["engine_args"] = engine_args
    data["kv_connector"] = CONNECTORS.get(target, "yuanrong")
    if target in ("pd", "pd-load", "peer-example-pd", "peer-ascend-store"):
        data.update(disaggregated=True, prefix_reuse=True)
        if target == "pd-load":
            data["routing"] = "load"
    elif target == "pd-noreuse":
        data.update(disaggregated=True, prefix_reuse=False)
    elif target in ("single", "single-yr", "peer-lmcache"):
        data.update(single_kv_store=target == "single-yr")
        devices = spec.prefill * spec.ptp * spec.pdp + spec.decode * spec.dtp * spec.ddp
        data.update(disaggregated=False, prefill=1, pdp=1, decode=1, ddp=1)
        if kind is DeviceKind.cpu:  # one TP rank binding every core the PD pair used
            data.update(ptp=1, cores_per_rank=devices * spec.cores_per_rank)
        else:
            data.update(ptp=devices)
    else:
        raise ValueError(target)
    return DeploySpec.model_validate(data).check()


def deploy(spec: DeploySpec, name: str, progress=None) -> str:
    """Deploy `spec` as a new session; returns its id."""
    from yrpd import api

    try:
        return api.deploy(spec, new_session=True, progress=progress).session.id
    except Exception as e:
        raise RuntimeError(f"deploying the {name} target failed: {e}") from e


def down(session_id: str) -> None:
    from yrpd import api

    api.down(api.open_deployment(session_id))


DS_HITS = ("hits_memory", "hits_disk", "misses")  # the data system workers' own counts of reads, by tier
TOKEN_SOURCES = ("prompt_tokens_computed", "prompt_tokens_local_cache", "prompt_tokens_loaded")


def counters(session_id: str) -> tuple[dict, dict]:
    """Counters summed over the instances and the data system workers (what `yrpd status` reports), and the
    workers' use of memory and disk now (MB)."""
    from yrpd import api

    report = api.status(api.open_deployment(session_id))
    blocks = ("loaded_blocks", "saved_blocks", "handoff_missed_blocks")
    total = {"external_cache_hit_tokens": 0.0, "prompt_tokens": 0.0, **{key: 0 for key in blocks},
             **{f"ds_{key}": 0 for key in DS_HITS}}
    for inst in report.instances:
        for key in ("external_cache_hit_tokens", "prompt_tokens"):
            total[key] += inst.probe.get(key) or 0
        # per role, where each prompt token's KV came from: what routing changes shows on the prefill side
        for key in TOKEN_SOURCES:
            total[f"{inst.role}_{key}"] = total.get(f"{inst.role}_{key}", 0.0) + (inst.probe.get(key) or 0)
        for key in blocks:
            total[key] += (inst.connector or {}).get(key) or 0
    use = {"memory_mb": 0.0, "memory_limit_mb": 0.0, "disk_mb": 0.0, "disk_limit_mb": 0.0, "objects": 0}
    workers = [c.cache for c in (report.cluster.components if report.cluster else [])
               if c.cache and "error" not in c.cache]
    for cache in workers:
        for key in DS_HITS:
            total[f"ds_{key}"] += cache[key]
        for key in ("memory", "disk"):
            use[f"{key}_mb"] += round(cache[f"{key}_used"] / 2**20, 1)
            use[f"{key}_limit_mb"] += round(cache[f"{key}_limit"] / 2**20, 1)
        use["objects"] += cache["objects"]
    return total, use if workers else {}


def bench_serve(vllm_venv: Path, url: str, model: str, tokenizer: Path, dataset: Path, out_dir: Path, name: str,
                num_prompts: int, output_len: int, concurrency: int, seed: int, key: str | None = None) -> dict:
    argv = [str(vllm_venv / "bin/vllm"), "bench", "serve", "--backend", "vllm", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(tokenizer),
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
            "--custom-output-len", str(output_len), "--num-prompts", str(num_prompts), "--disable-shuffle",
            "--max-concurrency", str(concurrency), "--temperature", "0", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", f"{name}.json",
            "--label", name]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    env.pop("OPENAI_API_KEY", None)
    if key:  # vllm bench serve sends it as the bearer token: the environment keeps it out of the .cmd file and ps
        env["OPENAI_API_KEY"] = key
    (out_dir / f"{name}.cmd").write_text(" ".join(argv) + "\n")
    with open(out_dir / f"{name}.log", "w") as log:
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    if proc.returncode != 0:
        tail = (out_dir / f"{name}.log").read_text().splitlines()[-15:]
        raise RuntimeError(f"vllm bench serve for {name} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return json.loads((out_dir / f"{name}.json").read_text())


def run_targets(session, spec: DeploySpec, kind: DeviceKind, targets: list[str], dataset: Path, out_dir: Path,
                vllm_venv: Path, tokenizer: Path, num_prompts: int, output_len: int, concurrency: int, seed: int,
                restore: bool, log=print, progress=None, kv_cache_mb: int | None = None,
                datasystem_mb: int | None = None, datasystem_spill_mb: int | None = None) -> dict:
    from yrpd.serving import endpoint_url
    from yrpd.steps import spec_fingerprint

    current: str | None = session.id  # deployed (the CLI checked); None while no target is up
    original = spec
    results: dict[str, dict] = {}
    try:
        for target in targets:
            want = variant(original, target, kind, kv_cache_mb, datasystem_mb, datasystem_spill_mb)
            live = current is not None and spec_fingerprint(want) == spec_fingerprint(spec)
            if not live:
                if current is not None:
                    log(f"bench: tearing down session {current} to deploy the {target} target")
                    down(current)
                    current = None
                log(f"bench: deploying the {target} target ({TARGETS[target]})")
                current = deploy(want, target, progress)
                spec = want
            from yrpd import api

            deployed = api.open_deployment(current)
            url = endpoint_url(deployed.spec, deployed.plan)
            before, _ = counters(current)
            log(f"bench: {target}: vllm bench serve against {url} ({num_prompts} prompts)")
            started = time.monotonic()
            raw = bench_serve(vllm_venv, url, deployed.spec.model_name, tokenizer, dataset, out_dir, target,
                              num_prompts, output_len, concurrency, seed, deployed.endpoint_key())
            time.sleep(STATS_INTERVAL_S + 1)  # the connector rewrites its stats files this often: let the last land
            after, use = counters(current)
            results[target] = {
                "description": TARGETS[target], "session": current, "url": url,
                "wall_s": round(time.monotonic() - started, 1),
                "metrics": {k: v for k, v in raw.items() if isinstance(v, (int, float))},
                "ttfts_ms": [round(t * 1000, 2) for t in raw.get("ttfts", []) if t],
                "counters": {k: after[k] - before[k] for k in after},
                "data_system": use,  # at the end of the run; empty where no worker reported
            }
    finally:
        if restore and spec_fingerprint(spec) != spec_fingerprint(original):
            if current is not None:
                down(current)
            log("bench: deploying the original spec again")
            deploy(original, "restore", progress)
    return results
