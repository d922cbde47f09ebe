"""Test helper run in the vLLM venv: save many KV blocks through the connector's own transport and write mode into
a real data-system worker, more than its memory holds.

    PYTHONPATH=. python tests/connector/scripts/ds_fill.py HOST:PORT EVICTABLE(true|false) BLOCKS BLOCK_BYTES [STOP_AFTER_FAILURES]

Prints one JSON line: how many saves succeeded and failed (with the first error), which of the first and last
tenth of the keys still exist afterwards, and whether the first key reads back with the bytes it was saved with.
"""

import json
import sys

import torch

from yrpd.connector.config import parse_config
from yrpd.connector.transport import write_mode
from yrpd.connector.transport import BlockLayout, DsConnection, HostTransport, kvclient_factory


def main() -> int:
    address, evictable, blocks, nbytes = sys.argv[1], sys.argv[2] == "true", int(sys.argv[3]), int(sys.argv[4])
    stop_after = int(sys.argv[5]) if len(sys.argv) > 5 else blocks  # each refused save takes seconds of retries
    cfg = parse_config("kv_producer", {"ds_address": address, "evictable": evictable}, env={})
    conn = DsConnection(kvclient_factory(cfg.ds_host, cfg.ds_port, 5000, 5000, False), "fill")
    assert conn.connect(), conn.last_error
    transport = HostTransport(conn, cfg.max_batch_keys, write_mode=write_mode(cfg))
    keys = [f"yrpd-fill-{evictable}-{i:05d}" for i in range(blocks)]
    ok, failed, first_error = 0, 0, ""
    for i, key in enumerate(keys):
        value = torch.full((nbytes,), i % 251, dtype=torch.uint8)
        try:
            transport.save([key], [value], cfg.ttl_seconds)
            ok += 1
        except Exception as e:  # noqa: BLE001 - every failure is counted and the first one shown
            failed += 1
            first_error = first_error or f"{type(e).__name__}: {e}"[:300]
            if failed >= stop_after:
                break
    tenth = max(1, blocks // 10)
    conn.connect()  # a failed save marks the connection down until it reconnects
    exist = transport.exists(keys[:tenth] + keys[-tenth:])
    part = torch.full((1, nbytes), 255, dtype=torch.uint8)
    loaded = transport.load(keys[:1], [part], BlockLayout.from_sizes([nbytes]), [0])[0]
    print(json.dumps({"ok": ok, "failed": failed, "first_error": first_error, "tenth": tenth,
                      "first_exist": sum(exist[:tenth]), "last_exist": sum(exist[tenth:]),
                      "first_reads_back": bool(loaded and (part == 0).all())}))
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
