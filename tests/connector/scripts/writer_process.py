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


NOISY_CHILD = """
import os, sys
from yrpd.connector import saver as S
connect = S.DsConnection.connect
def noisy_connect(self):  # a native library that prints while connecting
    os.write(1, b"hello from a native library\\n")
    print("and from Python", flush=True)
    return connect(self)
S.DsConnection.connect = noisy_connect
sys.exit(S.child_main(sys.argv[1:]))
"""


def staging_maps(pid: int) -> int:
    """How many staging slabs the writer has mapped (memfd files, by inode)."""
    with open(f"/proc/{pid}/maps") as fh:
        return len({line.split()[4] for line in fh if "yrpd-kv-staging" in line})


def noisy_child_and_dropped_slabs(address: str) -> dict:
    """A child whose stdout gets stray output still answers in step; a slab the pool drops is unmapped by the
    child on its next job (the worker's budget no longer counts it)."""
    cfg = parse_config("kv_producer", {"ds_address": address}, env={})
    stats = ConnectorStats("worker", cfg.role, 0, "", address)
    block = sum(PARTS)
    pool = StagingPool(PARTS, 40 * block, slab_factory=S.shared_slab_factory)  # room for a 16 and a 32 slab only
    saver = S.ProcessSaver("kv_producer", {"ds_address": address}, cfg, stats, 64 << 20, pool,
                           command=[sys.executable, "-c", NOISY_CHILD])
    saver.start()
    cache = [torch.randint(0, 256, (64, nb), dtype=torch.uint8) for nb in PARTS]
    rows = [block_rows_u8(p) for p in cache]
    tag = f"yrpd-writer-noisy-{os.getpid()}"

    def save(block_ids, name):
        slab = pool.acquire(len(block_ids))
        job = S.Job("save", [f"{tag}-{name}-{b}" for b in block_ids], stage_blocks(cache, rows, block_ids, slab),
                    len(block_ids) * block)
        job.slab = slab
        assert saver.submit(job)
        del slab, job
        assert saver.flush(60)

    save(range(8), "small")  # a 16-block slab
    maps_first = staging_maps(saver.child_pid)
    save(range(20), "large")  # a 32-block slab: the pool drops the free 16-block one to make room
    maps_after_drop = staging_maps(saver.child_pid)
    out = {"noisy_saved": stats.get("saved_blocks"), "noisy_failed": stats.get("save_failed_blocks"),
           "noisy_deaths": saver.deaths, "maps_first": maps_first, "maps_after_drop": maps_after_drop}
    saver.stop(10)
    return out


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

    # 3. a child that hangs (stopped here) is given up at the answer deadline: the job is counted, the child killed,
    # and the next job starts another
    os.kill(second_pid, signal.SIGSTOP)
    saver.answer_deadline_s = lambda n_keys: 2.0
    failed_before_hang = stats.get("save_failed_blocks")
    submit([5, 6], "d")
    hang_flushed = saver.flush(30)
    failed_by_hang = stats.get("save_failed_blocks") - failed_before_hang
    hung_gone = wait_gone(second_pid)
    submit([7], "e")
    saver.flush(60)
    third_pid = saver.child_pid
    back_e = reader.exists([f"{tag}-e-7"])

    # 4. stop() ends the child
    saver.stop(10)
    stopped = wait_gone(third_pid) if third_pid else False

    # 5. a parent killed outright takes its writer with it
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, __file__, address, "orphan"], capture_output=True, text=True, timeout=120,
                          env=env, stdin=subprocess.DEVNULL)
    orphan_pid = int(proc.stdout.split()[0]) if proc.stdout.split() else 0
    orphan_gone = bool(orphan_pid) and wait_gone(orphan_pid)
    reader.conn.close()
    print(json.dumps({"flushed": flushed, "jobs": len(jobs), "saved": saved, "bit_exact": exact,
                      "longest_stall_ms": round(max(gaps) * 1000, 1), "first_pid": first_pid,
                      "failed_after_kill": failed_after_kill, "second_pid": second_pid, "deaths": saver.deaths,
                      "saved_after_restart": sum(back_c), "stopped": stopped, "orphan_pid": orphan_pid,
                      "orphan_gone": orphan_gone, "hang_flushed": hang_flushed, "failed_by_hang": failed_by_hang,
                      "hung_gone": hung_gone, "third_pid": third_pid, "saved_after_hang": sum(back_e),
                      **noisy_child_and_dropped_slabs(address)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
