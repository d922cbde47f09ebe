"""In-process checks of YuanrongConnector against the real vLLM API, with a fake data system.

Run in the vLLM venv (needs vllm + torch, no server, no data-system worker):

    PYTHONPATH=. $YRPD_VLLM_VENV/bin/python tests/connector/scripts/inproc_checks.py MODEL_DIR

Drives the scheduler side with stand-in requests / scheduler outputs and the worker side with
real CPU KV cache tensors. Prints one JSON line {"passed": [...], "failed": {name: traceback}}
(tests/connector/test_inproc.py runs it and asserts nothing failed).
"""

from __future__ import annotations

import json
import pickle
import sys
import time
import traceback
from types import SimpleNamespace

import torch

from tests.connector.fakes import FakeKVClient
from yrpd.connector import keys as K

BS = 128
CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


class Env:
    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.ds = FakeKVClient()
        import yrpd.connector.connector as impl
        import yrpd.connector.transport as transport

        self.impl = impl
        # both halves open their data-system connections through transport.kv_connection, with this factory
        transport.kvclient_factory = lambda *a, **k: (lambda: self.ds)

    def config(self, role: str, dtype: str = "bfloat16", **extra):
        from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

        mc = ModelConfig(model=self.model_dir, dtype=dtype, max_model_len=4096)
        ktc = KVTransferConfig(kv_connector="YuanrongConnector", kv_connector_module_path="yrpd.connector",
                               kv_role=role,
                               # the stand-in data system lives in this process: the writer must too
                               kv_connector_extra_config={"ds_address": "127.0.0.1:1", "saver": "thread", **extra})
        return VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BS), kv_transfer_config=ktc)

    def connector(self, role: str, side: str, dtype: str = "bfloat16", **extra):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        r = KVConnectorRole.SCHEDULER if side == "scheduler" else KVConnectorRole.WORKER
        return self.impl.YuanrongConnector(self.config(role, dtype, **extra), r, None)


def request(req_id: str, tokens: list[int], params: dict | None = None):
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, kv_transfer_params=params, lora_request=None,
                           cache_salt=None, mm_features=[], prompt_embeds=None)


def new_req(req_id, tokens, block_ids, computed):
    return SimpleNamespace(req_id=req_id, prompt_token_ids=tokens, block_ids=(list(block_ids),),
                           num_computed_tokens=computed, lora_request=None, mm_features=[], prompt_embeds=None)


def sched_output(new=(), cached=(), num_sched=None, finished=()):
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[c[0] for c in cached], resumed_req_ids=set(),
                                              new_block_ids=[c[1] for c in cached],
                                              num_computed_tokens=[c[2] for c in cached]),
        num_scheduled_tokens=dict(num_sched or {}), finished_req_ids=set(finished))


def tokens(n: int, seed: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(3, 4096) for _ in range(n)]


def blocks_of(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


# ------------------------------------------------------------------------------------------------

@check
def producer_saves_each_prompt_block_once_under_chunked_prefill(env: Env):
    c = env.connector("kv_producer", "scheduler")
    toks = tokens(1000, 1)
    want = K.prefix_digests(toks, BS)
    # chunk budget 320: blocks become complete mid-chunk; block ids arrive incrementally
    steps = [
        sched_output(new=[new_req("r1", toks, [10, 11, 12], 0)], num_sched={"r1": 320}),
        sched_output(cached=[("r1", ([13, 14, 15],), 320)], num_sched={"r1": 320}),
        sched_output(cached=[("r1", ([16, 17],), 640)], num_sched={"r1": 320}),
        sched_output(cached=[("r1", None, 960)], num_sched={"r1": 40}),
        sched_output(cached=[("r1", None, 1000)], num_sched={"r1": 1}),  # decode step
    ]
    saves = []
    for so in steps:
        meta = c.build_connector_meta(so)
        pickle.loads(pickle.dumps(meta))  # crosses process boundaries in vLLM
        saves.append([(op.block_ids, op.digests) for op in meta.saves])
    assert saves[0] == [([10, 11], want[0:2])], saves[0]
    assert saves[1] == [([12, 13, 14], want[2:5])], saves[1]
    assert saves[2] == [([15, 16], want[5:7])], saves[2]
    assert saves[3] == [] and saves[4] == []
    delay, params = c.request_finished(request("r1", toks), [])
    assert delay is False and params["yrpd"]["num_blocks"] == 7
    c.shutdown()


@check
def producer_saves_local_prefix_hits_too(env: Env):
    c = env.connector("kv_producer", "scheduler")
    toks = tokens(600, 2)
    # 2 blocks came from the local prefix cache: they are still saved (the store may have lost them)
    meta = c.build_connector_meta(sched_output(new=[new_req("r2", toks, [5, 6, 7, 8, 9], 256)],
                                               num_sched={"r2": 344}))
    assert [op.block_ids for op in meta.saves] == [[5, 6, 7, 8]]
    c.shutdown()


@check
def consumer_promises_only_leading_present_blocks(env: Env):
    env.ds.store.clear()
    c = env.connector("kv_consumer", "scheduler")
    ns = c.connector_scheduler._rank_ns[0]
    toks = tokens(1153, 3)  # 1153 = 9 * 128 + 1: all 9 full blocks are loadable
    keys = K.block_keys(ns, toks, BS)
    for k in keys[:9]:
        env.ds.store[k] = FakeKVClient.Buf(8)
    assert c.get_num_new_matched_tokens(request("a", toks), 0) == (9 * BS, False)
    # the last full block of a prompt of exactly k blocks is not loadable (last token is computed)
    assert c.get_num_new_matched_tokens(request("b", toks[:1152]), 0) == (8 * BS, False)
    # a hole stops the run
    del env.ds.store[keys[4]]
    assert c.get_num_new_matched_tokens(request("c", toks), 0) == (4 * BS, False)
    # beyond the local hit only
    assert c.get_num_new_matched_tokens(request("d", toks), 2 * BS) == (2 * BS, False)
    # local hit up to block 5: the hole at block 4 does not matter, blocks 5-8 are there
    assert c.get_num_new_matched_tokens(request("e", toks), 5 * BS) == (4 * BS, False)
    assert c.get_num_new_matched_tokens(request("e2", toks), 9 * BS) == (0, False)
    # too short for a full loadable block
    assert c.get_num_new_matched_tokens(request("f", toks[:128]), 0) == (0, False)
    # another model / namespace sees nothing
    other = K.block_keys("0" * 16, toks, BS)
    assert not set(other) & set(env.ds.store)
    c.shutdown()


@check
def consumer_load_plan_matches_allocation(env: Env):
    env.ds.store.clear()
    c = env.connector("kv_consumer", "scheduler")
    toks = tokens(700, 4)
    keys = K.block_keys(c.connector_scheduler._rank_ns[0], toks, BS)
    for k in keys:
        env.ds.store[k] = FakeKVClient.Buf(8)
    req = request("g", toks)
    n, async_ = c.get_num_new_matched_tokens(req, BS)  # 1 block local
    assert (n, async_) == (4 * BS, False)
    c.update_state_after_alloc(req, blocks_of([40, 41, 42, 43, 44, 45]), n)
    meta = c.build_connector_meta(sched_output())
    assert [(op.block_ids, op.digests) for op in meta.loads] == [([41, 42, 43, 44],
                                                                  K.prefix_digests(toks, BS)[1:5])]
    assert c.build_connector_meta(sched_output()).loads == []  # handed over once
    # an allocation the connector never promised is loaded as "failed" -> vLLM recomputes
    c.update_state_after_alloc(request("h", toks), blocks_of([50, 51, 52]), 2 * BS)
    meta = c.build_connector_meta(sched_output())
    assert meta.loads[0].digests == [] and meta.loads[0].block_ids == [50, 51]
    c.shutdown()


@check
def consumer_waits_for_announced_blocks_then_gives_up(env: Env):
    env.ds.store.clear()
    c = env.connector("kv_consumer", "scheduler", ready_wait_ms=300)
    toks = tokens(900, 5)
    keys = K.block_keys(c.connector_scheduler._rank_ns[0], toks, BS)
    for k in keys[:3]:
        env.ds.store[k] = FakeKVClient.Buf(8)
    params = {"yrpd": {"num_blocks": 7, "ns": ",".join(c.connector_scheduler._rank_ns)}}
    req = request("w", toks, params)
    assert c.get_num_new_matched_tokens(req, 0) == (None, False)  # prefill's saves still in flight
    for k in keys[3:7]:
        env.ds.store[k] = FakeKVClient.Buf(8)
    time.sleep(0.02)
    assert c.get_num_new_matched_tokens(req, 0) == (7 * BS, False)
    c.update_state_after_alloc(req, blocks_of(range(8)), 7 * BS)
    assert c.stats.get("handoff_missed_blocks") == 0  # every announced block was loaded
    # blocks that never show up: wait at most ready_wait_ms, then take what is there
    req2 = request("w2", tokens(900, 6), params)
    t0 = time.monotonic()
    res = c.get_num_new_matched_tokens(req2, 0)
    while res[0] is None:
        time.sleep(0.02)
        res = c.get_num_new_matched_tokens(req2, 0)
    assert res == (0, False) and 0.25 < time.monotonic() - t0 < 2.0
    c.update_state_after_alloc(req2, blocks_of(range(8)), 0)
    # the leading 3 of 7 there (the rest evicted): 3 loaded, 4 recomputed; one block was computed here already
    toks4 = tokens(900, 8)
    for k in K.block_keys(c.connector_scheduler._rank_ns[0], toks4, BS)[:3]:
        env.ds.store[k] = FakeKVClient.Buf(8)
    req4 = request("w4", toks4, params)
    res = c.get_num_new_matched_tokens(req4, BS)
    while res[0] is None:
        time.sleep(0.02)
        res = c.get_num_new_matched_tokens(req4, BS)
    assert res == (2 * BS, False)
    c.update_state_after_alloc(req4, blocks_of(range(8)), 2 * BS)
    assert c.stats.get("handoff_missed_blocks") == 7 + 4, "prefill's KV computed again"
    # params from another namespace never make a request wait
    req3 = request("w3", tokens(900, 7), {"yrpd": {"num_blocks": 7, "ns": "ffff"}})
    assert c.get_num_new_matched_tokens(req3, 0) == (0, False)
    c.shutdown()


@check
def producer_hands_over_the_partial_last_block(env: Env):
    c = env.connector("kv_producer", "scheduler")
    toks = tokens(700, 21)  # 5 full blocks and 60 tokens
    want = K.prefix_digests(toks, BS)
    hand = request("t1", toks, {"do_remote_decode": True})
    assert c.get_num_new_matched_tokens(hand, 0) == (0, False)  # a producer loads nothing; it notes the hand-over
    m1 = c.build_connector_meta(sched_output(new=[new_req("t1", toks, [1, 2, 3, 4, 5, 6], 0)], num_sched={"t1": 640}))
    assert [(op.block_ids, op.digests) for op in m1.saves] == [([1, 2, 3, 4, 5], want)]
    m2 = c.build_connector_meta(sched_output(cached=[("t1", None, 640)], num_sched={"t1": 60}))
    assert [(op.block_ids, op.digests) for op in m2.saves] == [([6], [K.tail_digest(toks, BS, want[-1])])]
    assert c.build_connector_meta(sched_output(cached=[("t1", None, 700)], num_sched={"t1": 1})).saves == []
    _, params = c.request_finished(hand, [])
    assert params["yrpd"]["num_blocks"] == 5 and params["yrpd"]["tail"] == 59
    # a request that stays on this instance: its partial block is neither saved nor announced
    plain = request("t2", toks[:650])
    c.get_num_new_matched_tokens(plain, 0)
    m = c.build_connector_meta(sched_output(new=[new_req("t2", toks[:650], range(7, 13), 0)], num_sched={"t2": 650}))
    assert [op.block_ids for op in m.saves] == [[7, 8, 9, 10, 11]]
    assert c.request_finished(plain, [])[1]["yrpd"]["tail"] == 0
    # on a block boundary the hand-over's last block is the last full one: nothing more to save
    edge = request("t3", toks[:640], {"do_remote_decode": True})
    c.get_num_new_matched_tokens(edge, 0)
    m = c.build_connector_meta(sched_output(new=[new_req("t3", toks[:640], range(20, 25), 0)], num_sched={"t3": 640}))
    assert [op.block_ids for op in m.saves] == [[20, 21, 22, 23, 24]]
    assert c.request_finished(edge, [])[1]["yrpd"]["tail"] == BS - 1
    # one token past a boundary: decode computes that token and takes nothing of its block
    past = request("t4", toks[:641], {"do_remote_decode": True})
    c.get_num_new_matched_tokens(past, 0)
    m = c.build_connector_meta(sched_output(new=[new_req("t4", toks[:641], range(30, 36), 0)], num_sched={"t4": 641}))
    assert [op.block_ids for op in m.saves] == [[30, 31, 32, 33, 34]]
    assert c.request_finished(past, [])[1]["yrpd"]["tail"] == 0
    c.shutdown()


@check
def consumer_computes_one_prompt_token_of_a_handed_over_prompt(env: Env):
    env.ds.store.clear()
    c = env.connector("kv_consumer", "scheduler", ready_wait_ms=300)
    sch = c.connector_scheduler
    ns = sch._rank_ns[0]
    toks = tokens(700, 22)
    chain = K.prefix_digests(toks, BS)
    tail = K.tail_digest(toks, BS, chain[-1])
    for d in chain:
        env.ds.store[K.key_for(ns, d)] = FakeKVClient.Buf(8)
    params = {"yrpd": {"num_blocks": 5, "tail": 59, "ns": ",".join(sch._rank_ns)}}
    req = request("u1", toks, params)
    assert c.get_num_new_matched_tokens(req, 0) == (None, False)  # the last block is still being written
    env.ds.store[K.key_for(ns, tail)] = FakeKVClient.Buf(8)
    time.sleep(0.02)
    assert c.get_num_new_matched_tokens(req, 0) == (699, False)
    c.update_state_after_alloc(req, blocks_of(range(20, 26)), 699)
    assert [(op.block_ids, op.digests) for op in c.build_connector_meta(sched_output()).loads] == \
        [(list(range(20, 26)), chain + [tail])]
    # every full block held here already: only the last block is loaded
    req2 = request("u2", toks, params)
    assert c.get_num_new_matched_tokens(req2, 5 * BS) == (59, False)
    c.update_state_after_alloc(req2, blocks_of(range(30, 36)), 59)
    assert [(op.block_ids, op.digests) for op in c.build_connector_meta(sched_output()).loads] == [([35], [tail])]
    # a tail announced for another prompt length is not this request's: not waited for, not loaded
    odd = {"yrpd": {**params["yrpd"], "tail": 12}}
    assert c.get_num_new_matched_tokens(request("u3", toks, odd), 0) == (5 * BS, False)
    # a producer that sends no tail (null) still hands over its full blocks
    untailed = {"yrpd": {**params["yrpd"], "tail": None}}
    assert c.get_num_new_matched_tokens(request("u3b", toks, untailed), 0) == (5 * BS, False)
    # on a block boundary the last full block carries all but its last token
    edge = {"yrpd": {"num_blocks": 5, "tail": BS - 1, "ns": params["yrpd"]["ns"]}}
    req4 = request("u4", toks[:640], edge)
    assert c.get_num_new_matched_tokens(req4, 0) == (639, False)
    c.update_state_after_alloc(req4, blocks_of(range(40, 45)), 639)
    assert [(op.block_ids, op.digests) for op in c.build_connector_meta(sched_output()).loads] == \
        [(list(range(40, 45)), chain)]
    # a last block that never shows up: after ready_wait_ms the full blocks alone, the last one counted as lost
    missed = c.stats.get("handoff_missed_blocks")
    toks5 = tokens(700, 23)
    for d in K.prefix_digests(toks5, BS):
        env.ds.store[K.key_for(ns, d)] = FakeKVClient.Buf(8)
    req5 = request("u5", toks5, params)
    res = c.get_num_new_matched_tokens(req5, 0)
    while res[0] is None:
        time.sleep(0.02)
        res = c.get_num_new_matched_tokens(req5, 0)
    assert res == (5 * BS, False)
    c.update_state_after_alloc(req5, blocks_of(range(50, 56)), 5 * BS)
    assert c.stats.get("handoff_missed_blocks") == missed + 1
    assert [op.block_ids for op in c.build_connector_meta(sched_output()).loads] == [list(range(50, 55))]
    # the last block is there but a block before it is not: prefill writes the last block last, so that one was
    # evicted, not late; decode takes the blocks before the hole at once instead of waiting ready_wait_ms for it
    toks7 = tokens(700, 24)
    chain7 = K.prefix_digests(toks7, BS)
    for d in chain7[:2] + chain7[3:]:
        env.ds.store[K.key_for(ns, d)] = FakeKVClient.Buf(8)
    env.ds.store[K.key_for(ns, K.tail_digest(toks7, BS, chain7[-1]))] = FakeKVClient.Buf(8)
    missed = c.stats.get("handoff_missed_blocks")
    req7 = request("u7", toks7, params)
    assert c.get_num_new_matched_tokens(req7, 0) == (2 * BS, False)
    c.update_state_after_alloc(req7, blocks_of(range(70, 76)), 2 * BS)
    assert c.stats.get("handoff_missed_blocks") == missed + 3 + 1  # blocks 2-4 and the last one: computed here
    c.build_connector_meta(sched_output())
    # vLLM allocating a tail the connector did not promise: reported as failed, recomputed
    c.update_state_after_alloc(request("u6", toks, params), blocks_of(range(60, 66)), 699)
    assert c.build_connector_meta(sched_output()).loads[0].digests == []
    c.shutdown()


@check
def cpu_spin_is_capped_and_an_idle_reader_still_wakes(env: Env):
    import threading

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue, SpinCondition

    c = env.connector("kv_consumer", "scheduler")  # vLLM's CPU platform: the connector caps the spin here
    assert getattr(SpinCondition.wait, "_yrpd_spin_cap_s", None) == 0.002
    writer = MessageQueue(1, 1)
    handle = writer.export_handle()
    got: list = []

    def read():
        reader = MessageQueue.create_from_handle(handle, 0)
        reader.wait_until_ready()
        got.extend(reader.dequeue(timeout=10) for _ in range(2))
        got.append(reader._spin_condition.busy_loop_s)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    writer.wait_until_ready()
    writer.enqueue("first")
    time.sleep(0.3)  # far past the 2 ms cap: the reader sleeps on vLLM's notification socket by now
    t0 = time.monotonic()
    writer.enqueue("second")
    t.join(15)
    assert got == ["first", "second", 0.002], got  # no message lost, and the reader made before the cap is capped
    assert time.monotonic() - t0 < 5, "the idle reader was not woken by the write"
    c.shutdown()


@check
def a_capped_reader_whose_wake_up_is_lost_still_reads_the_message_at_its_next_look(env: Env):
    import threading

    from vllm.distributed.device_communicators.shm_broadcast import SHM_READER_RECHECK_INTERVAL_MS, MessageQueue

    from yrpd.connector.cpu_spin import RECHECK_MS

    c = env.connector("kv_consumer", "scheduler")
    writer = MessageQueue(1, 1)
    handle = writer.export_handle()
    got: list = []
    slept: list = []  # every timeout the reader's poller was given

    def read():
        reader = MessageQueue.create_from_handle(handle, 0)
        reader.wait_until_ready()
        poller = reader._spin_condition.poller
        poll = poller.poll
        poller.poll = lambda timeout=None: (slept.append(timeout), poll(timeout))[1]
        got.extend(reader.dequeue(timeout=30) for _ in range(2))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    writer.wait_until_ready()
    writer.enqueue("first")
    time.sleep(0.3)  # the reader sleeps on the notification socket by now
    writer._spin_condition.notify = lambda: None  # the wake-up of the next message is lost, as a full PUB drops it
    t0 = time.monotonic()
    writer.enqueue("second")
    t.join(15)
    took = time.monotonic() - t0
    assert got == ["first", "second"], got
    # vLLM alone would look again after SHM_READER_RECHECK_INTERVAL_MS (5 s): the capped reader within RECHECK_MS
    assert slept and max(slept) <= RECHECK_MS < SHM_READER_RECHECK_INTERVAL_MS, (max(slept or [0]), RECHECK_MS)
    assert took < SHM_READER_RECHECK_INTERVAL_MS / 1000 / 2, f"the lost wake-up held the message {took:.1f} s"
    c.shutdown()


@check
def prefill_tells_how_many_blocks_it_loaded_from_the_data_system(env: Env):
    env.ds.store.clear()
    c = env.connector("kv_both", "scheduler")
    ns = c.connector_scheduler._rank_ns[0]
    toks = tokens(700, 25)
    for k in K.block_keys(ns, toks, BS)[:3]:  # another prefill instance computed the first 3 blocks
        env.ds.store[k] = FakeKVClient.Buf(8)
    req = request("p1", toks, {"do_remote_decode": True})
    assert c.get_num_new_matched_tokens(req, 0) == (3 * BS, False)
    c.update_state_after_alloc(req, blocks_of(range(6)), 3 * BS)
    c.build_connector_meta(sched_output())
    assert c.request_finished(req, [])[1]["yrpd"]["loaded"] == 3  # what cache-aware routing learns from
    # a prompt it computed alone: 0
    alone = request("p2", tokens(700, 26), {"do_remote_decode": True})
    assert c.get_num_new_matched_tokens(alone, 0) == (0, False)
    c.update_state_after_alloc(alone, blocks_of(range(6)), 0)
    assert c.request_finished(alone, [])[1]["yrpd"]["loaded"] == 0
    c.shutdown()


def vllm_0_10(relpath: str):
    """A module of vLLM 0.10.0's own source (the vllm-ascend v0.10 images run it), loaded from its sdist under
    a private name; its imports resolve to the installed vLLM, which has what these modules need."""
    import importlib.util
    import os
    from pathlib import Path

    src = os.environ.get("YRPD_VLLM_010_SRC")
    assert src, "YRPD_VLLM_010_SRC (vLLM 0.10.0's unpacked sdist) is not set"
    name = "vllm010_" + relpath.replace("/", "_").removesuffix(".py")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(src) / "vllm" / relpath)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
    return sys.modules[name]


@check
def producer_reads_vllm_0_10_scheduler_output(env: Env):
    """vLLM 0.10 (the vllm-ascend v0.10 image) hands the scheduler its own classes: NewRequestData names
    multimodal inputs `mm_hashes` (no `mm_features`), CachedRequestData marks preemption per index
    (`resumed_from_preemption`). Built from 0.10.0's real classes: they are read, image hashes change the keys,
    a chunked prompt is saved once per block across steps, and a resumed request restarts from its new blocks."""
    out = vllm_0_10("v1/core/sched/output.py")
    c = env.connector("kv_producer", "scheduler")
    toks = tokens(300, 11)

    def req_010(req_id, mm_hashes, block_ids=(1, 2, 3)):
        return out.NewRequestData(req_id=req_id, prompt_token_ids=toks, mm_inputs=[], mm_hashes=mm_hashes,
                                  mm_positions=[], sampling_params=None, pooling_params=None,
                                  block_ids=(list(block_ids),), num_computed_tokens=0, lora_request=None)

    def step(new=(), cached=None, num_sched=None):
        num_sched = dict(num_sched or {})
        return out.SchedulerOutput(
            scheduled_new_reqs=list(new), scheduled_cached_reqs=cached or out.CachedRequestData.make_empty(),
            num_scheduled_tokens=num_sched, total_num_scheduled_tokens=sum(num_sched.values()),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, num_common_prefix_blocks=[0],
            finished_req_ids=set(), free_encoder_input_ids=[], structured_output_request_ids={},
            grammar_bitmask=None)

    plain = c.build_connector_meta(step(new=[req_010("p", [])], num_sched={"p": 300}))
    image = c.build_connector_meta(step(new=[req_010("i", ["img-abc"])], num_sched={"i": 300}))
    assert len(plain.saves[0].digests) == 2 and plain.saves[0].digests != image.saves[0].digests
    assert plain.saves[0].digests == K.prefix_digests(toks, BS, 2)
    # chunked: 200 tokens, then the other 100 as a cached request; then preempted and resumed on new blocks
    first = c.build_connector_meta(step(new=[req_010("c", [], (4, 5, 6))], num_sched={"c": 200}))
    assert [op.block_ids for op in first.saves] == [[4]]
    cont = out.CachedRequestData(req_ids=["c"], resumed_from_preemption=[False], new_token_ids=[[]],
                                 new_block_ids=[([],)], num_computed_tokens=[200])
    second = c.build_connector_meta(step(cached=cont, num_sched={"c": 100}))
    assert [op.block_ids for op in second.saves] == [[5]]
    assert first.saves[0].digests + second.saves[0].digests == plain.saves[0].digests
    resumed = out.CachedRequestData(req_ids=["c"], resumed_from_preemption=[True], new_token_ids=[[]],
                                    new_block_ids=[([7, 8, 9],)], num_computed_tokens=[300])
    assert c.build_connector_meta(step(cached=resumed, num_sched={"c": 1})).saves == []  # all saved already
    c.shutdown()


@check
def consumer_loads_nothing_where_vllm_cannot_recompute(env: Env):
    """vLLM < 0.11 (the vllm-ascend v0.10 image) has no way to be told a loaded block failed: the consumer role
    must then never promise external tokens (a failed load would be used as KV). The rule is evaluated on
    vLLM 0.10.0's real connector base class."""
    base_010 = vllm_0_10("distributed/kv_transfer/kv_connector/v1/base.py").KVConnectorBase_V1
    assert env.impl.can_recompute(env.impl.KVConnectorBase_V1) and not env.impl.can_recompute(base_010)
    env.ds.store.clear()
    toks = tokens(900, 12)
    probe = env.connector("kv_consumer", "scheduler")
    for key in K.block_keys(probe.connector_scheduler._rank_ns[0], toks, BS):
        env.ds.store[key] = FakeKVClient.Buf(8)
    assert probe.get_num_new_matched_tokens(request("r", toks), 0) == (7 * BS, False)
    probe.shutdown()
    env.impl._CAN_RECOMPUTE = env.impl.can_recompute(base_010)
    try:
        old = env.connector("kv_consumer", "scheduler")
        assert old.get_num_new_matched_tokens(request("r2", toks), 0) == (0, False)
        old.shutdown()
    finally:
        env.impl._CAN_RECOMPUTE = True


@check
def consumer_refuses_kv_of_another_dtype_with_one_line(env: Env):
    import logging

    env.ds.store.clear()
    toks = tokens(900, 9)
    producer = env.connector("kv_producer", "scheduler", dtype="float32")
    for key in K.block_keys(producer.connector_scheduler._rank_ns[0], toks, BS):
        env.ds.store[key] = FakeKVClient.Buf(8)
    producer.build_connector_meta(sched_output(new=[new_req("m", toks, range(8), 0)], num_sched={"m": 900}))
    _, params = producer.request_finished(request("m", toks), list(range(8)))
    assert params["yrpd"]["kv_dtype"] == "float32" and params["yrpd"]["num_blocks"] == 7
    consumer = env.connector("kv_consumer", "scheduler", dtype="bfloat16", ready_wait_ms=5000)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("yrpd.connector").addHandler(handler)
    try:
        t0 = time.monotonic()
        # refused at once (no waiting for blocks that can never appear), the prompt is recomputed
        assert consumer.get_num_new_matched_tokens(request("m", toks, params), 0) == (0, False)
        assert consumer.get_num_new_matched_tokens(request("m2", toks, params), 0) == (0, False)
        assert time.monotonic() - t0 < 1.0
    finally:
        logging.getLogger("yrpd.connector").removeHandler(handler)
    refused = [line for line in lines if "refusing" in line]
    assert len(refused) == 1 and "dtype float32 there, bfloat16 here" in refused[0] and "--dtype" in refused[0], lines
    assert consumer.stats.get("handoff_refused") == 2
    # the same dtype on both sides is accepted
    same = env.connector("kv_consumer", "scheduler", dtype="float32")
    assert same.get_num_new_matched_tokens(request("m3", toks, params), 0) == (7 * BS, False)
    for c in (producer, consumer, same):
        c.shutdown()


@check
def consumer_survives_a_dead_data_system(env: Env):
    env.ds.store.clear()
    c = env.connector("kv_consumer", "scheduler", retry_backoff_s=0.2)
    toks = tokens(900, 8)
    for k in K.block_keys(c.connector_scheduler._rank_ns[0], toks, BS):
        env.ds.store[k] = FakeKVClient.Buf(8)
    env.ds.down = True
    try:
        assert c.get_num_new_matched_tokens(request("x", toks), 0) == (0, False)
        t0 = time.monotonic()
        assert c.get_num_new_matched_tokens(request("y", toks), 0) == (0, False)
        assert time.monotonic() - t0 < 0.05  # marked down: no more calls
    finally:
        env.ds.down = False
    deadline = time.monotonic() + 5
    while not c.connector_scheduler._conn.healthy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.get_num_new_matched_tokens(request("z", toks), 0) == (7 * BS, False)
    assert c.stats.get("ds_reconnects") == 1
    c.shutdown()


@check
def failure_policy_forced_to_recompute(env: Env):
    c = env.connector("kv_consumer", "scheduler")
    assert c._vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
    c.shutdown()


def cpu_caches(num_blocks=16, fill=True):
    g = torch.Generator().manual_seed(7)
    caches = {}
    for i in range(2):
        t = torch.randn(num_blocks, 2, BS, 64, generator=g).to(torch.bfloat16) if fill else \
            torch.zeros(num_blocks, 2, BS, 64, dtype=torch.bfloat16)
        caches[f"model.layers.{i}.self_attn.attn"] = t
    return caches


def bind(conn, loads=(), saves=()):
    from yrpd.connector.common import YuanrongConnectorMetadata

    conn.bind_connector_metadata(YuanrongConnectorMetadata(loads=list(loads), saves=list(saves)))


@check
def worker_save_then_load_is_bit_exact(env: Env):
    from yrpd.connector.common import BlockOp

    env.ds.store.clear()
    prod = env.connector("kv_producer", "worker", ttl_seconds=42)
    src = cpu_caches()
    prod.register_kv_caches(src)
    toks = tokens(700, 9)
    dig = K.prefix_digests(toks, BS)
    bind(prod, saves=[BlockOp("s1", dig[:5], [3, 9, 1, 15, 0])])
    prod.wait_for_save()
    prod.clear_connector_metadata()
    # the source blocks may be reused right after wait_for_save: the save works on a snapshot
    for t in src.values():
        t[[3, 9, 1, 15, 0]] = 0
    assert prod.connector_worker._saver.flush(10)
    keys = [K.key_for(prod.connector_worker._ns_digest, d) for d in dig[:5]]
    assert all(k in env.ds.store for k in keys) and all(env.ds.ttl[k] == 42 for k in keys)
    assert prod.stats.get("saved_blocks") == 5

    ref = cpu_caches()  # same seed: the values before zeroing
    cons = env.connector("kv_consumer", "worker", delete_after_load=True)
    dst = cpu_caches(fill=False)
    cons.register_kv_caches(dst)
    bind(cons, loads=[BlockOp("l1", dig[:5], [4, 5, 6, 7, 8])])
    cons.start_load_kv(None)
    cons.wait_for_save()
    cons.clear_connector_metadata()
    assert cons.get_block_ids_with_load_errors() == set()
    for name in dst:
        for s, d in zip([3, 9, 1, 15, 0], [4, 5, 6, 7, 8]):
            assert torch.equal(ref[name][s].view(torch.int16), dst[name][d].view(torch.int16)), (name, s, d)
    assert cons.connector_worker._saver.flush(10)
    assert not any(k in env.ds.store for k in keys)  # delete_after_load
    prod.shutdown()
    cons.shutdown()


@check
def worker_reports_unloadable_blocks_and_never_publishes_from_them(env: Env):
    from yrpd.connector.common import BlockOp

    env.ds.store.clear()
    w = env.connector("kv_both", "worker")
    caches = cpu_caches(fill=False)
    w.register_kv_caches(caches)
    toks = tokens(700, 10)
    dig = K.prefix_digests(toks, BS)
    good = K.key_for(w.connector_worker._ns_digest, dig[0])
    buf = FakeKVClient.Buf(w.connector_worker._layout.block_nbytes)
    env.ds.store[good] = buf
    env.ds.store[K.key_for(w.connector_worker._ns_digest, dig[2])] = FakeKVClient.Buf(10)  # wrong size
    bind(w, loads=[BlockOp("q", dig[:3], [2, 3, 4]), BlockOp("u", [], [6, 7])],
         saves=[BlockOp("q", dig[3:5], [5, 6])])
    w.start_load_kv(None)
    w.wait_for_save()
    w.clear_connector_metadata()
    assert w.get_block_ids_with_load_errors() == {3, 4, 6, 7}
    assert w.get_block_ids_with_load_errors() == set()  # reported once
    assert w.connector_worker._saver.flush(10)
    assert K.key_for(w.connector_worker._ns_digest, dig[3]) not in env.ds.store  # request q had a failed load
    assert w.stats.get("save_dropped_blocks") == 2
    w.get_finished({"q"})
    assert "q" not in w.connector_worker._bad_reqs
    # data system down: loads fail fast and are reported, the engine carries on
    env.ds.down = True
    try:
        w.connector_worker._conn._mark_down(RuntimeError("rpc unavailable"))
        bind(w, loads=[BlockOp("v", dig[:1], [9])])
        w.start_load_kv(None)
        w.clear_connector_metadata()
        assert w.get_block_ids_with_load_errors() == {9}
    finally:
        env.ds.down = False
    w.shutdown()


@check
def vllm_stats_are_deltas_and_aggregate(env: Env):
    from yrpd.connector.connector import YuanrongConnector

    c = env.connector("kv_consumer", "scheduler")
    assert c.get_kv_connector_stats() is None
    c.stats.inc("lookup_hit_blocks", 3)
    s1 = c.get_kv_connector_stats()
    assert s1.data == {"lookup_hit_blocks": 3} and c.get_kv_connector_stats() is None
    c.stats.inc("lookup_hit_blocks", 2)
    merged = s1.aggregate(c.get_kv_connector_stats())
    assert merged.reduce() == {"lookup_hit_blocks": 5}
    rebuilt = YuanrongConnector.build_kv_connector_stats(merged.data)
    assert rebuilt.data == {"lookup_hit_blocks": 5} and not rebuilt.is_empty()
    c.shutdown()


@check
def both_constructor_signatures(env: Env):
    import yrpd.connector.connector as impl
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

    cfg = env.config("kv_producer")
    c = impl.YuanrongConnector(cfg, KVConnectorRole.SCHEDULER)  # 2 positional args
    c.shutdown()
    c = impl.YuanrongConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config=None)
    c.shutdown()
    # an old (vLLM 0.10) base class: __init__(self, vllm_config, role)
    orig_init, orig_flag = KVConnectorBase_V1.__init__, impl._NEW_CTOR

    def old_init(self, vllm_config, role):
        self._connector_metadata = None
        self._vllm_config = vllm_config
        self._role = role

    KVConnectorBase_V1.__init__ = old_init
    impl._NEW_CTOR = False
    try:
        c = impl.YuanrongConnector(cfg, KVConnectorRole.SCHEDULER)
        assert c.role == KVConnectorRole.SCHEDULER and c.connector_scheduler.block_size == BS
        c.shutdown()
    finally:
        KVConnectorBase_V1.__init__ = orig_init
        impl._NEW_CTOR = orig_flag


@check
def a_worker_under_tp_that_cannot_read_its_rank_refuses_to_start(env: Env):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    # control: one rank needs no rank from vLLM (its parallel state is not initialised in this process either)
    env.impl.YuanrongConnector(env.config("kv_producer"), KVConnectorRole.WORKER, None).shutdown()
    cfg = env.config("kv_producer")
    cfg.parallel_config.tensor_parallel_size = 2
    try:
        env.impl.YuanrongConnector(cfg, KVConnectorRole.WORKER, None)
    except RuntimeError as e:
        assert "cannot read this worker's tensor/pipeline parallel rank" in str(e) and "tp 2" in str(e), e
    else:
        raise AssertionError("a TP 2 worker without its rank started (every rank would write rank 0's keys)")


def main() -> int:
    env = Env(sys.argv[1])
    passed, failed = [], {}
    only = set(sys.argv[2:])
    for fn in CHECKS:
        if only and fn.__name__ not in only:
            continue
        try:
            fn(env)
            passed.append(fn.__name__)
        except Exception:  # noqa: BLE001
            failed[fn.__name__] = traceback.format_exc()
    print(json.dumps({"passed": passed, "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
