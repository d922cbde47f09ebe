"""`yrpd bench run`: drive `vllm bench serve` against the deployment and against its baselines.

Targets, each a deployment of the same model on the same hosts and devices:
- `pd`: the PD deployment with prefix reuse (prefill `kv_both`, vLLM's local prefix cache on);
- `pd-load`: the `pd` deployment with the proxy routing by load alone (`routing: load`); `pd` routes as the
  spec says. With several prefill instances and `routing: prefix` in the spec, the two show what cache-aware
  routing gains (benchmarks/routing.py); `pd-rr` routes round-robin, `pd-estimate` by prefix on what the proxy
  sent where (no KV-cache events), `pd-oracle` by prefix on the caches exactly as they are at each request (the
  events, brought up to the moment from the replay socket of an instance whose copy lags: benchmarks/trace_replay.py);
- `pd-noreuse`: the same PD deployment with prefix reuse off (prefill `kv_producer`, no local prefix cache):
  every prompt is prefilled in full, decode still loads it through the data system;
- `single`: one plain vLLM instance (no disaggregation, no connector, vLLM defaults) on all the devices the
  PD instances use;
- `single-yr`: the same instance with the yrpd connector as a prefix store (kv_both): what its own KV pool
  cannot hold is looked up in the data system (memory, then its disk tier);
- `single-roomy`: the `single` instance with vLLM's own pool whatever `--kv-cache-mb` says: beside targets whose
  pools overflow, the reuse a store could at best give back (every block its own pool's, nothing to load), so
  its ratio to `single` is the floor no store reaches below in that run;
- `peer-example-pd`: the `pd` deployment with vLLM's reference `ExampleConnector` in place of yrpd's: the
  handoff (and reuse of a whole prompt seen before) goes through safetensors files on the host's disk, what a
  user gets from vLLM alone. One host only;
- `peer-lmcache`: the `single` instance with LMCache's multi-process server as its prefix store (LMCache 0.5.6 in
  a venv of its own; its memory is the data system's, `datasystem_memory_mb`). CPU hosts.
- `peer-nixl-pd`: the `pd` deployment with vLLM's NixlConnector in place of yrpd's: decode pulls each prompt's
  blocks out of prefill's KV cache over UCX (NIXL 1.5.1 in a venv of its own); no store beyond the instances, so
  nothing is reused across requests but what each instance's own prefix cache keeps. CPU hosts.
- `peer-ascend-store`: the `pd` deployment with vllm-ascend's own AscendStoreConnector (backend yuanrong) on the
  same data system and its Mooncake hand-over (`kv_connector: ascend-store`). NPU hosts in the vllm-ascend image
  whose release it serves (refused before anything is deployed elsewhere).

A target that is not what is deployed now is deployed for the run (`yrpd down` of the current session, then
`yrpd deploy --new-session` with the variant spec) and torn down after; the original spec is deployed again at
the end. Everything goes through the same library calls (yrpd.api) the CLI makes, so the numbers measure what
users get.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import statistics
import subprocess
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from yrpd.bench.dataset import DatasetOptions, make
from yrpd.errors import SpecError
from yrpd.serving import STATS_INTERVAL_S, model_path
from yrpd.spec import ROLE_ENGINE_ARGS, DeploySpec, DeviceKind, stored_spec
from yrpd import api
from yrpd.bench.report import prefix_hit_rate, write_report
from yrpd.provenance import git_state, record
from yrpd.session import SessionPhase
from yrpd.steps.vllm_env import paths

TARGETS = {
    "pd": "PD + prefix reuse",
    "pd-load": "PD + prefix reuse, load-only routing",
    "pd-rr": "PD + prefix reuse, round-robin routing",
    "pd-estimate": "PD + prefix reuse, prefix routing on its estimate (no KV-cache events)",
    "pd-oracle": "PD + prefix reuse, prefix routing on the caches exactly as they are at each request",
    "pd-nostore": "PD + prefix reuse, prefix routing on the instances' events, the data system's holdings estimated",
    "pd-noreuse": "PD, prefix reuse off",
    "single": "single instance, same devices",
    "single-yr": "single instance, KV also in the data system",
    "single-roomy": "single instance, vLLM's own KV pool whatever --kv-cache-mb says (a store's floor)",
    "peer-example-pd": "PD through vLLM's ExampleConnector (files)",
    "peer-lmcache": "single instance, KV also in LMCache's server",
    "peer-nixl-pd": "PD through vLLM's NixlConnector (UCX, no store)",
    "peer-ascend-store": "PD through vllm-ascend's AscendStoreConnector + Mooncake",
}
#: the routing of the PD targets that differ from `pd` (prefix routing on the instances' KV-cache events) in it alone
ROUTING_TARGETS = {"pd-load": {"routing": "load"}, "pd-rr": {"routing": "round-robin"},
                   "pd-estimate": {"routing_kv_events": False}, "pd-oracle": {"routing_kv_exact": True},
                   "pd-nostore": {"routing_store_events": False}}
#: the targets that run one plain instance on the devices of all the PD instances
SINGLE_TARGETS = ("single", "single-yr", "single-roomy", "peer-lmcache")
#: the KV connector each target runs with
CONNECTORS = {"peer-example-pd": "example", "peer-lmcache": "lmcache", "peer-ascend-store": "ascend-store",
              "peer-nixl-pd": "nixl"}


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
    if target == "single-roomy":  # vLLM's own pool, whoever sized it smaller
        engine_args = _without(engine_args, "--kv-cache-memory-bytes")
    elif kv_cache_mb:
        pools = spec.prefill + spec.decode if target in SINGLE_TARGETS else 1
        engine_args += ["--kv-cache-memory-bytes", str((kv_cache_mb * pools) << 20)]
    if target == "pd-noreuse":
        engine_args.append("--no-enable-prefix-caching")
    # the run's flags win over a role's own too (a role's come after engine_args): appended there as well
    added = engine_args[len(spec.engine_args):]
    for role_args in ROLE_ENGINE_ARGS.values():
        if data[role_args] and added:
            data[role_args] = [*data[role_args], *added]
    data["engine_args"] = engine_args
    data["kv_connector"] = CONNECTORS.get(target, "yuanrong")
    if target in ("pd", *ROUTING_TARGETS, "peer-example-pd", "peer-ascend-store", "peer-nixl-pd"):
        data.update(disaggregated=True, prefix_reuse=True)
        if target in ROUTING_TARGETS:
            data.update(ROUTING_TARGETS[target])
    elif target == "pd-noreuse":
        data.update(disaggregated=True, prefix_reuse=False)
    elif target in SINGLE_TARGETS:
        # one plain instance takes engine_args alone (the spec refuses role arguments without PD)
        data.update(single_kv_store=target == "single-yr", **{f: [] for f in ROLE_ENGINE_ARGS.values()})
        devices = sum(n * tp * dp for n, (tp, dp) in ((spec.prefill, spec.parallelism("prefill")),
                                                      (spec.decode, spec.parallelism("decode"))))
        data.update(disaggregated=False, prefill=1, prefill_data_parallel_size=1, decode=1, decode_data_parallel_size=1)
        if kind is DeviceKind.cpu:  # one TP rank binding every core the PD pair used
            data.update(prefill_tensor_parallel_size=1, cores_per_rank=devices * spec.cores_per_rank)
        else:
            data.update(prefill_tensor_parallel_size=devices)
    else:
        raise ValueError(target)
    return DeploySpec.model_validate(data).check()


def _without(args: list[str], flag: str) -> list[str]:
    """`args` less every `flag V` and `flag=V`."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def _last_value(args: list[str], flag: str) -> str | None:
    """The value vLLM's argparse keeps for `flag` (the last one given, `--flag V` or `--flag=V`)."""
    found = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


def pool_refusal(spec: DeploySpec, kind: DeviceKind, model_dir: Path, dtype: str | None) -> tuple[str, int] | None:
    """Why vLLM would refuse this spec's KV pool and the MB it needs, or None: a pool (`--kv-cache-memory-bytes`,
    per TP rank) must hold one sequence of `--max-model-len` tokens. The KV of a token is 2 (K and V) x layers x
    KV heads x head size x the dtype's bytes, the heads split over TP ranks. A dtype the deployment leaves to the model counts as 2 bytes:
    the least a pool can need, so nothing vLLM would take is refused here."""
    from yrpd.serving import KIND_ENGINE_ARGS

    for role in ("prefill", "decode") if spec.disaggregated else ("single",):
        refused = _pool_refusal(spec, [*KIND_ENGINE_ARGS[kind], *spec.engine_args_of(role)], model_dir, dtype)
        if refused:
            return refused
    return None


def _pool_refusal(spec: DeploySpec, args: list[str], model_dir: Path, dtype: str | None) -> tuple[str, int] | None:
    pool = _last_value(args, "--kv-cache-memory-bytes")
    if pool is None:  # vLLM sizes it from the memory it finds
        return None
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None  # nothing to size it by: vLLM will say
    config = config.get("text_config", config)
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else None)
    max_len = _last_value(args, "--max-model-len") or config.get("max_position_embeddings")
    if not (layers and kv_heads and head_dim and max_len):
        return None
    tp = max(spec.parallelism(role)[0] for role in ("prefill", "decode"))
    size = DTYPE_BYTES.get(dtype or str(config.get("torch_dtype") or config.get("dtype") or ""), 2)
    need = 2 * layers * -(-kv_heads // tp) * head_dim * size * int(max_len)
    if int(pool) >= need:
        return None
    return (f"a KV pool of {int(pool) / 2**20:.0f} MB is less than one {int(max_len):,}-token sequence needs "
            f"({need / 2**20:.0f} MB: {layers} layers x {kv_heads} KV heads x {head_dim} x {size} bytes x 2)",
            -(-need // 2**20))


def deploy(spec: DeploySpec, name: str, progress=None, origin: DeploySpec | None = None) -> str:
    """Deploy `spec` as a new session; returns its id. `origin`: the spec the target varied, recorded in the session
    (`varied_spec`)."""
    try:
        done = api.deploy(spec, new_session=True, progress=progress)
    except Exception as e:
        raise RuntimeError(f"deploying the {name} target failed: {e}") from e
    if origin is not None:
        done.session.write_bench_origin({"target": name, "spec": origin.model_dump(mode="json"),
                                         "deployed": spec.fingerprint()})
    return done.session.id


def varied_spec(deployment) -> tuple[DeploySpec, str | None]:
    """The spec a bench run's targets vary, and the target whose deployment this is (None: the user's own). A
    session an earlier run deployed for one of its targets and left up (`--no-restore`) is that target's variant:
    the targets vary the spec that run varied, or `pd` on a `pd-load` deployment would keep load routing. Once the
    session's spec has changed since (a `yrpd deploy` of another spec onto it), it is the user's again."""
    origin = deployment.session.bench_origin
    if origin is None or origin.get("deployed") != deployment.spec.fingerprint():
        return deployment.spec, None
    return stored_spec(origin["spec"]), origin["target"]


def down(session_id: str) -> None:
    api.down(api.open_deployment(session_id))


#: the connector's time by kind, ms summed over its processes (serving_status.py; with TP > 1 over every rank, so
#: more than the engine waited): where a no-hit request's time goes
CONNECTOR_MS = ("stage_ms", "lookup_ms", "save_ms", "load_ms")
DS_HITS = ("hits_memory", "hits_disk", "misses")  # the data system workers' own counts of reads, by tier
TOKEN_SOURCES = ("prompt_tokens_computed", "prompt_tokens_local_cache", "prompt_tokens_loaded")
#: the key of `ms_per_chunk` (a target's results) for prefix routing's measure of a chunk loaded from the data system
LOAD_RATE = "load from the data system"


def counters(session_id: str) -> tuple[dict, dict, dict]:
    """Counters summed over the instances and the data system workers (what `yrpd status` reports; with the legs
    the proxy sent each instance, `legs_<instance>`, and the replays it asked of each, `replays_<instance>`, with the
    seconds they took, `replay_s_<instance>`), the
    workers' use of memory and disk now (MB), and the time per prompt chunk prefix routing measured for each
    instance now ({instance: ms}, and LOAD_RATE: a chunk loaded from the data system; empty without it)."""
    report = api.status(api.open_deployment(session_id))
    blocks = ("loaded_blocks", "saved_blocks", "handoff_missed_blocks", "save_skipped_recent_blocks", *CONNECTOR_MS)
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
        if inst.routed is not None:
            total[f"legs_{inst.name}"] = inst.routed.get("requests") or 0
            # the exact mode's round trips to the instance's replay socket and the seconds they took (the oracle's
            # price)
            index = inst.routed.get("kv_index") or {}
            for key in ("replays", "replay_s"):
                if index.get(key) is not None:
                    total[f"{key}_{inst.name}"] = index[key]
    rates = {i.name: i.routed["ms_per_chunk"] for i in report.instances if (i.routed or {}).get("ms_per_chunk")}
    load = ((report.proxy.routing if report.proxy else None) or {}).get("load_ms_per_chunk")
    if load is not None:
        rates[LOAD_RATE] = load
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
    return total, use if workers else {}, rates


def _proxy_metrics(url: str) -> str | None:
    """The proxy's /metrics at `url`; None where nothing answers them there (no proxy: a single instance)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            return resp.read().decode()
    except OSError:
        return None


def prefill_legs(url: str) -> tuple[float, int] | None:
    """(seconds, count) of the successful prefill legs the proxy at `url` has timed since it started (its
    yrpd_proxy_prefill_seconds histogram); None where nothing answers them there (no proxy: a single instance)."""
    text = _proxy_metrics(url)
    found = {}
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name in ("yrpd_proxy_prefill_seconds_sum", "yrpd_proxy_prefill_seconds_count"):
            found[name.rsplit("_", 1)[1]] = float(value)
    return (found["sum"], int(found["count"])) if len(found) == 2 else None


_CHECKED = re.compile(r'^yrpd_proxy_kv_index_checked_blocks_total\{.*outcome="(\w+)".*\} (\S+)$')


def index_checked(url: str) -> dict[str, int]:
    """The proxy's check of its KV-event index against the prefill instances' caches, summed over them: blocks
    by outcome (yrpd.proxy.pool.INDEX_OUTCOMES); empty where it routes on no events."""
    out: dict[str, int] = {}
    for line in (_proxy_metrics(url) or "").splitlines():
        if m := _CHECKED.match(line):
            out[m[1]] = out.get(m[1], 0) + int(float(m[2]))
    return out


def index_stage(before: dict[str, int], after: dict[str, int]) -> dict:
    """One run's check of the index (its deltas, `index_<outcome>_blocks`) and the share of the blocks the index
    and the caches agreed on (`index_agreement`, 0..1); empty where no leg was checked."""
    delta = {k: after[k] - before.get(k, 0) for k in after}
    total = sum(delta.values())
    if not total:
        return {}
    return {**{f"index_{k}_blocks": v for k, v in delta.items()},
            "index_agreement": round(delta.get("right", 0) / total, 4)}


def stages(run: dict, before: tuple[float, int] | None, after: tuple[float, int] | None) -> dict:
    """A PD run's mean TTFT split in two: the mean prefill leg (the proxy's timing of the legs this run sent: the
    stage prefill routing chooses) and the rest (decode's queue, the hand-over's load, the prompt's last block, the
    proxy). Empty where the proxy timed no leg in the run. Every leg between the two reads counts, vllm bench serve's
    one test prompt before the run included: on a run of N prompts the mean leg is off by about 1/N of a leg."""
    if before is None or after is None or after[1] <= before[1] or run.get("mean_ttft_ms") is None:
        return {}
    leg_ms = 1000 * (after[0] - before[0]) / (after[1] - before[1])
    return {"mean_prefill_leg_ms": round(leg_ms, 2),
            "mean_ttft_after_prefill_ms": round(run["mean_ttft_ms"] - leg_ms, 2)}


def serve_argv(load: "Load", url: str, model: str, out_dir: Path, name: str) -> list[str]:
    """The `vllm bench serve` command of one run: the workload (a saved JSONL, or one of vLLM's own datasets with its
    options as given), how it is sent, and every metric saved per request."""
    if load.vllm_dataset:
        workload = ["--dataset-name", load.vllm_dataset.name, *load.vllm_dataset.args]
    else:
        workload = ["--dataset-name", "custom", "--dataset-path", str(load.dataset), "--skip-chat-template",
                    "--custom-output-len", str(load.output_len)]
    return [str(load.vllm_venv / "bin/vllm"), "bench", "serve", "--backend", "vllm", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(load.tokenizer), *workload,
            "--num-prompts", str(load.num_prompts), "--disable-shuffle", "--max-concurrency", str(load.concurrency),
            "--temperature", "0", "--seed", str(load.seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", *(["--goodput", *load.goodput] if load.goodput else []),
            "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", f"{name}.json",
            "--label", name]


def bench_serve(load: "Load", url: str, model: str, out_dir: Path, name: str, key: str | None = None) -> dict:
    argv = serve_argv(load, url, model, out_dir, name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    env.pop("OPENAI_API_KEY", None)
    # vLLM's timed_trace makes each hash id's tokens from Python's hash() of a string: one seed, the same prompts
    # for every target (and new ones in each run of a repeat: Load.for_run)
    env["PYTHONHASHSEED"] = str(load.seed)
    if key:  # vllm bench serve sends it as the bearer token: the environment keeps it out of the .cmd file and ps
        env["OPENAI_API_KEY"] = key
    (out_dir / f"{name}.cmd").write_text(shlex.join(argv) + "\n")
    with open(out_dir / f"{name}.log", "w") as log:
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    if proc.returncode != 0:
        tail = (out_dir / f"{name}.log").read_text().splitlines()[-15:]
        raise RuntimeError(f"vllm bench serve for {name} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return json.loads((out_dir / f"{name}.json").read_text())


GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def goodput_slos(text: str) -> tuple[str, ...]:
    """`--goodput "ttft:2000 tpot:100"` as `vllm bench serve --goodput` takes it; a bad pair is a usage error here,
    before anything is deployed, not vLLM's failure after."""
    pairs = tuple(text.replace(",", " ").split())
    for pair in pairs:
        key, _, value = pair.partition(":")
        try:
            ok = key in GOODPUT_KEYS and float(value) > 0
        except ValueError:
            ok = False
        if not ok:
            raise SpecError("--goodput", f"{pair!r} is not KEY:MILLISECONDS",
                            f"give pairs like ttft:2000 tpot:100 (keys: {', '.join(GOODPUT_KEYS)})")
    return pairs


@dataclass(frozen=True)
class VllmDataset:
    """One of `vllm bench serve`'s own datasets (random, prefix_repetition, sharegpt, ...), passed through: its name
    and its options exactly as the user gave them."""
    name: str
    args: tuple[str, ...] = ()

    def files(self) -> dict[str, Path]:
        """The files its options name (`--dataset-path`), for the report's checksums."""
        path = _last_value(list(self.args), "--dataset-path")
        return {"dataset": Path(path)} if path else {}


@dataclass(frozen=True)
class BenchRequest:
    """One `yrpd bench run`: the targets, the workload (a saved dataset file, options to generate one, or one of
    vLLM's own datasets), how the load is sent, and the sizes every target's deployment gets."""
    targets: tuple[str, ...]
    dataset: DatasetOptions = DatasetOptions()
    #: a JSONL from `yrpd bench dataset` (with its .meta.json beside it); None: generate one from `dataset`
    dataset_file: Path | None = None
    vllm_dataset: VllmDataset | None = None  # instead of either: vLLM's own dataset, generated by `vllm bench serve`
    #: the deployed model's tokenizer.json directory; None: the deployed model's, if it is on this machine
    tokenizer: Path | None = None
    num_prompts: int | None = None  # None: every prompt of the dataset
    output_len: int = 32
    max_concurrency: int = 1
    goodput: tuple[str, ...] = ()  # SLOs as `vllm bench serve --goodput` takes them: ttft:MS tpot:MS e2el:MS
    repeat: int = 1  # runs of the load against each target (one deployment each); the report gives medians
    #: the repeats in rounds (every target's run n, then every target's run n + 1), each target deployed again in
    #: each round, so the machine's drift over the run spreads over all targets
    interleave: bool = False
    kv_cache_mb: int | None = None
    datasystem_mb: int | None = None
    datasystem_spill_mb: int | None = None
    #: a local venv with vLLM for `vllm bench serve`; None: <env_root>/vllm
    vllm_venv: Path | None = None
    restore: bool = True  # deploy the original spec again afterwards
    command: str = "yrpd bench run"  # how the run was asked for, as typed (the report's provenance)


@dataclass(frozen=True)
class BenchOutcome:
    out_dir: Path  # results.json, report.md, the plot, each target's raw result and log
    report: str  # the report, as markdown
    failed: dict[str, str]  # target -> why it has no figures (the others' are in the report)


def deployed_tokenizer(deployment) -> Path:
    """The deployed model's directory, when it is on this machine (it holds tokenizer.json)."""
    local = Path(model_path(deployment.spec, paths(deployment.context())))
    if not (local / "tokenizer.json").is_file():
        raise SpecError("--tokenizer", f"the deployed model {local} is not on this machine",
                        "pass --tokenizer DIR with a local copy of its tokenizer.json")
    return local


def bench(session_id: str | None, request: BenchRequest, log=print, progress=None) -> BenchOutcome:
    """Run the benchmark against a PD deployment (the latest, or `session_id`) and its baselines; every target's
    spec, and its KV pool against the model, is checked before the first is deployed. Results land in the
    session's bench/<time>/; a target that fails is named in them and the others still run."""
    unknown = [t for t in request.targets if t not in TARGETS]
    if unknown or not request.targets:
        raise SpecError("--targets", f"unknown target(s) {', '.join(unknown) or '(none)'}",
                        f"use a comma-separated subset of {', '.join(TARGETS)}")
    if "single-roomy" in request.targets and not request.kv_cache_mb:
        # without it the two are one spec, and the second would be measured on the first's warm deployment
        raise SpecError("--targets", "single-roomy differs from single only where --kv-cache-mb cuts the other "
                        "targets' pools", "give --kv-cache-mb with it, or leave single-roomy out")
    if request.interleave and request.repeat < 2:
        raise SpecError("--interleave", f"given with --repeat {request.repeat}: one run per target has no rounds",
                        "pass --repeat 2 or more, or leave out --interleave")
    if request.vllm_dataset and request.dataset_file:
        raise SpecError("--vllm-dataset", "given with --dataset", "run one workload: leave out one of the two")
    if request.vllm_dataset and not request.num_prompts:
        raise SpecError("--num-prompts", f"not given with --vllm-dataset {request.vllm_dataset.name}",
                        "say how many prompts vLLM generates, e.g. --num-prompts 64")
    for name, path in (request.vllm_dataset.files() if request.vllm_dataset else {}).items():
        if not path.is_file():
            raise SpecError("--vllm-dataset-args", f"--dataset-path {path} is not a file", "pass the dataset's file")
    code = git_state()  # what is measured is the code of now: the run lasts, the checkout may move meanwhile
    deployment = api.open_deployment(session_id)
    session = deployment.session
    if session.phase is not SessionPhase.deployed:
        raise SpecError("bench", f"session {session.id} is {session.phase}", "deploy first: yrpd deploy ...")
    base, left_up = varied_spec(deployment)
    if not base.disaggregated:
        raise SpecError("bench", f"session {session.id} is not a PD deployment", "bench a PD deployment")
    if left_up:
        log(f"bench: session {session.id} is the {left_up} target of an earlier bench run, left up: the targets vary "
            f"the spec that run varied")
    kind = deployment.plan.hosts[0].kind
    specs = {}
    for target in request.targets:
        try:
            specs[target] = variant(base, target, kind, request.kv_cache_mb, request.datasystem_mb,
                                    request.datasystem_spill_mb)
        except SpecError as e:
            raise SpecError("--targets", f"{target} cannot run on session {session.id} ({e.field}: {e.problem})",
                            "leave it out of --targets") from None
    tokenizer = request.tokenizer or deployed_tokenizer(deployment)
    for target, spec in specs.items():
        refused = pool_refusal(spec, kind, tokenizer, deployment.plan.dtype.dtype)
        if refused:
            reason, need_mb = refused
            per = "the PD instances' pools together" if target in SINGLE_TARGETS else ""
            raise SpecError("--kv-cache-mb",
                            f"vLLM would refuse the {target} target: {reason}{per and ' (' + per + ')'}",
                            f"give --kv-cache-mb {need_mb} or more, or deploy with a smaller --max-model-len")
    vllm_venv = request.vllm_venv or Path(deployment.spec.env_root) / "vllm"
    if not (vllm_venv / "bin" / "vllm").exists():
        raise SpecError("--vllm-venv", f"{vllm_venv}/bin/vllm not found", "pass a local venv with vLLM installed")
    out_dir = session.path / "bench" / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True)
    inputs: dict[str, Path] = {}
    if request.vllm_dataset:
        dataset_file = None
        meta = {"workload": f"vllm:{request.vllm_dataset.name}", "vllm_dataset": request.vllm_dataset.name,
                "vllm_dataset_args": list(request.vllm_dataset.args), "prompts": request.num_prompts,
                "seed": request.dataset.seed}
        inputs.update(request.vllm_dataset.files())
    elif request.dataset_file:
        dataset_file = request.dataset_file
        meta_file = dataset_file.with_name(dataset_file.name + ".meta.json")
        meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
        meta.setdefault("prompts", sum(1 for _ in dataset_file.open()))
    else:
        dataset_file = out_dir / "dataset.jsonl"
        meta = make(request.dataset, tokenizer, dataset_file, request.output_len)
    if dataset_file:
        inputs["dataset"] = dataset_file
    run_datasets = []
    if dataset_file is not None and not request.dataset_file:  # generated here: each further run gets its own
        for n in range(1, request.repeat):
            run_datasets.append(out_dir / f"dataset-run{n + 1}.jsonl")
            make(replace(request.dataset, seed=request.dataset.seed + n), tokenizer, run_datasets[-1],
                 request.output_len)
            inputs[f"dataset-run{n + 1}"] = run_datasets[-1]
    own_lengths = meta.get("workload") in ("mixed", "multi-turn")  # each prompt carries its output_tokens
    load = Load(dataset_file, tokenizer, vllm_venv, request.num_prompts or meta["prompts"],
                -1 if own_lengths else request.output_len, request.max_concurrency, request.dataset.seed,
                request.vllm_dataset, request.goodput, tuple(run_datasets))
    if request.repeat > 1:
        meta["runs_prompts"] = ("the user's dataset file in every run: runs after the first find its prompts cached"
                                if request.dataset_file else
                                "new prompts of the same workload in each run (seed + run - 1), the same for every "
                                "target: no run finds the one before it in the caches")
    results = run_targets(session, deployment.spec, kind, request, load, out_dir, log=log, progress=progress,
                          original=base)
    meta["kv_cache_mb_per_instance"] = request.kv_cache_mb
    meta["datasystem_mb"] = request.datasystem_mb or deployment.spec.datasystem_memory_mb
    meta["datasystem_spill_mb"] = (deployment.spec.datasystem_spill_mb if request.datasystem_spill_mb is None
                                   else request.datasystem_spill_mb)
    meta.update(max_concurrency=request.max_concurrency, repeat=request.repeat, goodput=list(request.goodput),
                interleave=request.interleave)
    # the spec's connector settings every yrpd-connector target ran with: two runs that differ only there
    # (benchmarks/store_regimes.sh's CONNECTOR) are told apart by their reports
    meta["connector"] = dict(base.connector)
    commands = [request.command] + [(out_dir / f"{run}.cmd").read_text().strip()
                                    for target in results for run in results[target].get("runs_named", [])]
    prov = record(commands, inputs, vllm_venv, code)
    failed = {t: r["error"] for t, r in results.items() if "error" in r}
    return BenchOutcome(out_dir, write_report(results, meta, out_dir, prov), failed)


@dataclass(frozen=True)
class Load:
    """What `vllm bench serve` sends to each target (the same for all)."""
    dataset: Path | None  # the JSONL sent (None with a vLLM dataset)
    tokenizer: Path
    vllm_venv: Path
    num_prompts: int
    output_len: int  # -1: each prompt's own (the mixed and multi-turn workloads)
    concurrency: int
    seed: int
    vllm_dataset: VllmDataset | None = None
    goodput: tuple[str, ...] = ()
    #: the datasets of a repeat's second, third.. runs, generated with the seed + 1, + 2.. (empty: `dataset` each time)
    run_datasets: tuple[Path, ...] = ()

    def for_run(self, n: int) -> Load:
        """The load of a repeat's run `n` (0: the first). A repeat is of the same experiment, so from cold caches:
        each run sends new prompts of the same shape (vLLM's datasets and timed_trace from the seed + n, a
        generated dataset's own file), or the same prompts where the dataset is the user's file. Each target's run
        `n` sends the same prompts."""
        if n == 0:
            return self
        dataset = self.run_datasets[n - 1] if self.run_datasets else self.dataset
        return replace(self, seed=self.seed + n, dataset=dataset)


#: the metrics a repeated run reports the spread of (min, max over its runs) beside the median
SPREAD = ("mean_ttft_ms", "mean_prefill_leg_ms", "mean_ttft_after_prefill_ms", "prefix_hit_rate", "index_agreement",
          "p90_ttft_ms", "mean_tpot_ms", "request_throughput", "total_token_throughput", "request_goodput")


def summarize(runs: list[dict]) -> tuple[dict, dict]:
    """(median of each numeric metric over the runs, {metric: [min, max]} of SPREAD) of repeated runs; the error
    rate of each run is failed / sent."""
    for m in runs:
        sent = (m.get("completed") or 0) + (m.get("failed") or 0)
        m["error_rate"] = round((m.get("failed") or 0) / sent, 4) if sent else None
    keys = [k for k in runs[0] if all(isinstance(r.get(k), (int, float)) for r in runs)]
    median = {k: statistics.median(r[k] for r in runs) for k in keys}
    spread = {k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in SPREAD if k in keys and len(runs) > 1}
    return median, spread


def run_targets(session, spec: DeploySpec, kind: DeviceKind, request: BenchRequest, load: Load, out_dir: Path,
                log=print, progress=None, original: DeploySpec | None = None) -> dict:
    """Each target in turn (variants of `original`, by default `spec`: what `session` runs), deployed as it needs;
    one that fails is recorded with its reason and torn down, and the run goes on with the next."""
    current: str | None = session.id  # deployed (checked by bench()); None while no target is up
    original = original or spec
    results: dict[str, dict] = {}
    parts: dict[str, list[dict]] = {}  # interleaved: each target's runs so far, one round each
    rounds = [[n] for n in range(request.repeat)] if request.interleave else [None]  # bench() refused it with one run
    try:
        for target, runs in ((t, r) for r in rounds for t in request.targets):
            if target in results:  # failed in an earlier round: its error stands
                continue
            try:
                want = variant(original, target, kind, request.kv_cache_mb, request.datasystem_mb,
                               request.datasystem_spill_mb)
                # in rounds every target is deployed anew each round (what ran before is the last target's)
                live = current is not None and want.fingerprint() == spec.fingerprint() and runs is None
                if not live:
                    if current is not None:
                        log(f"bench: tearing down session {current} to deploy the {target} target")
                        down(current)
                        current = None
                    log(f"bench: deploying the {target} target ({TARGETS[target]})")
                    spec = want
                    current = deploy(want, target, progress, origin=original)
                measured = measure(current, target, request, load, out_dir, log, runs)
                if runs is None:
                    results[target] = measured
                else:
                    parts.setdefault(target, []).append(measured)
            except Exception as e:  # noqa: BLE001 - the report names it; the other targets' figures still count
                reason = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
                log(f"bench: the {target} target failed: {reason}")
                results[target] = {"description": TARGETS[target], "error": str(e).strip() or repr(e)}
                _down_failed(current, log)
                current = None
    finally:
        if request.restore and (current is None or spec.fingerprint() != original.fingerprint()):
            if current is not None:
                down(current)
            log("bench: deploying the original spec again")
            deploy(original, "restore", progress)
    return {t: results[t] if t in results else merged(parts[t]) for t in request.targets if t in results or t in parts}


def merged(parts: list[dict]) -> dict:
    """One target's interleaved rounds (measure's results of one run each, each on a deployment of its own) as one
    result: every run's figures, medians and spread over them all, the counters summed."""
    runs = [r for p in parts for r in p["runs"]]
    metrics, spread = summarize(runs)
    counters: dict = {}
    for p in parts:
        for k, v in p["counters"].items():
            counters[k] = counters.get(k, 0) + v
    return {**parts[-1], "metrics": metrics, "spread": spread, "runs": runs, "counters": counters,
            "sessions": [p["session"] for p in parts], "wall_s": round(sum(p["wall_s"] for p in parts), 1),
            "runs_named": [n for p in parts for n in p["runs_named"]],
            "ttfts_ms": [t for p in parts for t in p["ttfts_ms"]],
            "input_lens_sha256": sorted({h for p in parts for h in p["input_lens_sha256"]})}


def _down_failed(current: str | None, log) -> None:
    """Tear down what a failed target left deployed (the session it ran on, or the one its deploy started)."""
    try:
        latest = api.open_deployment(None).session
    except Exception:  # noqa: BLE001 - no session at all
        latest = None
    for sid in {current, latest.id if latest and latest.phase is not SessionPhase.down else None} - {None}:
        try:
            log(f"bench: tearing down session {sid} after the failure")
            down(sid)
        except Exception as e:  # noqa: BLE001
            log(f"bench: tearing down session {sid} failed too: {e}")


def measure(current: str, target: str, request: BenchRequest, load: Load, out_dir: Path, log,
            only: list[int] | None = None) -> dict:
    """`request.repeat` runs of the load against the deployed target (`only`: those of these indices, one round
    of an interleaved run): medians, spread, counters over all runs."""
    deployed = api.open_deployment(current)
    url = deployed.url
    before, _, _ = counters(current)
    last = None  # (counters, use, rates) read after the last run of a repeat
    runs, ttfts, names, input_lens = [], [], [], set()
    started = time.monotonic()
    for n in range(request.repeat) if only is None else only:
        name = target if request.repeat == 1 else f"{target}-run{n + 1}"
        log(f"bench: {name}: vllm bench serve against {url} ({load.num_prompts} prompts)")
        legs_before, checked_before = prefill_legs(url), index_checked(url)
        raw = bench_serve(load.for_run(n), url, deployed.spec.model_name, out_dir, name, deployed.endpoint_key())
        names.append(name)
        runs.append({k: v for k, v in raw.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        runs[-1].update(stages(runs[-1], legs_before, prefill_legs(url)))
        runs[-1].update(index_stage(checked_before, index_checked(url)))
        if request.repeat > 1:  # each run's own hit rate, so a repeat gives its median and spread like the times
            time.sleep(STATS_INTERVAL_S + 1)  # the connector rewrites its stats files this often: let the run's land
            mark = last[0] if last else before
            last = counters(current)
            rate = prefix_hit_rate({k: last[0][k] - mark.get(k, 0) for k in last[0]})
            if rate is not None:
                runs[-1]["prefix_hit_rate"] = rate
        ttfts += [round(t * 1000, 2) for t in raw.get("ttfts", []) if t]
        input_lens.add(hashlib.sha256(json.dumps(raw.get("input_lens")).encode()).hexdigest())
    if last is None:  # one run: (a repeat read them after each run, the last one's are these)
        time.sleep(STATS_INTERVAL_S + 1)  # the connector rewrites its stats files this often: let the last land
        last = counters(current)
    after, use, rates = last
    metrics, spread = summarize(runs)
    return {"description": TARGETS[target], "session": current, "url": url,
            "wall_s": round(time.monotonic() - started, 1), "metrics": metrics, "spread": spread,
            "runs": runs if request.repeat > 1 else [], "runs_named": names,
            # the prompts' lengths as vLLM counted them, hashed: the same for every target of one run
            "input_lens_sha256": sorted(input_lens), "ttfts_ms": ttfts,
            "counters": {k: after[k] - before.get(k, 0) for k in after},
            "ms_per_chunk": rates,  # prefix routing's measure of each instance and of a load, at the end
            "data_system": use}  # at the end of the run; empty where no worker reported
