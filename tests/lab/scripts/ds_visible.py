"""Test helper, run on a host with the data-system venv's python: wait until a worker answers that keys exist.

    python - ADDRESS ENV_FILE WITHIN_S KEYS_JSON < ds_visible.py

A block one host's connector counted saved can reach another host's worker a few seconds later (seen in a CI: all 6
of a prefix missing from h2's worker, 2 of them there 3 s later). Prints one JSON line: {"all": bool, "after_s": s,
"exist": [...]} (the last answer), so a test asserting a load across hosts asserts it only once the other host's
worker sees the blocks, and says for how long it did not.
"""

import json
import os
import sys
import time


def main() -> int:
    address, env_file, within_s, keys = sys.argv[1], sys.argv[2], float(sys.argv[3]), json.loads(sys.argv[4])
    with open(env_file) as fh:  # the client's CURVE keys, read from the environment
        for line in fh:
            name, sep, value = line.rstrip("\n").partition("=")
            if sep and name:
                os.environ[name] = value
    from yr.datasystem import KVClient

    host, _, port = address.rpartition(":")
    client = KVClient(host, int(port), connect_timeout_ms=5000, req_timeout_ms=5000)
    client.init()
    started = time.monotonic()
    while True:
        exist = [bool(x) for x in client.exist(keys)]
        waited = time.monotonic() - started
        if all(exist) or waited > within_s:
            print(json.dumps({"all": all(exist), "after_s": round(waited, 2), "exist": exist}))
            return 0
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
