"""yrpd/bench/run.py: what `yrpd bench run` checks before deploying anything, what it sends, and a run that goes on
past a target that fails."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from yrpd.bench import run
from yrpd.errors import SpecError
from yrpd.placement import HostInventory, make_plan
from yrpd.spec import DeviceKind, build_spec

#: SmolLM2-135M's shape (its config.json): what the issue's user ran with
SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
           "head_dim": 64, "max_position_embeddings": 8192}


def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    return tmp_path


def spec_with(*engine_args: str):
    return build_spec({}, {"hosts": "localhost", "device_kind": "cpu", "model": "/m", "engine_args": list(engine_args)})


@pytest.mark.parametrize("kv_mb,dtype,refused", [(48, "float32", True), (96, "float32", False),
                                                 (48, "bfloat16", False), (44, "bfloat16", True)])
def test_a_kv_pool_vllm_would_refuse_for_the_dtype_and_max_model_len_is_named_before_any_deploy(
        tmp_path, kv_mb, dtype, refused):
    """One 2,048-token sequence of SmolLM2 needs 2 x 30 x 3 x 64 x 4 bytes x 2048 = 90 MB in float32, half in
    bfloat16: the issue's --kv-cache-mb 48 in float32 is refused, 96 is taken, and bfloat16 needs 45."""
    spec = spec_with("--max-model-len", "2048", "--kv-cache-memory-bytes", str(kv_mb << 20))
    answer = run.pool_refusal(spec, DeviceKind.cpu, model_dir(tmp_path), dtype)
    if refused:
        reason, need_mb = answer
        assert need_mb == (90 if dtype == "float32" else 45)
        assert f"a KV pool of {kv_mb} MB is less than one 2,048-token sequence needs" in reason
    else:
        assert answer is None


def test_the_last_max_model_len_given_wins_as_in_vllm_and_the_kind_default_counts(tmp_path):
    # the CPU default is --kv-cache-memory-bytes 512 MB and --max-model-len 4096: 180 MB in float32, taken
    assert run.pool_refusal(spec_with(), DeviceKind.cpu, model_dir(tmp_path), "float32") is None
    small = spec_with("--kv-cache-memory-bytes", str(100 << 20))  # 4,096 tokens still: 180 MB needed
    assert run.pool_refusal(small, DeviceKind.cpu, model_dir(tmp_path), "float32")[1] == 180
    shorter = spec_with("--kv-cache-memory-bytes", str(100 << 20), "--max-model-len=2048")
    assert run.pool_refusal(shorter, DeviceKind.cpu, model_dir(tmp_path), "float32") is None


def test_a_roles_own_kv_pool_is_checked_too_and_the_runs_size_wins_over_it(tmp_path):
    def pd(**role_args):
        return build_spec({}, {"hosts": "localhost", "device_kind": "cpu", "model": "/m", **role_args})

    small = ["--kv-cache-memory-bytes", str(100 << 20)]  # under the 180 MB a 4,096-token float32 sequence needs
    assert run.pool_refusal(pd(decode_engine_args=small), DeviceKind.cpu, model_dir(tmp_path), "float32")[1] == 180
    big = ["--kv-cache-memory-bytes", str(2048 << 20)]
    assert run.pool_refusal(pd(decode_engine_args=big), DeviceKind.cpu, model_dir(tmp_path), "float32") is None
    # `--kv-cache-mb` sizes every instance of the run, a role's own size included
    sized = run.variant(pd(decode_engine_args=big), "pd", DeviceKind.cpu, kv_cache_mb=300)
    assert sized.engine_args_of("decode")[-2:] == ["--kv-cache-memory-bytes", str(300 << 20)]
    # the no-reuse target turns caching off after a role's own flags too; a single instance takes engine_args alone
    noreuse = run.variant(pd(prefill_engine_args=["--enable-prefix-caching"]), "pd-noreuse", DeviceKind.cpu)
    assert noreuse.engine_args_of("prefill")[-1] == "--no-enable-prefix-caching"
    single = run.variant(pd(decode_engine_args=big), "single", DeviceKind.cpu)
    assert single.engine_args_of("single") == single.engine_args and single.decode_engine_args == []


def test_goodput_slos_are_checked_before_the_run():
    assert run.goodput_slos("ttft:2000 tpot:100") == ("ttft:2000", "tpot:100")
    assert run.goodput_slos("ttft:2000,e2el:9000") == ("ttft:2000", "e2el:9000")
    for bad in ("ttft", "latency:10", "ttft:-1", "ttft:soon"):
        with pytest.raises(SpecError) as e:
            run.goodput_slos(bad)
        assert e.value.field == "--goodput"


def load(**kw) -> run.Load:
    base = dict(dataset=Path("/d/set.jsonl"), tokenizer=Path("/m"), vllm_venv=Path("/v"), num_prompts=8,
                output_len=32, concurrency=2, seed=3)
    return run.Load(**{**base, **kw})


def test_vllms_own_dataset_goes_to_vllm_bench_serve_with_its_options_as_given():
    vllm = run.VllmDataset("prefix_repetition", ("--prefix-repetition-prefix-len", "512",
                                                 "--prefix-repetition-num-prefixes", "2"))
    argv = run.serve_argv(load(dataset=None, vllm_dataset=vllm, goodput=("ttft:2000", "tpot:100")), "http://p",
                          "m", Path("/out"), "pd")
    joined = " ".join(argv)
    assert "--dataset-name prefix_repetition --prefix-repetition-prefix-len 512 --prefix-repetition-num-prefixes 2" \
        in joined
    assert "--goodput ttft:2000 tpot:100" in joined and "--num-prompts 8" in joined and "--seed 3" in joined
    assert "custom" not in argv and "--save-detailed" in argv  # input lengths per request: the same-prompts check
    custom = run.serve_argv(load(), "http://p", "m", Path("/out"), "pd")  # control: the saved JSONL
    assert "--dataset-name custom --dataset-path /d/set.jsonl" in " ".join(custom) and "--goodput" not in custom


def test_repeated_runs_report_medians_the_spread_and_each_runs_error_rate():
    runs = [{"mean_ttft_ms": 100.0, "completed": 8, "failed": 0, "request_throughput": 2.0},
            {"mean_ttft_ms": 300.0, "completed": 6, "failed": 2, "request_throughput": 1.0},
            {"mean_ttft_ms": 200.0, "completed": 8, "failed": 0, "request_throughput": 3.0}]
    median, spread = run.summarize(runs)
    assert median["mean_ttft_ms"] == 200.0 and median["request_throughput"] == 2.0
    assert spread["mean_ttft_ms"] == [100.0, 300.0] and spread["request_throughput"] == [1.0, 3.0]
    assert [r["error_rate"] for r in runs] == [0.0, 0.25, 0.0] and median["error_rate"] == 0.0
    assert run.summarize(runs[:1])[1] == {}  # one run: no spread to give


def test_a_repeat_gives_each_runs_own_hit_rate_and_prefill_leg_with_their_medians(tmp_path, monkeypatch):
    """Measured around each run (the counters are cumulative: each run's is a delta), so a repeated run's hit rate
    has a median and a spread like its times; the runs stood in, the arithmetic real."""
    tokens = {"computed": 0, "local_cache": 0, "loaded": 0}
    legs = [0.0, 0]
    per_run = [(80, 20, 2.0), (50, 50, 1.0), (70, 30, 3.0)]  # (computed, from the instance's own cache, leg seconds)

    def counters(_):
        return {f"prefill_prompt_tokens_{k}": float(v) for k, v in tokens.items()}, {}, {}

    def serve(load, url, model, out_dir, name, key=None):
        computed, local, leg = per_run[len(names)]
        names.append(name)
        tokens["computed"] += computed
        tokens["local_cache"] += local
        legs[0] += leg * 4
        legs[1] += 4
        return {"mean_ttft_ms": 5000.0, "completed": 4, "failed": 0, "ttfts": [1.0] * 4, "input_lens": [1]}

    names: list[str] = []
    deployed = type("D", (), {"spec": type("S", (), {"model_name": "m"})(), "plan": None, "url": "http://p",
                              "endpoint_key": lambda self: None})()
    monkeypatch.setattr(run, "counters", counters)
    monkeypatch.setattr(run, "bench_serve", serve)
    monkeypatch.setattr(run, "prefill_legs", lambda url: (legs[0], legs[1]))
    monkeypatch.setattr(run.api, "open_deployment", lambda sid: deployed)
    monkeypatch.setattr(run.time, "sleep", lambda s: None)
    request = run.BenchRequest(targets=("pd",), repeat=3)
    got = run.measure("s1", "pd", request, load(), tmp_path, log=lambda *a: None)
    assert [r["prefix_hit_rate"] for r in got["runs"]] == [20.0, 50.0, 30.0]
    assert got["metrics"]["prefix_hit_rate"] == 30.0 and got["spread"]["prefix_hit_rate"] == [20.0, 50.0]
    assert [r["mean_prefill_leg_ms"] for r in got["runs"]] == [2000.0, 1000.0, 3000.0]
    assert got["metrics"]["mean_ttft_after_prefill_ms"] == 3000.0
    # one run: its hit rate is the counters' over the whole run, in the report's own row (no per-run figure)
    names.clear()
    tokens.update(computed=0, local_cache=0)
    once = run.measure("s1", "pd", run.BenchRequest(targets=("pd",)), load(), tmp_path, log=lambda *a: None)
    assert "prefix_hit_rate" not in once["metrics"] and once["metrics"]["mean_prefill_leg_ms"] == 2000.0


def test_a_target_that_fails_is_named_the_others_are_measured_and_the_original_comes_back(tmp_path, monkeypatch):
    """The issue's case with the deployments stood in: `single` fails to deploy after `pd` was measured. The run goes
    on with `single-yr`, tears down what the failure left, deploys the original spec again, and the report has the
    two targets' figures and the failure's reason."""
    from yrpd.bench.report import write_report
    from yrpd.session import SessionPhase

    spec = build_spec({}, {"hosts": "localhost", "device_kind": "cpu", "model": "/m"})
    events = []

    def deploy(want, name, progress=None, origin=None):
        events.append(("deploy", name))
        if name == "single":
            raise RuntimeError("deploying the single target failed: vLLM refused the KV pool")
        return f"s-{name}"

    class Latest:
        session = type("S", (), {"id": "s-half", "phase": SessionPhase.deploying})()

    monkeypatch.setattr(run, "deploy", deploy)
    monkeypatch.setattr(run, "down", lambda sid: events.append(("down", sid)))
    monkeypatch.setattr(run.api, "open_deployment", lambda sid: Latest)
    monkeypatch.setattr(run, "measure", lambda current, target, *a: (
        events.append(("measure", target, current)) or
        {"description": target, "metrics": {"mean_ttft_ms": 100.0, "completed": 4}, "counters": {}, "ttfts_ms": [100.0],
         "data_system": {}}))
    session = type("S", (), {"id": "s-original"})()
    request = run.BenchRequest(targets=("pd", "single", "single-yr"))
    results = run.run_targets(session, spec, DeviceKind.cpu, request, load(), tmp_path, log=lambda *_: None)
    assert events == [("measure", "pd", "s-original"), ("down", "s-original"), ("deploy", "single"),
                      ("down", "s-half"),  # what the failed deploy left
                      ("deploy", "single-yr"), ("measure", "single-yr", "s-single-yr"), ("down", "s-single-yr"),
                      ("deploy", "restore")]
    assert "vLLM refused the KV pool" in results["single"]["error"] and "metrics" not in results["single"]
    text = write_report(results, {"prompts": 4}, tmp_path, {"commit": "abc", "commands": ["yrpd bench run"]})
    assert "**single failed**, no figures: deploying the single target failed: vLLM refused the KV pool" in text
    header = next(line for line in text.splitlines() if line.startswith("| metric |"))
    assert "pd (" in header and "single-yr (" in header and "single (" not in header
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["targets"]["single"]["error"] and saved["provenance"]["commit"] == "abc"


def test_a_results_json_without_every_provenance_field_fails_this_check(tmp_path):
    """What `yrpd bench run` writes carries the whole provenance (yrpd.provenance.FIELDS); a result written without
    it is named incomplete."""
    from yrpd.bench.report import write_report
    from yrpd.provenance import missing, record

    data = tmp_path / "set.jsonl"
    data.write_text('{"prompt": "x"}\n')
    results = {"pd": {"description": "PD", "metrics": {"mean_ttft_ms": 1.0}, "counters": {}, "ttfts_ms": [1.0],
                      "data_system": {}}}
    write_report(results, {"prompts": 1}, tmp_path, record(["yrpd bench run"], {"dataset": data}))
    doc = json.loads((tmp_path / "results.json").read_text())
    assert missing(doc) == []
    assert doc["provenance"]["inputs"]["dataset"]["sha256"]
    del doc["provenance"]["cpu"]
    assert missing(doc) == ["cpu"]  # control: the check does fail on an incomplete one


def test_each_run_of_a_repeat_sends_new_prompts_the_same_for_every_target():
    """A run of a repeat that found the one before in the caches would measure a warm cache, not the workload: vLLM's
    datasets (timed_trace's tokens come from PYTHONHASHSEED) and generated files change with the run, the same for
    every target; a user's file stays as it is."""
    vllm = run.VllmDataset("timed_trace", ("--dataset-path", "/t.jsonl"))
    first, second = (run.serve_argv(load(dataset=None, vllm_dataset=vllm).for_run(n), "http://p", "m", Path("/o"),
                                    "pd") for n in (0, 1))
    assert "--seed 3" in " ".join(first) and "--seed 4" in " ".join(second)
    assert load(dataset=None, vllm_dataset=vllm).for_run(2).seed == 5
    # the same run of two targets: the same load
    assert load(dataset=None, vllm_dataset=vllm).for_run(1) == load(dataset=None, vllm_dataset=vllm).for_run(1)
    made = load(run_datasets=(Path("/o/dataset-run2.jsonl"), Path("/o/dataset-run3.jsonl")))
    assert [made.for_run(n).dataset for n in range(3)] == [Path("/d/set.jsonl"), Path("/o/dataset-run2.jsonl"),
                                                           Path("/o/dataset-run3.jsonl")]
    assert load().for_run(1).dataset == Path("/d/set.jsonl")  # control: the user's file, every run


def test_bench_serve_gives_vllm_the_runs_hash_seed(tmp_path, monkeypatch):
    seen = {}

    def fake_run(argv, env, **kw):
        seen["env"] = env
        (tmp_path / "pd-run2.json").write_text("{}")
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(run.subprocess, "run", fake_run)
    vllm = run.VllmDataset("timed_trace", ("--dataset-path", "/t.jsonl"))
    run.bench_serve(load(dataset=None, vllm_dataset=vllm).for_run(1), "http://p", "m", tmp_path, "pd-run2")
    assert seen["env"]["PYTHONHASHSEED"] == "4"


def test_a_target_left_up_by_an_earlier_run_is_benched_as_the_variant_it_is(tmp_path, monkeypatch):
    """`--no-restore` leaves the last target deployed: a later run on it varies the spec the earlier run varied, so
    its `pd` target is prefix routing again, not the `pd-load` deployment it finds (the sweep of dd4d6ad measured
    load routing against itself at 50 and 90 % that way)."""
    from types import SimpleNamespace

    from yrpd.session import Session

    user = build_spec({}, {"hosts": "localhost", "device_kind": "cpu", "model": "/m", "routing": "prefix"})
    pd_load = run.variant(user, "pd-load", DeviceKind.cpu, None, None, None)
    assert pd_load.routing.value == "load"
    session = Session(tmp_path / "s-pd-load")
    session.path.mkdir()
    done = SimpleNamespace(session=session)
    monkeypatch.setattr(run.api, "deploy", lambda spec, **kw: done)
    assert run.deploy(pd_load, "pd-load", origin=user) == "s-pd-load"
    left = SimpleNamespace(session=session, spec=pd_load)
    base, target = run.varied_spec(left)
    assert target == "pd-load" and base.fingerprint() == user.fingerprint()
    assert run.variant(base, "pd", DeviceKind.cpu, None, None, None).routing.value == "prefix"
    # the controls: a session deployed as the user asked, and one whose spec changed since the bench left it
    assert run.varied_spec(SimpleNamespace(session=Session(tmp_path / "other"), spec=pd_load)) == (pd_load, None)
    changed = pd_load.model_copy(update={"routing_bound": 3})
    assert run.varied_spec(SimpleNamespace(session=session, spec=changed)) == (changed, None)
    # and the run deploys each target recording what it varied
    seen = []
    monkeypatch.setattr(run, "deploy", lambda want, name, progress=None, origin=None: seen.append((name, origin))
                        or f"s-{name}")
    monkeypatch.setattr(run, "down", lambda sid: None)
    monkeypatch.setattr(run, "measure", lambda *a: {"metrics": {}})
    run.run_targets(SimpleNamespace(id="s-pd-load"), pd_load, DeviceKind.cpu,
                    run.BenchRequest(targets=("pd",), restore=False), load(), tmp_path, log=lambda *_: None,
                    original=user)
    assert [(name, origin.fingerprint()) for name, origin in seen] == [("pd", user.fingerprint())]


def test_interleaved_repeats_run_in_rounds_and_each_target_reports_all_its_runs(tmp_path, monkeypatch):
    """--interleave: every target's first run, then every target's second, each deployed again per round; each
    target's result has all its runs (medians over them, counters summed, the TTFTs in run order); without it each
    target runs its repeats together (the keyed control)."""
    spec = build_spec({}, {"hosts": "localhost", "device_kind": "cpu", "model": "/m"})
    events = []
    ttft = {("pd", 0): 100.0, ("pd", 1): 300.0, ("single", 0): 50.0, ("single", 1): 70.0}

    def measure(current, target, request, load, out_dir, log, only=None):
        events.append(("measure", target, only))
        rounds = range(request.repeat) if only is None else only
        runs = [{"mean_ttft_ms": ttft[(target, n)], "completed": 4, "failed": 0} for n in rounds]
        return {"description": target, "session": current, "wall_s": 1.0, "runs": runs,
                "runs_named": [f"{target}-run{n + 1}" for n in rounds], "metrics": run.summarize(runs)[0],
                "ttfts_ms": [ttft[(target, n)] for n in rounds], "input_lens_sha256": ["h"],
                "counters": {"saved_blocks": 10 * len(runs)}, "data_system": {}}

    monkeypatch.setattr(run, "deploy", lambda want, name, progress=None, origin=None:
                        events.append(("deploy", name)) or f"s-{name}")
    monkeypatch.setattr(run, "down", lambda sid: events.append(("down", sid)))
    monkeypatch.setattr(run, "measure", measure)
    session = type("S", (), {"id": "s-original"})()
    request = run.BenchRequest(targets=("pd", "single"), repeat=2, interleave=True)
    results = run.run_targets(session, spec, DeviceKind.cpu, request, load(), tmp_path, log=lambda *_: None)
    assert [e for e in events if e[0] == "measure"] == [("measure", "pd", [0]), ("measure", "single", [0]),
                                                        ("measure", "pd", [1]), ("measure", "single", [1])]
    # each target deployed anew every round, pd too though the session ran it when the bench began
    assert events.count(("deploy", "pd")) == 2 and events.count(("deploy", "single")) == 2
    assert list(results) == ["pd", "single"]
    assert results["pd"]["metrics"]["mean_ttft_ms"] == 200.0 and results["pd"]["spread"]["mean_ttft_ms"] == [100.0,
                                                                                                             300.0]
    assert results["pd"]["ttfts_ms"] == [100.0, 300.0] and results["pd"]["counters"]["saved_blocks"] == 20
    assert results["single"]["runs_named"] == ["single-run1", "single-run2"]
    events.clear()
    run.run_targets(session, spec, DeviceKind.cpu, run.BenchRequest(targets=("pd", "single"), repeat=2), load(),
                    tmp_path, log=lambda *_: None)
    assert [e for e in events if e[0] == "measure"] == [("measure", "pd", None), ("measure", "single", None)]
    assert events.count(("deploy", "pd")) == 0  # the keyed control: not in rounds, the running pd is measured


@pytest.mark.parametrize("repeat", [1, 2], ids=["--repeat 1: refused", "--repeat 2 (control)"])
def test_interleave_without_repeats_is_refused_before_any_session_is_read(tmp_path, monkeypatch, repeat):
    monkeypatch.setenv("YRPD_HOME", str(tmp_path))  # no session there: what the control runs into next
    from yrpd.errors import SessionError

    with pytest.raises((SpecError, SessionError)) as e:
        run.bench(None, run.BenchRequest(targets=("pd",), repeat=repeat, interleave=True))
    assert (getattr(e.value, "field", None) == "--interleave") is (repeat == 1)


@pytest.mark.parametrize("kv_cache_mb", [None, 48], ids=["no --kv-cache-mb: refused", "--kv-cache-mb 48 (control)"])
def test_single_roomy_without_a_cut_pool_is_refused_before_any_session_is_read(tmp_path, monkeypatch, kv_cache_mb):
    """Without --kv-cache-mb single-roomy is single's spec, and would be measured on single's warm deployment."""
    monkeypatch.setenv("YRPD_HOME", str(tmp_path))  # no session there: what the control runs into next
    from yrpd.errors import SessionError

    with pytest.raises((SpecError, SessionError)) as e:
        run.bench(None, run.BenchRequest(targets=("single", "single-roomy"), kv_cache_mb=kv_cache_mb))
    refused = getattr(e.value, "field", None) == "--targets" and "single-roomy" in str(e.value)
    assert refused is (kv_cache_mb is None)
