"""yrpd/bench/report.py: `yrpd bench compare` on two saved runs, as a user reads it after a change."""

from __future__ import annotations

import json


def saved_run(path, ttft: dict, seed: int = 0, provenance: dict | None = None, **dataset) -> None:
    from yrpd.provenance import FIELDS

    path.mkdir(parents=True)
    meta = {"prompts": 16, "groups": 4, "prompts_per_group": 4, "prefix_len": 1536, "suffix_len": 256, "seed": seed,
            **dataset}
    targets = {name: {"description": name, "metrics": {"mean_ttft_ms": v, "completed": 16}, "counters": {},
                      "ttfts_ms": [v]} for name, v in ttft.items()}
    prov = {**{f: "same" for f in FIELDS}, "commands": ["yrpd bench run"], **(provenance or {})}
    (path / "results.json").write_text(json.dumps({"provenance": prov, "dataset": meta, "targets": targets,
                                                   "ratios": {}}))


def test_compare_prints_each_metric_of_both_runs_and_their_ratio(tmp_path, yrpd, yrpd_home):
    saved_run(tmp_path / "a", {"pd": 400.0, "single": 800.0})
    saved_run(tmp_path / "b", {"pd": 500.0, "single": 800.0})
    proc = yrpd("bench", "compare", str(tmp_path / "a"), str(tmp_path / "b" / "results.json"))
    assert proc.returncode == 0, proc.stderr
    rows = {tuple(c.strip() for c in line.strip("|").split("|")) for line in proc.stdout.splitlines()}
    assert ("pd", "mean TTFT (ms)", "400.00", "500.00", "1.250") in rows  # a regression reads as > 1
    assert ("single", "mean TTFT (ms)", "800.00", "800.00", "1.000") in rows
    assert ("pd", "completed (requests)", "16", "16", "1.000") in rows
    assert proc.stderr == ""


def test_compare_warns_when_the_runs_are_not_alike(tmp_path, yrpd, yrpd_home):
    saved_run(tmp_path / "a", {"pd": 400.0, "pd-noreuse": 900.0})
    saved_run(tmp_path / "b", {"pd": 410.0}, seed=7)
    proc = yrpd("bench", "compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert proc.returncode == 0
    assert "warning: the two runs used different datasets (seed 0 vs 7)" in proc.stderr
    assert "warning: target pd-noreuse has figures only in the first run" in proc.stderr
    assert "pd-noreuse" not in proc.stdout


def test_compare_warns_when_the_runs_came_from_other_code_or_another_machine_or_do_not_say(tmp_path, yrpd,
                                                                                          yrpd_home):
    saved_run(tmp_path / "a", {"pd": 400.0})
    saved_run(tmp_path / "b", {"pd": 410.0}, provenance={"commit": "b2", "cpu": "AMD EPYC"})
    proc = yrpd("bench", "compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert proc.returncode == 0
    assert "warning: the two runs differ in commit (same vs b2), cpu (same vs AMD EPYC)" in proc.stderr
    old = tmp_path / "c"
    saved_run(old, {"pd": 400.0})
    doc = json.loads((old / "results.json").read_text())
    del doc["provenance"]
    (old / "results.json").write_text(json.dumps(doc))
    proc = yrpd("bench", "compare", str(old), str(tmp_path / "a"))
    assert "warning: the first run does not say where it came from (no commit, " in proc.stderr


def test_compare_of_something_that_is_not_a_run_exits_2_with_one_line(tmp_path, yrpd, yrpd_home):
    saved_run(tmp_path / "a", {"pd": 400.0})
    proc = yrpd("bench", "compare", str(tmp_path / "a"), str(tmp_path / "nowhere"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "SECOND:" in proc.stderr and "is not a saved bench run" in proc.stderr


def test_a_preset_fills_the_shape_and_options_given_beside_it_win():
    from yrpd.bench.dataset import PRESETS, apply_preset

    defaults = {"groups": 4, "prompts_per_group": 4, "prefix_len": 1536, "suffix_len": 256, "output_len": 32,
                "max_concurrency": 1, "seed": 0}
    guide = apply_preset(defaults, "guide", explicit={"max_concurrency"})
    assert (guide["groups"], guide["prompts_per_group"], guide["prefix_len"], guide["suffix_len"]) == (30, 100, 2048, 6144)
    assert guide["output_len"] == 2 and guide["max_concurrency"] == 1  # the user's --max-concurrency stays
    assert apply_preset(defaults, None, set()) == defaults
    assert PRESETS["cpu"]["max_concurrency"] >= 2  # the "seed at concurrency >= 2"


def test_report_shows_the_data_system_size_its_reads_by_tier_and_what_it_held_at_the_end():
    from yrpd.bench.report import markdown

    meta = {"prompts": 40, "groups": 10, "prompts_per_group": 4, "prefix_len": 1536, "suffix_len": 256, "seed": 0,
            "kv_cache_mb_per_instance": 112, "datasystem_mb": 128, "datasystem_spill_mb": 1024}
    counters = {"ds_hits_memory": 30, "ds_hits_disk": 12, "ds_misses": 3}
    results = {"pd": {"description": "PD", "metrics": {"mean_ttft_ms": 500.0}, "counters": counters,
                      "data_system": {"memory_mb": 115.2, "disk_mb": 480.0}},
               "single": {"description": "one", "metrics": {"mean_ttft_ms": 900.0}, "counters": {}, "data_system": {}}}
    text = markdown(results, meta)
    assert "KV pool 112 MB per instance, data system 128 MB per host + 1024 MB on disk" in text.splitlines()[0]
    assert "connector" not in text.splitlines()[0]  # the control: settings as the connector has them by default
    # a run deployed with connector settings of its own says so in its first line
    assert ", connector cpu_spin_ms -1, resave_after_s 0" in markdown(
        results, {**meta, "connector": {"resave_after_s": 0, "cpu_spin_ms": -1}}).splitlines()[0]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
            for line in text.splitlines() if line.startswith("| ")}
    assert rows["data system reads from disk"] == ["12", "0"]
    assert rows["data system disk used at the end (MB)"] == ["480.00", "-"]


def test_counters_split_each_roles_prompt_tokens_by_where_their_kv_came_from(monkeypatch):
    from yrpd import api
    from yrpd.bench import run
    from yrpd.session import SessionPhase
    from yrpd.status import InstanceStatus, StatusReport

    def inst(name, role, computed, cached, loaded, routed=None):
        return InstanceStatus(name=name, role=role, host="h1", devices=[0], tp=1, dp=1, port=8100, url="u", pid=1,
                              state="running", healthy=True, routed=routed,
                              probe={"prompt_tokens_computed": computed, "prompt_tokens_local_cache": cached,
                                     "prompt_tokens_loaded": loaded, "prompt_tokens": computed + cached + loaded})

    from yrpd.status import ProxyStatus

    proxy = ProxyStatus(url="u", host="h1", pid=1, state="running", healthy=True,
                        routing={"policy": "prefix", "bound": 2, "load_ms_per_chunk": 6.5})
    report = StatusReport(session="s", phase=SessionPhase.deployed, healthy=True, problems=[], hosts=[],
                          processes=[], proxy=proxy, cluster=None,
                          instances=[inst("prefill-0", "prefill", 800, 2300, 0, {"requests": 5, "ms_per_chunk": 31.5}),
                                     inst("prefill-1", "prefill", 900, 0, 768,
                                          {"requests": 9, "kv_index": {"sight": "seeing", "replays": 4, "replay_s": 0.5}}),
                                     inst("decode-0", "decode", 64, 128, 1536)])
    monkeypatch.setattr(api, "open_deployment", lambda sid: sid)
    monkeypatch.setattr(api, "status", lambda deployment: report)
    total, _, rates = run.counters("s")
    # the legs the proxy sent each instance (a delta over the run, like every counter) and its measured time
    assert total["legs_prefill-0"] == 5 and total["legs_prefill-1"] == 9 and "legs_decode-0" not in total
    assert rates == {"prefill-0": 31.5, run.LOAD_RATE: 6.5}
    report.proxy.routing = {"policy": "prefix", "bound": 2}  # the control: no load measured yet, none reported
    assert run.counters("s")[2] == {"prefill-0": 31.5}
    # the round trips to its replay socket where the proxy follows its events (the oracle's price), else nothing
    assert total["replays_prefill-1"] == 4 and "replays_prefill-0" not in total
    assert total["replay_s_prefill-1"] == 0.5 and "replay_s_prefill-0" not in total
    assert total["prefill_prompt_tokens_computed"] == 1700
    assert total["prefill_prompt_tokens_local_cache"] == 2300
    assert total["prefill_prompt_tokens_loaded"] == 768
    assert total["decode_prompt_tokens_loaded"] == 1536
    assert total["prompt_tokens"] == 1700 + 2300 + 768 + 64 + 128 + 1536


def test_report_shows_where_each_roles_prompt_tokens_came_from_where_the_target_has_that_role():
    from yrpd.bench.report import markdown

    meta = {"prompts": 32, "groups": 8, "prompts_per_group": 4, "prefix_len": 768, "suffix_len": 64, "seed": 0}
    results = {"pd": {"description": "PD", "metrics": {"mean_ttft_ms": 500.0}, "data_system": {},
                      "counters": {"prefill_prompt_tokens_computed": 9000, "prefill_prompt_tokens_local_cache": 17000,
                                   "prefill_prompt_tokens_loaded": 0, "decode_prompt_tokens_loaded": 24000}},
               "single": {"description": "one", "metrics": {"mean_ttft_ms": 900.0}, "data_system": {},
                          "counters": {"single_prompt_tokens_computed": 26000}}}
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
            for line in markdown(results, meta).splitlines() if line.startswith("| ")}
    assert rows["prefill prompt tokens from its own prefix cache"] == ["17,000", "-"]
    assert rows["decode prompt tokens loaded through the connector"] == ["24,000", "-"]
    assert "prefill prompt tokens loaded through the connector" not in rows  # zero everywhere: nothing to tell


def test_report_gives_each_targets_prefix_cache_hit_rate_and_its_distance_from_the_oracles():
    from yrpd.bench.report import markdown

    def target(ttft: float, computed: int, local: int, loaded: int) -> dict:
        return {"description": "x", "metrics": {"mean_ttft_ms": ttft}, "data_system": {},
                "counters": {"prefill_prompt_tokens_computed": computed, "prefill_prompt_tokens_local_cache": local,
                             "prefill_prompt_tokens_loaded": loaded}}

    results = {"pd": target(400.0, 6000, 3000, 1000), "pd-oracle": target(390.0, 5900, 3100, 1000),
               "pd-rr": target(800.0, 9000, 500, 500), "single": {"description": "one", "metrics": {"mean_ttft_ms": 1.0},
                                                                  "data_system": {}, "counters": {}}}
    text = markdown(results, {"prompts": 1})
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
            for line in text.splitlines() if line.startswith("| ")}
    # the share of the prefill instances' prompt tokens their own caches held; a target without them has none
    assert rows["prefill prefix-cache hit rate (% of its prompt tokens)"] == ["30.00", "31.00", "5.00", "-"]
    assert "- pd prefix-cache hit rate against pd-oracle's: **-1.00 points**" in text
    assert "- pd-rr prefix-cache hit rate against pd-oracle's: **-26.00 points**" in text
    assert "- pd-oracle/pd-rr mean TTFT: **0.487**" in text and "- pd/pd-oracle mean TTFT: **1.026**" in text
    # the control: without the oracle's run there is no distance to give
    assert "against pd-oracle" not in markdown({k: v for k, v in results.items() if k != "pd-oracle"}, {"prompts": 1})


def test_report_splits_a_pd_targets_first_token_wait_into_the_prefill_leg_and_the_rest():
    """What prefill routing chooses (the prefill leg) apart from decode's wait, per target, with the ratios between
    routings on the leg alone; a target the proxy did not time (a single instance) shows a dash."""
    from yrpd.bench.report import markdown

    def target(ttft: float, leg: float | None) -> dict:
        metrics = {"mean_ttft_ms": ttft}
        if leg is not None:
            metrics.update(mean_prefill_leg_ms=leg, mean_ttft_after_prefill_ms=ttft - leg)
        return {"description": "x", "metrics": metrics, "data_system": {}, "counters": {}}

    results = {"pd": target(5000.0, 3000.0), "pd-estimate": target(4000.0, 3500.0), "single": target(900.0, None)}
    text = markdown(results, {"prompts": 1})
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
            for line in text.splitlines() if line.startswith("| ")}
    assert rows["of which the prefill leg (mean, the proxy's timing) (ms)"] == ["3,000.00", "3,500.00", "-"]
    assert rows["of which after the prefill leg (decode, hand-over) (ms)"] == ["2,000.00", "500.00", "-"]
    assert "- pd/pd-estimate mean prefill leg: **0.857**" in text and "- pd/pd-estimate mean TTFT: **1.25**" in text
    # the control: runs the proxy did not time have no such rows at all
    plain = markdown({"single": target(900.0, None)}, {"prompts": 1})
    assert "of which the prefill leg" not in plain


def test_report_pairs_each_request_of_a_store_with_the_same_prompt_on_the_plain_instance_and_shows_its_own_time():
    """Where a store's cost sits: each request's TTFT less the plain instance's for the same prompt, and the
    connector's time by kind; targets sent other prompts are not paired (the keyed control)."""
    from yrpd.bench.report import markdown

    meta = {"prompts": 4, "seed": 0}
    plain = [100.0, 200.0, 300.0, 400.0]
    results = {"single": {"description": "one", "metrics": {"mean_ttft_ms": 250.0}, "counters": {},
                          "ttfts_ms": plain, "input_lens_sha256": ["a"]},
               "single-yr": {"description": "one + store", "metrics": {"mean_ttft_ms": 265.0},
                             "counters": {"stage_ms": 812.4, "save_skipped_recent_blocks": 64},
                             "ttfts_ms": [110.0, 195.0, 330.0, 425.0], "input_lens_sha256": ["a"]}}
    text = markdown(results, meta)
    assert "- single-yr less single, per request (4): median 17.50 ms, p90 28.50 ms; 3 of 4 slower" in text
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
            for line in text.splitlines() if line.startswith("| ")}
    assert rows["connector: copying saves out on the engine's steps (ms, all runs)"] == ["0", "812"]
    assert rows["KV blocks not saved again (saved within resave_after_s)"] == ["0", "64"]
    results["single-yr"]["input_lens_sha256"] = ["b"]
    assert "per request" not in markdown(results, meta)


def test_beside_overflowing_pools_the_report_gives_the_floor_of_a_stores_ratio_and_the_stores_distance_from_it():
    """single-roomy (vLLM's own pool) against single is the least single-yr / single can be in that run; both
    ratios are reported, and only where the roomy instance ran (the keyed control)."""
    from yrpd.bench.report import markdown, ratios

    results = {name: {"description": name, "metrics": {"mean_ttft_ms": ttft}, "counters": {}}
               for name, ttft in (("single", 2000.0), ("single-yr", 1000.0), ("single-roomy", 800.0))}
    meta = {"kv_cache_mb_per_instance": 48}
    got = ratios(results)
    assert got["single-roomy/single mean TTFT"] == 0.4 and got["single-yr/single-roomy mean TTFT"] == 1.25
    assert "KV pool 48 MB per instance (single-roomy: vLLM's own)" in markdown(results, meta)
    del results["single-roomy"]
    assert set(ratios(results)) == {"single-yr/single mean TTFT"}
    assert "KV pool 48 MB per instance" in markdown(results, meta) and "(single-roomy" not in markdown(results, meta)
