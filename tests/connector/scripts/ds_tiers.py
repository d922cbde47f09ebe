"""Test helper run in the vLLM venv: the proxy's inference of which of a data-system worker's blocks are on its disk
tier (yrpd.proxy.kvindex.StoreBlocks), checked against the worker's own hit counters.

    PYTHONPATH=. python tests/connector/scripts/ds_tiers.py HOST:PORT RUN_DIR WORKER_HOME MEMORY_MB BLOCKS BLOCK_BYTES

The worker has MEMORY_MB of shared memory, a disk tier, resource.log every second under WORKER_HOME and its KV events
on ipc://RUN_DIR/kv-events-datasystem.sock. The connector's transport saves BLOCKS blocks of one prompt (one value of
BLOCK_BYTES each, the connector's keys), a few at a time, while the proxy's own feeds follow the worker. Then, with
the proxy told the blocks' size: the blocks it takes for in memory are loaded (newest first; the oldest EDGE of them
apart), then the oldest ten it takes for on disk, which the proxy is then told were loaded (`Store.touch`, as a
leg's answer tells it), and those ten once more. After each of the four loads the worker's counters are read (deploy_scripts/hostlib.ds_resource_now).
Prints one JSON line: what the proxy inferred (blocks in memory, on disk), the worker's hits from memory and from
disk for each load, and what the proxy inferred of the ten once told they were loaded.
"""

import asyncio
import json
import sys
import time
from pathlib import Path

import torch

from ds_events import connector_transport, following  # (this folder: the script's own)
from yrpd.connector import keys as K
from yrpd.connector.transport import BlockLayout

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "deploy_scripts"))
from hostlib import ds_resource_now as counters  # noqa: E402

BS = 16
#: how many of the blocks taken for in memory, the least recently stored, may have been spilled already
EDGE = 10


async def main() -> int:
    address, run_dir, home = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    memory_mb, blocks, nbytes = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    feeds = await following(run_dir, store_memory_mb=memory_mb)
    conn, transport, cfg = connector_transport(address, "tiers")
    tokens = list(range(1000, 1000 + blocks * BS))
    keys = K.block_keys("0123456789abcdef", tokens, BS)
    hashes = [K.event_hash(k.rsplit("@", 1)[1]) for k in keys]
    value = torch.full((nbytes,), 7, dtype=torch.uint8)
    for lo in range(0, blocks, 8):  # a few at a time, as legs save them: the worker spills as it fills
        transport.save(keys[lo:lo + 8], [value] * len(keys[lo:lo + 8]), cfg.ttl_seconds)
        await asyncio.sleep(0.05)
    store, worker = feeds.store, feeds.store.worker("127.0.0.1")
    deadline = time.monotonic() + 30  # a busy host delivers the worker's events late
    while time.monotonic() < deadline and len(worker.held) < blocks:
        await asyncio.sleep(0.1)
    store.learn_block_bytes(nbytes)
    on_disk = [store.on_disk(h) for h in hashes]
    log = next(home.rglob("resource.log"), None)
    if log is None:
        raise SystemExit(f"the worker wrote no resource.log under {home}: is log_monitor on?")
    part = torch.zeros((1, nbytes), dtype=torch.uint8)
    layout = BlockLayout.from_sizes([nbytes])

    def load(idx: list[int]) -> dict:
        before = counters(log)
        for i in idx:
            assert transport.load([keys[i]], [part], layout, [0]) == [True], f"block {i} did not load"
        after = counters(log)
        return {k: after[k] - before[k] for k in ("hits_memory", "hits_disk", "misses")}

    in_memory = [i for i in reversed(range(blocks)) if not on_disk[i]]
    oldest = [i for i in range(blocks) if on_disk[i]][:10]
    resource = counters(log)
    # the oldest EDGE of those taken for in memory are where the worker's spill may have gone further than the
    # inference (it spills in bursts, and further on a busy host): loaded apart
    memory_load = load(in_memory[:-EDGE])
    edge_load = load(in_memory[-EDGE:])
    disk_load = load(oldest)
    store.touch([hashes[i] for i in oldest])
    after_touch = [store.on_disk(hashes[i]) for i in oldest]
    again = load(oldest)
    print(json.dumps({"held": len(worker.held), "memory_blocks": store.memory_blocks, "in_memory": len(in_memory),
                      "on_disk": sum(on_disk), "sight": [worker.sight.value, worker.why],
                      "memory_load": memory_load, "edge": EDGE, "edge_load": edge_load, "disk_load": disk_load,
                      "after_touch_on_disk": after_touch, "again": again, "resource": resource}))
    await feeds.close()
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
