"""The bench report: the targets side by side with ratios (JSON, Markdown table) and a PNG plot."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from yrpd.provenance import missing

ROWS = [  # (label, metric key in vllm bench serve's result, or yrpd.bench.run.stages's, unit)
    ("mean TTFT", "mean_ttft_ms", "ms"),
    ("of which the prefill leg (mean, the proxy's timing)", "mean_prefill_leg_ms", "ms"),
    ("of which after the prefill leg (decode, hand-over)", "mean_ttft_after_prefill_ms", "ms"),
    ("prefill prefix-cache hit rate, each run's own", "prefix_hit_rate", "% of its prompt tokens"),
    ("KV-event index agreeing with the prefill caches", "index_agreement", "share of its legs' checked blocks"),
    ("of them said held by the index, absent from the cache", "index_claimed_absent_blocks", "blocks"),
    ("of them in the cache, not said by the index", "index_held_unclaimed_blocks", "blocks"),
    ("median TTFT", "median_ttft_ms", "ms"),
    ("p90 TTFT", "p90_ttft_ms", "ms"),
    ("p99 TTFT", "p99_ttft_ms", "ms"),
    ("mean TPOT", "mean_tpot_ms", "ms"),
    ("mean ITL", "mean_itl_ms", "ms"),
    ("p99 ITL", "p99_itl_ms", "ms"),
    ("request throughput", "request_throughput", "req/s"),
    ("request goodput (within the SLOs)", "request_goodput", "req/s"),
    ("output throughput", "output_throughput", "tok/s"),
    ("total token throughput", "total_token_throughput", "tok/s"),
    ("completed", "completed", "requests"),
    ("failed", "failed", "requests"),
    ("error rate", "error_rate", "failed / sent"),
]
COUNTER_ROWS = [("external cache hit tokens", "external_cache_hit_tokens"), ("KV blocks loaded", "loaded_blocks"),
                ("KV blocks saved", "saved_blocks"),
                ("KV blocks handed over but computed again (evicted or late)", "handoff_missed_blocks"),
                ("KV blocks not saved again (saved within resave_after_s)", "save_skipped_recent_blocks"),
                ("connector: copying saves out on the engine's steps (ms, all runs)", "stage_ms"),
                ("connector: existence lookups in the scheduler's steps (ms, all runs)", "lookup_ms"),
                ("connector: the writer's puts, beside the engine (ms, all runs)", "save_ms"),
                ("connector: loads (ms, all runs)", "load_ms"),
                ("data system reads from memory", "ds_hits_memory"),
                ("data system reads from disk", "ds_hits_disk"), ("data system misses", "ds_misses")]
# where each role's prompt tokens came from; a row shows only where a target has it (the single targets have no role
# `prefill`), and only where vLLM counts by source (>= 0.11)
SOURCE_ROWS = [(f"{role} prompt tokens {how}", f"{role}_prompt_tokens_{key}") for role in ("prefill", "decode")
               for how, key in (("computed", "computed"), ("from its own prefix cache", "local_cache"),
                                ("loaded through the connector", "loaded"))]


RATIOS = (  # (target, baseline, metric, label); the last is the mixed workload's goal: streams keep their pace
    ("pd", "pd-noreuse", "mean_ttft_ms", "mean TTFT"), ("pd", "pd-load", "mean_ttft_ms", "mean TTFT"),
    ("pd", "single", "mean_ttft_ms", "mean TTFT"),
    ("single-yr", "single", "mean_ttft_ms", "mean TTFT"), ("pd", "single", "p99_tpot_ms", "p99 TPOT"),
    # the floor of a store's ratio where pools overflow, and how near the store comes to it
    ("single-roomy", "single", "mean_ttft_ms", "mean TTFT"), ("single-yr", "single-roomy", "mean_ttft_ms", "mean TTFT"),
    ("pd", "peer-example-pd", "mean_ttft_ms", "mean TTFT"), ("single-yr", "peer-lmcache", "mean_ttft_ms", "mean TTFT"),
    ("pd", "peer-nixl-pd", "mean_ttft_ms", "mean TTFT"),
    ("pd", "pd-rr", "mean_ttft_ms", "mean TTFT"), ("pd", "pd-estimate", "mean_ttft_ms", "mean TTFT"),
    ("pd-estimate", "pd-rr", "mean_ttft_ms", "mean TTFT"), ("pd-oracle", "pd-rr", "mean_ttft_ms", "mean TTFT"),
    ("pd", "pd-oracle", "mean_ttft_ms", "mean TTFT"), ("pd", "pd-nostore", "mean_ttft_ms", "mean TTFT"),
    # the stage prefill routing chooses, apart from decode's (yrpd.bench.run.stages)
    ("pd", "pd-rr", "mean_prefill_leg_ms", "mean prefill leg"),
    ("pd", "pd-estimate", "mean_prefill_leg_ms", "mean prefill leg"),
    ("pd", "pd-oracle", "mean_prefill_leg_ms", "mean prefill leg"),
    ("pd", "pd-nostore", "mean_prefill_leg_ms", "mean prefill leg"),
)


def prefix_hit_rate(counters: dict) -> float | None:
    """The share (%) of the prefill instances' prompt tokens their own prefix caches held: what routing decides
    (a token loaded from the data system or computed was not where the request went). None where vLLM does not
    count tokens by source."""
    parts = [counters.get(f"prefill_{key}") for key in ("prompt_tokens_computed", "prompt_tokens_local_cache",
                                                         "prompt_tokens_loaded")]
    if any(v is None for v in parts) or not sum(parts):
        return None
    return round(100 * parts[1] / sum(parts), 2)


def ratios(results: dict) -> dict:
    """Each target's metric against its baseline's, where both ran (lower is better)."""
    out = {}
    for mine, base, key, label in RATIOS:
        a = results.get(mine, {}).get("metrics", {}).get(key)
        b = results.get(base, {}).get("metrics", {}).get(key)
        if a and b:
            out[f"{mine}/{base} {label}"] = round(a / b, 3)
    return out


def markdown(results: dict, meta: dict, provenance: dict | None = None) -> str:
    failed = {n: r["error"] for n, r in results.items() if "error" in r}
    names = [n for n in results if n not in failed]
    if str(meta.get("workload", "")).startswith("vllm:"):
        shape = (f"vLLM's {meta['vllm_dataset']} dataset, {meta.get('prompts')} prompts "
                 f"({' '.join(meta.get('vllm_dataset_args') or []) or 'its defaults'})")
    elif meta.get("workload") == "multi-turn":
        shape = (f"multi-turn chat: {meta.get('conversations')} conversations x {meta.get('turns')} turns, shared "
                 f"system prompt {meta.get('common_prefix_len')} + opening {meta.get('opening_len')} tokens, "
                 f"questions {meta.get('question_len')} / answers {meta.get('answer_len')} tokens, prompts "
                 f"{meta.get('prompt_tokens_min')}-{meta.get('prompt_tokens_max')} tokens, seed {meta.get('seed')}")
    elif meta.get("workload") == "mixed":
        shape = (f"mixed: {meta.get('streams')} prompts of {meta.get('stream_prompt_len')} tokens streaming "
                 f"{meta.get('stream_output_len')} tokens, {meta.get('long_prompts')} long prompts of "
                 f"{meta.get('long_len')} tokens, seed {meta.get('seed')}")
    else:
        shape = (f"{meta.get('prompts')} prompts, {meta.get('groups')} groups x {meta.get('prompts_per_group')}, "
                 f"prefix {meta.get('prefix_len')} + suffix {meta.get('suffix_len')} tokens, seed {meta.get('seed')}")
    if meta.get("kv_cache_mb_per_instance"):
        shape += f", KV pool {meta['kv_cache_mb_per_instance']} MB per instance"
        if "single-roomy" in results:
            shape += " (single-roomy: vLLM's own)"
    if meta.get("datasystem_mb"):
        shape += f", data system {meta['datasystem_mb']} MB per host"
        if meta.get("datasystem_spill_mb"):
            shape += f" + {meta['datasystem_spill_mb']} MB on disk"
    if meta.get("connector"):
        shape += ", connector " + ", ".join(f"{k} {v}" for k, v in sorted(meta["connector"].items()))
    if meta.get("max_concurrency"):
        shape += f", concurrency {meta['max_concurrency']}"
    if (meta.get("repeat") or 1) > 1:
        shape += f", {meta['repeat']} runs per target (medians; [min, max] below)"
        if meta.get("interleave"):
            shape += ", in rounds (every target's run n before any run n + 1)"
    if meta.get("goodput"):
        shape += f", goodput SLOs {' '.join(meta['goodput'])}"
    lines = [f"# yrpd bench: {shape}", ""]
    if meta.get("runs_prompts"):
        lines += [f"Each run's prompts: {meta['runs_prompts']}.", ""]
    if provenance:
        dirty = " (with uncommitted changes)" if provenance.get("dirty") else ""
        lines += [f"Commit {provenance.get('commit') or 'unknown (not a git checkout)'}{dirty}, yrpd "
                  f"{provenance.get('yrpd')}, vLLM {provenance.get('vllm') or '?'}; {provenance.get('cpu')} "
                  f"({provenance.get('cores')} cores; {', '.join(provenance.get('cpu_flags') or []) or 'no bf16/AMX'}"
                  f"); recorded {provenance.get('recorded')}. Command: `{(provenance.get('commands') or ['?'])[0]}`",
                  ""]
    for name, why in failed.items():
        lines.append(f"- **{name} failed**, no figures: {why.splitlines()[0]}")
    if failed:
        lines.append("")
    if not names:
        return "\n".join(lines) + "\n"
    lines += ["| metric | " + " | ".join(f"{n} ({results[n]['description']})" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for label, key, unit in ROWS:
        values = [results[n]["metrics"].get(key) for n in names]
        if all(v is None for v in values):
            continue
        lines.append(f"| {label} ({unit}) | " + " | ".join(_fmt(v) for v in values) + " |")
    for label, key in COUNTER_ROWS:
        lines.append(f"| {label} | " + " | ".join(f"{results[n]['counters'].get(key, 0):,.0f}" for n in names) + " |")
    for label, key in SOURCE_ROWS:
        values = [results[n]["counters"].get(key) for n in names]
        if any(values):
            lines.append(f"| {label} | " + " | ".join("-" if v is None else f"{v:,.0f}" for v in values) + " |")
    rates = [prefix_hit_rate(results[n]["counters"]) for n in names]
    if any(r is not None for r in rates):
        lines.append("| prefill prefix-cache hit rate (% of its prompt tokens) | "
                     + " | ".join(_fmt(r) for r in rates) + " |")
    if any(results[n].get("data_system") for n in names):
        # in rounds each round deploys anew: the end is the last round's, which held one run's blocks
        end = "at the end of the last round" if meta.get("interleave") else "at the end"
        for label, key in ((f"data system memory used {end} (MB)", "memory_mb"),
                           (f"data system disk used {end} (MB)", "disk_mb")):
            lines.append(f"| {label} | " + " | ".join(_fmt((results[n].get("data_system") or {}).get(key))
                                                      for n in names) + " |")
    spreads = [(n, k, v) for n in names for k, v in (results[n].get("spread") or {}).items()]
    if spreads:
        lines += ["", "Spread over the runs [min, max]: " + "; ".join(
            f"{n} {k} [{_fmt(lo)}, {_fmt(hi)}]" for n, k, (lo, hi) in spreads)]
    lens = {n: tuple(results[n].get("input_lens_sha256") or ()) for n in names}
    if len(set(lens.values())) > 1:
        lines += ["", "**Warning:** the targets were not sent the same prompts (their input lengths differ): "
                  + ", ".join(f"{n} {','.join(h[:8] for h in v)}" for n, v in lens.items())]
    lines.append("")
    for name, value in ratios(results).items():
        lines.append(f"- {name}: **{value}**")
    for line in per_request(results):
        lines.append(f"- {line}")
    oracle = prefix_hit_rate(results["pd-oracle"]["counters"]) if "pd-oracle" in names else None
    for name in names:
        rate = prefix_hit_rate(results[name]["counters"])
        if oracle is not None and rate is not None and name != "pd-oracle":
            lines.append(f"- {name} prefix-cache hit rate against pd-oracle's: **{rate - oracle:+.2f} points**")
    return "\n".join(lines) + "\n"


#: (target, baseline): pairs whose requests are compared one by one (a store's own cost beside the plain instance)
PAIRED = (("single-yr", "single"), ("single-yr", "peer-lmcache"), ("peer-lmcache", "single"),
          ("single-yr", "single-roomy"))


def per_request(results: dict) -> list[str]:
    """For each of PAIRED both measured on the same prompts: each request's TTFT less the baseline's for the same
    prompt (vLLM's bench lists the TTFTs in the order of its prompts, and every target of a run gets the same
    ones), median and p90 of the difference and how many requests were slower: where a store's cost sits (every
    request a little, or a few a lot), which a ratio of means hides."""
    out = []
    for target, base in PAIRED:
        a, b = (results.get(n) or {} for n in (target, base))
        if "error" in a or "error" in b or not a.get("ttfts_ms") or len(a["ttfts_ms"]) != len(b.get("ttfts_ms") or ()):
            continue
        if a.get("input_lens_sha256") != b.get("input_lens_sha256"):
            continue
        deltas = [x - y for x, y in zip(a["ttfts_ms"], b["ttfts_ms"])]
        p90 = statistics.quantiles(deltas, n=10, method="inclusive")[-1] if len(deltas) > 1 else deltas[0]
        out.append(f"{target} less {base}, per request ({len(deltas)}): median {_fmt(statistics.median(deltas))} ms, "
                   f"p90 {_fmt(p90)} ms; {sum(d > 0 for d in deltas)} of {len(deltas)} slower")
    return out


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.2f}"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    data = [results[n]["ttfts_ms"] or [0.0] for n in names]
    left.boxplot(data, showmeans=True)
    left.set_xticks(range(1, len(names) + 1), names)
    left.set_ylabel("TTFT (ms)")
    left.set_title("Time to first token per request")
    throughput = [results[n]["metrics"].get("total_token_throughput") or 0.0 for n in names]
    right.bar(names, throughput, color=["#2a7ab9", "#999999", "#d98c2b", "#4c9a2a"][: len(names)])
    right.set_ylabel("tokens/s (prompt + output)")
    right.set_title("Total token throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: dict, meta: dict, out_dir: Path, provenance: dict) -> str:
    """results.json (with where it came from: yrpd.provenance), report.md and the plot in out_dir; the report's
    text. Targets that failed are in both, named, without figures."""
    doc = {"provenance": provenance, "dataset": meta, "targets": results, "ratios": ratios(results)}
    (out_dir / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
    report = markdown(results, meta, provenance)
    (out_dir / "report.md").write_text(report)
    measured = {n: r for n, r in results.items() if "error" not in r}
    if measured:
        plot(measured, out_dir / "ttft_throughput.png")
    return report


def load_results(path: Path) -> dict:
    """A saved run: its results.json, or the bench directory that holds it."""
    file = path / "results.json" if path.is_dir() else path
    return json.loads(file.read_text())


def compare(before: dict, after: dict) -> tuple[str, list[str]]:
    """Two saved runs side by side: for each target both ran, each metric's value in both and after/before.
    Returns the Markdown table and warnings (runs on different datasets, targets only one of them ran)."""
    warnings = []
    shape = ("workload", "prompts", "groups", "prompts_per_group", "prefix_len", "suffix_len", "streams",
             "stream_output_len", "long_prompts", "long_len", "seed", "kv_cache_mb_per_instance")
    differs = [k for k in shape if before["dataset"].get(k) != after["dataset"].get(k)]
    if differs:
        warnings.append("the two runs used different datasets (" + ", ".join(
            f"{k} {before['dataset'].get(k)} vs {after['dataset'].get(k)}" for k in differs) + "): ratios compare "
            "unlike workloads")
    for which, doc in (("first", before), ("second", after)):
        if missing(doc):
            warnings.append(f"the {which} run does not say where it came from (no {', '.join(missing(doc))}): "
                            "it predates provenance, or was edited")
    machine = [k for k in ("commit", "cpu", "cores", "vllm") if (before.get("provenance") or {}).get(k)
               != (after.get("provenance") or {}).get(k)]
    if machine and not any("does not say" in w for w in warnings):
        warnings.append("the two runs differ in " + ", ".join(
            f"{k} ({before['provenance'].get(k)} vs {after['provenance'].get(k)})" for k in machine)
            + ": a ratio between them mixes that change in")
    def measured(doc: dict) -> set[str]:
        return {t for t, r in doc["targets"].items() if "metrics" in r}

    common = [t for t in before["targets"] if t in measured(before) & measured(after)]
    for name in sorted(measured(before) ^ measured(after)):
        warnings.append(f"target {name} has figures only in the {'first' if name in measured(before) else 'second'}"
                        " run")
    lines = ["| target | metric | first | second | second/first |", "|---|---|---|---|---|"]
    for target in common:
        a, b = before["targets"][target]["metrics"], after["targets"][target]["metrics"]
        for label, key, unit in ROWS:
            if a.get(key) is None and b.get(key) is None:
                continue
            ratio = f"{b[key] / a[key]:.3f}" if a.get(key) and b.get(key) is not None else "-"
            lines.append(f"| {target} | {label} ({unit}) | {_fmt(a.get(key))} | {_fmt(b.get(key))} | {ratio} |")
    return "\n".join(lines) + "\n", warnings
