"""`yrpd bench trace` (yrpd/bench/trace.py): a Mooncake-format trace scaled by the factors it names, for vLLM's
timed_trace dataset."""

import json

import pytest

from yrpd.bench.trace import TraceScale, scale_trace
from yrpd.errors import SpecError

TRACE = [  # two conversations (second ids 1 and 5), one alone (id 9), as Mooncake writes them
    {"timestamp": 1000, "input_length": 1500, "output_length": 320, "hash_ids": [0, 1, 2]},
    {"timestamp": 3000, "input_length": 700, "output_length": 10, "hash_ids": [0, 5]},
    {"timestamp": 61000, "input_length": 2100, "output_length": 3200, "hash_ids": [0, 1, 2, 3, 4]},
    {"timestamp": 62000, "input_length": 4000, "output_length": 1, "hash_ids": [0, 9, 10, 11, 12, 13, 14, 15]},
]


def write(tmp_path):
    src = tmp_path / "trace.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    return src


def test_a_scaled_trace_keeps_ids_and_partial_blocks_and_scales_lengths_and_time(tmp_path):
    out = tmp_path / "scaled.jsonl"
    meta = scale_trace(write(tmp_path), out, TraceScale(tokens_per_id=16, output_scale=1 / 32, max_output=64,
                                                        time_scale=0.5))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["hash_ids"] for r in rows] == [r["hash_ids"] for r in TRACE]
    # 1500 tokens = 2 full blocks of 512 and 476 of a third: 16 + 16 + 15 (vLLM's timed_trace cuts the last id)
    assert [r["input_length"] for r in rows] == [47, 22, 66, 125]
    assert [r["output_length"] for r in rows] == [10, 1, 64, 1]  # at least 1, at most max_output
    assert [r["timestamp"] for r in rows] == [0, 1000, 30000, 30500]  # from the first request, times 0.5
    assert meta["written"] == 4 and meta["span_s"] == 30.5 and meta["ids_seen_before"] == pytest.approx(5 / 18, abs=1e-3)
    assert json.loads((tmp_path / "scaled.jsonl.meta.json").read_text())["bench_args"][1] == "16"


def test_a_sample_of_conversations_keeps_every_turn_of_each_and_the_window_counts_what_is_kept(tmp_path):
    src = write(tmp_path)
    chosen = set()
    for seed in range(40):
        out = tmp_path / f"s{seed}.jsonl"
        try:
            scale_trace(src, out, TraceScale(conversations=0.5, seed=seed))
        except SpecError as err:  # a sample that kept no conversation says so
            assert "in the sample" in str(err)
            chosen.add(frozenset())
            continue
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        conversations = {r["hash_ids"][1] for r in rows}
        chosen.add(frozenset(conversations))
        # a conversation is kept whole: both turns of conversation 1, or neither
        assert sum(r["hash_ids"][1] == 1 for r in rows) == (2 if 1 in conversations else 0)
    assert len(chosen) > 2  # the seed chooses (the control: not the same sample every time)
    # the window: --start and --requests count kept requests
    out = tmp_path / "w.jsonl"
    scale_trace(src, out, TraceScale(start=1, requests=2))
    assert [json.loads(line)["hash_ids"][1] for line in out.read_text().splitlines()] == [5, 1]


def test_a_file_that_is_not_a_trace_is_named_with_its_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(TRACE[0]) + "\n" + json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(SpecError) as err:
        scale_trace(bad, tmp_path / "out.jsonl", TraceScale())
    assert "line 2 is not a Mooncake trace entry" in str(err.value)
    with pytest.raises(SpecError) as err:
        scale_trace(bad, tmp_path / "out.jsonl", TraceScale(conversations=0))
    assert "--conversations" in str(err.value)


def test_a_load_on_a_measured_capacity_sets_the_time_scale_and_says_so(tmp_path):
    src = write(tmp_path)
    out = tmp_path / "loaded.jsonl"
    # scaled inputs 47 + 22 + 66 + 125 = 260 tokens over the window's 61 s: at 0.5 of 10 tokens a second they take 52 s
    meta = scale_trace(src, out, TraceScale(load=0.5, capacity=10.0))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[-1]["timestamp"] == pytest.approx(52000, abs=1)
    assert meta["time_scale"] == pytest.approx(52 / 61, abs=1e-5) and meta["load"] == 0.5 and meta["capacity"] == 10.0
    # twice the capacity: arrivals twice as dense (the control beside it)
    meta2 = scale_trace(src, tmp_path / "twice.jsonl", TraceScale(load=0.5, capacity=20.0))
    assert meta2["time_scale"] == pytest.approx(meta["time_scale"] / 2, rel=1e-4)
    # without a load the given scale stays
    assert scale_trace(src, tmp_path / "plain.jsonl", TraceScale(time_scale=0.5))["time_scale"] == 0.5


@pytest.mark.parametrize("scale, field", [(TraceScale(load=0.5), "--load"), (TraceScale(capacity=9.0), "--capacity"),
                                          (TraceScale(load=0.5, capacity=9.0, time_scale=2.0), "--time-scale"),
                                          (TraceScale(load=0.0, capacity=9.0), "--load")])
def test_a_load_needs_a_capacity_and_no_time_scale_beside_it(tmp_path, scale, field):
    with pytest.raises(SpecError) as err:
        scale_trace(write(tmp_path), tmp_path / "out.jsonl", scale)
    assert err.value.field == field
