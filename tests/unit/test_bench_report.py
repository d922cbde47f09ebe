"""yrpd/bench/report.py: `yrpd bench compare` on two saved runs, as a user reads it after a change."""

from __future__ import annotations

import json


def saved_run(path, ttft: dict, seed: int = 0, **dataset) -> None:
    path.mkdir(parents=True)
    meta = {"prompts": 16, "groups": 4, "prompts_per_group": 4, "prefix_len": 1536, "suffix_len": 256, "seed": seed,
            **dataset}
    targets = {name: {"description": name, "metrics": {"mean_ttft_ms": v, "completed": 16}, "counters": {},
                      "ttfts_ms": [v]} for name, v in ttft.items()}
    (path / "results.json").write_text(json.dumps({"dataset": meta, "targets": targets, "ratios": {}}))


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
    assert "warning: target pd-noreuse is only in the first run" in proc.stderr
    assert "pd-noreuse" not in proc.stdout


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
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
            for line in text.splitlines() if line.startswith("| ")}
    assert rows["data system reads from disk"] == ["12", "0"]
    assert rows["data system disk used at the end (MB)"] == ["480.00", "-"]
