"""The PD proxy (yrpd.proxy) against fake vLLM instances on 127.0.0.1."""

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.unit.proxy_fakes import KV, running, until  # noqa: E402
from yrpd.proxy.pool import Instance, Pool  # noqa: E402
from yrpd.proxy.routing import CHUNK_CHARS, Prompt, Routing, chain, prompt_text  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 15))


async def post(setup, path, body, **kw):
    async with setup.client.post(setup.url + path, json=body, **kw) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.read()


def error_of(status, data, code):
    """The OpenAI-style error body a client must get, never an empty 200."""
    assert status == code, data
    err = json.loads(data)["error"]
    assert err["code"] == code and err["message"] and err["type"]
    return err


def sse_events(data: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in data.decode().split("\n\n") if e]


# -- the two legs


def test_completion_prefills_with_one_token_then_decodes_with_the_kv_params_prefill_returned():
    async def go():
        async with running() as s:
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 20, "temperature": 0}
            status, ctype, data = await post(s, "/v1/completions", body)
            assert status == 200 and ctype.startswith("application/json")
            assert json.loads(data)["choices"][0]["text"] == "d0 says hi"
            [prefill_body] = s.prefill[0].bodies
            assert prefill_body == {**body, "max_tokens": 1, "stream": False,
                                    "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
            assert s.decode[0].bodies == [{**body, "kv_transfer_params": KV}]
    run(go())


def test_streamed_chat_reaches_the_client_byte_for_byte():
    async def go():
        async with running() as s:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                    "stream_options": {"include_usage": True}, "max_completion_tokens": 8, "min_tokens": 2}
            status, ctype, data = await post(s, "/v1/chat/completions", body)
            assert status == 200 and ctype.startswith("text/event-stream")
            assert data == b"".join(s.decode[0].events(chat=True))
            [p] = s.prefill[0].bodies
            assert (p["stream"], p["max_tokens"], p["max_completion_tokens"]) == (False, 1, 1)
            assert "stream_options" not in p and "min_tokens" not in p  # vLLM would answer 400 to both
            # the stream's leg is asked for its token ids (what a migration goes on from); the client, who did not
            # ask, gets none
            assert s.decode[0].bodies == [{**body, "return_token_ids": True, "kv_transfer_params": KV}]
    run(go())


def test_without_kv_params_from_prefill_decode_gets_the_plain_request():
    async def go():
        async with running() as s:
            s.prefill[0].kv = None
            body = {"prompt": "hello", "max_tokens": 5, "kv_transfer_params": {"client": "supplied"}}
            status, _, _ = await post(s, "/v1/completions", body)
            assert status == 200
            assert s.decode[0].bodies == [{"prompt": "hello", "max_tokens": 5}]
    run(go())


# -- choice of instance, failures, retries


def test_pool_prefers_fewest_in_flight_and_rotates_ties_and_skips_down():
    pool = Pool(["http://a", "http://b/"], ["http://c", "http://d", "http://e"])
    assert pool.select("decode") is None  # nothing probed yet
    for i in pool.instances:
        i.up = True
    picks = [pool.select("decode").url for _ in range(6)]
    assert sorted(picks[:3]) == ["http://c", "http://d", "http://e"] and picks[3:] == picks[:3]
    c, d, e = pool.of("decode")
    c.in_flight, d.in_flight, e.in_flight = 2, 1, 1
    assert {pool.select("decode").url for _ in range(4)} == {"http://d", "http://e"}
    d.up = False
    assert pool.select("decode") is e and pool.select("decode", exclude=[e]) is c
    assert pool.of("prefill")[1].url == "http://b"


def prompt(text):
    return Prompt.of({"prompt": text})


def test_prefix_routing_sends_a_prefill_leg_where_it_costs_least():
    pool = Pool(["http://a", "http://b"], [], Routing.prefix, bound=3)
    a, b = pool.of("prefill")
    a.up = b.up = True
    system = "You are a terse assistant. Answer in one line, cite nothing, never apologise. " * 8  # 10 chunks
    first = pool.acquire("prefill", prompt=prompt(system + "What is 2+2?"))
    home, other = first.instance, (b if first.instance is a else a)
    assert home.queued == pytest.approx(prompt(system + "What is 2+2?").chunks)
    # while the prefix is being computed there, a request sharing it waits behind it rather than computing it again
    assert pool.select("prefill", prompt=prompt(system + "Why?")) is home
    pool.release(first)
    pool.release(first)  # a second release of one lease changes nothing
    assert home.queued == 0 and home.in_flight == 0
    # the same leading text goes back where it went, though that instance is busier: only the question is new there
    busy = pool.acquire("prefill", prompt=prompt(system + "Name a prime."))
    assert busy.instance is home and busy.work < 1 and home.prefix_routed == 1
    assert pool.select("prefill", prompt=prompt(system + "Capital of Peru?")) is home
    assert home.prefix_routed == 1  # select only looks: nothing counted, nothing remembered
    # a prompt matching nothing goes where the least work is queued
    novel = pool.acquire("prefill", prompt=prompt("Translate to French: " * 40))
    assert novel.instance is other and other.prefix_routed == 0
    # the home instance busy with more than the prefix saves: computing the prefix again elsewhere is sooner
    pool.release(novel)
    home.queued += 50
    spilled = pool.acquire("prefill", prompt=prompt(system + "Say hi."))
    assert spilled.instance is other and other.memory.matched(chain(system)) == len(chain(system))
    # never `bound` more in flight than the least busy instance, whatever the prefix saves
    pool.release(spilled)
    home.queued, other.queued, home.in_flight = 0, 100, 3
    assert pool.select("prefill", prompt=prompt(system + "Q?")) is other
    home.in_flight = 2
    assert pool.select("prefill", prompt=prompt(system + "Q?")) is home
    # between idle instances a prompt nobody has seen goes to the one given less work lately: each keeps as many
    home.in_flight = other.queued = 0
    assert other.recent > home.recent > 0  # `other` computed two whole prompts, `home` one and a question
    assert pool.select("prefill", prompt=prompt("Unseen: " * 30)) is home
    home.recent = other.recent + 1
    assert pool.select("prefill", prompt=prompt("Also unseen: " * 30)) is other
    # an instance taken out forgets what it was sent (a restart empties its cache)
    pool.failed(home, "gone", down=True)
    assert home.memory.matched(chain(system)) == 0
    # with load routing the prompt is ignored
    plain = Pool(["http://a", "http://b"], [])
    for i in plain.instances:
        i.up = True
    picks = {plain.select("prefill", prompt=prompt(system)).url for _ in range(4)}
    assert picks == {"http://a", "http://b"}


def test_a_prefix_another_instance_finished_is_loaded_rather_than_waited_for_while_the_data_system_holds_it():
    pool = Pool(["http://a", "http://b"], [], Routing.prefix, bound=3)
    a, b = pool.of("prefill")
    a.up = b.up = True
    shared = "Context: " + "the quick brown fox jumps over the lazy dog. " * 30  # 21 chunks
    first = pool.acquire("prefill", prompt=prompt(shared + "Q1"))
    home, other = first.instance, (b if first.instance is a else a)
    pool.release(first)
    pool.observe(first, 0)  # its KV went to the data system
    home.queued, home.in_flight = 40.0, 1  # now busy with a cold prompt of another group
    # the data system has evicted such prefixes lately: computing this one again costs more than the queue
    pool.loadable_found = 0.05
    assert pool.select("prefill", prompt=prompt(shared + "Q3")) is home
    # it has had what others computed: the idle instance loads the prefix instead of queueing behind the cold prompt
    pool.loadable_found = 0.95
    moved = pool.acquire("prefill", prompt=prompt(shared + "Q2"))
    assert moved.instance is other and moved.loadable == len(chain(shared)) == 21
    assert moved.work < 3  # what it computes is the question; the prefix is loaded
    pool.release(moved)
    # what the connector says it loaded teaches that estimate; legs expecting little to load do not
    pool.loadable_found = 0.5
    pool.observe(moved, 0)
    assert pool.loadable_found == pytest.approx(0.4)
    pool.observe(moved, 6)
    assert pool.loadable_found == pytest.approx(0.52)
    pool.observe(moved, None)  # a connector that does not say: it teaches nothing, and its prompt is not taken
    unsaid = pool.acquire("prefill", prompt=prompt("Another context entirely. " * 30))  # for loadable either
    pool.release(unsaid)
    pool.observe(unsaid, None)
    assert pool.stored.matched(unsaid.prompt.chain) == 0
    tiny = pool.acquire("prefill", prompt=prompt("short"))
    pool.observe(tiny, 0)
    assert pool.loadable_found == pytest.approx(0.52)
    # load routing keeps none of this
    plain = Pool(["http://a"], [], Routing.load)
    plain.of("prefill")[0].up = True
    plain.observe(plain.acquire("prefill", prompt=prompt(shared)), 0)
    assert len(plain.stored) == 0 and plain.routing_state() == {"policy": "load", "bound": 2}


def test_prefix_routing_weighs_work_by_the_time_each_instance_was_measured_to_take_per_chunk():
    pool = Pool(["http://a", "http://b"], [], Routing.prefix, bound=3)
    a, b = pool.of("prefill")
    a.up = b.up = True
    cold = "Unrelated question number {}: " + "lorem ipsum dolor sit amet, consectetur. " * 30
    # nothing measured yet: costs are in chunks, a cold prompt goes where fewer are queued
    b.queued = 10.0
    assert pool.select("prefill", prompt=prompt(cold.format(0))) is a
    # an instance's time per chunk: the seconds it had a leg in flight over the chunks its legs computed
    leg = pool.acquire("prefill", prompt=prompt(cold.format(1)), now=100.0)
    assert leg.instance is a and leg.ahead == 0
    pool.release(leg, now=106.0)
    pool.observe(leg, 0, now=106.0)
    assert a.chunk_s == pytest.approx(6.0 / leg.work)
    # b computes 0.05 s a chunk, one leg after the other: the second leg, sent while the first was half done,
    # waits for the first's second half only, yet the first counts whole ahead of it; timed from routed to
    # answered over the chunks ahead and its own, b came out faster than it is, busier still faster
    b.queued, a.queued = 0.0, 1000.0  # (a busy with another client's work meanwhile)
    first = pool.acquire("prefill", prompt=prompt(cold.format(2)), now=200.0)
    half = 200.0 + 0.05 * first.work / 2
    second = pool.acquire("prefill", prompt=prompt(cold.format(3)), now=half)
    assert first.instance is second.instance is b and second.ahead == pytest.approx(first.work)
    first_done = 200.0 + 0.05 * first.work
    pool.release(first, now=first_done)
    pool.observe(first, 0, now=first_done)
    second_done = first_done + 0.05 * second.work
    pool.release(second, now=second_done)
    pool.observe(second, 0, now=second_done)
    assert b.chunk_s == pytest.approx(0.05)
    # the control: what the old measure took from the second leg
    assert (second_done - half) / (second.ahead + second.work) < 0.05 * 0.8
    # idle seconds are no instance's time: a leg an hour later still takes 0.05 s a chunk
    late = pool.acquire("prefill", prompt=prompt(cold.format(4)), now=4000.0)
    pool.release(late, now=4000.0 + 0.05 * late.work)
    pool.observe(late, 0, now=4000.0 + 0.05 * late.work)
    assert late.instance is b and b.chunk_s == pytest.approx(0.05)
    b.queued, a.queued = 10.0, 0.0
    # b takes a sixth of a's time per chunk: a cold prompt goes there though 10 chunks wait there
    assert b.chunk_s < a.chunk_s / 3
    assert pool.select("prefill", prompt=prompt(cold.format(5))) is b
    a.chunk_s = b.chunk_s  # the control: at equal speeds the queue decides
    assert pool.select("prefill", prompt=prompt(cold.format(5))) is a
    # an instance not measured yet is taken for the mean of those measured
    c = Pool(["http://a", "http://b"], [], Routing.prefix)
    c.of("prefill")[0].chunk_s = 0.3
    assert c.chunk_s(c.of("prefill")[1]) == pytest.approx(0.3) and c.chunk_s(c.of("prefill")[0]) == 0.3
    # one measured slow gets no cold leg while its time is fresh; after RECENT_LEGS legs elsewhere it is taken for
    # the others' mean again and gets the next one, which measures it anew
    d = Pool(["http://a", "http://b"], [], Routing.prefix)
    slow, fast = d.of("prefill")
    slow.up = fast.up = True
    slow.chunk_s, fast.chunk_s = 1.0, 0.1
    for n in range(32):
        leg = d.acquire("prefill", prompt=prompt(f"Cold prompt {n}: " + "words to compute here. " * 30))
        assert leg.instance is fast, n
        d.release(leg)
    leg = d.acquire("prefill", prompt=prompt("Cold prompt 32: " + "words to compute here. " * 30))
    assert leg.instance is slow and d.chunk_s(slow) == pytest.approx(0.1)
    d.release(leg, now=leg.started + 0.05 * leg.work)
    d.observe(leg, 0, now=leg.started + 0.05 * leg.work)
    assert slow.chunk_s == pytest.approx(0.05) and slow.untimed_legs == 0
    state = {i["url"]: i for i in (i.as_dict() for i in pool.instances)}
    assert state["http://a"]["ms_per_chunk"] == pytest.approx(b.chunk_s * 1000, abs=0.01)
    assert "ms_per_chunk" not in c.of("prefill")[1].as_dict()


def test_an_instances_time_per_chunk_is_reckoned_on_what_its_connector_says_it_computed():
    text = "Background: " + "the quick brown fox jumps over the lazy dog. " * 40
    tokens = list(range(1000, 1400))

    def taught(cached):
        pool = Pool(["http://a"], [], Routing.prefix)
        a = pool.of("prefill")[0]
        a.up = True
        leg = pool.acquire("prefill", prompt=prompt(text).with_tokens(tokens, None), now=10.0)
        assert leg.matched == 0  # routing knew of nothing held there
        pool.release(leg, now=12.0)
        pool.observe(leg, 0, now=12.0, cached_tokens=cached)
        return a.chunk_s, leg.prompt

    # its cache had three quarters of the prompt: 2 s were for the last quarter
    chunk_s, p = taught(300)
    assert chunk_s == pytest.approx(2.0 / (p.chunks / 4))
    # the control: where the connector does not say, the whole prompt as routing reckoned it
    chunk_s, p = taught(None)
    assert chunk_s == pytest.approx(2.0 / p.chunks)


#: a prompt prefix of 21 chunks
SHARED = "Context: " + "the quick brown fox jumps over the lazy dog. " * 30


def a_prefix_stored_at_home() -> tuple[Pool, Instance, Instance]:
    """Two prefill instances of 0.05 s a chunk; a leg of SHARED + "Q1" went to one (home) and ended at t=0.05 x its
    chunks, so the data system holds the prefix. Returns (pool, home, the other)."""
    pool = Pool(["http://a", "http://b"], [], Routing.prefix, bound=3)
    a, b = pool.of("prefill")
    a.up = b.up = True
    a.chunk_s = b.chunk_s = 0.05
    first = pool.acquire("prefill", prompt=prompt(SHARED + "Q1"), now=0.0)
    pool.release(first, now=0.05 * first.work)
    pool.observe(first, 0, now=0.05 * first.work)
    return pool, first.instance, (b if first.instance is a else a)


def test_a_load_from_the_data_system_is_weighed_by_its_measured_time():
    pool, home, other = a_prefix_stored_at_home()
    home.queued, home.in_flight = 15.0, 1
    # a leg that loaded the prefix: what it took beyond computing the rest, per chunk loaded, is the load's time
    moved = pool.acquire("prefill", prompt=prompt(SHARED + "Q2"))
    assert moved.instance is other and moved.loadable == 21
    pool.release(moved, now=moved.started + 0.05 * moved.work + 21 * 0.2)
    pool.observe(moved, 3, now=moved.started + 0.05 * moved.work + 21 * 0.2)
    assert pool.load_chunk_s == pytest.approx(0.2) and pool.routing_state()["load_ms_per_chunk"] == 200
    # and its busy seconds, less the load's, were its 0.05 s a chunk computed
    assert other.chunk_s == pytest.approx(0.05)
    other.memory.forget()  # (as if its own cache had lost the prefix since)
    # loads measured slower than computing (a data system on disk): waiting at home is sooner than loading
    assert pool.select("prefill", prompt=prompt(SHARED + "Q3")) is home
    pool.load_chunk_s = 0.005  # the control: measured fast, the idle instance loads it
    assert pool.select("prefill", prompt=prompt(SHARED + "Q3")) is other
    # a load nobody expected, of blocks whose size nobody told, teaches neither time
    before = (home.chunk_s, pool.load_chunk_s)
    cold = pool.acquire("prefill", prompt=prompt("Never seen before. " * 40))
    pool.release(cold)
    pool.observe(cold, 4, now=cold.started + 9.0)
    assert (home.chunk_s, pool.load_chunk_s) == before


def test_a_loads_time_is_the_busy_seconds_its_leg_brought_beyond_computing_not_its_wait_behind_a_queue():
    pool, home, other = a_prefix_stored_at_home()
    home.queued, home.in_flight = 1000.0, 5  # busy with other clients: the prefix is loaded elsewhere
    cold = pool.acquire("prefill", prompt=prompt("Unrelated: " + "lorem ipsum dolor sit amet. " * 40), now=100.0)
    half = 100.0 + 0.05 * cold.work / 2
    moved = pool.acquire("prefill", prompt=prompt(SHARED + "Q2"), now=half)
    assert cold.instance is moved.instance is other and moved.loadable == 21
    assert moved.ahead == pytest.approx(cold.work)
    cold_done = 100.0 + 0.05 * cold.work
    pool.release(cold, now=cold_done)
    pool.observe(cold, 0, now=cold_done)
    # after the cold leg, the moved one computes its own chunks at 0.05 s and loads 21 at 0.01 s
    moved_done = cold_done + 0.05 * moved.work + 21 * 0.01
    pool.release(moved, now=moved_done)
    pool.observe(moved, 3, now=moved_done)
    assert pool.load_chunk_s == pytest.approx(0.01)
    # the control: its time from routing less the whole queue ahead and its own chunks, what was measured before
    assert (moved_done - half) - 0.05 * (moved.ahead + moved.work) < 0


def test_the_proxy_learns_from_prefill_answers_how_often_the_data_system_had_a_prefix(caplog):
    caplog.set_level("INFO", logger="yrpd.proxy")

    async def go():
        async with running(prefill=2, routing=Routing.prefix) as s:
            for fake in s.prefill:
                fake.kv = {"yrpd": {**KV["yrpd"], "loaded": 0}}  # the data system never has what others computed
            shared = "Background: " + "the quick brown fox jumps over the lazy dog. " * 20
            assert (await post(s, "/v1/completions", {"prompt": shared + "Q1", "max_tokens": 3}))[0] == 200
            holder = s.prefill[0] if s.prefill[0].bodies else s.prefill[1]
            # the holder fails: the retry goes to the other instance, which could have loaded the prefix but did not
            holder.error = (500, {"error": {"message": "boom"}})
            assert (await post(s, "/v1/completions", {"prompt": shared + "Q2", "max_tokens": 3}))[0] == 200
            routing = (await s.status())["routing"]
            assert routing["policy"] == "prefix" and routing["prompts_stored"] > 0
            assert routing["data_system_found"] == pytest.approx(0.8)  # from the prior 1.0, one miss
    run(go())
    # the log line says what the leg was reckoned with: the chunks queued ahead of it and the time per chunk, once
    # a leg has taught one (not the first)
    first, second = [r.getMessage() for r in caplog.records if "POST /v1/completions 200" in r.getMessage()]
    assert "chunk_ms=" not in first and re.search(r" ahead=0\.0 chunk_ms=\d+(\.\d+)? decode=", second), second


def test_prefix_routing_balances_decode_legs_by_load_and_breaks_ties_by_prefix():
    pool = Pool([], ["http://c", "http://d"], Routing.prefix, bound=2)
    c, d = pool.of("decode")
    c.up = d.up = True
    shared = "Context: " + "the quick brown fox jumps over the lazy dog. " * 6
    first = pool.acquire("decode", prompt=prompt(shared + "Q1"))
    home, twin = first.instance, (d if first.instance is c else c)
    pool.release(first)
    # equal load: the instance that saw the prefix; more load there: the other one, whatever it saw
    assert {pool.select("decode", prompt=prompt(shared + f"Q{n}")) for n in range(4)} == {home}
    held = pool.acquire("decode", prompt=prompt(shared + "Q5"))
    assert held.instance is home and home.queued == 0  # decode legs carry no prefill work
    assert pool.select("decode", prompt=prompt(shared + "Q6")) is twin


def test_a_prompt_longer_than_the_hashed_chunks_still_counts_its_whole_length():
    text = "x" * (CHUNK_CHARS * 300 + 10)
    p = prompt(text)
    assert len(p.chain) == 256 and p.chunks == pytest.approx(300 + 10 / CHUNK_CHARS)
    assert p.work(256) == pytest.approx(44 + 10 / CHUNK_CHARS) and p.work(10**6) == 0.5


def test_the_prompt_text_routing_hashes_covers_completions_chats_and_token_ids():
    assert prompt_text({"prompt": "abc"}) == prompt_text({"prompt": ["abc"]}) == "abc"
    chat = prompt_text({"messages": [{"role": "system", "content": "x" * 70}, {"role": "user", "content": "hi"}]})
    assert chat.startswith("system") and "hi" in chat
    assert prompt_text({"prompt": [1, 2, 3]}) == "[1, 2, 3]"
    # chunks chain: equal digests mean equal leading text, so two prompts diverging in chunk 2 share only chunk 1
    one, two = chain("a" * 64 + "b" * 64), chain("a" * 64 + "c" * 64)
    assert one[0] == two[0] and one[1] != two[1] and len(chain("a" * 63)) == 0


def test_with_prefix_routing_requests_sharing_a_prompt_prefix_reach_one_prefill_instance():
    async def go():
        async with running(prefill=2, routing=Routing.prefix) as s:
            shared = "Background: " + "the quick brown fox jumps over the lazy dog. " * 6
            for n in range(6):
                status, _, _ = await post(s, "/v1/completions", {"prompt": shared + f"Q{n}?", "max_tokens": 3})
                assert status == 200
            counts = sorted(len(p.bodies) for p in s.prefill)
            assert counts == [0, 6], counts  # load routing would split these 3/3 (they arrive one at a time)
            busy = s.prefill[0] if s.prefill[0].bodies else s.prefill[1]
            assert (await s.instance(busy))["prefix_routed"] == 5
    run(go())


def test_a_busy_decode_instance_is_passed_over():
    async def go():
        async with running(decode=2) as s:
            for d in s.decode:
                d.gate.clear()
            held = asyncio.create_task(post(s, "/v1/completions", {"prompt": "long", "max_tokens": 9}))
            await until(lambda: any(d.bodies for d in s.decode))
            busy, free = s.decode if s.decode[0].bodies else s.decode[::-1]
            free.gate.set()
            for _ in range(2):  # plain round robin would send the second of these to the busy one
                status, _, data = await post(s, "/v1/completions", {"prompt": "short", "max_tokens": 9})
                assert status == 200 and free.name in json.loads(data)["choices"][0]["text"]
            assert len(busy.bodies) == 1 and len(free.bodies) == 2
            assert (await s.instance(busy))["in_flight"] == 1
            assert f'yrpd_proxy_in_flight{{instance="{busy.url}",role="decode"}} 1' in await s.metrics()
            busy.gate.set()
            assert (await held)[0] == 200
            assert (await s.instance(busy))["in_flight"] == 0
    run(go())


def test_a_dead_decode_instance_is_marked_down_and_the_request_retried_elsewhere_then_prefill_answers_alone():
    async def go():
        async with running(decode=2) as s:
            dead, alive = s.decode
            await dead.stop()
            for _ in range(2):  # one of the two meets the dead instance first
                status, _, data = await post(s, "/v1/completions", {"prompt": "x", "max_tokens": 4})
                assert status == 200 and json.loads(data)["choices"][0]["text"] == "d1 says hi"
            info = await s.instance(dead)
            assert (info["up"], info["errors"]) == (False, 1) and "unreachable" in info["last_error"]
            metrics = await s.metrics()
            assert f'yrpd_proxy_instance_up{{instance="{dead.url}",role="decode"}} 0' in metrics
            assert f'yrpd_proxy_upstream_errors_total{{instance="{dead.url}",role="decode"}} 1' in metrics

            # the last decode instance gone too: PD degrades, the prefill instance answers whole requests
            await alive.stop()
            status, _, data = await post(s, "/v1/completions", {"prompt": "x", "max_tokens": 4})
            assert status == 200 and json.loads(data)["choices"][0]["text"] == "p0 says hi"
            assert s.prefill[0].bodies[-1] == {"prompt": "x", "max_tokens": 4}  # the client's request, no hand-over
            status, _, data = await post(s, "/v1/chat/completions", {"messages": [], "stream": True})
            assert status == 200 and data == b"".join(s.prefill[0].events(chat=True))
            async with s.client.get(s.url + "/health") as r:
                health = await r.json()
                assert r.status == 200 and health["status"] == "degraded" and health["missing"] == ["decode"]
                assert "prefill instances answer whole requests" in health["message"]
            # with no instance of either role up: a 503 at once
            await s.prefill[0].stop()
            await post(s, "/v1/completions", {"prompt": "x", "max_tokens": 4})  # finds prefill gone
            status, _, data = await post(s, "/v1/completions", {"prompt": "x", "max_tokens": 4})
            assert "no prefill or decode instance is up" in error_of(status, data, 503)["message"]
            async with s.client.get(s.url + "/health") as r:
                assert r.status == 503 and sorted((await r.json())["missing"]) == ["decode", "prefill"]
    run(go())


def test_while_no_decode_instance_is_up_prefill_answers_whole_requests_and_pd_resumes_when_decode_is_back(caplog):
    """A decode instance being restarted: PD degrades (the prefill instances answer whole requests), says so in
    /health, /yrpd/status, /metrics and the log, and resumes as soon as a decode instance is up again."""
    async def go():
        async with running(probe_interval=0.05) as s:
            [decode], [prefill] = s.decode, s.prefill
            body = {"prompt": "x", "max_tokens": 4}
            decode.health_status = 500
            await until(lambda: _up(s, decode, False))
            for _ in range(2):
                status, _, data = await post(s, "/v1/completions", body)
                assert status == 200 and json.loads(data)["choices"][0]["text"] == "p0 says hi"
            assert prefill.bodies[-2:] == [body, body] and decode.bodies == []
            status = await s.status()
            assert status["degraded"]["missing"] == ["decode"] and status["degraded"]["since"] <= time.time()
            metrics = await s.metrics()
            assert "yrpd_proxy_degraded 1" in metrics
            assert 'yrpd_proxy_degraded_answers_total{how="prefill alone"} 2' in metrics
            decode.health_status = 200
            await until(lambda: _up(s, decode, True))
            status, _, data = await post(s, "/v1/completions", body)
            assert status == 200 and json.loads(data)["choices"][0]["text"] == "d0 says hi"  # PD again
            assert prefill.bodies[-1]["max_tokens"] == 1 and decode.bodies == [{**body, "kv_transfer_params": KV}]
            assert (await s.status())["degraded"] is None and "yrpd_proxy_degraded 0" in await s.metrics()
    with caplog.at_level("INFO", logger="yrpd.proxy"):
        run(go())
    assert "serving degraded: no decode instance is up" in caplog.text and "PD serving resumed after" in caplog.text


def test_a_5xx_takes_the_instance_out_and_the_leg_goes_to_the_other():
    async def go():
        async with running(prefill=2) as s:
            sick, well = s.prefill
            sick.error = (500, {"error": "engine dead"})
            for _ in range(2):
                assert (await post(s, "/v1/completions", {"prompt": "x"}))[0] == 200
            assert len(sick.bodies) == 1 and len(well.bodies) == 2
            assert "engine dead" in (await s.instance(sick))["last_error"]
            # both prefill instances failing: decode computes the prompt itself, and the client gets its answer
            well.error = (503, {"error": "overloaded"})
            status, _, data = await post(s, "/v1/completions", {"prompt": "x"})
            assert status == 200 and json.loads(data)["choices"][0]["text"] == "d0 says hi"
            assert s.decode[0].bodies[-1] == {"prompt": "x"}  # no hand-over to load
            assert 'yrpd_proxy_degraded_answers_total{how="prefill leg failed"} 1' in await s.metrics()
    run(go())


def test_the_prober_takes_instances_out_and_brings_them_back():
    async def go():
        async with running(probe_interval=0.05) as s:
            async with s.client.get(s.url + "/health") as r:
                assert r.status == 200 and (await r.json())["status"] == "ok"
            s.prefill[0].health_status = 500
            await until(lambda: _up(s, s.prefill[0], False))
            async with s.client.get(s.url + "/health") as r:
                assert r.status == 200 and (await r.json())["missing"] == ["prefill"]
            status, _, data = await post(s, "/v1/completions", {"prompt": "x"})  # decode alone: it computes the prompt
            assert status == 200 and s.decode[0].bodies[-1] == {"prompt": "x"} and s.prefill[0].bodies == []
            s.prefill[0].health_status = 200
            await until(lambda: _up(s, s.prefill[0], True))
            assert (await post(s, "/v1/completions", {"prompt": "x"}))[0] == 200
    run(go())


async def _up(s, fake, want):
    return (await s.instance(fake))["up"] is want


def test_an_upstream_400_reaches_the_client_as_it_is():
    async def go():
        async with running() as s:
            too_long = {"error": {"message": "prompt is too long", "type": "BadRequestError", "code": 400}}
            s.prefill[0].error = (400, too_long)
            status, _, data = await post(s, "/v1/chat/completions", {"messages": [], "stream": True})
            assert status == 400 and json.loads(data) == too_long
            assert s.decode[0].bodies == []
            s.prefill[0].error, s.decode[0].error = None, (400, too_long)
            status, ctype, data = await post(s, "/v1/chat/completions", {"messages": [], "stream": True})
            assert status == 400 and ctype.startswith("application/json") and json.loads(data) == too_long
            assert all(i["up"] and i["errors"] == 0 for i in (await s.status())["instances"])
    run(go())


def test_an_instance_that_stays_silent_gives_504():
    async def go():
        async with running(request_timeout=0.3) as s:
            s.prefill[0].gate.clear()
            status, _, data = await post(s, "/v1/completions", {"prompt": "x"})
            assert "0.3 s" in error_of(status, data, 504)["message"]
            assert (await s.instance(s.prefill[0]))["up"] is True  # slow is not dead
    run(go())


def test_a_stream_that_breaks_ends_with_an_error_event():
    async def go():
        async with running() as s:
            s.decode[0].break_after = 2
            status, ctype, data = await post(s, "/v1/completions", {"prompt": "x", "stream": True})
            assert status == 200 and ctype.startswith("text/event-stream")
            events = sse_events(data)
            assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["d0-0 ", "d0-1 "]
            assert json.loads(events[2])["error"]["code"] == 502 and events[3:] == ["[DONE]"]
            assert (await s.instance(s.decode[0]))["up"] is False
    run(go())


def test_a_non_stream_answer_that_breaks_is_sent_again_and_a_502_once_every_instance_broke():
    async def go():
        async with running() as s:
            s.decode[0].break_after = 0
            status, _, data = await post(s, "/v1/completions", {"prompt": "x"})
            assert status == 200 and json.loads(data)["choices"][0]["text"] == "p0 says hi"  # prefill, alone
        async with running() as s:
            s.decode[0].break_after = s.prefill[0].break_after = 0
            status, _, data = await post(s, "/v1/completions", {"prompt": "x"})
            assert "broke off" in error_of(status, data, 502)["message"]
    run(go())


# -- the client side


def test_the_api_key_is_enforced_on_v1_only():
    async def go():
        async with running(api_key="s3cret") as s:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                status, _, data = await post(s, "/v1/completions", {"prompt": "x"}, headers=headers)
                error_of(status, data, 401)
            async with s.client.get(s.url + "/v1/models") as r:
                assert r.status == 401
            status, _, _ = await post(s, "/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer s3cret"})
            assert status == 200 and s.prefill[0].bodies and s.decode[0].bodies
            async with s.client.get(s.url + "/health") as r:
                assert r.status == 200
    run(go())


def test_instances_get_the_deployments_token_and_never_the_clients_key():
    async def go():
        async with running(api_key="client-key", instance_token="inst-token") as s:
            body = {"prompt": "x", "stream": True}
            status, _, _ = await post(s, "/v1/completions", body, headers={"Authorization": "Bearer client-key"})
            assert status == 200
            assert s.prefill[0].auth == ["Bearer inst-token"] and s.decode[0].auth == ["Bearer inst-token"]
        async with running() as s:  # instances started by hand, sharing the proxy's key: the client's header passes
            status, _, _ = await post(s, "/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer k"})
            assert status == 200 and s.decode[0].auth == ["Bearer k"]
    run(go())


def test_a_client_that_hangs_up_mid_stream_closes_the_decode_request():
    async def go():
        async with running() as s:
            s.decode[0].hang_after = 1
            resp = await s.client.post(s.url + "/v1/completions", json={"prompt": "x", "stream": True})
            assert resp.status == 200 and b"d0-0" in await resp.content.readuntil(b"\n\n")
            resp.close()
            await asyncio.wait_for(s.decode[0].cancelled.wait(), 3)
            await until(lambda: _in_flight_zero(s))
    run(go())


def test_a_client_that_hangs_up_during_prefill_closes_the_prefill_request():
    async def go():
        async with running() as s:
            s.prefill[0].gate.clear()
            task = asyncio.create_task(post(s, "/v1/completions", {"prompt": "x"}))
            await asyncio.wait_for(s.prefill[0].received.wait(), 3)
            task.cancel()
            await asyncio.wait_for(s.prefill[0].cancelled.wait(), 3)
            await until(lambda: _in_flight_zero(s))
            assert s.decode[0].bodies == []
            assert 'yrpd_proxy_requests_total{endpoint="/v1/completions",status="499"} 1' in await s.metrics()
    run(go())


async def _in_flight_zero(s):
    st = await s.status()
    return st["totals"]["in_flight"] == 0 and all(i["in_flight"] == 0 for i in st["instances"])


def test_models_come_from_a_decode_instance():
    async def go():
        async with running() as s:
            async with s.client.get(s.url + "/v1/models") as r:
                assert r.status == 200 and (await r.json())["data"][0]["owned_by"] == "d0"
            await s.decode[0].stop()
            async with s.client.get(s.url + "/v1/models") as r:
                error_of(r.status, await r.read(), 502)
            async with s.client.get(s.url + "/v1/models") as r:
                error_of(r.status, await r.read(), 503)
    run(go())


def test_bad_requests_get_json_errors():
    async def go():
        async with running() as s:
            async with s.client.post(s.url + "/v1/completions", data=b"{not json") as r:
                error_of(r.status, await r.read(), 400)
            status, _, data = await post(s, "/v1/completions", ["a list"])
            error_of(status, data, 400)
            async with s.client.get(s.url + "/v1/embeddings") as r:
                error_of(r.status, await r.read(), 404)
            async with s.client.get(s.url + "/v1/completions") as r:
                error_of(r.status, await r.read(), 405)
            assert s.prefill[0].bodies == []
    run(go())


# -- monitoring


def test_metrics_and_status_report_what_happened():
    async def go():
        async with running() as s:
            assert (await post(s, "/v1/completions", {"prompt": "x", "stream": True}))[0] == 200
            assert (await post(s, "/v1/chat/completions", {"messages": []}))[0] == 200
            s.prefill[0].error = (400, {"error": "too long"})
            assert (await post(s, "/v1/completions", {"prompt": "x"}))[0] == 400
            metrics = await s.metrics()
            lines = set(metrics.splitlines())
            for line in ('yrpd_proxy_requests_total{endpoint="/v1/completions",status="200"} 1',
                         'yrpd_proxy_requests_total{endpoint="/v1/completions",status="400"} 1',
                         'yrpd_proxy_requests_total{endpoint="/v1/chat/completions",status="200"} 1',
                         f'yrpd_proxy_instance_up{{instance="{s.decode[0].url}",role="decode"}} 1',
                         f'yrpd_proxy_in_flight{{instance="{s.prefill[0].url}",role="prefill"}} 0',
                         f'yrpd_proxy_upstream_errors_total{{instance="{s.prefill[0].url}",role="prefill"}} 0',
                         "# TYPE yrpd_proxy_ttft_seconds histogram",
                         'yrpd_proxy_ttft_seconds_bucket{le="+Inf"} 1',  # streamed requests only
                         "yrpd_proxy_ttft_seconds_count 1"):
                assert line in lines, line
            st = await s.status()
            assert st["model"] == "tiny"
            assert st["totals"] | {"requests": 3, "failed": 1, "in_flight": 0, "prefill_up": 1, "decode_up": 1} \
                == st["totals"]
            by_url = {i["url"]: i for i in st["instances"]}
            assert by_url[s.prefill[0].url]["requests"] == 3 and by_url[s.decode[0].url]["requests"] == 2
            assert {i["role"] for i in st["instances"]} == {"prefill", "decode"}
    run(go())


def test_the_prefill_legs_time_is_what_the_bench_splits_a_first_tokens_wait_by():
    """A first token's wait is the prefill leg (what prefill routing chooses) and the rest (decode's): the proxy times
    each successful leg, and `yrpd bench run` reads the sum and count before and after a run."""
    from yrpd.bench import run as bench_run

    async def go():
        async with running() as s:
            s.prefill[0].delay = 0.3
            before = await asyncio.to_thread(bench_run.prefill_legs, s.url)
            assert before == (0.0, 0)
            for _ in range(2):
                assert (await post(s, "/v1/completions", {"prompt": "x"}))[0] == 200
            s.prefill[0].error = (400, {"error": "too long"})
            assert (await post(s, "/v1/completions", {"prompt": "x"}))[0] == 400  # a failed leg is not timed
            after = await asyncio.to_thread(bench_run.prefill_legs, s.url)
            assert after[1] == 2 and 0.6 <= after[0] < 1.5, after
            split = bench_run.stages({"mean_ttft_ms": 900.0}, before, after)
            assert 300 <= split["mean_prefill_leg_ms"] < 750
            assert split["mean_ttft_after_prefill_ms"] == pytest.approx(900.0 - split["mean_prefill_leg_ms"])
            # control: an instance's own URL (a single target, no proxy) times nothing: no split, not a zero
            assert await asyncio.to_thread(bench_run.prefill_legs, s.decode[0].url) is None
            assert not any((await asyncio.to_thread(bench_run.index_checked, s.url)).values())  # routed on no events
            assert bench_run.stages({"mean_ttft_ms": 900.0}, None, after) == {}
            assert bench_run.stages({"mean_ttft_ms": 900.0}, after, after) == {}  # no leg in the run
    run(go())


def test_benchmarks_proxy_stages_reads_the_proxys_own_log_lines(caplog, tmp_path):
    """benchmarks/proxy_stages.py splits older runs from their kept proxy logs: the proxy's log line for a streamed
    request carries the prefill instance, the leg's time and the TTFT, by vllm bench serve's request id."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.proxy_stages import runs_of

    async def go():
        async with running() as s:
            s.prefill[0].delay = 0.2
            for n in range(2):
                status, _, _ = await post(s, "/v1/completions", {"prompt": "x", "stream": True},
                                          headers={"X-Request-Id": f"bench-run1-{n}"})
                assert status == 200
            assert (await post(s, "/v1/completions", {"prompt": "x", "stream": True}))[0] == 200  # not a bench's
    caplog.set_level("INFO", logger="yrpd.proxy")
    run(go())
    log = tmp_path / "proxy.log"
    log.write_text("\n".join(r.getMessage() for r in caplog.records) + "\n")
    [one] = runs_of(log)
    assert one["requests"] == 2 and sum(one["legs"].values()) == 2
    assert 200 <= one["leg_ms"] < 1000 and one["ttft_ms"] >= one["leg_ms"]
    assert one["after_ms"] == pytest.approx(one["ttft_ms"] - one["leg_ms"])
    assert [p["requests"] for p in runs_of(log, 2)[0]["parts"]] == [1, 1]  # --quarters' slices, here halves
    # the line of a leg routed on KV-cache events carries the index's check and the routing's reckoning before
    # decode's URL
    log.write_text(log.read_text() + "INFO yrpd.proxy: POST /v1/completions 200 9ms id=bench-run2-0 prefill=http://a:1 "
                   "prefill_ms=5 index=3/4 ahead=12.5 chunk_ms=41.2 decode=http://d:1 ttft_ms=9 own_ms=1.0\n")
    assert runs_of(log)[1]["legs"] == {"http://a:1": 1}


def test_benchmarks_proxy_stages_reads_every_session_of_a_target_run_in_rounds(tmp_path, monkeypatch, capsys):
    """Run in rounds (--interleave), a target's runs are in one proxy log per round's session; a target run in one
    session (the keyed control) has its runs in that one."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import proxy_stages

    def line(run, ms):
        return (f"INFO yrpd.proxy: POST /v1/completions 200 9ms id=bench-{run}-0 prefill=http://a:1 prefill_ms={ms} "
                f"decode=http://d:1 ttft_ms={ms + 10}\n")

    for session, text in (("s1", line("run1", 100)), ("s2", line("run2", 300)), ("s3", line("run1", 500))):
        (tmp_path / "h1" / session).mkdir(parents=True)
        (tmp_path / "h1" / session / "proxy.log").write_text(text)
    doc = {"provenance": {}, "dataset": {"prompts": 1},
           "targets": {"pd": {"session": "s2", "sessions": ["s1", "s2"]}, "pd-rr": {"session": "s3"}}}
    (tmp_path / "results.json").write_text(json.dumps(doc))
    monkeypatch.setattr(sys, "argv", ["proxy_stages.py", str(tmp_path / "results.json"), str(tmp_path)])
    assert proxy_stages.main() == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| pd")]
    assert [r.split("|")[1:5] for r in rows[:3]] == [[" pd ", " 1 ", " 1: 1 ", " 100 "], [" pd ", " 2 ", " 1: 1 ", " 300 "],
                                                     [" pd-rr ", " 1 ", " 1: 1 ", " 500 "]]


def test_the_proxy_counts_as_its_own_time_only_what_it_did_not_spend_waiting_for_instances():
    """What `benchmarks/serving.py proxy-overhead` reads: own time to first token, the instances' waits left out."""
    async def go():
        async with running() as s:
            s.prefill[0].delay, s.decode[0].delay = 0.3, 0.2
            assert (await post(s, "/v1/completions", {"prompt": "x", "stream": True}))[0] == 200
            assert (await post(s, "/v1/completions", {"prompt": "x"}))[0] == 200
            s.prefill[0].error = (400, {"error": "too long"})
            assert (await post(s, "/v1/completions", {"prompt": "x"}))[0] == 400  # failures are not counted
            own = (await s.status())["own_overhead_ms"]
            assert own["n"] == 2 and 0 < own["p50"] < 250 and own["p99"] < 250, own  # 500 ms were waits
            metrics = set((await s.metrics()).splitlines())
            assert "yrpd_proxy_own_seconds_count 2" in metrics
    run(go())


# -- the command line, as the deploy step runs it


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url, headers=None):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_cli_serves_503_without_instances_and_stops_on_sigterm():
    port, nobody = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TEST_PROXY_KEY": "k1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "yrpd.proxy", "--host", "127.0.0.1", "--port", str(port),
         "--prefill", f"http://127.0.0.1:{nobody}", "--decode", f"http://127.0.0.1:{nobody}/",
         "--served-model-name", "tiny", "--api-key-env", "TEST_PROXY_KEY", "--probe-interval", "0.2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                status, body = _get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "proxy did not come up"
                time.sleep(0.05)
        assert status == 503 and body["missing"] == ["prefill", "decode"]
        assert _get(f"http://127.0.0.1:{port}/v1/models")[0] == 401
        assert _get(f"http://127.0.0.1:{port}/v1/models", {"Authorization": "Bearer k1"})[0] == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        out = proc.stdout.read()
        assert f"prefill: http://127.0.0.1:{nobody} (down); decode: http://127.0.0.1:{nobody} (down)" in out
        assert "GET /v1/models 401" in out and "GET /v1/models 503" in out
        assert "(event loop: uvloop)" in out  # as deployed: beside vLLM, which depends on uvloop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_log_line_splits_a_slow_first_token_into_the_prefill_leg_and_the_rest(caplog):
    async def go():
        async with running() as s:
            s.prefill[0].delay, s.decode[0].delay = 0.3, 0.1
            with caplog.at_level("INFO", logger="yrpd.proxy"):
                body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True}
                status, _, _ = await post(s, "/v1/completions", body)
            assert status == 200
            [line] = [r.getMessage() for r in caplog.records if "/v1/completions" in r.getMessage()]
            note = dict(part.split("=", 1) for part in line.split() if "=" in part)
            assert 300 <= int(note["prefill_ms"]) < int(note["ttft_ms"])
            assert int(note["ttft_ms"]) - int(note["prefill_ms"]) >= 100  # decode's own wait shows as the rest

    run(go())


# -- an instance its probe declares down while a request waits on it (a hung or cut-off host)


def test_a_leg_waiting_on_an_instance_its_probe_declares_down_goes_to_another_at_once():
    async def go():
        # request_timeout far beyond the client's 10 s: only the probe can end the wait
        async with running(decode=2, probe_interval=0.2, request_timeout=300) as s:
            for d in s.decode:
                d.gate.clear()  # both hold what they get; the one that got it is then declared down
            task = asyncio.ensure_future(post(s, "/v1/completions", {"prompt": "x"}))
            await until(lambda: any(d.received.is_set() for d in s.decode))
            hung = next(d for d in s.decode if d.received.is_set())
            well = next(d for d in s.decode if d is not hung)
            well.gate.set()
            hung.health_status = 503
            status, _, data = await task
            assert status == 200 and json.loads(data)["choices"][0]["text"] == f"{well.name} says hi", data
            assert hung.cancelled.is_set()  # the abandoned request was closed upstream
            assert "declared down by its health probe" in (await s.instance(hung))["last_error"]
    run(go())


def test_a_slow_instance_that_stays_healthy_is_waited_for():
    async def go():  # the control: a probe that keeps answering 200 never ends a leg
        async with running(decode=2, probe_interval=0.2, request_timeout=300) as s:
            for d in s.decode:
                d.delay = 1.0
            status, _, data = await post(s, "/v1/completions", {"prompt": "x"})
            served = [d for d in s.decode if d.bodies]
            assert status == 200 and len(served) == 1, data
            assert json.loads(data)["choices"][0]["text"] == f"{served[0].name} says hi"
    run(go())


def test_a_stream_whose_instance_is_declared_down_after_its_first_token_ends_with_an_error_event():
    async def go():
        async with running(probe_interval=0.2, request_timeout=300) as s:
            s.decode[0].hang_after = 1
            task = asyncio.ensure_future(post(s, "/v1/completions", {"prompt": "x", "stream": True}))
            await until(lambda: s.decode[0].received.is_set())
            await asyncio.sleep(0.3)  # its first event is out
            s.decode[0].health_status = 503
            status, ctype, data = await task
            events = sse_events(data)
            assert status == 200 and json.loads(events[0])["choices"][0]["text"] == "d0-0 "
            error = json.loads(events[1])["error"]
            assert error["code"] == 502 and "declared down by its health probe" in error["message"]
            assert events[2:] == ["[DONE]"]
    run(go())


# -- the membership file (scale out and in, draining)


@contextlib.asynccontextmanager
async def spare_decode(tmp_path: Path, probe_interval: float):
    """A proxy reading a membership file, its prefill and decode instance, and one more decode instance that no
    membership names yet."""
    from tests.unit.proxy_fakes import FakeVLLM

    path = tmp_path / "members.json"
    async with running(probe_interval=probe_interval, instances_file=str(path), routing=Routing.load) as s:
        (p0,), (d0,) = s.prefill, s.decode
        d1 = await FakeVLLM("d1", "decode").start()
        try:
            yield s, path, p0, d0, d1
        finally:
            await d1.stop()


def write_members(path: Path, *members, group: str = "") -> None:
    """Replace the membership file as the controller does: whole, by rename."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"instances": [{"url": f.url, "role": f.role, "draining": d, "group": group}
                                             for f, d in members]}))
    os.replace(tmp, path)


async def members(s) -> dict:
    return {i["url"]: i for i in (await s.status())["instances"]}


def test_an_instance_written_into_the_membership_joins_once_its_probe_answers_and_a_draining_one_gets_no_new_leg(
        tmp_path):
    async def go():
        async with spare_decode(tmp_path, probe_interval=0.1) as (s, path, p0, d0, d1):
            d1.health_status = 503
            write_members(path, (p0, False), (d0, False), (d1, False))
            await until(lambda: members(s), timeout=3)
            await until(lambda: _member_has(s, d1.url), timeout=3)
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
            for _ in range(4):  # it does not answer yet: nothing goes there
                assert (await post(s, "/v1/completions", body))[0] == 200
            assert d1.bodies == [] and (await members(s))[d1.url]["up"] is False
            d1.health_status = 200
            await until(lambda: _member_up(s, d1.url), timeout=3)
            for _ in range(4):
                assert (await post(s, "/v1/completions", body))[0] == 200
            assert d1.bodies, "a joined instance that answers gets legs"
            # draining: listed and probed, but no new leg; the control is the same instance undrained
            write_members(path, (p0, False), (d0, False), (d1, True))
            await until(lambda: _member_draining(s, d1.url), timeout=3)
            sent = len(d1.bodies)
            for _ in range(4):
                assert (await post(s, "/v1/completions", body))[0] == 200
            assert len(d1.bodies) == sent
            write_members(path, (p0, False), (d0, False), (d1, False))
            await until(lambda: _member_routable(s, d1.url), timeout=3)
            for _ in range(4):
                assert (await post(s, "/v1/completions", body))[0] == 200
            assert len(d1.bodies) > sent
    run(go())


def test_a_membership_that_adds_a_decode_instance_and_drains_the_old_one_at_once_refuses_no_request(tmp_path):
    """A rolling change writes "new one joins" and "old one drains" as two versions; when both land within one probe
    round the proxy reads them as one, and the new instance must be up before the old one stops taking requests."""
    async def go():
        async with spare_decode(tmp_path, probe_interval=0.3) as (s, path, p0, d0, d1):
            write_members(path, (p0, False), (d0, False))
            await until(lambda: _member_version(s, 1), timeout=3)
            d1.health_delay = 0.5  # its probe takes a while: the time a request could find no decode up
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
            statuses = []

            async def load():
                while True:
                    statuses.append((await post(s, "/v1/completions", body))[0])
                    await asyncio.sleep(0.01)

            loader = asyncio.create_task(load())
            await asyncio.sleep(0.2)
            write_members(path, (p0, False), (d0, True), (d1, False))
            await until(lambda: _member_version(s, 2), timeout=5)
            await asyncio.sleep(0.05)  # a leg routed just before the drain reaches d0 still
            sent = len(d0.bodies)
            await asyncio.sleep(0.3)
            loader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loader
            assert statuses and set(statuses) == {200}, statuses
            assert len(d0.bodies) == sent and d1.bodies, "the new one serves, the drained one takes nothing new"
    run(go())


def test_an_instance_left_out_of_the_membership_finishes_its_request_in_flight_then_goes(tmp_path, caplog):
    def logged(version: int) -> str:
        return next(r.getMessage() for r in caplog.records if f"(version {version})" in r.getMessage())

    async def go():
        path = tmp_path / "members.json"
        async with running(decode=2, probe_interval=0.1, instances_file=str(path), routing=Routing.load) as s:
            (p0,), (d0, d1) = s.prefill, s.decode
            # a group, as the deploy writes: the command line's instances (no group) are replaced
            write_members(path, (p0, False), (d0, False), (d1, False), group="tiny#0")
            await until(lambda: _member_version(s, 1), timeout=3)
            # the first version takes over the command line's instances: joined, not also "leaving"
            assert "leaving" not in logged(1) and d1.url in logged(1)
            for d in (d0, d1):
                d.gate.clear()
            held = asyncio.create_task(post(s, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4}))
            await until(lambda: d0.bodies or d1.bodies, timeout=3)
            busy, other = (d0, d1) if d0.bodies else (d1, d0)
            other.gate.set()
            write_members(path, (p0, False), (other, False), group="tiny#0")
            await until(lambda: _member_version(s, 2), timeout=3)
            listed = await members(s)
            assert listed[busy.url]["draining"] and listed[busy.url]["in_flight"] == 1  # still there: it has a leg
            body = {"model": "tiny", "prompt": "more", "max_tokens": 4}
            for _ in range(3):
                assert (await post(s, "/v1/completions", body))[0] == 200
            assert len(busy.bodies) == 1
            busy.gate.set()
            status, _, data = await held
            assert status == 200 and json.loads(data)["choices"][0]["text"] == f"{busy.name} says hi"  # not cut
            await until(lambda: _member_gone(s, busy.url), timeout=3)
            assert f"leaving: {busy.url}" in logged(2)
    with caplog.at_level("INFO", logger="yrpd.proxy"):
        run(go())


def test_a_membership_file_that_makes_no_sense_is_named_and_the_last_good_one_stays(tmp_path):
    async def go():
        path = tmp_path / "members.json"
        async with running(probe_interval=0.1, instances_file=str(path)) as s:
            (p0,), (d0,) = s.prefill, s.decode
            path.write_text(json.dumps({"instances": [{"url": d0.url, "role": "decoder"}]}))
            await until(lambda: _member_error(s), timeout=3)
            status = await s.status()
            assert "instances[0]: want a url http://HOST:PORT and a role prefill or decode" in \
                status["membership"]["error"] and status["membership"]["version"] == 0
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
            assert (await post(s, "/v1/completions", body))[0] == 200  # the membership it had still serves
            # the control: a good file is taken (d0 drained: prefill answers alone)
            write_members(path, (p0, False), (d0, True))
            await until(lambda: _member_version(s, 1), timeout=3)
            assert (await s.status())["membership"]["error"] is None
            asked = len(d0.bodies)
            status, _, data = await post(s, "/v1/completions", body)
            assert status == 200 and json.loads(data)["choices"][0]["text"] == "p0 says hi" and len(d0.bodies) == asked
    run(go())


async def _member_has(s, url):
    return url in await members(s)


async def _member_up(s, url):
    return (await members(s)).get(url, {}).get("up") is True


async def _member_draining(s, url):
    return (await members(s)).get(url, {}).get("draining") is True


async def _member_routable(s, url):
    m = (await members(s)).get(url, {})
    return m.get("up") is True and m.get("draining") is False


async def _member_gone(s, url):
    return url not in await members(s)


async def _member_version(s, n):
    return (await s.status())["membership"]["version"] >= n


async def _member_error(s):
    return (await s.status())["membership"]["error"] is not None


def test_a_request_never_pairs_instances_of_two_models_and_its_model_name_picks_the_group(tmp_path):
    """While a model change rolls, the membership holds two groups: every request's decode leg goes to an instance of
    the group its prefill leg went to (decode is sent the KV of its own model), a request naming one group's model
    goes there, and a group without a decode instance up gets no prefill leg (the control: in one group it does, and its
    KV goes to the other's decode instance)."""
    from tests.unit.proxy_fakes import FakeVLLM

    async def go():
        path = tmp_path / "members.json"
        async with running(probe_interval=0.1, instances_file=str(path), routing=Routing.load) as s:
            (p0,), (d0,) = s.prefill, s.decode
            p1, d1 = await FakeVLLM("p1", "prefill").start(), await FakeVLLM("d1", "decode").start()
            try:
                p0.kv, p1.kv = {"from": "p0"}, {"from": "p1"}

                def publish(groups, version):
                    entries = [{"url": f.url, "role": f.role, "group": g} for f, g in groups]
                    tmp = path.with_suffix(".tmp")
                    tmp.write_text(json.dumps({"instances": entries}))
                    os.replace(tmp, path)
                    return until(lambda: _member_version(s, version), timeout=3)

                async def send(model, n=8):
                    for _ in range(n):
                        assert (await post(s, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4}))[0] == 200

                def seen(d):
                    return {b["kv_transfer_params"]["from"] for b in d.bodies if b.get("kv_transfer_params")}

                await publish([(p0, "m#old"), (d0, "m#old"), (p1, "m#new"), (d1, "m#new")], 1)
                await until(lambda: _all_up(s, 4), timeout=3)
                await send("m", 12)
                assert seen(d0) == {"p0"} and seen(d1) == {"p1"}  # both groups served, never crossed
                assert p0.bodies and p1.bodies

                await publish([(p0, "a#1"), (d0, "a#1"), (p1, "b#2"), (d1, "b#2")], 2)
                before = len(p0.bodies), len(d0.bodies)
                await send("b")
                assert (len(p0.bodies), len(d0.bodies)) == before  # the request's model picks its group

                # a group with no decode instance: its prefill instance gets nothing
                await publish([(p0, "m#old"), (d0, "m#old"), (p1, "m#new")], 3)
                sent = len(p1.bodies)
                await send("m")
                assert len(p1.bodies) == sent

                # the control: the same three instances in one group: p1's KV goes to d0
                d0.bodies.clear()
                await publish([(p0, ""), (d0, ""), (p1, "")], 4)
                await until(lambda: _all_up(s, 3), timeout=3)
                await send("m")
                assert len(p1.bodies) > sent and seen(d0) == {"p0", "p1"}
            finally:
                await p1.stop()
                await d1.stop()
    run(go())


async def _all_up(s, n):
    listed = await members(s)
    return len(listed) == n and all(i["up"] for i in listed.values())


def test_status_reports_ttft_and_itl_of_the_streamed_requests_of_the_window_it_is_asked_for():
    """The SLA planner's input: p50/p90 of time to first token and between tokens, streamed requests only (a
    non-streamed answer has no first token of its own: the control), over the last `?window=` seconds."""
    async def go():
        async with running() as s:
            s.decode[0].delay = 0.2
            for _ in range(3):
                assert (await post(s, "/v1/completions", {"prompt": "x", "max_tokens": 4}))[0] == 200
            async with s.client.get(s.url + "/yrpd/status?window=60") as r:
                latency = (await r.json())["latency"]
            assert latency["ttft_ms"]["n"] == 0 and latency["itl_ms"]["n"] == 0  # the control: none streamed
            for _ in range(2):
                assert (await post(s, "/v1/completions", {"prompt": "x", "max_tokens": 4, "stream": True}))[0] == 200
            async with s.client.get(s.url + "/yrpd/status?window=60") as r:
                latency = (await r.json())["latency"]
            assert latency["window_s"] == 60 and latency["ttft_ms"]["n"] == 2 and latency["itl_ms"]["n"] == 2
            assert latency["ttft_ms"]["p90"] >= 200  # decode's delay is before its first event
            await asyncio.sleep(1.1)
            async with s.client.get(s.url + "/yrpd/status?window=1") as r:
                assert (await r.json())["latency"]["ttft_ms"]["n"] == 0  # out of a 1 s window
            async with s.client.get(s.url + "/yrpd/status?window=soon") as r:
                assert r.status == 400
    run(go())


def test_round_robin_takes_turns_whatever_each_instance_holds_or_has_in_flight():
    pool = Pool(["http://a", "http://b"], [], Routing.round_robin)
    for inst in pool.of("prefill"):
        inst.up = True
    shared = prompt("Background: " + "the quick brown fox. " * 40)
    first = pool.acquire("prefill", prompt=shared)  # held: in flight on its instance
    turns = [first.instance.url] + [pool.acquire("prefill", prompt=shared).instance.url for _ in range(3)]
    assert turns[0::2] == [turns[0]] * 2 and turns[1::2] == [turns[1]] * 2 and turns[0] != turns[1]


def test_prefix_routing_scores_an_instance_by_what_its_kv_events_say_it_holds_and_falls_back_when_blind():
    from yrpd.proxy.kvindex import InstanceBlocks, Sight, Stored, block_hashes

    pool = Pool(["http://a", "http://b"], [], Routing.prefix)
    a, b = pool.of("prefill")
    for inst in (a, b):
        inst.up = True
        inst.blocks = InstanceBlocks()
        inst.blocks.apply(0, [])  # seen: holding nothing
    text = "Background: " + "the quick brown fox jumps over the lazy dog. " * 40
    tokens = list(range(1000, 1400))  # the instances' ids for it (what /tokenize answers)
    p = prompt(text).with_tokens(tokens, None)
    # b was sent the prompt before (the estimate would pick b), but only a's events say it holds its blocks
    b.memory.remember(p.chain)
    a.blocks.apply(1, [Stored(tuple(block_hashes(tokens, 16)[:20]), 16)])
    lease = pool.acquire("prefill", prompt=p)
    assert lease.instance is a and lease.matched == pytest.approx(20 * 16 * p.chunks / len(tokens))
    assert lease.new_blocks == 5  # of its 25 full blocks, a lacked the last 5: their batch is due
    pool.release(lease)
    # another prompt, again held by a (its events say) and sent to b before: a while seen; once a's events are
    # lost (blind) its cache is estimated, it was never sent this prompt, and b wins
    other = "Other background: " + "a slow red cat sleeps under the warm sun. " * 40
    tokens2 = list(range(5000, 5400))
    p2 = prompt(other).with_tokens(tokens2, None)
    b.memory.remember(p2.chain)
    a.blocks.apply(2, [Stored(tuple(block_hashes(tokens2, 16)), 16)])
    assert pool.select("prefill", prompt=p2) is a
    a.blocks.go_blind("batch 4 came after 2")
    assert pool.select("prefill", prompt=p2) is b
    # the control: without token ids (no /tokenize answer) the estimate decides, seen or not
    a.blocks.resync()
    assert pool.select("prefill", prompt=prompt(other)) is b
    # a request that finds it gone takes it out of rotation, and its cache out of sight, before any probe does
    pool.failed(a, "prefill instance http://a unreachable", down=True)
    assert a.blocks.sight is Sight.blind and a.blocks.why == "the instance is down"


def test_what_the_data_system_says_it_holds_decides_what_a_leg_loads_and_the_estimate_only_where_it_is_blind():
    from yrpd.connector import keys as K
    from yrpd.proxy.kvindex import InstanceBlocks, Store, Stored

    pool = Pool(["http://a", "http://b"], [], Routing.prefix, bound=3)
    for inst in pool.of("prefill"):
        inst.up = True
        inst.blocks = InstanceBlocks()
        inst.blocks.apply(0, [Stored((12345,), 16)])  # seen, holding none of the prompts below
    text = "Background: " + "the quick brown fox jumps over the lazy dog. " * 40
    p = prompt(text).with_tokens(list(range(1000, 1400)), None)  # 25 full blocks of 16
    store = Store()
    store.worker("a").apply(1, [Stored(tuple(p.store_hashes(16)[:20]))])  # the prefill hosts' workers: a and b
    pool.store = store
    probe = Pool(["http://a", "http://b"], [], Routing.prefix, bound=3)  # the same instances, nothing sent yet
    for inst, seen in zip(probe.of("prefill"), pool.of("prefill")):
        inst.up, inst.blocks = True, seen.blocks
    probe.store, probe.loadable_found = store, 0.0
    assert not probe.acquire("prefill", prompt=p).store_told  # b's worker has said nothing yet: not taken for empty
    store.worker("b").apply(1, [])
    # the estimate never saw the prompt finish and thinks the data system loses what it is given; its workers say
    # they hold the first 20 blocks: a leg loads them, and is charged the rest only
    pool.loadable_found = 0.0
    lease = pool.acquire("prefill", prompt=p)
    assert lease.store_told and lease.loadable == pytest.approx(20 * 16 * p.chunks / 400)
    assert lease.store_new == 5  # the blocks its connector saves: a batch of the worker's is due after it
    assert lease.work == pytest.approx(p.chunks - lease.loadable)
    pool.release(lease)
    assert pool.routing_state()["store_routed"] == 1
    # the other way round: the estimate remembers a prompt finished and trusts the data system; the workers say
    # they hold none of it (evicted): nothing is loadable, all of it is computed
    other = prompt("Other background: " + "a slow red cat sleeps under the warm sun. " * 40).with_tokens(
        list(range(5000, 5400)), None)
    pool.stored.remember(other.chain)
    pool.loadable_found = 1.0
    lease = pool.acquire("prefill", prompt=other)
    assert lease.store_told and lease.loadable == 0 and lease.work == pytest.approx(other.chunks)
    pool.release(lease)
    # the control: a worker blind (a batch missed) hands the decision back to the estimate, which loads it
    store.worker("a").apply(3, [])
    lease = pool.acquire("prefill", prompt=other)
    assert not lease.store_told and lease.loadable == pytest.approx(len(other.chain))
    pool.release(lease)
    # and so do a request with a cache salt the workers' keys chain from: its hashes differ from the unsalted ones
    salted = Prompt.of({"prompt": text, "cache_salt": "s1"}).with_tokens(list(range(1000, 1400)), None)
    assert salted.store_hashes(16) != p.store_hashes(16)
    # a request for another model (a LoRA adapter, whose name the keys also chain from) is not looked up
    store.worker("a").apply(1, [Stored(tuple(p.store_hashes(16)))])
    assert p.in_store(store, 16, {"a", "b"}) == 24  # all but the last block
    lora = Prompt.of({"prompt": text, "model": "my-lora"}, "smollm2").with_tokens(list(range(1000, 1400)), None)
    assert lora.in_store(store, 16, {"a", "b"}) is None
    assert Prompt.of({"prompt": text, "model": "smollm2"}, "smollm2").with_tokens(
        list(range(1000, 1400)), None).in_store(store, 16, {"a", "b"}) is not None  # the control: the served model
    assert salted.store_hashes(16) == [K.event_hash(d) for d in K.prefix_digests(
        list(range(1000, 1400)), 16, extra=K.request_extra(cache_salt="s1"))]  # as the connector keys them


def test_a_held_prefix_behind_a_queue_that_would_evict_it_counts_less_once_the_cache_has_evicted():
    """a holds the whole prompt and has legs queued; b holds nothing and is idle. Where a's cache has never had to
    evict, the prefix it holds is worth the wait (a); where it is full and the queue ahead computes as many new
    blocks as it holds, the prefix is likely gone when the leg runs: b. The control is the first case."""
    from yrpd.proxy.kvindex import InstanceBlocks, Removed, Stored, block_hashes

    text = "Background: " + "the quick brown fox jumps over the lazy dog. " * 40
    tokens = list(range(1000, 1000 + 16 * 28))
    p = prompt(text).with_tokens(tokens, None)

    def pool_with(evicted: bool):
        pool = Pool(["http://a", "http://b"], [], Routing.prefix, bound=100)
        a, b = pool.of("prefill")
        for inst in (a, b):
            inst.up = True
            inst.blocks = InstanceBlocks()
            inst.blocks.apply(0, [])
        filler = tuple(range(1, 29))  # as many blocks as the prompt: the size of a's cache
        # full once (it had to make room for the prompt's blocks), or not
        a.blocks.apply(1, [Stored(filler, 16), *([Removed(filler)] if evicted else [])])
        a.blocks.apply(2, [Stored(tuple(block_hashes(tokens, 16)), 16)])
        b.blocks.apply(1, [Stored((7,), 16)])
        a.in_flight, a.queued = 2, 1.5 * p.chunks  # legs queued there computing about 1.5 prompts' worth
        return pool, a, b

    pool, a, b = pool_with(evicted=False)
    assert pool.select("prefill", prompt=p) is a
    pool, a, b = pool_with(evicted=True)
    assert a.blocks.survival(a.queued * len(tokens) / p.chunks / 16) < 0.5
    assert pool.select("prefill", prompt=p) is b


def test_each_prefill_leg_checks_what_the_kv_event_index_said_against_what_the_cache_had(monkeypatch):
    """A leg routed on an instance's events claims the leading blocks they said it held; its connector says what
    the cache had when the leg was scheduled. /metrics counts both ways of being wrong (an index that drifted from
    the cache shows there, not only in a worse hit rate) and `yrpd bench run` reads each run's share. The controls:
    a leg routed on the estimate (blind) or one whose connector said nothing is not checked."""
    from yrpd.bench import run as bench_run
    from yrpd.proxy.kvindex import InstanceBlocks, Stored, block_hashes
    from yrpd.proxy.metrics import Metrics

    pool = Pool(["http://a"], ["http://d"], Routing.prefix)
    for inst in pool.instances:
        inst.up = True
    a = pool.of("prefill")[0]
    a.blocks = InstanceBlocks()
    tokens = list(range(1000, 1400))  # 25 blocks of 16
    a.blocks.apply(0, [Stored(tuple(block_hashes(tokens, 16)[:20]), 16)])
    p = prompt("Background: " + "the quick brown fox jumps over the lazy dog. " * 40).with_tokens(tokens, None)
    lease = pool.acquire("prefill", prompt=p)
    assert lease.held_blocks == 20
    assert pool.checked(lease, 12 * 16 + 5, 16) == (20, 12)  # 8 of its blocks were evicted meanwhile
    pool.release(lease)
    lease = pool.acquire("prefill", prompt=p)
    assert pool.checked(lease, 24 * 16, 16) == (20, 24)  # 4 more were stored meanwhile, not yet announced
    pool.release(lease)
    assert a.index_checked == {"right": 32, "claimed_absent": 8, "held_unclaimed": 4}
    text = Metrics().render(pool, kv_index={})
    assert 'yrpd_proxy_kv_index_checked_blocks_total{instance="http://a",role="prefill",outcome="claimed_absent"} 8' \
        in text and 'instance="http://d"' not in text.split("yrpd_proxy_kv_index_checked_blocks_total")[-1]
    # controls: no word from the connector, and a leg routed blind
    lease = pool.acquire("prefill", prompt=p)
    assert pool.checked(lease, None, 16) is None
    pool.release(lease)
    a.blocks.go_blind("batch 4 came after 2")
    lease = pool.acquire("prefill", prompt=p)
    assert lease.held_blocks is None and pool.checked(lease, 24 * 16, 16) is None
    assert a.index_checked == {"right": 32, "claimed_absent": 8, "held_unclaimed": 4}
    # the bench's reading of it: the sums over the instances, a run's deltas and the share agreed on
    monkeypatch.setattr(bench_run, "_proxy_metrics", lambda url: text)
    assert bench_run.index_checked("http://proxy") == {"right": 32, "claimed_absent": 8, "held_unclaimed": 4}
    assert bench_run.index_stage({"right": 2}, {"right": 32, "claimed_absent": 8, "held_unclaimed": 4}) == {
        "index_right_blocks": 30, "index_claimed_absent_blocks": 8, "index_held_unclaimed_blocks": 4,
        "index_agreement": round(30 / 42, 4)}
    assert bench_run.index_stage(a.index_checked, dict(a.index_checked)) == {}


def test_in_exact_mode_each_leg_is_routed_after_catching_up_on_every_up_instances_events(monkeypatch):
    """--kv-exact (the bench's oracle): before a leg is routed the proxy brings the copies of that role's instances up
    to the moment (yrpd.proxy.kvfeed.Feeds.catch_up, tested against vLLM's publisher in tests/connector). The
    controls: without it, or with the events not followed, it never does."""
    from yrpd.proxy.kvfeed import Feeds

    calls = []

    async def catch_up(self, urls):
        calls.append(sorted(urls))

    monkeypatch.setattr(Feeds, "catch_up", catch_up)

    async def legs(**options):
        calls.clear()
        async with running(prefill=2, routing=Routing.prefix, **options) as s:
            status, _, _ = await post(s, "/v1/completions", {"prompt": "Background: hello", "max_tokens": 3})
            assert status == 200
            return list(calls), sorted(p.url for p in s.prefill), [d.url for d in s.decode]

    caught, prefill, decode = run(legs(kv_exact=True))
    assert caught == [prefill, decode]  # the prefill leg, then the decode leg
    assert run(legs())[0] == []
    assert run(legs(kv_exact=True, kv_events=False))[0] == []


def test_with_events_a_prompt_follows_the_leg_in_flight_that_is_computing_its_prefix():
    """An instance's events announce blocks only once its leg has computed them; a second request with the same
    prefix arriving meanwhile goes to that instance (it will hold the prefix by its turn), not to the idle one that
    would compute the prefix again. The controls: once that leg ended without its events telling of the blocks (they
    were not kept), the prefix counts for nothing there; a prompt with another prefix goes to the idle instance."""
    from yrpd.proxy.kvindex import InstanceBlocks

    pool = Pool(["http://a", "http://b"], [], Routing.prefix)
    for inst in pool.of("prefill"):
        inst.up = True
        inst.blocks = InstanceBlocks()
        inst.blocks.apply(0, [])  # seen: holding nothing
    shared = "Background: " + "the quick brown fox jumps over the lazy dog. " * 40
    first = prompt(shared + "Q1?").with_tokens(list(range(1000, 1410)), None)
    second = prompt(shared + "Q2?").with_tokens(list(range(1000, 1400)) + [7] * 12, None)
    lease = pool.acquire("prefill", prompt=first)
    busy = lease.instance
    assert pool.select("prefill", prompt=second) is busy
    other = prompt("Unrelated: " + "a slow red cat sleeps under the warm sun. " * 40).with_tokens(
        list(range(5000, 5400)), None)
    assert pool.select("prefill", prompt=other) is not busy
    pool.release(lease)
    assert busy.pending == []
    assert pool.seen(busy, second) == 0  # ended, and its events told of nothing kept: nothing held


def test_blocks_the_data_system_has_only_on_disk_cost_more_to_load_than_waiting_for_an_instance_that_holds_them():
    """Instance a's own cache holds the first 10 of a prompt's 25 blocks, b's none, and the data system all but the
    last; a has work queued. Loaded from the workers' memory, the blocks are cheap: the idle b takes the leg. Where
    the workers' index takes them for spilled to disk (stored before more than the memory holds), a load costs
    DISK_LOAD_RATIO times as much: a, which must load fewer, takes it."""
    from yrpd.proxy.kvindex import InstanceBlocks, Store, Stored
    from yrpd.proxy.routing import DISK_LOAD_RATIO

    text = "Background: " + "the quick brown fox jumps over the lazy dog. " * 40
    p = prompt(text).with_tokens(list(range(1000, 1400)), None)  # 25 full blocks of 16

    def routed(spilled: bool):
        pool = Pool(["http://a", "http://b"], [], Routing.prefix, bound=3)
        a, b = pool.of("prefill")
        for inst, held in ((a, p.hashes(16)[:10]), (b, [12345])):
            inst.up, inst.blocks = True, InstanceBlocks()
            inst.blocks.apply(0, [Stored(tuple(held), 16)])
        a.queued = 8.0
        store = Store(memory_bytes=56_000)  # 38 blocks of 1,000 bytes (MEMORY_REACH)
        store.learn_block_bytes(1000)
        for host in ("a", "b"):
            store.worker(host).apply(1, [])
        later = [Stored(tuple(range(1, 71)))]  # 70 blocks of other prompts
        mine = [Stored(tuple(p.store_hashes(16)))]
        store.worker("a").apply(2, later + mine if not spilled else mine + later)
        pool.store = store
        lease = pool.acquire("prefill", prompt=p)
        pool.release(lease)
        return pool, lease

    pool, lease = routed(spilled=False)
    assert lease.store_told and lease.instance.url == "http://b" and lease.on_disk == 0
    pool, lease = routed(spilled=True)
    assert lease.store_told and lease.instance.url == "http://a"
    assert lease.on_disk == pytest.approx(lease.loadable) == pytest.approx(14 * 16 * p.chunks / 400)
    assert DISK_LOAD_RATIO > 1
    # its connector loaded the 14 blocks past the 10 its cache had: read back, they are in memory now
    hashes = p.store_hashes(16)[:24]
    for control in ({"block_size": 16}, {"cached_tokens": 160}):  # the connector did not say where its loads began
        pool.observe(lease, 14, **control)
        assert all(pool.store.on_disk(h) for h in hashes)
    pool.observe(lease, 14, cached_tokens=160, block_size=16)
    assert [pool.store.on_disk(h) for h in hashes] == [True] * 10 + [False] * 14
    from yrpd.proxy.metrics import Metrics
    text = Metrics().render(pool, store=pool.store.state())
    assert 'yrpd_proxy_store_index_on_disk_blocks{host="a"} 57' in text  # 25 + 70 held, 38 in memory
    assert "store_index_on_disk" not in Metrics().render(pool, store=Store().state())  # the control: no disk tier
    # what a block takes, as a connector says it (an instance with two TP ranks: twice the bytes), sizes the memory
    pool.observe(lease, 0, block_bytes=2000)
    assert pool.store.block_bytes == 2000 and pool.store.memory_blocks == pool.store.worker("a").memory == 19


def test_a_leg_that_loaded_from_disk_teaches_the_memory_loads_time_counting_each_chunk_as_the_disk_ratio():
    from yrpd.proxy.routing import DISK_LOAD_RATIO

    def taught(on_disk: bool) -> float:
        pool, home, other = a_prefix_stored_at_home()
        home.queued, home.in_flight = 15.0, 1
        moved = pool.acquire("prefill", prompt=prompt(SHARED + "Q2"))
        assert moved.instance is other and moved.loadable == 21
        if on_disk:
            moved.on_disk = moved.loadable  # as the workers' index would infer
        done = moved.started + 0.05 * moved.work + 21 * 0.2
        pool.release(moved, now=done)
        pool.observe(moved, 3, now=done)
        return pool.load_chunk_s

    assert taught(False) == pytest.approx(0.2)  # the control: from memory, 0.2 s a chunk
    assert taught(True) == pytest.approx(0.2 / DISK_LOAD_RATIO)  # the same seconds, from disk: memory is faster


def test_the_blocks_an_instance_holds_itself_are_not_charged_as_disk_loads_whatever_the_prompts_length():
    """Its cache holds the first k blocks, whose copies in the data system were spilled long ago; the rest are in
    the workers' memory: nothing it would load is on disk (chunks back to blocks must not fall a block short)."""
    from yrpd.proxy.kvindex import InstanceBlocks, Store, Stored

    for n_tokens in (400, 413, 437):
        p = prompt("Background: " + "the quick brown fox jumps over the lazy dog. " * 40).with_tokens(
            list(range(1000, 1000 + n_tokens)), None)
        for k in range(1, 24):
            pool = Pool(["http://a"], [], Routing.prefix)
            a = pool.of("prefill")[0]
            a.up, a.blocks = True, InstanceBlocks()
            a.blocks.apply(0, [Stored(tuple(p.hashes(16)[:k]), 16)])
            store = Store(memory_bytes=56_000)  # 38 blocks of 1,000 bytes
            store.learn_block_bytes(1000)
            mine = p.store_hashes(16)
            store.worker("a").apply(1, [Stored(tuple(mine[:k])), Stored(tuple(range(1, 39))), Stored(tuple(mine[k:]))])
            pool.store = store
            assert store.on_disk(mine[0]) and not store.on_disk(mine[k])
            lease = pool.acquire("prefill", prompt=p)
            assert lease.store_told and lease.loadable > 0 and lease.on_disk == 0, (n_tokens, k)
            pool.release(lease)
