"""End to end: kv_both prefix reuse across instances, and expiry of stored blocks."""

from __future__ import annotations

import time

import pytest

from tests.connector.conftest import MAX_TOKENS
from tests.connector.harness import BLOCK_SIZE, Stack, ds_tool, make_prompts, metric_sum
from yrpd.connector import keys as K

pytestmark = pytest.mark.e2e

TTL = 10


@pytest.fixture(scope="module")
def both(vllm_venv, tiny_model, session_stack, reference_server, e2e_root):
    stack = Stack(e2e_root / "both", venv=vllm_venv, ports=session_stack.ports)
    try:
        ds = stack.start_ds()
        extra = {"ds_address": ds.address, "ttl_seconds": TTL, "retry_backoff_s": 1.0}
        a = stack.start_vllm("both-a", tiny_model, core=1, kv_role="kv_both", extra_config=extra)
        b = stack.start_vllm("both-b", tiny_model, core=0, kv_role="kv_both", extra_config=extra)
        stack.wait_healthy([reference_server, a, b])
        yield stack, ds, a, b
    finally:
        stack.close()


def _namespace(server) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        st = server.connector_stats("worker")
        if st and st.get("namespace"):
            return st["namespace"]
        time.sleep(0.5)
    raise AssertionError("no stats file")


def _wait_exist(stack, ds, keys, want: bool, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ex = ds_tool(stack.venv, ds, "exist", keys)["exist"]
        if all(e == want for e in ex):
            return True
        time.sleep(0.5)
    return False


def test_prefix_reuse_across_instances(both, reference):
    stack, ds, a, b = both
    first = make_prompts([1000], seed=21)[0]
    tail = make_prompts([300], seed=22)[0]
    second = first[:900] + tail  # shares 900 tokens = 7 full blocks
    ns = _namespace(a)
    assert ns == _namespace(b)  # same model, layout, rank: one namespace

    assert a.generate(first, MAX_TOKENS) == reference.tokens(first)
    keys_first = K.block_keys(ns, first, BLOCK_SIZE)
    assert len(keys_first) == 7
    assert _wait_exist(stack, ds, keys_first, True, 10), "instance A did not save its prompt blocks"

    before = b.metrics()
    assert b.generate(second, MAX_TOKENS) == reference.tokens(second)
    after = b.metrics()
    hits = metric_sum(after, "vllm:external_prefix_cache_hits_total") - \
        metric_sum(before, "vllm:external_prefix_cache_hits_total")
    assert hits == 7 * BLOCK_SIZE, f"B loaded {hits} tokens from the shared prefix, expected {7 * BLOCK_SIZE}"
    # B saved the blocks it computed itself (7 and 8), and only those
    keys_second = K.block_keys(ns, second, BLOCK_SIZE)
    assert keys_second[:7] == keys_first
    assert _wait_exist(stack, ds, keys_second[7:], True, 10)

    # and the other way round: A reuses what B computed
    third = second[:1100] + make_prompts([50], seed=23)[0]
    before = a.metrics()
    assert a.generate(third, MAX_TOKENS) == reference.tokens(third)
    after = a.metrics()
    local = metric_sum(after, "vllm:prefix_cache_hits_total") - metric_sum(before, "vllm:prefix_cache_hits_total")
    ext = metric_sum(after, "vllm:external_prefix_cache_hits_total") - \
        metric_sum(before, "vllm:external_prefix_cache_hits_total")
    assert local == 7 * BLOCK_SIZE  # A still holds the first 7 blocks itself
    assert ext == 1 * BLOCK_SIZE  # block 7 (tokens 896-1023) comes from B through the data system


def test_stored_blocks_expire(both, reference):
    stack, ds, a, b = both
    prompt = make_prompts([700], seed=24)[0]
    ns = _namespace(a)
    keys = K.block_keys(ns, prompt, BLOCK_SIZE)
    a.generate(prompt, 2)
    assert _wait_exist(stack, ds, keys, True, 10)
    t0 = time.monotonic()
    assert _wait_exist(stack, ds, keys, False, TTL + 20), "blocks did not expire"
    assert time.monotonic() - t0 > TTL / 2
