"""The proxy's KV index on its own (yrpd/proxy/kvindex.py): what an instance holds after stored, removed and cleared
events, a prefix that ends at the first block missing, and blindness when a batch is missing or the numbering
restarts, until a resync. (Against vLLM's own hashing and encoder: tests/connector/test_kvindex_vllm.py.)"""

from pathlib import Path

from yrpd.proxy.kvindex import Cleared, InstanceBlocks, Removed, Sight, Stored, block_hashes, events_of


def test_events_in_order_keep_an_exact_copy_of_what_the_instance_holds():
    inst = InstanceBlocks()
    assert inst.sight is Sight.never and inst.matched([1, 2]) == 0
    inst.apply(0, [Stored((1, 2, 3))])
    assert inst.sight is Sight.seeing and inst.matched([1, 2, 3, 4]) == 3
    inst.apply(1, [Removed((2,))])
    assert inst.matched([1, 2, 3]) == 1  # the chain breaks at the first block the instance no longer holds
    inst.apply(2, [Cleared(), Stored((7,))])
    assert inst.held == {7} and inst.sight is Sight.seeing and inst.gaps == 0


def test_a_missing_batch_makes_it_blind_a_restart_empties_it():
    inst = InstanceBlocks()
    inst.apply(0, [Stored((1,))])
    inst.apply(2, [Stored((2,))], now=100.0)  # batch 1 never came
    assert inst.sight is Sight.blind and inst.blind_since == 100.0 and "batch 2 came after 0" in inst.why
    assert inst.held == {1, 2}  # what it did hear still counts, as an estimate
    # a replay from the first batch rebuilds it exactly
    inst.rebuild()
    for seq, events in enumerate([[Stored((1,))], [Stored((3,))], [Stored((2,))]]):
        inst.apply(seq, events)
    inst.resync()
    assert inst.sight is Sight.seeing and inst.blind_since is None and inst.held == {1, 2, 3}
    # numbering from 0 again: a restarted instance, whose cache began empty; exact, since nothing was missed
    inst.apply(0, [Stored((9,))])
    assert inst.held == {9} and inst.sight is Sight.seeing and inst.restarts == 1 and inst.gaps == 1
    inst.apply(1, [Stored((8,))])
    # ... and blind where the restarted run's first batches were missed (batch 1 again: a third run, its 0 unseen)
    inst.apply(1, [Stored((7,))], now=200.0)
    assert inst.sight is Sight.blind and "batches before 1" in inst.why and inst.held == {7} and inst.gaps == 2
    # a gap is not a restart: what was held stays
    inst.apply(5, [Stored((6,))])
    assert inst.held == {6, 7} and inst.restarts == 2
    # joined late: the first batch seen is not the first published
    late = InstanceBlocks()
    late.apply(5, [Stored((1,))])
    assert late.sight is Sight.blind and "first batch seen was 5" in late.why
    # the control: batches in order never blind it
    fresh = InstanceBlocks()
    for seq in range(5):
        fresh.apply(seq, [Stored((seq,))])
    assert fresh.sight is Sight.seeing and fresh.gaps == 0 and fresh.restarts == 0


def test_what_it_holds_survives_a_queue_only_once_its_cache_has_had_to_evict():
    inst = InstanceBlocks()
    inst.apply(0, [Stored(tuple(range(100)))])
    assert (inst.count, inst.peak, inst.evicted) == (100, 100, 0)
    assert inst.survival(1000) == 1.0  # never evicted: no size known, room assumed
    inst.apply(1, [Removed(tuple(range(20))), Stored(tuple(range(100, 110)))])
    assert (inst.count, inst.peak, inst.evicted) == (90, 100, 20)  # full at 100: 10 free now
    assert inst.survival(10) == 1.0  # what is free is taken first
    assert inst.survival(55) == 0.5  # 45 new blocks evict half of the 90 held
    assert inst.survival(500) == 0.0 and inst.survival(0) == 1.0
    inst.apply(2, [Removed((999,))])  # a hash it did not hold moves nothing
    assert (inst.count, inst.evicted) == (90, 20)
    inst.apply(3, [Cleared()])  # emptied: its size, as learnt, stays
    assert (inst.count, inst.peak) == (0, 100) and inst.survival(50) == 1.0


def test_block_hashes_cover_full_blocks_only_and_chain():
    tokens = list(range(40))
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 2 and all(0 <= h < 2**64 for h in hashes)
    assert block_hashes(tokens[:32], 16) == hashes  # a partial last block has no hash
    # the second block's hash depends on the first: the same 16 tokens after another first block differ
    assert block_hashes([99] + tokens[1:32], 16)[1] != hashes[1]


def test_events_of_a_decoded_batch_keeps_the_kinds_the_index_uses():
    batch = [1.5, [{"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": None, "token_ids": [],
                    "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None},
                   {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"},
                   {"type": "AllBlocksCleared"}, {"type": "SomethingNew"}], 0]
    assert events_of(batch) == [Stored((5, 6), 16), Removed((5,)), Cleared()]


def test_blind_for_want_of_news_ends_with_the_next_batch_in_order_and_a_lost_one_keeps_it_blind():
    inst = InstanceBlocks()
    inst.apply(0, [Stored((1,), 16)])
    assert inst.block_size == 16  # learnt from the instance's own events
    inst.go_blind("no events after a prefill leg", now=5.0, lagging=True)
    assert inst.sight is Sight.blind and inst.held == {1}
    inst.apply(1, [Stored((2,))])  # late, nothing lost: exact again
    assert inst.sight is Sight.seeing and inst.held == {1, 2} and inst.gaps == 1
    # the control: lagging, then a batch skipped: a batch was lost, the next in-order one does not cure that
    inst.go_blind("no events after a prefill leg", lagging=True)
    inst.apply(3, [Stored((4,))])
    inst.apply(4, [Stored((5,))])
    assert inst.sight is Sight.blind and "batch 3 came after 1" in inst.why
    # down, then back: the instance's new run from its batch 0 is the whole of its new cache
    inst.go_blind("the instance is down", lagging=True)
    inst.apply(0, [Stored((9,))])
    assert inst.sight is Sight.seeing and inst.held == {9} and inst.restarts == 1


def test_the_relay_finds_each_instances_sockets_by_name_and_the_proxy_names_them_alike(tmp_path):
    """yrpd.proxy.kvrelay looks in the run directory for the sockets instances publish on; the proxy derives the
    same name from the endpoint an instance reports (/kv_event_sources), and only from such an endpoint."""
    from yrpd.layout import HostSessionLayout
    from yrpd.proxy.kvfeed import relayed_name
    from yrpd.proxy.kvrelay import instances_in, topic

    layout = HostSessionLayout(str(tmp_path), "s1")
    run = Path(layout.run_dir)
    run.mkdir(parents=True)
    for name in ("prefill-1", "prefill-10", "decode-0"):
        for what in ("events", "replay"):
            Path(layout.kv_events(name, what)).touch()
    (run / "kv-prefill-1-scheduler-dp0-rank0.json").touch()  # the connector's stats beside them: not an instance
    found = instances_in(run)
    assert set(found) == {"prefill-1", "prefill-10", "decode-0"}
    assert found["prefill-10"] == tuple(f"ipc://{layout.kv_events('prefill-10', what)}" for what in ("events", "replay"))
    assert all(relayed_name(events) == name for name, (events, _) in found.items())
    # no topic is a prefix of another's: a subscription to prefill-1 gets none of prefill-10's batches
    assert not topic("prefill-10").startswith(topic("prefill-1"))
    # the controls: a tcp endpoint, another socket, a replay socket are no instance's events
    for other in ("tcp://*:5557", f"ipc://{run}/other.sock", f"ipc://{layout.kv_events('decode-0', 'replay')}"):
        assert relayed_name(other) is None


def test_a_partial_blocks_entry_does_not_change_the_block_size_a_restart_learns_it_anew():
    """vLLM announces a partial block's entry (a hash unit finer than its blocks) with the tokens it covers as its
    block size: the index keeps hashing prompts by whole blocks. A restarted instance may have another size."""
    inst = InstanceBlocks()
    inst.apply(0, [Stored((1, 2), 16)])
    inst.apply(1, [Stored((3,), 5)])  # the partial entry of a prompt's last 5 tokens
    assert inst.block_size == 16
    inst.apply(0, [Stored((9,), 32)])  # numbering began again: a new run of the instance, a new cache
    assert inst.block_size == 32 and inst.held == {9}


def test_a_data_system_workers_events_keep_a_set_of_what_it_holds_numbered_from_one():
    from yrpd.proxy.kvindex import StoreBlocks

    w = StoreBlocks()
    assert w.sight is Sight.never and w.next_seq == 1
    w.apply(1, [Stored((1, 2)), Stored((2, 3))])  # the worker says "stored" again on every overwrite
    w.apply(2, [Removed((2,))])
    assert w.sight is Sight.seeing and w.held == {1, 3} and w.gaps == 0  # a set: one removal takes it out
    # a missed batch: blind, what it did hear still counts; it has no replay, so it stays blind ...
    w.apply(4, [Stored((5,))], now=50.0)
    assert w.sight is Sight.blind and w.blind_since == 50.0 and "batch 4 came after 2" in w.why and w.held == {1, 3, 5}
    w.apply(5, [Stored((6,))])
    assert w.sight is Sight.blind and w.gaps == 1
    # ... until the worker starts anew (numbering from 1 again), empty: exact again
    w.apply(1, [Stored((9,))])
    assert w.sight is Sight.seeing and w.held == {9} and w.restarts == 1
    # a new run whose first batches were missed: blind, emptied all the same
    w.apply(3, [Stored((8,))])
    w.apply(2, [Stored((7,))], now=60.0)
    assert w.sight is Sight.blind and "batches before 2" in w.why and w.held == {7} and w.restarts == 2


def test_a_proxy_that_joins_after_the_worker_stored_is_blind_one_that_joins_before_sees():
    from yrpd.proxy.kvindex import StoreBlocks

    late, early = StoreBlocks(), StoreBlocks()
    late.apply(7, [Stored((1,))])
    early.apply(1, [Stored((1,))])
    assert late.sight is Sight.blind and "first batch seen was 7" in late.why
    assert early.sight is Sight.seeing  # the control
    # blind for want of news (no batch after a leg saved there): the next batch in order ends it; a lost one does not
    early.go_blind("no event within 2 s", lagging=True)
    early.apply(2, [])
    assert early.sight is Sight.seeing
    early.go_blind("no event within 2 s", lagging=True)
    early.apply(4, [])
    early.apply(5, [])
    assert early.sight is Sight.blind and "batch 4 came after 2" in early.why


def test_the_data_system_holds_what_any_worker_holds_and_is_seen_while_none_is_blind():
    from yrpd.proxy.kvindex import Store

    store = Store()
    assert store.sight is Sight.never and store.matched([1]) == 0
    store.worker("h1").apply(1, [Stored((1, 2))])
    store.worker("h2").apply(1, [Stored((3,))])
    store.worker("h3")  # followed, silent so far: holds nothing, blinds nothing
    assert store.sight is Sight.seeing
    assert store.matched([1, 2, 3, 4]) == 3 and store.matched([2, 1]) == 2 and store.matched([4, 1]) == 0
    state = store.state()
    assert state["blocks"] == 3 and state["workers"]["h1"] == {"sight": "seeing", "blocks": 2, "gaps": 0,
                                                               "restarts": 0}
    # routing trusts it for the prefill hosts only where each one's worker is followed and seen: a silent one may be
    # one whose events never reach the proxy
    assert store.sees({"h1", "h2"}) and not store.sees({"h1", "h3"}) and not store.sees({"h4"}) and not store.sees(())
    store.worker("h2").apply(3, [])
    assert store.sight is Sight.blind and "why" in store.state()["workers"]["h2"] and not store.sees({"h1", "h2"})
    store.forget("h2")  # its instances left: neither its blocks nor its blindness count any more
    assert store.sees({"h1"}) and store.matched([3]) == 0 and store.sight is Sight.seeing


def test_where_a_worker_has_a_disk_tier_its_least_recently_written_or_read_blocks_are_taken_for_spilled():
    """The worker never says a block's tier: with a disk tier behind its memory, the blocks beyond what its memory
    holds, by when each was last stored or loaded, are taken for on disk (it spills the least recently used)."""
    from yrpd.proxy.kvindex import MEMORY_REACH, Store

    store = Store(memory_bytes=5000)  # 3 blocks of 1,000 bytes (MEMORY_REACH)
    a = store.worker("a")
    a.apply(1, [Stored((1, 2, 3, 4, 5))])
    # the blocks' size not said yet: nothing is taken for on disk
    assert store.memory_blocks is None and not any(store.on_disk(h) for h in range(1, 6))
    store.learn_block_bytes(1000)  # a prefill connector said what a block takes
    assert store.memory_blocks == a.memory == int(5000 * MEMORY_REACH) // 1000 == 3
    assert [store.on_disk(h) for h in range(1, 7)] == [True, True, False, False, False, False]  # 6: not held at all
    store.touch([1])  # a connector loaded block 1: read back into memory, the newest read
    assert [store.on_disk(h) for h in range(1, 6)] == [False, True, True, False, False]
    a.apply(2, [Stored((2,))])  # an overwrite lands in memory and pushes the oldest there (4) out
    assert [store.on_disk(h) for h in range(1, 6)] == [False, False, True, True, False]
    a.apply(3, [Removed((5,))])  # a removal makes room in memory, but reads nothing back from disk
    assert [store.on_disk(h) for h in range(1, 6)] == [False, False, True, True, False]
    assert store.state()["workers"]["a"] == {"sight": "seeing", "blocks": 4, "gaps": 0, "restarts": 0,
                                             "memory_blocks": 3, "on_disk": 2}
    a.apply(4, [Stored((6,))])  # the room is taken by a new block, not by one read back
    assert store.on_disk(3) and store.on_disk(4) and not store.on_disk(6)
    # a block another worker has in memory is loaded from there: not on disk
    store.worker("b").apply(1, [Stored((3,))])
    assert store.worker("b").memory == 3 and not store.on_disk(3)
    store.learn_block_bytes(500)  # a smaller size said later (an instance with fewer ranks) changes nothing
    assert store.memory_blocks == 3
    # the control: no disk tier (what a worker cannot hold it evicts, and says so): all it holds is in memory
    plain = Store()
    plain.worker("a").apply(1, [Stored((1, 2, 3, 4, 5))])
    plain.learn_block_bytes(1000)
    assert plain.memory_blocks is None and not any(plain.on_disk(h) for h in range(1, 6))
    assert "memory_blocks" not in plain.state()["workers"]["a"]
