"""Test helper run in the vLLM venv: prefill's writer (`saver.ProcessSaver`, as the worker half drives it) against a
real data-system worker, with room or with its memory full of entries it may not evict.

    PYTHONPATH=. python tests/connector/scripts/ds_full.py HOST:PORT write TAG JOBS   # JOBS jobs of 3 blocks
    PYTHONPATH=. python tests/connector/scripts/ds_full.py HOST:PORT fill             # 1 MiB entries until refused
    PYTHONPATH=. python tests/connector/scripts/ds_full.py HOST:PORT delete TAG JOBS
    PYTHONPATH=. python tests/connector/scripts/ds_full.py HOST:PORT cost JOBS        # the look after a write

Each prints one JSON line. `write` saves the keys TAG-<job>-<block>, 128 KiB a block (about a tiny-model block of
128 tokens in float32, under the client's 500 KiB shared-memory threshold like the lab's), all jobs queued at once as
a busy prefill queues them; it reports the writer's counters once the writer has been idle for a while and again
after stop(), and how many of the keys the worker holds at the end. `fill` is another client of the worker writing
1 MiB entries in the client's default write mode (entries the worker may not evict) until a write is refused.
"""

import json
import os
import statistics
import sys
import time

import torch

from yr.datasystem import KVClient

from yrpd.connector import saver as S
from yrpd.connector.config import parse_config
from yrpd.connector.stats import ConnectorStats
from yrpd.connector.transport import (DsConnection, HostTransport, StagingPool, block_rows_u8, kvclient_factory,
                                      stage_blocks, values_from_staged, write_mode)

PARTS = [64 << 10, 64 << 10]  # K and V of one block: 128 KiB a stored value
PER_JOB = 3
COUNTERS = ("saved_blocks", "saved_bytes", "save_failed_blocks", "save_failed_memory_full_blocks", "ds_errors")


def keys_of(tag: str, jobs: int) -> list[list[str]]:
    return [[f"{tag}-{j}-{b}" for b in range(PER_JOB)] for j in range(jobs)]


def client(address: str) -> KVClient:
    host, _, port = address.rpartition(":")
    c = KVClient(host, int(port), connect_timeout_ms=5000, req_timeout_ms=5000)
    c.init()
    return c


def write(address: str, tag: str, jobs: int) -> dict:
    extra = {"ds_address": address, "ttl_seconds": 600}
    cfg = parse_config("kv_producer", extra, env={})
    stats = ConnectorStats("worker", cfg.role, 0, "", address)
    pool = StagingPool(PARTS, 256 << 20, slab_factory=S.shared_slab_factory)
    saver = S.ProcessSaver("kv_producer", extra, cfg, stats, 256 << 20, pool)
    saver.start()
    cache = [torch.randint(0, 256, (PER_JOB, nb), dtype=torch.uint8) for nb in PARTS]
    rows = [block_rows_u8(p) for p in cache]
    all_keys = keys_of(tag, jobs)
    for keys in all_keys:
        slab = pool.acquire(PER_JOB)
        job = S.Job("save", keys, stage_blocks(cache, rows, list(range(PER_JOB)), slab), PER_JOB * sum(PARTS))
        job.slab = slab
        assert saver.submit(job)
    written = [k for keys in all_keys for k in keys]
    deadline = time.monotonic() + 120
    while stats.get("saved_blocks") + stats.get("save_failed_blocks") < len(written) - PER_JOB \
            and time.monotonic() < deadline:
        time.sleep(0.05)  # every job but the last one counted (the last one may wait on the next write)
    time.sleep(3.0)  # idle: longer than the writer waits before it looks at its last job's blocks again
    idle = {k: stats.get(k) for k in COUNTERS}
    saver.stop(30)
    stopped = {k: stats.get(k) for k in COUNTERS}
    held = sum(bool(x) for x in client(address).exist(written))
    return {"blocks": len(written), "idle": idle, "stopped": stopped, "held_at_end": held}


def fill(address: str) -> dict:
    c = client(address)
    value, n, t0 = os.urandom(1 << 20), 0, time.monotonic()
    while True:  # the client's default write mode: entries the worker may not evict
        try:
            c.set(f"yrpd-test-fill-{n}", value)
        except Exception as e:  # noqa: BLE001 - the refusal that ends the fill
            return {"filled_mb": n, "error": str(e).strip()[:200], "s": round(time.monotonic() - t0, 1)}
        n += 1


def delete(address: str, tag: str, jobs: int) -> dict:
    keys = [k for keys in keys_of(tag, jobs) for k in keys]
    failed = client(address).delete(keys)
    return {"deleted": len(keys) - len(failed or [])}


def cost(address: str, jobs: int) -> dict:
    """Per job of 3 blocks, with room in the worker: write_job without the look after the write and with it
    (alternately, so both see the same load), and the look alone."""
    pending_cls = getattr(S, "PendingSaves", None)
    if pending_cls is None:  # a writer without looks: nothing to measure
        return {"cost": None}
    cfg = parse_config("kv_producer", {"ds_address": address}, env={})
    conn = DsConnection(kvclient_factory(cfg.ds_host, cfg.ds_port, 5000, 5000, False), "cost")
    assert conn.connect(), conn.last_error
    transport = HostTransport(conn, cfg.max_batch_keys, write_mode=write_mode(cfg))
    staged = [torch.randint(0, 256, (PER_JOB, nb), dtype=torch.uint8) for nb in PARTS]
    values = values_from_staged(staged, range(PER_JOB))
    plain, looked, looks, pending = [], [], [], pending_cls()
    for j in range(jobs):
        keys = [f"yrpd-test-cost-{j}-{b}" for b in range(PER_JOB)]
        t0 = time.perf_counter()
        write_job_args = (transport, 600, keys, values) + ((pending,) if j % 2 else ())
        S.write_job(*write_job_args)
        (looked if j % 2 else plain).append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        transport.held(keys)
        looks.append((time.perf_counter() - t0) * 1000)
        transport.delete(keys)
    conn.close()
    median = lambda xs: round(statistics.median(xs), 2)  # noqa: E731
    return {"jobs": jobs, "job_ms_without_look": median(plain), "job_ms_with_look": median(looked),
            "look_ms": median(looks), "look_ms_p90": round(sorted(looks)[int(len(looks) * 0.9)], 2)}


def main() -> int:
    address, action = sys.argv[1], sys.argv[2]
    if action == "write":
        out = write(address, sys.argv[3], int(sys.argv[4]))
    elif action == "fill":
        out = fill(address)
    elif action == "delete":
        out = delete(address, sys.argv[3], int(sys.argv[4]))
    elif action == "cost":
        out = cost(address, int(sys.argv[3]))
    else:
        out = {"error": f"unknown action {action}"}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
