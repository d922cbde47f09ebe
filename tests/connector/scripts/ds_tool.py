"""Test helper run in the vLLM venv: poke data-system keys directly.

    python tests/connector/scripts/ds_tool.py HOST:PORT exist|sizes|corrupt|delete   < keys.json

Prints one JSON line. `corrupt` rewrites each present value with the sign bit of every 16-bit
element flipped (finite, plausible-looking but wrong KV), keeping its size.
"""

import json
import sys

from yr.datasystem import KVClient
from yr.datasystem.kv_client import WriteMode


def main() -> int:
    address, action = sys.argv[1], sys.argv[2]
    keys = json.load(sys.stdin)
    host, _, port = address.rpartition(":")
    client = KVClient(host, int(port), connect_timeout_ms=5000, req_timeout_ms=5000)
    client.init()
    if action == "exist":
        print(json.dumps({"exist": [bool(x) for x in client.exist(keys)] if keys else []}))
        return 0
    if action == "delete":
        failed = client.delete(keys) if keys else []
        print(json.dumps({"failed": list(failed or [])}))
        return 0
    present = [k for k, e in zip(keys, client.exist(keys)) if e] if keys else []
    if action == "sizes":
        bufs = client.get_read_only_buffers(present) if present else []
        print(json.dumps({"sizes": {k: (len(b.immutable_data()) if b is not None else None)
                                    for k, b in zip(present, bufs)}}))
        return 0
    if action == "corrupt":
        done = []
        for k in present:
            data = bytearray(client.get_read_only_buffers([k])[0].immutable_data())
            for i in range(1, len(data), 2):
                data[i] ^= 0x80
            # the data system refuses to overwrite a key with another write mode (and drops it): write as the
            # connector does (evictable, its default)
            bufs = client.mcreate([k], [len(data)], write_mode=WriteMode.NONE_L2_CACHE_EVICT)
            memoryview(bufs[0].MutableData())[:] = data
            client.mset_buffer(bufs)
            done.append(k)
        print(json.dumps({"corrupted": done}))
        return 0
    print(json.dumps({"error": f"unknown action {action}"}))
    return 2


if __name__ == "__main__":
    sys.exit(main())
