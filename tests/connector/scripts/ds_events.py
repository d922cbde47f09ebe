"""Test helper run in the vLLM venv: what a data-system worker started with `kv_events_config` publishes while the
connector's own transport saves blocks under the connector's keys and deletes some of them.

    PYTHONPATH=. python tests/connector/scripts/ds_events.py HOST:PORT EVENTS_ENDPOINT < request.json

request.json: {"tokens": [...], "block_size": N, "ns": "<16 hex>", "delete": K, "old_form": [key, ...]}: saves one
value per full block of `tokens` under `keys.block_keys`, then the `old_form` keys (any other form), then deletes the
first K block keys. Prints one JSON line: the hashes of the stored and of the removed events, in order, the batches'
sequence numbers, the media the events named, and which block keys the data system holds at the end.
"""

import json
import sys
import time

import msgspec
import torch
import zmq

from yrpd.connector import keys as K
from yrpd.connector.config import parse_config
from yrpd.connector.transport import DsConnection, HostTransport, kvclient_factory, write_mode


def main() -> int:
    address, endpoint = sys.argv[1], sys.argv[2]
    req = json.load(sys.stdin)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(1.0)  # a SUB socket misses what is published before its connection is up
    cfg = parse_config("kv_producer", {"ds_address": address}, env={})
    conn = DsConnection(kvclient_factory(cfg.ds_host, cfg.ds_port, 5000, 5000, False), "events")
    assert conn.connect(), conn.last_error
    transport = HostTransport(conn, cfg.max_batch_keys, write_mode=write_mode(cfg))
    keys = K.block_keys(req["ns"], req["tokens"], req["block_size"])
    values = [torch.full((4096,), i % 251, dtype=torch.uint8) for i in range(len(keys))]
    transport.save(keys, values, cfg.ttl_seconds)
    old = req.get("old_form") or []
    if old:
        transport.save(old, values[:len(old)], cfg.ttl_seconds)
    transport.delete(keys[:req.get("delete", 0)])
    held = transport.exists(keys)
    stored, removed, seqs, media = [], [], [], set()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not sub.poll(250):
            continue
        topic, seq, payload = sub.recv_multipart()
        seqs.append(int.from_bytes(seq, "big"))
        for event in msgspec.msgpack.decode(payload)[1]:
            media.add(event.get("medium"))
            (stored if event.get("type") == "BlockStored" else removed).extend(event.get("block_hashes") or ())
    print(json.dumps({"stored": stored, "removed": removed, "seqs": seqs, "media": sorted(map(str, media)),
                      "held": [bool(x) for x in held]}))
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
