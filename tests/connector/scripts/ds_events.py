"""Test helper run in the vLLM venv: what a data-system worker started with `kv_events_config` publishes while the
connector's own transport saves blocks under the connector's keys and deletes some of them, read twice: raw from its
socket, and by the proxy's own feeds (yrpd.proxy.kvfeed.Feeds) as they follow a host's worker beside an instance.

    PYTHONPATH=. python tests/connector/scripts/ds_events.py HOST:PORT RUN_DIR < request.json

The worker publishes on ipc://RUN_DIR/kv-events-datasystem.sock. request.json: {"tokens": [...], "block_size": N,
"ns": "<16 hex>", "delete": K, "old_form": [key, ...]}: saves one value per full block of `tokens` under
`keys.block_keys`, then the `old_form` keys (any other form), then deletes the first K block keys. Prints one JSON
line: the hashes of the stored and of the removed events in order, the batches' numbers, the media the events named,
which block keys and old-form keys the data system holds at the end, what the proxy's index of that worker holds and
its sight, and the hashes the proxy's Prompt gives the same tokens.
"""

import asyncio
import json
import sys
import time

import msgspec
import torch
import zmq

from yrpd.connector import keys as K
from yrpd.connector.config import parse_config
from yrpd.connector.transport import DsConnection, HostTransport, kvclient_factory, write_mode
from yrpd.layout import DATASYSTEM_EVENTS, KV_EVENTS_SOCKET
from yrpd.proxy.kvfeed import Feeds
from yrpd.proxy.routing import Prompt


async def following(run_dir: str, **feeds_options) -> Feeds:
    """The proxy's own feeds, following the host's worker beside an instance on this host that publishes beside it
    (the instance's socket need not exist for this)."""
    feeds = Feeds(lag_s=1.0, **feeds_options)
    instance = {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"ipc://{run_dir}/{KV_EVENTS_SOCKET.format(name='prefill-0')}"}}
    await feeds.attach("http://127.0.0.1:8100", instance, "127.0.0.1", local=True)
    await asyncio.sleep(1.0)  # a SUB socket misses what is published before its connection is up
    return feeds


def connector_transport(address: str, name: str):
    """(connection, transport, config) as a producer's connector has them, to the worker at `address`."""
    cfg = parse_config("kv_producer", {"ds_address": address}, env={})
    conn = DsConnection(kvclient_factory(cfg.ds_host, cfg.ds_port, 5000, 30000, False), name)
    assert conn.connect(), conn.last_error
    return conn, HostTransport(conn, cfg.max_batch_keys, write_mode=write_mode(cfg)), cfg


async def main() -> int:
    address, run_dir = sys.argv[1], sys.argv[2]
    req = json.load(sys.stdin)
    endpoint = f"ipc://{run_dir}/{KV_EVENTS_SOCKET.format(name=DATASYSTEM_EVENTS)}"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    feeds = await following(run_dir)  # (its 1 s wait covers this socket's connection too)
    conn, transport, cfg = connector_transport(address, "events")
    keys = K.block_keys(req["ns"], req["tokens"], req["block_size"])
    values = [torch.full((4096,), i % 251, dtype=torch.uint8) for i in range(len(keys))]
    transport.save(keys, values, cfg.ttl_seconds)
    old = req.get("old_form") or []
    if old:
        transport.save(old, values[:len(old)], cfg.ttl_seconds)
    transport.delete(keys[:req.get("delete", 0)])
    held, old_held = transport.exists(keys), transport.exists(old) if old else []
    stored, removed, seqs, media = [], [], [], set()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # the feeds receive meanwhile
        while sub.poll(0):
            topic, seq, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            for event in msgspec.msgpack.decode(payload)[1]:
                media.add(event.get("medium"))
                (stored if event.get("type") == "BlockStored" else removed).extend(event.get("block_hashes") or ())
    worker = feeds.store.worker("127.0.0.1")
    prompt = Prompt.of({"prompt": "x"}).with_tokens(req["tokens"], None)
    seen = {"proxy_held": sorted(worker.held), "proxy_sight": worker.sight.value}

    async def save_one(n: int) -> None:
        more = K.block_keys(req["ns"], [n] * req["block_size"], req["block_size"])
        transport.save(more, values[:1], cfg.ttl_seconds)
        for _ in range(100):
            await asyncio.sleep(0.05)
            if K.event_hash(more[0].rsplit("@", 1)[1]) in worker.held:
                return

    # a leg said it saved blocks there and a batch came: still seen (the control) ...
    started = time.monotonic()
    await save_one(7)
    feeds.store_saved("127.0.0.1", started)
    feeds.check(time.monotonic() + 2.0)
    in_time = worker.sight.value
    # ... none came within the lag: blind for want of news, until the next batch in order
    feeds.store_saved("127.0.0.1", time.monotonic())
    feeds.check(time.monotonic() + 2.0)
    late = [worker.sight.value, worker.why]
    await save_one(8)
    print(json.dumps({"stored": stored, "removed": removed, "seqs": seqs, "media": sorted(map(str, media)),
                      "held": [bool(x) for x in held], "old_held": [bool(x) for x in old_held], **seen,
                      "prompt_hashes": prompt.store_hashes(req["block_size"]), "in_time": in_time, "late": late,
                      "after_late": worker.sight.value}))
    await feeds.close()
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
