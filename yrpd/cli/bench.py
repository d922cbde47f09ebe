"""`yrpd bench`: the prefix-shared long-sequence benchmark (dataset, run, report)."""

from __future__ import annotations

# the library is imported inside the command: `yrpd bench --help` and usage errors load none of it (yrpd.api: ~0.2 s)

import shlex
from pathlib import Path

import click

from yrpd.cli.options import session_option, version


@click.group()
@version
def bench() -> None:
    """Benchmark a deployment with vLLM's own `vllm bench serve`, against its baselines."""


def _need_bench_extra() -> None:
    import importlib.util

    from yrpd.errors import SpecError

    missing = [m for m in ("tokenizers", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecError("bench", f"{', '.join(missing)} not installed", "pip install 'yrpd[bench]'")


def _dataset_options(func):
    for option in reversed([
        click.option("--workload", type=click.Choice(["prefix", "mixed", "multi-turn"]), default="prefix",
                     show_default=True,
                     help="prefix: groups sharing prefixes; mixed: long unique prompts (prefix + suffix tokens) "
                          "arriving while short prompts stream long answers; multi-turn: chats that grow turn by "
                          "turn (vLLM's benchmarks/multi_turn shape), a system prompt of --prefix-len tokens shared by "
                          "all, an opening of --suffix-len tokens each"),
        click.option("--conversations", type=click.IntRange(1, 10000), default=6, show_default=True,
                     help="multi-turn: conversations, interleaved turn by turn"),
        click.option("--turns", type=click.IntRange(1, 1000), default=4, show_default=True,
                     help="multi-turn: turns per conversation"),
        click.option("--question-len", type=click.IntRange(1, 100000), default=48, show_default=True,
                     help="multi-turn: tokens of each user turn"),
        click.option("--answer-len", type=click.IntRange(0, 100000), default=32, show_default=True,
                     help="multi-turn: tokens of each earlier answer kept in the history (fixed text)"),
        click.option("--streams", type=click.IntRange(1, 10000), default=8, show_default=True,
                     help="mixed: prompts that stream long answers"),
        click.option("--stream-prompt-len", type=click.IntRange(1, 100000), default=64, show_default=True),
        click.option("--stream-output-len", type=click.IntRange(1, 100000), default=128, show_default=True),
        click.option("--long-prompts", type=click.IntRange(1, 10000), default=8, show_default=True,
                     help="mixed: long prompts, 2 output tokens each"),
        click.option("--groups", type=click.IntRange(1, 10000), default=4, show_default=True,
                     help="prompt groups (each shares one prefix)"),
        click.option("--prompts-per-group", type=click.IntRange(1, 10000), default=4, show_default=True),
        click.option("--prefix-len", type=click.IntRange(0, 1_000_000), default=1536, show_default=True,
                     help="shared prefix, tokens"),
        click.option("--suffix-len", type=click.IntRange(1, 1_000_000), default=256, show_default=True,
                     help="unique suffix, tokens"),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--tokenizer", type=click.Path(path_type=Path, file_okay=False),
                     help="directory with the deployed model's tokenizer.json (default: the deployed model, if local)"),
    ]):
        func = option(func)
    return func


@bench.command()
@click.option("--trace", "source", type=click.Path(path_type=Path, dir_okay=False, exists=True), required=True,
              help="a trace in Mooncake's format (JSONL: timestamp ms, input_length, output_length, hash_ids)")
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), required=True, help="scaled JSONL to write")
@click.option("--start", type=int, default=0, show_default=True, help="first request of the window")
@click.option("--requests", type=int, default=200, show_default=True, help="requests in the window")
@click.option("--tokens-per-id", type=int, default=16, show_default=True,
              help="tokens in place of each 512-token block (input lengths scale with it)")
@click.option("--output-scale", type=float, default=1 / 32, show_default=True, help="output lengths times this")
@click.option("--max-output", type=int, default=64, show_default=True, help="no answer longer than this")
@click.option("--time-scale", type=float, default=1.0, show_default=True,
              help="arrival times times this (2: half as many requests a second)")
@click.option("--load", type=float, help="instead of --time-scale: the window's input tokens arrive at this share of "
                                         "--capacity (0.6: the machine 60 % busy with prompts none of it had seen)")
@click.option("--capacity", type=float, help="with --load: input tokens a second the deployment computes (measure "
                                             "it: `yrpd bench run --vllm-dataset random`, total input tokens over "
                                             "the duration)")
@click.option("--conversations", type=float, default=1.0, show_default=True,
              help="keep this share of the conversations, every turn of each (0.02: a replay of minutes that keeps "
                   "the trace's reuse)")
@click.option("--seed", type=int, default=0, show_default=True, help="which conversations --conversations keeps")
def trace(source: Path, out: Path, **factors) -> int:
    """Scale a recorded trace to this machine, for `bench run --vllm-dataset timed_trace`."""
    from yrpd.console import err

    from yrpd.bench.trace import TraceScale, scale_trace

    meta = scale_trace(source, out, TraceScale(**factors))
    err().print(f"wrote {meta['written']} requests over {meta['span_s']} s (time x{meta['time_scale']:.4g}) to {out} "
                f"(inputs {meta['input_tokens']['min']}-"
                f"{meta['input_tokens']['max']} tokens, {meta['ids_seen_before']:.0%} of blocks seen before); replay: "
                f"yrpd bench run --vllm-dataset timed_trace --num-prompts {meta['written']} --max-concurrency 64 "
                f"--vllm-dataset-args \"--dataset-path {out} {' '.join(meta['bench_args'])}\"")
    return 0


@bench.command()
@_dataset_options
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), required=True, help="JSONL file to write")
@click.option("--output-len", type=click.IntRange(1), default=32, show_default=True,
              help="multi-turn: tokens each turn asks for (kept in the file)")
@session_option
def dataset(**params) -> int:
    """Write the prefix-shared dataset as JSONL for `vllm bench serve --dataset-name custom`."""
    _need_bench_extra()
    from yrpd.console import err

    from yrpd.bench.dataset import DatasetOptions, make

    tokenizer = params["tokenizer"]
    if tokenizer is None:
        from yrpd import api
        from yrpd.bench.run import deployed_tokenizer

        tokenizer = deployed_tokenizer(api.open_deployment(params["session_id"]))
    meta = make(DatasetOptions.from_params(params), tokenizer, params["out"], params["output_len"])
    if meta.get("workload") == "mixed":
        err().print(f"wrote {meta['streams']} streaming prompts ({meta['stream_output_len']} tokens each) and "
                    f"{meta['long_prompts']} long prompts of {meta['long_len']} tokens to {params['out']}")
    else:
        err().print(f"wrote {meta['prompts']} prompts of {meta['prompt_tokens_min']}-{meta['prompt_tokens_max']} "
                    f"tokens to {params['out']}")
    return 0


@bench.command()
@_dataset_options
@click.option("--dataset", "dataset_file", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="a JSONL from `yrpd bench dataset` (default: generate one with the options above)")
@click.option("--preset", type=click.Choice(["guide", "cpu"]),
              help="guide: the openYuanrong guide's benchmark (30 x 100 prompts of 2k + 6k tokens, concurrency 8, "
                   "2 output tokens; NPU hosts); cpu: its shape scaled to a small CPU host. Options given beside it win")
@click.option("--targets", default="pd,pd-noreuse,single", show_default=True,
              help="comma-separated: pd, pd-load, pd-rr, pd-estimate (pd routed by load, round robin, or on the "
                   "proxy's estimate instead of the KV-cache events), pd-nostore (pd without the data system's own "
                   "events: what it holds estimated), pd-noreuse, single, single-yr, single-roomy (vLLM's "
                   "own pool whatever --kv-cache-mb says), peer-example-pd, "
                   "peer-lmcache, peer-nixl-pd, peer-ascend-store (NPU)")
@click.option("--vllm-dataset", type=click.Choice(["random", "prefix_repetition", "sharegpt", "burstgpt", "timed_trace"]),
              help="send one of vLLM's own datasets instead (generated by `vllm bench serve` with the same seed for "
                   "every target); needs --num-prompts")
@click.option("--vllm-dataset-args", default="",
              help="its options, passed to `vllm bench serve` as given, e.g. \"--prefix-repetition-prefix-len 512 "
                   "--prefix-repetition-num-prefixes 4\" or \"--dataset-path ShareGPT.json\"")
@click.option("--num-prompts", type=click.IntRange(1), help="default: every prompt of the dataset")
@click.option("--output-len", type=click.IntRange(1), default=32, show_default=True, help="tokens per answer")
@click.option("--max-concurrency", type=click.IntRange(1), default=1, show_default=True)
@click.option("--goodput", default="",
              help="SLOs a request must meet to count as good: \"ttft:MS tpot:MS\" (also e2el:MS); the report gives "
                   "the good requests per second beside the throughput")
@click.option("--repeat", type=click.IntRange(1, 100), default=1, show_default=True,
              help="runs of the load against each target, each with new prompts of the same workload (a dataset "
                   "file of yours: the same prompts), so no run finds the one before in the caches; the report "
                   "gives medians and the [min, max] spread")
@click.option("--interleave", is_flag=True,
              help="with --repeat: run the targets in rounds (each target's first run, then each one's second, ...), "
                   "deploying each target again every round: slower, but a drift of the machine over the run spreads "
                   "over every target instead of landing on the one measured then")
@click.option("--kv-cache-mb", type=click.IntRange(1), default=None,
              help="size every instance's own KV pool (vLLM --kv-cache-memory-bytes): a working set larger than it "
                   "shows what a store beyond it keeps (default: vLLM's own sizing)")
@click.option("--datasystem-mb", type=click.IntRange(64), default=None,
              help="shared memory of every data system worker, MB, for every target (default: the deployment's); "
                   "smaller than the working set: it evicts, or spills with --datasystem-spill-mb")
@click.option("--datasystem-spill-mb", type=click.IntRange(0), default=None,
              help="disk tier of every data system worker, MB, for every target (default: the deployment's)")
@click.option("--vllm-venv", type=click.Path(path_type=Path, file_okay=False),
              help="local venv with vLLM for `vllm bench serve` (default: <env_root>/vllm)")
@click.option("--no-restore", is_flag=True, help="leave the last target deployed instead of the original spec")
@session_option
@version
def run(**params) -> int:
    """Run the benchmark against the latest deployment and its baselines; results land in the session."""
    _need_bench_extra()
    from click.core import ParameterSource

    from yrpd.bench.dataset import DatasetOptions, apply_preset
    from yrpd.bench.run import BenchRequest, VllmDataset, bench as run_bench, goodput_slos
    from yrpd.cli.progress import ConsoleProgress
    from yrpd.console import err, out
    from yrpd.errors import SpecError
    from yrpd.provenance import command_line

    ctx = click.get_current_context()
    explicit = {n for n in params if ctx.get_parameter_source(n) is ParameterSource.COMMANDLINE}
    params = apply_preset(params, params["preset"], explicit)
    if params["vllm_dataset_args"] and not params["vllm_dataset"]:
        raise SpecError("--vllm-dataset-args", "given without --vllm-dataset", "name the dataset: --vllm-dataset NAME")
    try:
        words = tuple(shlex.split(params["vllm_dataset_args"]))
    except ValueError as e:
        raise SpecError("--vllm-dataset-args", f"cannot be split into words ({e})", "check its quotes") from None
    request = BenchRequest(
        targets=tuple(t.strip() for t in params["targets"].split(",") if t.strip()),
        dataset=DatasetOptions.from_params(params), dataset_file=params["dataset_file"], tokenizer=params["tokenizer"],
        vllm_dataset=VllmDataset(params["vllm_dataset"], words) if params["vllm_dataset"] else None,
        num_prompts=params["num_prompts"], output_len=params["output_len"], max_concurrency=params["max_concurrency"],
        goodput=goodput_slos(params["goodput"]), repeat=params["repeat"], interleave=params["interleave"],
        kv_cache_mb=params["kv_cache_mb"], datasystem_mb=params["datasystem_mb"],
        datasystem_spill_mb=params["datasystem_spill_mb"], vllm_venv=params["vllm_venv"],
        restore=not params["no_restore"], command=command_line())
    console = err()
    outcome = run_bench(params["session_id"], request, log=console.print, progress=ConsoleProgress())
    out().print(outcome.report, markup=False, highlight=False)
    console.print(f"results: {outcome.out_dir}/results.json, report.md, ttft_throughput.png")
    if outcome.failed:
        console.print(f"error: {len(outcome.failed)} target(s) failed ({', '.join(outcome.failed)}); the report has "
                      "the others' figures and each failure's reason", markup=False)
        return 1
    return 0


@bench.command()
@click.argument("first", type=click.Path(path_type=Path))
@click.argument("second", type=click.Path(path_type=Path))
@version
def compare(first: Path, second: Path) -> int:
    """Two saved runs side by side (each a bench directory or its results.json): every metric and second/first."""
    from yrpd.bench.report import compare as side_by_side, load_results
    from yrpd.console import err, out
    from yrpd.errors import SpecError

    runs = []
    for name, path in (("FIRST", first), ("SECOND", second)):
        try:
            runs.append(load_results(path))
        except (OSError, ValueError) as exc:  # a JSONDecodeError is a ValueError
            raise SpecError(name, f"{path} is not a saved bench run ({exc.__class__.__name__})",
                            "pass a directory `yrpd bench run` wrote (…/bench/<time>) or its results.json") from None
        if "targets" not in runs[-1] or "dataset" not in runs[-1]:
            raise SpecError(name, f"{path} is not a saved bench run (no targets)",
                            "pass a directory `yrpd bench run` wrote (…/bench/<time>) or its results.json")
    table, warnings = side_by_side(*runs)
    for line in warnings:
        err().print(f"warning: {line}", markup=False)
    out().print(table, markup=False, highlight=False)
    return 0
