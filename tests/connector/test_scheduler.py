"""The scheduler half of the connector (yrpd/connector/scheduler.py) on its own: fake vLLM requests and scheduler
outputs, an in-memory data system, and a hand-driven clock for the consumer's waiting.

Producer: what each step's metadata tells the workers to save. Consumer: what it promises vLLM, when it makes a
request wait, and the load plan a promise turns into.
"""

from __future__ import annotations

import logging
import pickle
import random
import threading
import time
from types import SimpleNamespace

import pytest

from tests.connector import fakes
from tests.connector.fakes import FakeKVClient
from yrpd.connector import keys as K

pytestmark = pytest.mark.torch

try:
    from yrpd.connector import common
    from yrpd.connector import scheduler as S
except ImportError as exc:  # the main pass (`-m "not torch"`, no vLLM) collects this module and runs none of it
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

BS = 4  # small blocks keep prompts short and every block index readable in the assertions


def tokens(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, 30000) for _ in range(n)]


class Clock:
    """time.monotonic for the scheduler module, moved by hand: waits and poll intervals without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return time.perf_counter()

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def _imported():
    if _IMPORT_ERROR is not None:
        raise _IMPORT_ERROR


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(S, "time", c)
    return c


@pytest.fixture
def make(ds, clock):
    """make(role, extra, can_wait=, can_recompute=, groups=, **vllm_config kwargs) -> a ConnectorScheduler."""
    before = set(threading.enumerate())
    made = []

    def build(role, extra=None, *, can_wait=True, can_recompute=True, groups=None, **cfg):
        extra = {"retry_backoff_s": 0.05, **(extra or {})}
        kvc = fakes.kv_cache_config(groups) if groups is not None else None
        ctx = common.ConnectorContext(fakes.vllm_config(role, extra, block_size=BS, **cfg), kvc)
        sch = S.ConnectorScheduler(ctx, can_wait=can_wait, can_recompute=can_recompute)
        made.append(sch)
        return sch

    yield build
    for sch in made:
        sch.shutdown()
    assert not fakes.stray_threads(before), "a connector thread outlived shutdown()"


def rank_ns(sch) -> list[str]:
    """Every rank's namespace digest, in the order a producer announces them."""
    ctx = sch.ctx
    return [ctx.namespace(t, p).digest for p in range(ctx.pp_size) for t in range(ctx.tp_size)]


def put(ds: FakeKVClient, ns: str, digests) -> None:
    for d in digests:
        ds.store[K.key_for(ns, d)] = FakeKVClient.Buf(1)


def announce(sch, num_blocks: int, tail: int = 0, **over) -> dict:
    """kv_transfer_params as a matching producer sends them to decode."""
    info = {"num_blocks": num_blocks, "tail": tail, "ns": ",".join(rank_ns(sch)), "block_size": BS,
            "kv_dtype": sch.ctx.kv_dtype, "model": sch.ctx.model_identity}
    info.update(over)
    return {"yrpd": info}


def ops(op_list) -> list:
    return [(op.req_id, op.block_ids, op.digests) for op in op_list]


# --- producer ---------------------------------------------------------------------------------------------

def test_producer_plans_each_prompt_block_in_the_step_that_completes_it(make):
    sch = make("kv_producer")
    toks = tokens(22, 1)  # 5 full blocks and 2 tokens
    d = K.prefix_digests(toks, BS)
    # chunks of 7 tokens end inside blocks, and block ids arrive as the chunks are scheduled
    steps = [
        fakes.scheduler_output(new=[fakes.new_req("r", toks, [10, 11])], num_scheduled={"r": 7}),
        fakes.scheduler_output(cached=[fakes.cached_req("r", [12, 13], 7)], num_scheduled={"r": 7}),
        fakes.scheduler_output(cached=[fakes.cached_req("r", [14, 15], 14)], num_scheduled={"r": 8}),
        fakes.scheduler_output(cached=[fakes.cached_req("r", None, 22)], num_scheduled={"r": 1}),  # decoding
    ]
    # vLLM pickles each step's metadata over to the workers: the plan must survive the trip
    plans = [ops(pickle.loads(pickle.dumps(sch.build_connector_meta(so))).saves) for so in steps]
    assert plans == [
        [("r", [10], d[0:1])],
        [("r", [11, 12], d[1:3])],
        [("r", [13, 14], d[3:5])],
        [],
    ]
    # the partial block (id 15) of a request that stays here is no block any other prompt could reuse
    info = sch.request_finished(fakes.request("r", toks), [])[1]["yrpd"]
    assert (info["num_blocks"], info["tail"]) == (5, 0)


def test_producer_saves_blocks_the_local_prefix_cache_supplied_too(make):
    sch = make("kv_producer")
    toks = tokens(22, 2)
    # two blocks were hits in vLLM's own prefix cache: the data system may not hold them (evicted, other engine)
    meta = sch.build_connector_meta(fakes.scheduler_output(
        new=[fakes.new_req("r", toks, [5, 6, 7, 8, 9, 10], computed=8)], num_scheduled={"r": 14}))
    assert ops(meta.saves) == [("r", [5, 6, 7, 8, 9], K.prefix_digests(toks, BS))]


def test_producer_resumed_request_saves_the_rest_on_its_new_blocks_only(make):
    sch = make("kv_producer")
    toks = tokens(24, 3)
    d = K.prefix_digests(toks, BS)
    first = sch.build_connector_meta(fakes.scheduler_output(new=[fakes.new_req("r", toks, [1, 2])],
                                                            num_scheduled={"r": 8}))
    assert ops(first.saves) == [("r", [1, 2], d[0:2])]
    # preempted (its blocks freed), then resumed from scratch on other blocks
    resumed = sch.build_connector_meta(fakes.scheduler_output(
        cached=[fakes.cached_req("r", [20, 21, 22, 23, 24, 25], 0, resumed=True)], num_scheduled={"r": 24}))
    assert ops(resumed.saves) == [("r", [22, 23, 24, 25], d[2:6])]


def test_producer_hands_over_the_prompts_partial_last_block_once_it_is_computed(make):
    sch = make("kv_producer")
    toks = tokens(22, 4)
    d = K.prefix_digests(toks, BS)
    hand = fakes.request("h", toks, {"do_remote_decode": True})
    # a producer promises nothing: this call only tells it that the request's KV goes on to decode
    assert sch.get_num_new_matched_tokens(hand, 0) == (0, False)
    m1 = sch.build_connector_meta(fakes.scheduler_output(new=[fakes.new_req("h", toks, [1, 2, 3, 4, 5, 6])],
                                                         num_scheduled={"h": 20}))
    assert ops(m1.saves) == [("h", [1, 2, 3, 4, 5], d)]  # the last token is not computed yet: no tail
    m2 = sch.build_connector_meta(fakes.scheduler_output(cached=[fakes.cached_req("h", None, 20)],
                                                         num_scheduled={"h": 2}))
    tail = K.handover_digest(toks, BS, d)  # the key decode looks the tail block up by
    assert ops(m2.saves) == [("h", [6], [tail])]
    m3 = sch.build_connector_meta(fakes.scheduler_output(cached=[fakes.cached_req("h", None, 22)],
                                                         num_scheduled={"h": 1}))
    assert m3.saves == []
    info = sch.request_finished(hand, [])[1]["yrpd"]
    assert (info["num_blocks"], info["tail"]) == (5, 1)  # decode takes 21 of 22 prompt tokens
    # control: the same prompt that stays here plans and announces no tail
    stay = fakes.request("s", toks)
    sch.get_num_new_matched_tokens(stay, 0)
    sch.build_connector_meta(fakes.scheduler_output(new=[fakes.new_req("s", toks, [7, 8, 9, 10, 11, 12])],
                                                    num_scheduled={"s": 20}))
    assert sch.build_connector_meta(fakes.scheduler_output(cached=[fakes.cached_req("s", None, 20)],
                                                           num_scheduled={"s": 2})).saves == []
    assert sch.request_finished(stay, [])[1]["yrpd"]["tail"] == 0


def test_producer_tells_the_proxy_what_its_own_prefix_cache_had_when_the_request_was_first_scheduled(make):
    """The proxy checks its KV-event index against what the instance's cache really had: the local prefix-cache
    tokens vLLM gave the connector's first lookup of a handed-over request, not a later one (a preempted request is
    looked up again after its blocks went). The control: a request that stays here says nothing of it."""
    sch = make("kv_producer")
    toks = tokens(22, 11)
    hand = fakes.request("h", toks, {"do_remote_decode": True})
    sch.get_num_new_matched_tokens(hand, 8)
    sch.get_num_new_matched_tokens(hand, 0)
    assert sch.request_finished(hand, [])[1]["yrpd"]["cached"] == 8
    stay = fakes.request("s", toks)
    sch.get_num_new_matched_tokens(stay, 8)
    assert "cached" not in sch.request_finished(stay, [])[1]["yrpd"]
    assert not sch._handover  # nothing kept once they finished


def test_producer_hand_over_ending_on_a_block_boundary_needs_no_extra_block(make):
    sch = make("kv_producer")
    toks = tokens(20, 5)  # exactly 5 blocks: the last full block is the hand-over's last block
    hand = fakes.request("h", toks, {"do_remote_decode": True})
    sch.get_num_new_matched_tokens(hand, 0)
    meta = sch.build_connector_meta(fakes.scheduler_output(new=[fakes.new_req("h", toks, [1, 2, 3, 4, 5])],
                                                           num_scheduled={"h": 20}))
    assert ops(meta.saves) == [("h", [1, 2, 3, 4, 5], K.prefix_digests(toks, BS))]
    info = sch.request_finished(hand, [])[1]["yrpd"]
    assert (info["num_blocks"], info["tail"]) == (5, BS - 1)


def test_a_producers_hand_over_is_what_a_consumer_promises(make, ds):
    producer, consumer = make("kv_producer"), make("kv_consumer")
    toks = tokens(22, 6)
    hand = fakes.request("h", toks, {"do_remote_decode": True})
    producer.get_num_new_matched_tokens(hand, 0)
    saves = producer.build_connector_meta(fakes.scheduler_output(
        new=[fakes.new_req("h", toks, range(6))], num_scheduled={"h": 22})).saves
    # stands in for the producer's worker: every planned block written under rank 0's key
    put(ds, rank_ns(producer)[0], [d for op in saves for d in op.digests])
    params = producer.request_finished(hand, [])[1]
    assert consumer.get_num_new_matched_tokens(fakes.request("h", toks, params), 0) == (21, False)


def test_each_side_of_a_hand_over_logs_one_line_naming_the_request(make, ds, caplog):
    """What `yrpd logs --request ID` finds on the prefill and the decode host: vLLM's request id carries the proxy's
    X-Request-Id. The control: a request whose hand-over decode does not load logs why."""
    producer, consumer = make("kv_producer"), make("kv_consumer")
    toks = tokens(22, 6)
    hand = fakes.request("cmpl-trace7-0", toks, {"do_remote_decode": True})
    producer.get_num_new_matched_tokens(hand, 0)
    saves = producer.build_connector_meta(fakes.scheduler_output(
        new=[fakes.new_req("cmpl-trace7-0", toks, range(6))], num_scheduled={"cmpl-trace7-0": 22})).saves
    put(ds, rank_ns(producer)[0], [d for op in saves for d in op.digests])
    with caplog.at_level(logging.INFO, logger="yrpd.connector"):
        params = producer.request_finished(hand, [])[1]
        req = fakes.request("cmpl-trace7-0", toks, params)
        n, _ = consumer.get_num_new_matched_tokens(req, 0)
        consumer.update_state_after_alloc(req, fakes.KVCacheBlocks([40, 41, 42, 43, 44, 45]), n)
    lines = [r.getMessage() for r in caplog.records if "trace7" in r.getMessage()]
    assert lines[0] == ("yrpd connector: request cmpl-trace7-0: hands over 5 blocks + a 1-token tail through the "
                        "data system (loaded 0 of them from it)")
    assert lines[1].startswith("yrpd connector: request cmpl-trace7-0: loads 5 blocks + a 1-token tail from the data "
                               "system (prefill handed over 5; waited ") and len(lines) == 2
    caplog.clear()
    other = fakes.request("cmpl-trace8-0", tokens(22, 9), params)  # announced, but none of its blocks stored
    with caplog.at_level(logging.INFO, logger="yrpd.connector"):
        consumer.get_num_new_matched_tokens(other, 0)
        consumer.update_state_after_alloc(other, fakes.KVCacheBlocks([]), 0)
    assert [r.getMessage() for r in caplog.records if "trace8" in r.getMessage()] == [
        "yrpd connector: request cmpl-trace8-0: loads nothing of the 6 blocks prefill handed over (visible: 0; "
        "waited 0 ms): computes the prompt"]


def test_cache_salt_keeps_requests_from_sharing_kv(make, ds):
    producer, consumer = make("kv_producer"), make("kv_consumer")
    toks = tokens(22, 7)
    saves = producer.build_connector_meta(fakes.scheduler_output(
        new=[fakes.new_req("a", toks, range(6), salt="tenant-a")], num_scheduled={"a": 22})).saves
    put(ds, rank_ns(producer)[0], [d for op in saves for d in op.digests])
    assert consumer.get_num_new_matched_tokens(fakes.request("b", toks, salt="tenant-b"), 0) == (0, False)
    assert consumer.get_num_new_matched_tokens(fakes.request("u", toks), 0) == (0, False)
    assert consumer.get_num_new_matched_tokens(fakes.request("a2", toks, salt="tenant-a"), 0) == (20, False)


def test_kv_both_does_not_save_again_what_it_loaded(make, ds):
    sch = make("kv_both")
    toks = tokens(22, 8)
    d = K.prefix_digests(toks, BS)
    put(ds, rank_ns(sch)[0], d[:3])  # another instance computed the first 3 blocks
    req = fakes.request("r", toks, {"do_remote_decode": True})
    assert sch.get_num_new_matched_tokens(req, 0) == (12, False)
    sch.update_state_after_alloc(req, fakes.KVCacheBlocks([30, 31, 32, 33, 34, 35]), 12)
    meta = sch.build_connector_meta(fakes.scheduler_output(
        new=[fakes.new_req("r", toks, [30, 31, 32, 33, 34, 35], computed=12)], num_scheduled={"r": 10}))
    assert ops(meta.loads) == [("r", [30, 31, 32], d[0:3])]
    assert ops(meta.saves) == [("r", [33, 34], d[3:5]), ("r", [35], [K.handover_digest(toks, BS, d)])]
    info = sch.request_finished(req, [])[1]["yrpd"]
    assert (info["num_blocks"], info["loaded"]) == (5, 3)


def _next_turn(sch, rid: str, toks: list, computed: int):
    """One request's first step with its whole prompt scheduled; its block ids are 100, 101, ..."""
    n = len(toks) // BS + 1
    return sch.build_connector_meta(fakes.scheduler_output(
        new=[fakes.new_req(rid, toks, range(100, 100 + n), computed=computed)], num_scheduled={rid: len(toks) - computed}))


@pytest.mark.parametrize("extra, again", [({}, False), ({"resave_after_s": 0}, True)], ids=["default", "resave 0"])
def test_kv_both_does_not_copy_out_again_a_history_it_saved_lately(make, clock, extra, again):
    """A chat's next turn: the history came from vLLM's own prefix cache and this instance saved it a turn ago, so
    only the new blocks are staged on the step (resave_after_s 0, the keyed control: every block again)."""
    sch = make("kv_both", extra)
    first = tokens(22, 12)  # 5 full blocks
    turn = first + tokens(9, 13)  # 7 full blocks, the first 5 of them the history
    d = K.prefix_digests(turn, BS)
    assert ops(_next_turn(sch, "t1", first, 0).saves) == [("t1", [100, 101, 102, 103, 104], d[:5])]
    skipped = sch.stats.get("save_skipped_recent_blocks")
    clock.advance(60)
    saves = ops(_next_turn(sch, "t2", turn, 20).saves)
    if again:
        assert saves == [("t2", [100, 101, 102, 103, 104, 105, 106], d[:7])]
    else:
        assert saves == [("t2", [105, 106], d[5:7])]
    assert sch.stats.get("save_skipped_recent_blocks") - skipped == (0 if again else 5)


def test_kv_both_saves_a_history_again_once_resave_after_s_passed_and_a_hand_over_always(make, clock):
    sch = make("kv_both", {"resave_after_s": 100})
    toks = tokens(22, 14)
    d = K.prefix_digests(toks, BS)
    _next_turn(sch, "a", toks, 0)
    clock.advance(99)
    assert ops(_next_turn(sch, "b", toks, 20).saves) == []  # control: within the window nothing again
    # a hand-over: decode loads every block, and the data system may have evicted one since
    handed = fakes.request("c", toks, {"do_remote_decode": True})
    sch.get_num_new_matched_tokens(handed, 20)
    assert ops(_next_turn(sch, "c", toks, 20).saves)[0] == ("c", [100, 101, 102, 103, 104], d[:5])
    clock.advance(50)  # 149 s after the first save, 50 after the hand-over's: its save restarted the window
    assert ops(_next_turn(sch, "d", toks, 20).saves) == []
    clock.advance(50)
    assert ops(_next_turn(sch, "e", toks, 20).saves) == [("e", [100, 101, 102, 103, 104], d[:5])]


def test_kv_both_saves_again_a_history_it_had_to_compute_even_if_it_saved_it_lately(make, clock):
    """vLLM's own cache had evicted the history, so this request computed it: maybe the first save never landed
    (dropped, refused, evicted since), and this is the copy that can make it land."""
    sch = make("kv_both")
    toks = tokens(22, 15)
    d = K.prefix_digests(toks, BS)
    _next_turn(sch, "a", toks, 0)
    clock.advance(10)
    assert ops(_next_turn(sch, "b", toks, 0).saves) == [("b", [100, 101, 102, 103, 104], d[:5])]
    assert ops(_next_turn(sch, "c", toks, 8).saves) == [("c", [102, 103, 104], d[2:5])]  # 2 blocks from its cache


def test_kv_both_announces_only_requests_that_came_with_transfer_params(make):
    sch = make("kv_both")
    toks = tokens(12, 9)
    for rid in ("plain", "pd"):
        sch.build_connector_meta(fakes.scheduler_output(new=[fakes.new_req(rid, toks, [1, 2, 3])],
                                                        num_scheduled={rid: 12}))
    assert sch.request_finished(fakes.request("plain", toks), []) == (False, None)
    delay, params = sch.request_finished(fakes.request("pd", toks, {"do_remote_decode": True}), [])
    assert delay is False and params["yrpd"]["num_blocks"] == 3


def test_consumer_plans_no_saves_and_announces_nothing(make):
    toks = tokens(12, 10)
    step = fakes.scheduler_output(new=[fakes.new_req("r", toks, [1, 2, 3])], num_scheduled={"r": 12})
    consumer = make("kv_consumer")
    assert consumer.build_connector_meta(step).saves == []
    assert consumer.request_finished(fakes.request("r", toks), []) == (False, None)
    producer = make("kv_producer")  # control: the same step on a producer
    assert len(producer.build_connector_meta(step).saves) == 1
    assert producer.request_finished(fakes.request("r", toks), [])[1] is not None


def test_hybrid_model_keeps_the_connector_idle(make, ds):
    toks = tokens(22, 11)
    step = fakes.scheduler_output(new=[fakes.new_req("r", toks, range(6))], num_scheduled={"r": 22})
    one = make("kv_both", groups=[["layers.0"]])
    two = make("kv_both", groups=[["layers.0"], ["layers.1"]])
    put(ds, rank_ns(one)[0], K.prefix_digests(toks, BS))
    # a flat list of block ids cannot name two groups' blocks: neither loads nor saves
    assert two.get_num_new_matched_tokens(fakes.request("r", toks), 0) == (0, False)
    assert two.build_connector_meta(step).saves == []
    assert one.get_num_new_matched_tokens(fakes.request("r", toks), 0) == (20, False)
    assert one.build_connector_meta(step).saves != []


# --- consumer: what it promises -----------------------------------------------------------------------------

def test_consumer_promises_the_leading_run_present_for_every_rank(make, ds):
    sch = make("kv_consumer", tp=2)
    rank0, rank1 = rank_ns(sch)
    toks = tokens(22, 12)  # 5 loadable blocks
    d = K.prefix_digests(toks, BS)
    put(ds, rank0, d)
    put(ds, rank1, d[:2] + d[3:])  # rank 1 lacks block 2: no rank may load past it
    assert sch.get_num_new_matched_tokens(fakes.request("a", toks), 0) == (2 * BS, False)
    put(ds, rank1, d[2:3])
    assert sch.get_num_new_matched_tokens(fakes.request("b", toks), 0) == (5 * BS, False)
    # counted from the first block vLLM did not find locally
    assert sch.get_num_new_matched_tokens(fakes.request("c", toks), 2 * BS) == (3 * BS, False)
    # the last prompt token is always computed here: a prompt of exactly 5 blocks loads 4
    assert sch.get_num_new_matched_tokens(fakes.request("d", toks[:20]), 0) == (4 * BS, False)


def test_consumer_asks_about_many_blocks_of_many_ranks_in_batches_the_data_system_takes(make, ds):
    """The data system refuses a call naming too many keys (2000 and more for the real one): TP ranks x blocks of a
    long prompt go in batches of `max_batch_keys`; the control, the same lookup without a limit, promises the same."""
    toks = tokens(22, 15)  # 5 loadable blocks x 2 ranks = 10 keys
    d = K.prefix_digests(toks, BS)
    unlimited = make("kv_consumer", tp=2)
    for ns in rank_ns(unlimited):
        put(ds, ns, d)
    assert unlimited.get_num_new_matched_tokens(fakes.request("a", toks), 0) == (5 * BS, False)
    ds.batch_limit = 4
    ds.key_log.clear()
    limited = make("kv_consumer", {"max_batch_keys": 4}, tp=2)
    assert limited.get_num_new_matched_tokens(fakes.request("b", toks), 0) == (5 * BS, False)
    asked = [keys for op, keys in ds.key_log if op == "exist"]
    assert asked and max(map(len, asked)) <= 4 and sum(map(len, asked)) == 10, [len(k) for k in asked]


def test_consumer_promise_becomes_the_next_steps_load_plan_once(make, ds):
    sch = make("kv_consumer")
    toks = tokens(22, 13)
    d = K.prefix_digests(toks, BS)
    put(ds, rank_ns(sch)[0], d)
    req = fakes.request("r", toks)
    hits = sch.stats.get("lookup_hit_blocks")
    n, _ = sch.get_num_new_matched_tokens(req, BS)  # block 0 is a local hit
    assert n == 4 * BS
    sch.update_state_after_alloc(req, fakes.KVCacheBlocks([40, 41, 42, 43, 44, 45]), n)
    assert ops(sch.build_connector_meta(fakes.scheduler_output()).loads) == [("r", [41, 42, 43, 44], d[1:5])]
    assert sch.build_connector_meta(fakes.scheduler_output()).loads == []
    assert sch.stats.get("lookup_hit_blocks") - hits == 4


def test_consumer_turns_an_allocation_it_never_promised_into_a_failed_load(make, ds):
    sch = make("kv_consumer")
    toks = tokens(22, 14)
    d = K.prefix_digests(toks, BS)
    put(ds, rank_ns(sch)[0], d[:2])
    promised = fakes.request("p", toks)
    assert sch.get_num_new_matched_tokens(promised, 0) == (2 * BS, False)
    sch.update_state_after_alloc(promised, fakes.KVCacheBlocks([1, 2, 3, 4, 5, 6]), 2 * BS)
    assert ops(sch.build_connector_meta(fakes.scheduler_output()).loads) == [("p", [1, 2], d[:2])]
    # no lookup at all, or more than the lookup promised: the worker gets no keys and reports the blocks failed
    sch.update_state_after_alloc(fakes.request("q", toks), fakes.KVCacheBlocks([7, 8, 9]), 2 * BS)
    over = fakes.request("o", toks)
    assert sch.get_num_new_matched_tokens(over, 0) == (2 * BS, False)
    sch.update_state_after_alloc(over, fakes.KVCacheBlocks([10, 11, 12, 13]), 3 * BS)
    assert ops(sch.build_connector_meta(fakes.scheduler_output()).loads) == [("q", [7, 8], []),
                                                                              ("o", [10, 11, 12], [])]


def test_consumer_allocation_without_external_tokens_plans_no_load(make, ds):
    sch = make("kv_consumer")
    toks = tokens(22, 15)
    put(ds, rank_ns(sch)[0], K.prefix_digests(toks, BS)[:2])
    req = fakes.request("r", toks)
    before = {k: sch.stats.get(k) for k in ("lookup_requests", "lookup_blocks", "lookup_miss_blocks")}
    assert sch.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    sch.update_state_after_alloc(req, fakes.KVCacheBlocks(range(6)), 0)  # vLLM took none of it
    assert sch.build_connector_meta(fakes.scheduler_output()).loads == []
    after = {k: sch.stats.get(k) - v for k, v in before.items()}
    assert after == {"lookup_requests": 1, "lookup_blocks": 5, "lookup_miss_blocks": 5}


# --- consumer: waiting for prefill ---------------------------------------------------------------------------

def test_consumer_waits_for_announced_blocks_and_promises_them_when_they_appear(make, ds, clock):
    sch = make("kv_consumer", {"ready_wait_ms": 1000})
    ns = rank_ns(sch)[0]
    toks = tokens(22, 16)
    d = K.prefix_digests(toks, BS)
    put(ds, ns, d[:2])  # prefill's saver has written 2 of the 5 blocks it announced
    req = fakes.request("r", toks, announce(sch, 5))
    waits = sch.stats.get("lookup_waits")
    assert sch.get_num_new_matched_tokens(req, 0) == (None, False)
    # asked again within the poll interval: still waiting, and the data system is not asked
    asked = len(ds.calls)
    clock.advance(S._POLL_S / 2)
    assert sch.get_num_new_matched_tokens(req, 0) == (None, False)
    assert len(ds.calls) == asked
    clock.advance(2 * S._POLL_S)  # past the poll interval
    assert sch.get_num_new_matched_tokens(req, 0) == (None, False)
    assert len(ds.calls) == asked + 1
    put(ds, ns, d[2:])
    clock.advance(2 * S._POLL_S)  # past the poll interval
    assert sch.get_num_new_matched_tokens(req, 0) == (5 * BS, False)
    assert sch.stats.get("lookup_waits") - waits == 1  # one waiting request, however often it was asked
    missed = sch.stats.get("handoff_missed_blocks")
    sch.update_state_after_alloc(req, fakes.KVCacheBlocks(range(6)), 5 * BS)
    assert sch.stats.get("handoff_missed_blocks") == missed


def test_consumer_gives_up_after_ready_wait_ms_and_takes_what_is_there(make, ds, clock):
    sch = make("kv_consumer", {"ready_wait_ms": 100})
    toks = tokens(22, 17)
    put(ds, rank_ns(sch)[0], K.prefix_digests(toks, BS)[:2])
    req = fakes.request("r", toks, announce(sch, 5))
    assert sch.get_num_new_matched_tokens(req, 0) == (None, False)
    clock.advance(0.09)
    assert sch.get_num_new_matched_tokens(req, 0) == (None, False)
    clock.advance(0.02)
    assert sch.get_num_new_matched_tokens(req, 0) == (2 * BS, False)  # the other 3 blocks are recomputed
    missed = sch.stats.get("handoff_missed_blocks")
    sch.update_state_after_alloc(req, fakes.KVCacheBlocks(range(6)), 2 * BS)
    assert sch.stats.get("handoff_missed_blocks") - missed == 3


@pytest.mark.parametrize("why", ["vllm cannot wait", "another namespace", "another dtype", "nothing announced"])
def test_consumer_answers_at_once_where_waiting_cannot_help(make, ds, why):
    toks = tokens(22, 18)
    sch = make("kv_consumer", {"ready_wait_ms": 1000}, can_wait=(why != "vllm cannot wait"))
    put(ds, rank_ns(sch)[0], K.prefix_digests(toks, BS)[:2])
    params = {"another namespace": announce(sch, 5, ns="f" * 16),
              "another dtype": announce(sch, 5, kv_dtype="float32"),
              "nothing announced": None}.get(why, announce(sch, 5))
    refused = sch.stats.get("handoff_refused")
    assert sch.get_num_new_matched_tokens(fakes.request("r", toks, params), 0) == (2 * BS, False)
    assert sch.stats.get("handoff_refused") - refused == (1 if why == "another dtype" else 0)
    # control: a matching announcement on a vLLM that can wait makes the same request wait
    waiting = make("kv_consumer", {"ready_wait_ms": 1000})
    assert waiting.get_num_new_matched_tokens(fakes.request("r", toks, announce(waiting, 5)), 0) == (None, False)


def test_consumer_promises_and_loads_the_hand_overs_last_block(make, ds, clock):
    sch = make("kv_consumer", {"ready_wait_ms": 1000})
    ns = rank_ns(sch)[0]
    toks = tokens(22, 19)  # 5 full blocks; decode takes 1 token of the partial 6th
    d = K.prefix_digests(toks, BS)
    tail = K.handover_digest(toks, BS, d)
    put(ds, ns, d)
    req = fakes.request("r", toks, announce(sch, 5, tail=1))
    assert sch.get_num_new_matched_tokens(req, 0) == (None, False)  # prefill writes the last block last
    put(ds, ns, [tail])
    clock.advance(2 * S._POLL_S)  # past the poll interval
    assert sch.get_num_new_matched_tokens(req, 0) == (21, False)  # all prompt tokens but the last
    sch.update_state_after_alloc(req, fakes.KVCacheBlocks([60, 61, 62, 63, 64, 65]), 21)
    assert ops(sch.build_connector_meta(fakes.scheduler_output()).loads) == [
        ("r", [60, 61, 62, 63, 64, 65], d + [tail])]
    # a tail announced for another prompt length is not this prompt's: neither waited for nor promised
    odd = fakes.request("o", toks, announce(sch, 5, tail=2))
    assert sch.get_num_new_matched_tokens(odd, 0) == (5 * BS, False)


def test_consumer_seeing_the_last_block_stops_waiting_for_an_evicted_one(make, ds):
    sch = make("kv_consumer", {"ready_wait_ms": 1000})
    ns = rank_ns(sch)[0]
    toks = tokens(22, 20)
    d = K.prefix_digests(toks, BS)
    put(ds, ns, d[:2] + d[3:])  # block 2 was evicted; prefill's last write (the tail) is visible
    req = fakes.request("r", toks, announce(sch, 5, tail=1))
    assert sch.get_num_new_matched_tokens(req, 0) == (None, False)  # control: tail not there yet -> wait
    put(ds, ns, [K.handover_digest(toks, BS, d)])
    assert sch.get_num_new_matched_tokens(fakes.request("r2", toks, announce(sch, 5, tail=1)), 0) == (2 * BS, False)


# --- consumer: when it cannot load ---------------------------------------------------------------------------

def test_consumer_recomputes_while_the_data_system_is_down(make, ds):
    sch = make("kv_consumer")
    toks = tokens(22, 21)
    put(ds, rank_ns(sch)[0], K.prefix_digests(toks, BS))
    assert sch.get_num_new_matched_tokens(fakes.request("a", toks), 0) == (5 * BS, False)  # control
    errors = sch.stats.get("lookup_errors")
    ds.down = True
    assert sch.get_num_new_matched_tokens(fakes.request("b", toks), 0) == (0, False)
    asked = len(ds.calls)
    assert sch.get_num_new_matched_tokens(fakes.request("c", toks), 0) == (0, False)
    assert len(ds.calls) == asked  # known down: not asked again on the engine's critical path
    assert sch.stats.get("lookup_errors") - errors == 2
    ds.down = False
    deadline = time.monotonic() + 5
    while sch.get_num_new_matched_tokens(fakes.request("d", toks), 0) != (5 * BS, False):
        assert time.monotonic() < deadline, "the scheduler never used the data system again"
        time.sleep(0.02)


def test_consumer_loads_nothing_where_vllm_cannot_recompute_a_failed_load(make, ds):
    toks = tokens(22, 22)
    able = make("kv_consumer")
    put(ds, rank_ns(able)[0], K.prefix_digests(toks, BS))
    assert able.get_num_new_matched_tokens(fakes.request("a", toks), 0) == (5 * BS, False)
    asked = len(ds.calls)
    unable = make("kv_consumer", can_recompute=False)
    assert unable.get_num_new_matched_tokens(fakes.request("b", toks), 0) == (0, False)
    assert len(ds.calls) == asked


def test_consumer_forces_the_load_failure_policy_to_recompute(make):
    sch = make("kv_consumer", failure_policy="fail")
    assert sch.ctx.ktc.kv_load_failure_policy == "recompute"


def test_prefill_tells_what_one_block_takes_in_the_data_system_every_ranks_key_together(make):
    """Cache-aware routing sizes a worker's memory in blocks from it (yrpd.proxy.kvindex.Store.memory_blocks): a page
    of every layer, on each TP x PP rank."""
    def said(sch) -> dict:
        req = fakes.request("r", tokens(22, 9), {"do_remote_decode": True})
        sch.get_num_new_matched_tokens(req, 0)
        return sch.request_finished(req, [])[1]["yrpd"]

    page = SimpleNamespace(page_size_bytes=4096)
    groups = [SimpleNamespace(layer_names=["l0", "l1", "l2"], kv_cache_spec=page)]
    for tp, pp in ((2, 1), (2, 2), (1, 1)):
        ctx = common.ConnectorContext(fakes.vllm_config("kv_both", {"retry_backoff_s": 0.05}, block_size=BS, tp=tp,
                                                        pp=pp), SimpleNamespace(kv_cache_groups=groups, num_blocks=None))
        assert ctx.block_bytes == 3 * 4096 * tp * pp
    sch = S.ConnectorScheduler(ctx, can_wait=True, can_recompute=True)
    try:
        assert said(sch)["block_bytes"] == 3 * 4096
    finally:
        sch.shutdown()
    # the control: a vLLM that gave no KV cache config (nothing to size it by): not said
    assert "block_bytes" not in said(make("kv_both"))
