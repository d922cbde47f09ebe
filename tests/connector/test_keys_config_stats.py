"""Fast unit tests of the connector's pure parts (no vLLM, no torch, no data system)."""

import json
import logging
import random
import threading

import pytest

from yrpd.connector import keys as K
from yrpd.connector.config import ConfigError, parse_config, parse_address
from yrpd.connector.stats import ConnectorStats, StatsReporter, read_stats_file, write_json_atomic

BS = 128


def ns(**over):
    base = dict(model="tiny#abc", kv_dtype="bfloat16", layout="cpu/default", block_size=BS)
    base.update(over)
    return K.Namespace(**base)


# --- keys -----------------------------------------------------------------------------------------

def test_keys_are_prefix_chained_and_stable():
    toks = list(range(1000))
    a = K.block_keys(ns(), toks, BS)
    assert len(a) == 1000 // BS
    assert a == K.block_keys(ns(), list(toks), BS)  # deterministic
    # a block's key depends on everything before it ...
    changed = list(toks)
    changed[5] = 4000
    b = K.block_keys(ns(), changed, BS)
    assert all(x != y for x, y in zip(a, b))
    # ... and on nothing after it
    changed = list(toks)
    changed[3 * BS + 1] = 4000
    c = K.block_keys(ns(), changed, BS)
    assert c[:3] == a[:3] and all(x != y for x, y in zip(a[3:], c[3:]))


def test_keys_independent_of_how_prefill_was_chunked():
    toks = [random.Random(1).randrange(4096) for _ in range(1500)]
    whole = K.prefix_digests(toks, BS)
    # a chunked producer computes digests up to the blocks completed so far, then extends
    first = K.prefix_digests(toks[:700], BS)
    assert whole[:len(first)] == first
    assert K.prefix_digests(toks, BS, num_blocks=3) == whole[:3]


def test_namespace_separates_models_layouts_and_ranks():
    toks = list(range(300))
    base = K.block_keys(ns(), toks, BS)
    variants = [ns(model="other#def"), ns(kv_dtype="float16"), ns(layout="npu/default"),
                ns(tp_rank=1, tp_size=2), ns(layer_group=1), ns(extra={"user": "x"})]
    digests = {ns().digest} | {v.digest for v in variants}
    assert len(digests) == len(variants) + 1
    for v in variants:
        assert set(K.block_keys(v, toks, BS)).isdisjoint(base)
    # block size changes both namespace and chunk boundaries
    assert set(K.block_keys(ns(block_size=64), toks, 64)).isdisjoint(base)


def test_request_identity_in_chain_seed():
    toks = list(range(300))
    plain = K.prefix_digests(toks, BS)
    assert K.prefix_digests(toks, BS, extra=(("lora", "a"),)) != plain
    assert K.prefix_digests(toks, BS, extra=(("salt", "s"),)) != plain
    assert K.prefix_digests(toks, BS, extra=()) == plain


def test_key_format_is_accepted_by_the_data_system_charset():
    key = K.block_keys(ns(), list(range(BS)), BS)[0]
    assert K.is_block_key(key)
    assert all(ch.isalnum() or ch in "_@:" for ch in key)  # '.', '/', ' ' are rejected by the data system
    assert len(key) < 128


@pytest.mark.parametrize("n,expected", [
    (0, 0), (1, 0), (2, 0), (BS - 1, 0), (BS, 0),  # the last prompt token is always computed locally
    (BS + 1, 1),  # n = 1 mod block_size: the full block IS loadable (the reference connector missed it)
    (BS + 2, 1), (2 * BS, 1), (2 * BS + 1, 2), (11 * BS + 1, 11), (1500, 11),
])
def test_loadable_blocks_no_off_by_one(n, expected):
    assert K.loadable_blocks(n, BS) == expected
    # never more than the full blocks, and at least one token left to compute
    assert expected * BS <= max(0, n - 1)


@pytest.mark.parametrize("n,tail", [
    (0, 0), (1, 0), (2, 1), (BS - 1, BS - 2), (BS, BS - 1),  # a prompt within one block: all but its last token
    (BS + 1, 0),  # the loadable full block already ends one token short
    (BS + 2, 1), (2 * BS, BS - 1), (700, 59),
])
def test_handover_leaves_exactly_one_prompt_token_to_compute(n, tail):
    assert K.handover_tail(n, BS) == tail
    assert K.loadable_blocks(n, BS) * BS + tail == max(0, n - 1)


def test_tail_keys_name_exact_prompts_and_never_a_full_block():
    toks = [random.Random(2).randrange(4096) for _ in range(700)]  # 5 full blocks and 60 tokens
    chain = K.prefix_digests(toks, BS)
    tail = K.handover_digest(toks, BS, chain)
    assert tail == K.tail_digest(toks, BS, chain[-1]) and tail not in chain
    # any token of the prompt, before or inside the partial block, changes it; so does the count
    for i in (3, 5 * BS, 699):
        other = list(toks)
        other[i] = (other[i] + 1) % 4096
        assert K.handover_digest(other, BS, K.prefix_digests(other, BS)) != tail
    assert K.tail_digest(toks[:699], BS, chain[-1]) != tail
    # a partial block of exactly one block's tokens would be a full block: refused, the full key names it
    with pytest.raises(ValueError):
        K.tail_digest(toks[:640], BS, chain[3])
    assert K.handover_digest(toks[:640], BS, chain) == chain[4]
    assert K.handover_digest(toks[:641], BS, chain) is None  # nothing of block 5 to take
    # a prompt shorter than a block chains from the seed, with the request's identity
    assert K.handover_digest(toks[:50], BS, []) != K.handover_digest(toks[:50], BS, [], extra=(("lora", "a"),))


def test_saveable_range_under_chunked_prefill():
    prompt = 1000  # 7 full blocks (896 tokens) + 104 tokens
    chunks = [0, 320, 640, 960, 1000, 1001, 1002]  # budget 320 (chunks end mid-block), then decode steps
    saved = []
    for before, after in zip(chunks, chunks[1:]):
        saved.extend(K.saveable_range(prompt, before, after, BS))
    assert saved == list(range(7))  # every full prompt block exactly once, in order
    # generated tokens never make a prompt block
    assert list(K.saveable_range(prompt, 1000, 1200, BS)) == []
    # a step that completes no block saves nothing
    assert list(K.saveable_range(prompt, 130, 200, BS)) == []


def test_leading_hits():
    assert K.leading_hits([True, True, False, True]) == 2
    assert K.leading_hits([]) == 0
    assert K.leading_hits([False, True]) == 0


def test_model_identity():
    cfg = {"hidden_size": 128, "num_hidden_layers": 2}
    a = K.model_identity("/data/models/tiny/", cfg)
    assert a == K.model_identity("/mnt/other/tiny", cfg)  # same model at another path
    assert a != K.model_identity("/data/models/tiny", {**cfg, "hidden_size": 256})
    assert K.model_identity("/x/tiny", cfg, model_id="tiny@sha256:1234") == "tiny@sha256:1234"


# --- config ---------------------------------------------------------------------------------------

def test_config_defaults_and_roles():
    c = parse_config("kv_producer", {"ds_address": "127.0.0.1:31501"}, env={})
    assert (c.ds_host, c.ds_port, c.ttl_seconds, c.delete_after_load) == ("127.0.0.1", 31501, 600, False)
    assert c.is_producer and not c.is_consumer and c.evictable  # a full cache evicts, never refuses saves
    assert not parse_config("kv_producer", {"ds_address": "h:1", "evictable": "false"}, env={}).evictable
    c = parse_config("kv_both", {"ds_host": "10.0.0.2", "ds_port": "31501", "delete_after_load": "true",
                                 "ttl_seconds": 30, "stats_file": "/tmp/s-{side}-{rank}.json"}, env={})
    assert c.is_producer and c.is_consumer and c.delete_after_load and c.ttl_seconds == 30
    assert c.stats_path("worker", 3) == "/tmp/s-worker-3.json"
    assert parse_config("kv_consumer", {}, env={"YRPD_DS_ADDRESS": "[::1]:9"}).ds_host == "::1"
    # vLLM's 1 s busy wait is cut to 2 ms on CPU unless told otherwise; negative leaves vLLM's own
    assert c.cpu_spin_ms == 2.0
    assert parse_config("kv_both", {"ds_address": "h:1", "cpu_spin_ms": "-1"}, env={}).cpu_spin_ms == -1.0
    # a block saved lately is not saved again for 300 s, and never past half its TTL (it would expire meanwhile)
    assert parse_config("kv_both", {"ds_address": "h:1"}, env={}).resave_after_s == 300.0
    assert c.resave_after_s == 15.0  # ttl_seconds 30
    assert parse_config("kv_both", {"ds_address": "h:1", "ttl_seconds": 0}, env={}).resave_after_s == 300.0


@pytest.mark.parametrize("role,extra", [
    ("kv_sender", {"ds_address": "h:1"}),
    ("kv_producer", {}),
    ("kv_producer", {"ds_address": "nohostport"}),
    ("kv_producer", {"ds_address": "h:99999"}),
    ("kv_producer", {"ds_host": "h"}),
    ("kv_producer", {"ds_address": "h:1", "ttl_seconds": -1}),
    ("kv_producer", {"ds_address": "h:1", "delete_after_load": "maybe"}),
    ("kv_producer", {"ds_address": "h:1", "transport": "rdma"}),
    ("kv_producer", {"ds_address": "h:1", "cpu_spin_ms": "soon"}),
    ("kv_producer", {"ds_address": "h:1", "max_batch_keys": 5000}),
    ("kv_producer", {"ds_address": "h:1", "resave_after_s": -1}),
    ("kv_producer", {"ds_address": "h:1", "resave_after_s": "nan"}),
    ("kv_producer", {"ds_address": "h:1", "ttl_seconds": 60, "resave_after_s": 60}),
    ("kv_producer", {"ds_address": "h:1", "writer_nice": -1}),
    ("kv_producer", {"ds_address": "h:1", "writer_nice": 20}),
])
def test_config_rejects_bad_input(role, extra):
    with pytest.raises(ConfigError):
        parse_config(role, extra, env={})


def test_config_keeps_unknown_keys_for_a_warning():
    c = parse_config("kv_producer", {"ds_address": "h:1", "ds_adress": "typo"}, env={})
    assert c.unknown == {"ds_adress": "typo"}


def test_parse_address():
    assert parse_address("127.0.0.1:31501") == ("127.0.0.1", 31501)
    assert parse_address("[fe80::1]:80") == ("fe80::1", 80)


# --- stats ----------------------------------------------------------------------------------------

def test_stats_counters_snapshot_and_file(tmp_path, caplog):
    s = ConnectorStats("worker", "kv_consumer", 0, "abcd", "127.0.0.1:1")
    threads = [threading.Thread(target=lambda: [s.inc("loaded_blocks") for _ in range(1000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s.inc("loaded_bytes", 4096)
    s.observe("load", 2.0)
    s.observe("load", 4.0)
    snap = s.snapshot()
    assert snap["counters"]["loaded_blocks"] == 4000
    assert snap["latency_ms"]["load"]["avg"] == 3.0 and snap["latency_ms"]["load"]["max"] == 4.0
    path = tmp_path / "sub" / "stats.json"
    logger = logging.getLogger("test.yrpd.stats")
    rep = StatsReporter(s, 60.0, str(path), logger, extra=lambda: {"block_size": 128})
    with caplog.at_level(logging.INFO, logger="test.yrpd.stats"):
        rep.flush()
        rep.flush()  # nothing changed: no second line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "loaded_blocks=4000" in lines[0] and "load_ms_avg=3.0" in lines[0]
    data = read_stats_file(str(path))
    assert data["counters"]["loaded_bytes"] == 4096 and data["block_size"] == 128
    assert data["side"] == "worker" and data["namespace"] == "abcd"
    assert not list(path.parent.glob(".stats-*"))  # temp file renamed away


def test_read_stats_file_rejects_garbage(tmp_path):
    p = tmp_path / "x.json"
    assert read_stats_file(str(p)) is None
    p.write_text("{not json")
    assert read_stats_file(str(p)) is None
    write_json_atomic(str(p), {"schema": "other"})
    assert read_stats_file(str(p)) is None
    write_json_atomic(str(p), {"schema": "yrpd.connector.stats/1", "counters": {}})
    assert json.loads(p.read_text())["counters"] == {}


def test_reporter_writes_at_start_and_when_woken_not_only_each_interval(tmp_path):
    """The deploy waits on ds_healthy in this file: a data system that comes up must show without waiting out the
    interval (60 s here)."""
    s = ConnectorStats("worker", "kv_consumer", 0, "abcd", "127.0.0.1:1")
    s.ds_healthy = False
    path = tmp_path / "stats.json"

    def read_when(predicate):
        for _ in range(200):
            data = read_stats_file(str(path))
            if data is not None and predicate(data):
                return data
            threading.Event().wait(0.01)
        return read_stats_file(str(path))

    rep = StatsReporter(s, 60.0, str(path), logging.getLogger("test.yrpd.stats")).start()
    try:
        assert read_when(lambda d: True)["ds_healthy"] is False
        s.ds_healthy = True
        rep.wake()
        assert read_when(lambda d: d["ds_healthy"])["ds_healthy"] is True
    finally:
        rep.stop()
    rep._thread.join(2)
    assert not rep._thread.is_alive()  # stop() ends the thread while it waits
