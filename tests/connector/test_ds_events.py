"""What the data system says it holds of ours: a real worker started with `kv_events_config` (openYuanrong's own
KV-event publisher, on the unix socket yrpd gives it) publishes a stored event for every block the connector's
transport saves, under the number `keys.event_hash` gives its prefix digest, and a removed event when one goes; a key
of any other form is never published (the control: the worker publishes only the `@cache_family:` form, which
`keys.key_for` writes, and holds the other keys all the same). The proxy's own feeds, following the host's worker
beside an instance, hold what it holds, under the numbers the proxy's Prompt gives the same tokens, and go blind
when no batch follows a leg that saved blocks there within the lag (the control: one that did).
docs/dev/kv-events.md, "The data system's tiers". About 10 s."""

from __future__ import annotations

import json

import pytest

from tests.connector.harness import Stack, run_script
from yrpd.connector import keys as K
from yrpd.layout import DATASYSTEM_EVENTS, KV_EVENTS_SOCKET
from yrpd.proxy.kvindex import MEMORY_REACH

pytestmark = pytest.mark.e2e

BS = 16
NS = "0123456789abcdef"


def test_the_data_system_names_our_saved_and_deleted_blocks_by_their_prefix_digests(vllm_venv, session_stack,
                                                                                     e2e_root):
    stack = Stack(e2e_root / "ds-events", venv=vllm_venv, ports=session_stack.ports)
    run_dir = e2e_root / "ds-events" / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        ds = stack.start_ds(shm_mb=64, extra=("--kv_events_config", json.dumps(
            {"bind_endpoint": f"ipc://{run_dir}/{KV_EVENTS_SOCKET.format(name=DATASYSTEM_EVENTS)}",
             "backend_id": "ds-events-test"})))
        tokens = list(range(1000, 1000 + 5 * BS + 7))  # five full blocks and a partial one (no key of its own)
        old_form = [f"{K.KEY_PREFIX}_{NS}_{'ab' * 16}", f"{K.KEY_PREFIX}-other-{'cd' * 16}"]
        got = run_script(stack.venv, "ds_events.py", ds.address, str(run_dir),
                         stdin=json.dumps({"tokens": tokens, "block_size": BS, "ns": NS, "delete": 2,
                                           "old_form": old_form}))
        want = [K.event_hash(d) for d in K.prefix_digests(tokens, BS)]
        assert len(want) == 5
        assert got["stored"] == want, got  # every saved block, in order, and nothing for the other forms
        assert got["removed"] == want[:2], got  # the deleted ones
        assert got["held"] == [False, False, True, True, True], got  # as the data system answers
        assert got["seqs"] == list(range(1, len(got["seqs"]) + 1)), got  # numbered from 1 without a gap
        assert got["media"] == ["cpu"], got
        assert got["old_held"] == [True, True], got  # the other forms were saved, only never published
        # the proxy's index of the host's worker: what it holds now, seen, under the Prompt's own numbers
        assert got["proxy_sight"] == "seeing" and got["proxy_held"] == sorted(want[2:]), got
        assert got["prompt_hashes"] == want, got
        # silence after a leg that saved blocks there: blind within the lag, seen again with the next batch
        assert got["in_time"] == "seeing", got
        assert got["late"][0] == "blind" and "no event of the data system's within 1 s" in got["late"][1], got
        assert got["after_late"] == "seeing", got
    finally:
        stack.close()


def test_the_blocks_the_proxy_takes_for_spilled_are_those_the_worker_reads_from_disk(vllm_venv, session_stack, e2e_root):
    """The worker never says a block's tier; the proxy infers it (its memory over the blocks' size, the least
    recently stored or loaded beyond that on disk: kvindex.StoreBlocks). Checked against the worker's own hit
    counters: 150 blocks of 1 MiB into 64 MiB of memory with a disk tier behind it. Those taken for in memory are
    read from memory (all but the ten least recently stored of them, the edge the worker's spill may pass); the
    oldest ten taken for on disk are read from disk (the control: the inference is not "all in memory"). Once the
    proxy is told they were loaded they count as in memory, and the worker reads them from memory again."""
    stack = Stack(e2e_root / "ds-tiers", venv=vllm_venv, ports=session_stack.ports)
    run_dir = e2e_root / "ds-tiers" / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        ds = stack.start_ds(shm_mb=64, extra=(
            "--spill_directory", str(e2e_root / "ds-tiers" / "disk"), "--spill_size_limit", str(512 << 20),
            "--log_monitor", "true", "--log_monitor_interval_ms", "1000",
            "--kv_events_config", json.dumps(
                {"bind_endpoint": f"ipc://{run_dir}/{KV_EVENTS_SOCKET.format(name=DATASYSTEM_EVENTS)}",
                 "backend_id": "ds-tiers-test"})))
        got = run_script(stack.venv, "ds_tiers.py", ds.address, str(run_dir), str(ds.home), "64", "150",
                         str(1 << 20))
        print(f"measured: {got}")
        assert got["sight"] == ["seeing", ""], got  # every batch of the worker's followed
        assert got["held"] == 150 and got["memory_blocks"] == got["in_memory"] == int(64 * MEMORY_REACH), got
        # the worker keeps between its 80 % and 90 % marks in memory (a 1 MiB value takes about 1.25 MiB there), but
        # spills in bursts: a quiet host kept 43 blocks (edge 0-3), the CI's busy one 38. So the oldest ten taken for
        # in memory (the edge) may come from either tier, the rest from memory alone
        inner = got["in_memory"] - got["edge"]
        assert got["edge"] == 10 and got["memory_load"] == {"hits_memory": inner, "hits_disk": 0, "misses": 0}, got
        assert got["edge_load"]["hits_memory"] + got["edge_load"]["hits_disk"] == got["edge"], got
        assert got["edge_load"]["misses"] == 0, got
        assert got["disk_load"] == {"hits_memory": 0, "hits_disk": 10, "misses": 0}, got
        assert got["after_touch_on_disk"] == [False] * 10, got
        assert got["again"] == {"hits_memory": 10, "hits_disk": 0, "misses": 0}, got
    finally:
        stack.close()
