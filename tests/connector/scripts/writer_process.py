"""Test helper run in the vLLM venv: the connector's writer process (`saver.ProcessSaver`) against a real data-system
worker, the way the worker half drives it.

    PYTHONPATH=. python tests/connector/scripts/writer_process.py HOST:PORT

Prints one JSON line: whether staged blocks read back bit-exact through another client, how long this process's
own thread stalled while the child wrote (the GIL stays here), what a killed child cost and that it came back, and
whether stop() and the death of its parent leave no writer behind.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import torch

from yrpd.connector import saver as S
from yrpd.connector.config import parse_config
from yrpd.connector.stats import ConnectorStats
from yrpd.connector.transport import (BlockLayout, DsConnection, HostTransport, StagingPool, block_rows_u8,
                                      kvclient_factory, stage_blocks)

PARTS = [96 << 10, 160 << 10]  # two cache parts of different block sizes: 256 KiB a stored value


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def orphan_check(address: str) -> int:
    """A parent that dies without stopping its writer (SIGKILL of a vLLM worker): print the child's pid, then die."""
    cfg = parse_config("kv_producer", {"ds_address": address}, env={})
    pool = StagingPool(PARTS, 64 << 20, slab_factory=S.shared_slab_factory)
    saver = S.ProcessSaver("kv_producer", {"ds_address": address}, cfg, ConnectorStats("worker", cfg.role, 0, "", ""),
                           64 << 20, pool)
    saver.start()
    deadline = time.monotonic() + 30
    while saver.child_pid is None and time.monotonic() < deadline:
        time.sleep(0.05)
    print(saver.child_pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    return 1


def main() -> int:
    address = sys.argv[1]
    if len(sys.argv) > 2 and sys.argv[2] == "orphan":
        return orphan_check(address)
    extra = {"ds_address": address, "ttl_seconds": 120}
    cfg = parse_config("kv_producer", extra, env={})
    stats = ConnectorStats("worker", cfg.role, 0, "", address)
    pool = StagingPool(PARTS, 256 << 20, slab_factory=S.shared_slab_factory)
    saver = S.ProcessSaver("kv_producer", extra, cfg, stats, 256 << 20, pool)
    saver.start()
    cache = [torch.randint(0, 256, (64, nb), dtype=torch.uint8) for nb in PARTS]  # 64 blocks of each part
    rows = [block_rows_u8(p) for p in cache]
    tag = f"yrpd-writer-{os.getpid()}"

    def submit(block_ids, name):
        slab = pool.acquire(len(block_ids))
        job = S.Job("save", [f"{tag}-{name}-{b}" for b in block_ids], stage_blocks(cache, rows, block_ids, slab),
                    len(block_ids) * sum(PARTS))
        job.slab = slab
        assert saver.submit(job)
        return job

    # 1. blocks round trip, bit-exact, through another client; this thread keeps running meanwhile
    gaps, stop = [0.0], threading.Event()

    def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=ticker, daemon=True)
    t.start()
    jobs = [submit(list(range(i, i + 8)), "a") for i in range(0, 64, 8)]
    flushed = saver.flush(60)
    stop.set()
    t.join()
    host, port = address.rsplit(":", 1)
    reader = HostTransport(DsConnection(kvclient_factory(host, int(port), 5000, 5000, False), "reader"))
    assert reader.conn.connect(), reader.conn.last_error
    back = [torch.zeros_like(p) for p in cache]
    ok = reader.load([f"{tag}-a-{b}" for b in range(64)], back, BlockLayout.from_sizes(PARTS), list(range(64)))
    exact = all(ok) and all(torch.equal(a, b) for a, b in zip(cache, back))
    saved = stats.get("saved_blocks")

    # 2. the child killed: while the restart backoff holds, its jobs fail and are counted; after it, a new child
    first_pid = saver.child_pid
    os.kill(first_pid, signal.SIGKILL)
    wait_gone(first_pid)
    S.RESTART_BACKOFF_S = 3600.0  # the last start was seconds ago: no new child yet
    submit([0, 1, 2], "b")
    saver.flush(30)
    failed_after_kill = stats.get("save_failed_blocks")
    S.RESTART_BACKOFF_S = 0.0
    submit([3, 4], "c")
    saver.flush(60)
    second_pid = saver.child_pid
    back_c = reader.exists([f"{tag}-c-3", f"{tag}-c-4"])

    # 3. stop() ends the child
    saver.stop(10)
    stopped = wait_gone(second_pid) if second_pid else False

    # 4. a parent killed outright takes its writer with it
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, __file__, address, "orphan"], capture_output=True, text=True, timeout=120,
                          env=env, stdin=subprocess.DEVNULL)
    orphan_pid = int(proc.stdout.split()[0]) if proc.stdout.split() else 0
    orphan_gone = bool(orphan_pid) and wait_gone(orphan_pid)
    reader.conn.close()
    print(json.dumps({"flushed": flushed, "jobs": len(jobs), "saved": saved, "bit_exact": exact,
                      "longest_stall_ms": round(max(gaps) * 1000, 1), "first_pid": first_pid,
                      "failed_after_kill": failed_after_kill, "second_pid": second_pid, "restarts": saver.restarts,
                      "saved_after_restart": sum(back_c), "stopped": stopped, "orphan_pid": orphan_pid,
                      "orphan_gone": orphan_gone}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
