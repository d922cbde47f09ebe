"""The proxy's KV index (yrpd/proxy/kvindex.py) against vLLM 0.32 itself, in its venv: the block hashes it computes
for real prompts (SmolLM2's tokenizer, the embedded default's model) are the ones vLLM's prefix cache computes and
its events publish, with and without PYTHONHASHSEED; and the batches vLLM's publisher encodes read back into what an
instance holds."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from tests.lab.real_model import MODEL_DIR
from tests.prereq import missing
from yrpd.proxy import kvindex

pytestmark = pytest.mark.torch

BLOCK = 16
PROMPTS = [
    "The capital of France is Paris. " * 12,
    "The capital of France is Paris. " * 12 + "And the capital of Italy is",
    "import os\nimport sys\n\ndef main():\n    print(sys.argv)\n" * 6,
]


@pytest.fixture(scope="module")
def tokenize():
    tokenizer_json = MODEL_DIR / "tokenizer.json"
    if not tokenizer_json.is_file():
        missing(f"{tokenizer_json} missing: run scripts/test.sh (it makes the built-in model)")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    return lambda text: tok.encode(text).ids


def vllm_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """What vLLM's prefix cache names each full block, as its events carry it, with the seed its environment gives."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as u

    u.init_none_hash(sha256)
    parent, out = None, []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = u.hash_block_tokens(sha256, parent, token_ids[start:start + block_size], None)
        out.append(u.maybe_convert_block_hash(parent))
    return out


def stored(*hashes):
    """A batch of vLLM's events: the blocks `hashes` stored."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=BLOCK, lora_id=None,
        medium="GPU", lora_name=None)])


async def until(check, what: str, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("seed", [None, "0"])
def test_block_hashes_are_vllms_for_real_prompts(tokenize, monkeypatch, seed):
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    ids = [tokenize(p) for p in PROMPTS]
    for tokens in ids:
        want = vllm_hashes(tokens, BLOCK)
        assert len(want) == len(tokens) // BLOCK > 3
        assert kvindex.block_hashes(tokens, BLOCK, seed) == want
    # equal leading blocks, equal hashes; the first block that differs and every one after it, different
    first, second = (kvindex.block_hashes(t, BLOCK, seed) for t in ids[:2])
    same = next(i for i in range(len(ids[0])) if ids[0][i] != ids[1][i]) // BLOCK
    assert first[:same] == second[:same] and same > 0
    assert not set(first[same:]) & set(second[same:])
    # the control: the other seed names every block differently
    assert not set(kvindex.block_hashes(ids[0], BLOCK, "1" if seed is None else None)) & set(first)


def test_vllms_published_batches_tell_what_an_instance_holds(tokenize):
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    tokens = tokenize(PROMPTS[1])
    hashes = kvindex.block_hashes(tokens, BLOCK)
    encode = msgspec.msgpack.Encoder().encode
    stored = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens[:len(hashes) * BLOCK],
                         block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None)
    removed = BlockRemoved(block_hashes=hashes[-2:], medium="GPU")
    inst = kvindex.InstanceBlocks()
    inst.apply(0, kvindex.events_of(kvindex.decode_batch(encode(KVEventBatch(ts=1.0, events=[stored])))))
    assert inst.sight is kvindex.Sight.seeing and inst.matched(hashes) == len(hashes)
    inst.apply(1, kvindex.events_of(kvindex.decode_batch(encode(KVEventBatch(ts=2.0, events=[removed],
                                                                             data_parallel_rank=0)))))
    assert inst.matched(hashes) == len(hashes) - 2  # its tail evicted: the prefix ends there
    # the shorter prompt's blocks are the longer one's first five: the same blocks, so the same prefix left
    shorter = kvindex.block_hashes(tokenize(PROMPTS[0]), BLOCK)
    assert shorter == hashes[:len(shorter)] and inst.matched(shorter) == len(hashes) - 2
    inst.apply(2, kvindex.events_of(kvindex.decode_batch(encode(KVEventBatch(ts=3.0, events=[AllBlocksCleared()])))))
    assert inst.held == set() and inst.sight is kvindex.Sight.seeing


def test_the_index_holds_what_vllms_block_pool_holds_when_two_requests_computed_the_same_prefix(tokenize):
    """vLLM's own block pool, its events on: two requests that miss the same prompt in one step each compute and
    cache it, so the pool holds two blocks under every one of its hashes, announced twice; evicting the first
    request's copies announces their removal, and the second's still serve the prefix. The index, fed the pool's
    events as the publisher encodes them, matches the whole prompt until the last copy of each block is gone, as the
    pool's own lookup does."""
    import msgspec
    from vllm import SamplingParams
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    tokens = tokenize(PROMPTS[1])
    n = len(tokens) // BLOCK
    pool = BlockPool(2 * n + 1, True, BLOCK, enable_kv_cache_events=True)  # (its first block is its null block)
    hasher = get_request_block_hasher(BLOCK, sha256)
    first, second = (Request(f"r{i}", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
                     for i in (1, 2))
    inst, seq = kvindex.InstanceBlocks(), iter(range(100))
    encode = msgspec.msgpack.Encoder().encode

    def publish():
        batch = KVEventBatch(ts=time.time(), events=pool.take_events())
        inst.apply(next(seq), kvindex.events_of(kvindex.decode_batch(encode(batch))))

    def pool_holds() -> int:  # the leading blocks vLLM's own lookup finds
        found = 0
        for h in first.block_hashes[:n]:
            if pool.get_cached_block(h, [0]) is None:
                break
            found += 1
        return found

    hashes = kvindex.block_hashes(tokens, BLOCK)
    own, other = pool.get_new_blocks(n), pool.get_new_blocks(n)
    pool.cache_full_blocks(first, own, 0, n, BLOCK, 0)
    pool.cache_full_blocks(second, other, 0, n, BLOCK, 0)
    publish()
    assert pool_holds() == n and inst.matched(hashes) == n
    pool.free_blocks(own)
    pool.free_blocks(other)
    pool.get_new_blocks(n)  # evicted in the order freed: the first request's copies
    publish()
    assert pool_holds() == n and inst.matched(hashes) == n  # every block still has its second copy
    assert len(inst.held) == n
    pool.get_new_blocks(1)  # then the second request's first block: the prefix ends at once
    publish()
    assert pool_holds() == 0 and inst.matched(hashes) == 0 and len(inst.held) == n - 1


def test_a_feed_follows_vllms_publisher_and_fills_what_it_missed_from_the_replay_socket(tmp_path):
    """vLLM's own ZMQ publisher (the one an instance's scheduler runs), on ipc sockets: a subscriber that joins
    after the first batches gets them from the replay socket; a gap is filled the same way; a gap the publisher's
    buffer no longer holds leaves the copy blind; a new publisher (a restarted instance) is followed from its first
    batch, the old holdings dropped."""
    from vllm.distributed.kv_events import BlockRemoved, KVEventBatch, ZmqEventPublisher

    from yrpd.proxy.kvfeed import Feed

    def start(name: str, buffer_steps: int) -> tuple[ZmqEventPublisher, str, str]:
        pub, replay = f"ipc://{tmp_path}/{name}-pub", f"ipc://{tmp_path}/{name}-replay"
        return ZmqEventPublisher(0, endpoint=pub, replay_endpoint=replay, buffer_steps=buffer_steps), pub, replay

    async def scenario():
        publisher, pub, replay = start("a", buffer_steps=100)
        for h in (1, 2, 3):  # published before anyone subscribed: a PUB socket drops them
            publisher.publish(stored(h))
        # publish() only queues a batch for the publisher's thread: sent after the subscription joined, they would
        # arrive without a replay. The queue is pinned vLLM's; task_done() comes once a batch is on the socket.
        await asyncio.to_thread(publisher._event_queue.join)
        blocks = kvindex.InstanceBlocks()
        feed = Feed(blocks, pub, replay)
        task = asyncio.create_task(feed.run())
        await asyncio.sleep(0.5)  # the subscription is up
        publisher.publish(stored(4))
        await until(lambda: blocks.last_seq == 3, "batch 3 never arrived")
        assert blocks.held == {1, 2, 3, 4} and blocks.sight is kvindex.Sight.seeing and feed.replays == 1
        # a gap (batches 4 and 5 published but not delivered): asked again of the replay socket, applied in order
        task.cancel()
        publisher.publish(stored(5))
        publisher.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[1], medium="CPU")]))
        publisher.publish(stored(7))
        await asyncio.sleep(0.5)
        await feed.receive(6, msgspec.msgpack.Encoder().encode(stored(7)))
        assert blocks.held == {2, 3, 4, 5, 7} and blocks.sight is kvindex.Sight.seeing and blocks.last_seq == 6
        publisher.shutdown()

        # a publisher that keeps 2 batches: a gap older than that cannot be filled, and the copy says so
        small, pub, replay = start("b", buffer_steps=2)
        for h in range(6):
            small.publish(stored(10 + h))
        await asyncio.sleep(0.5)
        short = kvindex.InstanceBlocks()
        short.apply(0, [kvindex.Stored((10,))])
        await Feed(short, pub, replay).receive(5, msgspec.msgpack.Encoder().encode(stored(15)))
        assert short.sight is kvindex.Sight.blind and short.held == {10, 15}
        small.shutdown()

        # the instance restarted: a new publisher numbers from 0 again and its cache began empty; its first
        # batches, missed, come from its replay socket
        again, pub, replay = start("c", buffer_steps=100)
        for h in (20, 21, 22):
            again.publish(stored(h))
        await asyncio.sleep(0.5)
        restarted = Feed(blocks, pub, replay)
        await restarted.receive(2, msgspec.msgpack.Encoder().encode(stored(22)))
        assert blocks.held == {20, 21, 22} and blocks.sight is kvindex.Sight.seeing and blocks.restarts == 1
        again.shutdown()

    import msgspec

    asyncio.run(scenario())


def test_catching_up_sees_a_cache_before_its_events_arrive_and_their_late_arrival_is_no_restart(tmp_path):
    """The exact mode (--kv-exact, the bench's oracle): a batch vLLM's publisher sent but the subscription has not
    delivered is fetched from the replay socket before routing; when the subscription then delivers the same batch
    it is not read as a new run of the publisher (the copy stays seeing, nothing rebuilt). The control: a batch of
    that number with other contents is a restarted instance."""
    import msgspec
    from vllm.distributed.kv_events import ZmqEventPublisher

    from yrpd.proxy.kvfeed import Feed

    encode = msgspec.msgpack.Encoder().encode
    pub, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"

    async def scenario():
        publisher = ZmqEventPublisher(0, endpoint=pub, replay_endpoint=replay, buffer_steps=100)
        blocks = kvindex.InstanceBlocks()
        feed = Feed(blocks, pub, replay)  # not subscribed: what it learns comes from replays alone
        assert await feed.sync() and blocks.held == set()
        first, second = stored(1, 2), stored(3)
        publisher.publish(first)
        publisher.publish(second)
        await asyncio.sleep(0.3)
        assert blocks.held == set()  # the subscription would still be on its way
        assert await feed.catch_up()
        assert blocks.held == {1, 2, 3} and blocks.last_seq == 1 and feed.replays == 2
        # the subscription delivers them late: the same batches, nothing happens
        await feed.receive(0, encode(first))
        await feed.receive(1, encode(second))
        assert blocks.held == {1, 2, 3} and blocks.restarts == 0 and blocks.sight is kvindex.Sight.seeing
        assert feed.replays == 2  # no replay asked for them
        # nothing new: catching up changes nothing
        assert await feed.catch_up() and blocks.held == {1, 2, 3}
        publisher.publish(stored(4))
        await asyncio.sleep(0.3)
        await feed.receive(2, encode(stored(4)))  # delivered before any catch-up: applied once
        assert blocks.held == {1, 2, 3, 4} and blocks.last_seq == 2
        publisher.shutdown()

        # the control: batch 0 again with other contents is a new publisher (a restarted instance, cache empty)
        again = ZmqEventPublisher(0, endpoint=pub, replay_endpoint=replay, buffer_steps=100)
        await asyncio.sleep(0.3)
        fresh = stored(9)
        again.publish(fresh)
        await asyncio.sleep(0.3)
        await feed.receive(0, encode(fresh))
        assert blocks.held == {9} and blocks.restarts == 1 and blocks.sight is kvindex.Sight.seeing
        again.shutdown()

    asyncio.run(scenario())


def publisher_sockets(tmp_path) -> tuple[str, str, dict]:
    """One instance's publisher on unix sockets: (its endpoint, its replay endpoint, what its /kv_event_sources
    answers)."""
    pub, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    return pub, replay, {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
                               "replay_endpoint": replay, "topic": ""}}


async def following(tmp_path, url: str, lag_s: float, exact: bool = False):
    """The proxy's feeds attached to a vLLM publisher of their own: (the feeds, the publisher)."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    from yrpd.proxy.kvfeed import Feeds

    pub, replay, sources = publisher_sockets(tmp_path)
    feeds = Feeds(lag_s=lag_s, exact=exact)
    publisher = ZmqEventPublisher(0, endpoint=pub, replay_endpoint=replay)
    assert await feeds.attach(url, sources, "127.0.0.1", local=True) is None
    return feeds, publisher


def test_the_proxys_feeds_say_when_they_cannot_see_a_cache_and_see_again(tmp_path):
    """What the proxy does with vLLM's publisher (yrpd.proxy.kvfeed.Feeds), on ipc sockets: subscribing syncs from
    the replay socket (an instance with nothing published yet is seen, empty); a publisher that goes silent after a
    leg that stored blocks makes the copy blind within the lag, and its next batch cures that; an instance down is
    blind until it is back, when its new run's replay makes the copy exact again. Where the proxy cannot subscribe,
    the reason is kept. The controls: a feed that hears its batch in time stays seeing."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    from yrpd.proxy.pool import Pool

    pub, replay, sources = publisher_sockets(tmp_path)
    url = "http://127.0.0.1:8100"

    async def scenario():
        feeds, publisher = await following(tmp_path, url, lag_s=0.5)
        blocks = feeds.watch(url).blocks
        assert blocks.sight is kvindex.Sight.seeing and blocks.held == set()  # alive, holding nothing yet
        await asyncio.sleep(0.3)  # the subscription is up
        publisher.publish(stored(1, 2))
        await until(lambda: blocks.held == {1, 2}, "the first batch never arrived")
        assert feeds.state(url)["block_size"] == BLOCK

        # a leg stored blocks and its batch came in time: still seeing (the control)
        t0 = time.monotonic()
        publisher.publish(stored(3))
        await until(lambda: 3 in blocks.held, "batch 1 never arrived")
        feeds.leg_stored(url, t0, 1)
        assert feeds.check(time.monotonic() + 1) == [] and blocks.sight is kvindex.Sight.seeing

        # silent after a leg that stored blocks: blind once the lag has passed, then its next batch cures it
        feeds.leg_stored(url, time.monotonic(), 2)
        assert feeds.check() == [] and blocks.sight is kvindex.Sight.seeing  # not yet
        assert feeds.check(time.monotonic() + 0.6) == [url] and blocks.sight is kvindex.Sight.blind
        assert "no KV-cache event within 0.5 s" in feeds.state(url)["why"]
        publisher.publish(stored(4))
        await until(lambda: blocks.sight is kvindex.Sight.seeing, "the next batch did not cure the lag")
        assert blocks.held == {1, 2, 3, 4}

        # down, and back as a new run that published before the proxy saw it up: exact again from its replay
        pool = Pool([url], [])  # as the proxy takes it out of rotation (a failed probe or request)
        [inst] = pool.of("prefill")
        inst.up, inst.blocks = True, blocks
        pool.probed(inst, False, "connection refused")
        assert feeds.state(url)["sight"] == "blind" and feeds.state(url)["why"] == "the instance is down"
        publisher.shutdown()
        publisher = ZmqEventPublisher(0, endpoint=pub, replay_endpoint=replay)
        publisher.publish(stored(9))
        await asyncio.sleep(0.3)
        assert await feeds.attach(url, sources, "127.0.0.1", local=True) is None
        assert blocks.sight is kvindex.Sight.seeing and blocks.held == {9}
        publisher.shutdown()

        # where the proxy cannot subscribe it says why, and the instance stays unseen
        other = "http://10.0.0.2:8100"
        assert "not the proxy's" in await feeds.attach(other, sources, "10.0.0.2", local=False)
        assert await feeds.attach("http://x:1", {}, "x", local=True) == "it publishes no KV-cache events"
        assert feeds.state(other)["sight"] == "never" and "not the proxy's" in feeds.state(other)["why"]
        await feeds.close()

    asyncio.run(scenario())


def test_the_exact_mode_asks_a_replay_only_of_a_copy_that_lacks_an_ended_legs_last_block(tmp_path):
    """The oracle's catch-up (Feeds.catch_up) against vLLM's publisher: a copy that holds the last block of every leg
    that ended there makes no round trip (vLLM serves a replay after up to 0.1 s); one that lacks it, though other
    batches came meanwhile, asks the replay socket, gets the blocks the subscription has not delivered, and asks
    once; a leg that ends while that replay is on its way is asked for again."""
    url = "http://127.0.0.1:8100"

    async def scenario():
        feeds, publisher = await following(tmp_path, url, lag_s=5, exact=True)
        w = feeds.watch(url)
        await asyncio.sleep(0.3)  # the subscription is up
        publisher.publish(stored(1, 2))
        await until(lambda: w.blocks.held == {1, 2}, "the first batch never arrived")
        replays, spent = w.feed.replays, w.feed.replay_s
        feeds.leg_stored(url, time.monotonic(), 2, last=2)  # its last block came by the subscription
        assert await feeds.catch_up([url]) == 0 and w.feed.replays == replays and w.feed.replay_s == spent

        # the subscription stops delivering; a batch of another leg came, but not this leg's last block
        w.task.cancel()
        await asyncio.sleep(0.1)
        publisher.publish(stored(3, 4))
        await asyncio.sleep(0.3)
        assert 4 not in w.blocks.held
        feeds.leg_stored(url, time.monotonic(), 2, last=4)
        assert await feeds.catch_up([url]) == 1 and w.blocks.held == {1, 2, 3, 4} and w.feed.replays == replays + 1
        assert w.feed.replay_s > spent and feeds.state(url)["replay_s"] == round(w.feed.replay_s, 3)  # its price
        assert await feeds.catch_up([url]) == 0 and w.feed.replays == replays + 1  # once it holds it, no more

        # a leg ends while a replay is on its way: that replay cannot answer for it, so it stays awaited
        publisher.publish(stored(5))
        await asyncio.sleep(0.3)
        feeds.leg_stored(url, time.monotonic(), 1, last=5)
        first = asyncio.ensure_future(feeds.catch_up([url]))
        await asyncio.sleep(0)  # the replay is asked
        feeds.leg_stored(url, time.monotonic(), 1, last=6)  # its batch is published after that replay's answer
        assert await first == 1 and 5 in w.blocks.held and w.awaited == {6}
        publisher.publish(stored(6))
        await asyncio.sleep(0.3)
        assert await feeds.catch_up([url]) == 1 and 6 in w.blocks.held
        assert not w.awaited and await feeds.catch_up([url]) == 0
        publisher.shutdown()
        await feeds.close()
        # the control: without the exact mode nothing asks for them, so nothing is kept awaited (it only grew)
        plain, publisher = await following(tmp_path, url, lag_s=5)
        plain.leg_stored(url, time.monotonic(), 1, last=7)
        assert 7 not in plain.watch(url).blocks.held and not plain.watch(url).awaited
        publisher.shutdown()
        await plain.close()

    asyncio.run(scenario())


def test_through_a_hosts_relay_the_proxy_follows_an_instance_on_another_host_and_only_with_its_key(tmp_path):
    """The relay (yrpd.proxy.kvrelay) beside instances publishing on unix sockets, reached over tcp with CURVE: the
    proxy's feeds sync from it, follow the instance's batches under its name, fill a gap through it, and an instance
    that appears later is found (the run directory is looked at again). The keyed control: a client with another key
    gets nothing, neither batches nor a replay."""
    import threading

    import msgspec
    from vllm.distributed.kv_events import ZmqEventPublisher

    from yrpd.credentials import curve_keypair
    from yrpd.layout import KV_EVENTS_SOCKET, KV_REPLAY_SOCKET
    from yrpd.proxy.kvfeed import Curve, Feeds
    from yrpd.proxy.kvrelay import Relay

    def publisher(name: str) -> ZmqEventPublisher:
        return ZmqEventPublisher(0, endpoint=f"ipc://{tmp_path}/{KV_EVENTS_SOCKET.format(name=name)}",
                                 replay_endpoint=f"ipc://{tmp_path}/{KV_REPLAY_SOCKET.format(name=name)}")

    def sources(name: str) -> dict:
        return {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
                      "endpoint": f"ipc://{tmp_path}/{KV_EVENTS_SOCKET.format(name=name)}",
                      "replay_endpoint": f"ipc://{tmp_path}/{KV_REPLAY_SOCKET.format(name=name)}"}}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, proxy, stranger = curve_keypair(), curve_keypair(), curve_keypair()
    first = publisher("prefill-1")
    relay = Relay(tmp_path, "127.0.0.1", port, (server[1], server[0], proxy[0]))
    stop = threading.Event()
    thread = threading.Thread(target=relay.serve, args=(stop.is_set,), daemon=True)
    thread.start()

    async def scenario():
        feeds = Feeds(lag_s=0.5, curve=Curve(server[0], *proxy), relay_port=port)
        first.publish(stored(1, 2))  # before anyone listens: only a replay has it
        await asyncio.sleep(1.5)  # the relay has found the sockets
        assert await feeds.attach("http://h2:8101", sources("prefill-1"), "127.0.0.1", local=False) is None
        blocks = feeds.watch("http://h2:8101").blocks
        assert blocks.held == {1, 2} and blocks.sight is kvindex.Sight.seeing
        await asyncio.sleep(0.5)  # subscribed through the relay
        first.publish(stored(3))
        await until(lambda: blocks.held == {1, 2, 3}, "a batch never came through the relay")
        # an instance whose name extends another's (prefill-10): its batches are not prefill-1's
        tenth = publisher("prefill-10")
        await asyncio.sleep(1.5)
        assert await feeds.attach("http://h2:8110", sources("prefill-10"), "127.0.0.1", local=False) is None
        await asyncio.sleep(0.5)
        tenth.publish(stored(100))
        other = feeds.watch("http://h2:8110").blocks
        await until(lambda: other.held == {100}, "the second instance's batch never came")
        assert blocks.held == {1, 2, 3}
        # a gap, filled through the relay's replay port
        feed = feeds.watch("http://h2:8101").feed
        first.publish(stored(4))
        first.publish(stored(5))
        await until(lambda: blocks.held == {1, 2, 3, 4, 5}, "the later batches never came")
        await feed.receive(4, msgspec.msgpack.Encoder().encode(stored(5)))  # delivered again: nothing changes
        assert blocks.sight is kvindex.Sight.seeing and blocks.restarts == 0

        # an instance the relay has not found (no sockets by that name): no answer, so the proxy does not take it
        # for one seen empty
        assert await feeds.attach("http://h2:8199", sources("prefill-9"), "127.0.0.1", local=False) is None
        unknown = feeds.watch("http://h2:8199").blocks
        assert unknown.sight is kvindex.Sight.blind and "replay" in unknown.why

        # the keyed control: another client key is refused by the relay's ZAP handler
        intruder = Feeds(lag_s=0.5, curve=Curve(server[0], *stranger), relay_port=port)
        assert await intruder.attach("http://h2:8101", sources("prefill-1"), "127.0.0.1", local=False) is None
        theirs = intruder.watch("http://h2:8101").blocks
        assert theirs.sight is kvindex.Sight.blind and "replay" in theirs.why and theirs.held == set()
        first.publish(stored(6))
        await until(lambda: 6 in blocks.held, "the proxy's own feed stopped")
        await asyncio.sleep(0.5)
        assert theirs.held == set()
        # and without a relay known for it, an instance elsewhere is routed on the estimate, saying why
        alone = Feeds(lag_s=0.5, curve=Curve(server[0], *proxy))
        why = await alone.attach("http://h2:8101", sources("prefill-1"), "127.0.0.1", local=False)
        assert why == "its events go to a socket on its own host, not the proxy's"
        for f in (feeds, intruder, alone):
            await f.close()
        tenth.shutdown()

    try:
        asyncio.run(scenario())
    finally:
        stop.set()
        thread.join(5)
        relay.close()
        first.shutdown()
