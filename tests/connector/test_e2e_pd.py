"""End to end: prefill (kv_producer) + decode (kv_consumer) with YuanrongConnector over a real
data-system worker, real vLLM CPU processes, tiny model; outputs compared with a single instance.

Order matters inside this module (one stack for all tests, started once): the data-system-stop
test runs last.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest

from tests.connector.conftest import MAX_TOKENS
from tests.connector.harness import BLOCK_SIZE, DTYPE_BYTES, Stack, ds_tool, make_prompts, metric_sum, pd_generate
from yrpd.connector import keys as K

pytestmark = pytest.mark.e2e

# >= 20 prompts of 20-1500 tokens, including every interesting length around block boundaries
SEQ_LENGTHS = [20, 100, 127, 128, 129, 200, 255, 256, 257, 300, 383, 384, 385, 500, 640, 641, 700, 900,
               1024, 1025, 1153, 1300, 1499, 1500]
CONC_LENGTHS = [33, 129, 250, 257, 400, 513, 777, 897, 1000, 1153, 1281, 1450]


@pytest.fixture(scope="module")
def pd(vllm_venv, tiny_model, session_stack, reference_server, e2e_root):
    stack = Stack(e2e_root / "pd", venv=vllm_venv, ports=session_stack.ports)
    try:
        ds = stack.start_ds()
        common = {"ds_address": ds.address, "retry_backoff_s": 1.0, "request_timeout_ms": 2000,
                  "connect_timeout_ms": 1000}
        prefill = stack.start_vllm("prefill", tiny_model, core=1, kv_role="kv_producer",
                                   extra_config={**common, "ttl_seconds": 300})
        decode = stack.start_vllm("decode", tiny_model, core=0, kv_role="kv_consumer",
                                  extra_config={**common, "delete_after_load": True}, dev_mode=True)
        stack.wait_healthy([reference_server, prefill, decode])
        yield stack, ds, prefill, decode
    finally:
        stack.close()


def _ns(server) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        st = server.connector_stats("worker")
        if st and st.get("namespace"):
            return st["namespace"]
        time.sleep(0.5)
    raise AssertionError(f"{server.name}: no connector stats file")


def _counter(server, side: str, name: str) -> int:
    st = server.connector_stats(side) or {}
    return int(st.get("counters", {}).get(name, 0))


def _wait_counter(server, side: str, name: str, at_least: int, timeout: float = 15.0) -> int:
    deadline = time.monotonic() + timeout
    value = _counter(server, side, name)
    while value < at_least and time.monotonic() < deadline:
        time.sleep(0.3)
        value = _counter(server, side, name)
    return value


def _handed_over_blocks(n: int) -> int:
    """Blocks decode loads of an n-token prompt prefill handed over: the loadable full ones and the one holding
    the rest of the prompt but its last token."""
    return K.loadable_blocks(n, BLOCK_SIZE) + bool(K.handover_tail(n, BLOCK_SIZE))


def test_sequential_prompts_match_single_instance(pd, reference):
    stack, ds, prefill, decode = pd
    prompts = make_prompts(SEQ_LENGTHS, seed=11)
    expected = [reference.tokens(p) for p in prompts]
    before = decode.metrics()
    loaded_before = _counter(decode, "worker", "loaded_blocks")
    mismatches = []
    for p, exp in zip(prompts, expected):
        got, params = pd_generate(prefill, decode, p, MAX_TOKENS)
        assert params["yrpd"]["num_blocks"] == len(p) // BLOCK_SIZE
        assert params["yrpd"]["tail"] == K.handover_tail(len(p), BLOCK_SIZE)
        if got != exp:
            mismatches.append((len(p), exp, got))
    assert not mismatches, f"PD output differs from the single instance: {mismatches}"

    # decode took the prompt KV from the external cache, all but each prompt's last token, and computed that one
    want_tokens = sum(len(p) - 1 for p in prompts)
    after = decode.metrics()
    hits = metric_sum(after, "vllm:external_prefix_cache_hits_total") - \
        metric_sum(before, "vllm:external_prefix_cache_hits_total")
    assert hits == want_tokens, f"external cache hits {hits}, expected {want_tokens}"
    by_source = metric_sum(after, "vllm:prompt_tokens_cached_by_source_total", source="host") - \
        metric_sum(before, "vllm:prompt_tokens_cached_by_source_total", source="host")
    assert by_source == want_tokens
    want_blocks = sum(_handed_over_blocks(len(p)) for p in prompts)
    loaded = _wait_counter(decode, "worker", "loaded_blocks", loaded_before + want_blocks)
    assert loaded - loaded_before == want_blocks
    assert _counter(decode, "worker", "load_failed_blocks") == 0
    # our own counters also reach vLLM's /metrics
    assert metric_sum(after, "vllm:yrpd_kv_loaded_blocks_total") >= want_blocks


def test_concurrent_prompts_match_single_instance(pd, reference):
    stack, ds, prefill, decode = pd
    prompts = make_prompts(CONC_LENGTHS, seed=12)
    expected = [reference.tokens(p) for p in prompts]
    loaded_before = _counter(decode, "worker", "loaded_blocks")
    with cf.ThreadPoolExecutor(max_workers=12) as pool:
        futures = [pool.submit(pd_generate, prefill, decode, p, MAX_TOKENS) for p in prompts]
        results = [f.result(timeout=600) for f in futures]
    mismatches = [(len(p), exp, got) for p, exp, (got, _) in zip(prompts, expected, results) if got != exp]
    assert not mismatches, f"concurrent PD output differs: {mismatches}"
    want_blocks = sum(_handed_over_blocks(len(p)) for p in prompts)
    loaded = _wait_counter(decode, "worker", "loaded_blocks", loaded_before + want_blocks)
    assert loaded - loaded_before == want_blocks
    assert prefill.healthy() and decode.healthy()


def test_delete_after_load_and_expiry_set(pd, reference):
    stack, ds, prefill, decode = pd
    prompt = make_prompts([900], seed=13)[0]
    ns = _ns(prefill)
    keys = K.block_keys(ns, prompt, BLOCK_SIZE)
    said = prefill.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]["yrpd"]
    deadline = time.monotonic() + 10
    while not all(ds_tool(stack.venv, ds, "exist", keys)["exist"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(ds_tool(stack.venv, ds, "exist", keys)["exist"]), "prefill did not publish its blocks"
    sizes = ds_tool(stack.venv, ds, "sizes", keys)["sizes"]
    # 2 layers x (2 kv heads, 128 tokens, 2 x 32) in the instances' dtype
    assert set(sizes.values()) == {2 * 2 * BLOCK_SIZE * 64 * DTYPE_BYTES}
    # what prefill tells the proxy a block takes (from vLLM's KV cache config) is what the data system holds
    assert said["block_bytes"] == 2 * 2 * BLOCK_SIZE * 64 * DTYPE_BYTES, said
    got = decode.complete(prompt, MAX_TOKENS, kv_transfer_params={"yrpd": {"num_blocks": len(keys)}})
    assert got["choices"][0]["token_ids"] == reference.tokens(prompt)
    deadline = time.monotonic() + 10
    while any(ds_tool(stack.venv, ds, "exist", keys)["exist"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    # decode loaded the 7 loadable blocks and deleted them; the 8th... 900 = 7*128 + 4: all 7 loadable
    assert not any(ds_tool(stack.venv, ds, "exist", keys[:K.loadable_blocks(len(prompt), BLOCK_SIZE)])["exist"])


def test_poisoned_entries_change_output_deleted_entries_recompute(pd, reference):
    stack, ds, prefill, decode = pd
    prompt = make_prompts([1100], seed=14)[0]
    expected = reference.tokens(prompt)
    ns = _ns(prefill)
    keys = K.block_keys(ns, prompt, BLOCK_SIZE)
    first = prefill.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    deadline = time.monotonic() + 10
    while not all(ds_tool(stack.venv, ds, "exist", keys)["exist"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    corrupted = ds_tool(stack.venv, ds, "corrupt", keys)["corrupted"]
    assert corrupted == keys

    loaded_before = _counter(decode, "worker", "loaded_blocks")
    poisoned = decode.complete(prompt, MAX_TOKENS, kv_transfer_params=params)["choices"][0]["token_ids"]
    assert _wait_counter(decode, "worker", "loaded_blocks", loaded_before + 1) > loaded_before
    assert poisoned != expected, "corrupted KV did not change the output: is the KV really used?"

    # forget what decode cached locally from the poisoned load, delete the entries -> recompute
    decode.reset_prefix_cache()
    ds_tool(stack.venv, ds, "delete", keys)
    assert not any(ds_tool(stack.venv, ds, "exist", keys)["exist"])
    again = decode.complete(prompt, MAX_TOKENS, kv_transfer_params=params)["choices"][0]["token_ids"]
    assert again == expected
    assert decode.healthy() and prefill.healthy()
    # and the normal path still works afterwards
    other = make_prompts([600], seed=15)[0]
    assert pd_generate(prefill, decode, other, MAX_TOKENS)[0] == reference.tokens(other)


def test_data_system_worker_stopped_mid_run(pd, reference):
    stack, ds, prefill, decode = pd
    prompts = make_prompts([300, 700, 1000, 1300, 450, 900, 1200, 800], seed=16)
    expected = [reference.tokens(p) for p in prompts]
    results: list = [None] * len(prompts)

    def run(i):
        results[i] = pd_generate(prefill, decode, prompts[i], MAX_TOKENS)[0]

    with cf.ThreadPoolExecutor(max_workers=4) as pool:
        futures = [pool.submit(run, i) for i in range(len(prompts))]
        # stop the worker while requests are in flight
        deadline = time.monotonic() + 60
        while sum(r is not None for r in results) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        stack.stop_ds(ds)
        for f in futures:
            f.result(timeout=600)
    mismatches = [(len(p), e, g) for p, e, g in zip(prompts, expected, results) if g != e]
    assert not mismatches, f"output wrong after the data system went away: {mismatches}"
    assert prefill.healthy() and decode.healthy()

    # with the data system gone, more requests still complete correctly (pure recompute)
    more = make_prompts([500, 1000], seed=17)
    errors_before = _counter(decode, "scheduler", "lookup_errors")
    for p in more:
        assert pd_generate(prefill, decode, p, MAX_TOKENS)[0] == reference.tokens(p)
    # the lost reuse shows: each of those decode lookups failed and was recomputed (stats are written every few s)
    assert _wait_counter(decode, "scheduler", "lookup_errors", errors_before + len(more)) >= errors_before + len(more)

    # bring the worker back on the same address: the connector reconnects and hits resume
    stack.start_ds(reuse=ds)
    hits_before = _counter(decode, "scheduler", "lookup_hit_blocks")
    p = make_prompts([1000], seed=18)[0]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = pd_generate(prefill, decode, p, MAX_TOKENS)[0]
        assert got == reference.tokens(p)
        time.sleep(1.0)
        if _counter(decode, "scheduler", "lookup_hit_blocks") > hits_before:
            break
        decode.reset_prefix_cache()
        p = make_prompts([1000], seed=int(time.monotonic()))[0]
    assert _counter(decode, "scheduler", "lookup_hit_blocks") > hits_before, "no hits after the worker came back"
    assert _counter(decode, "scheduler", "ds_reconnects") >= 1 or _counter(decode, "worker", "ds_reconnects") >= 1
