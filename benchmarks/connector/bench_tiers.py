"""A KV load through the connector timed by the data system's tier it came from: shared memory or the disk tier
(`datasystem_spill_mb`), with the worker's own hit counters saying which tier served each load.

Run in the vLLM venv (torch + yr.datasystem), from the repository root:

    PYTHONPATH=. /opt/yrpd/venvs/vllm/bin/python benchmarks/connector/bench_tiers.py \
        [--model-shape smollm2] [--memory-mb 256] [--requests 8] [--tokens 2048] [--rounds 5] [--out FILE]

It starts its own worker with `dscli` on 127.0.0.1 (ports from 41950 up): `--memory-mb` of shared memory, a disk tier
of `--requests` requests' bytes in a temporary directory, and resource.log written every second; stops it at the
end. Each round saves `--requests` requests' KV blocks (one value per block of every layer, evictable, as the
connector saves them) into it, several times what its memory holds, so the oldest are spilled. Then, one request at
a time from the newest to the oldest, it loads each into a CPU paged cache, as the connector's consumer does, and
reads the worker's counters after each load (hits from memory and from disk: `deploy_scripts/hostlib.ds_resource_now`).
A load is filed under the tier all of its blocks came from (a load served by both tiers is counted apart). With
`--cold` (root only) the page cache is dropped after the saves, so that a spilled block is read from the device, not
from the kernel's copy of the file it was just written to.

Reported per tier: loads, median and range of milliseconds per block and GB/s, and the ratio disk / memory of the
medians; also, per request age (0 = newest), the tier that served it in each round: how far back memory reaches,
against the worker's memory in blocks (it spills from 90 % full down to 80 %).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy_scripts"))
from hostlib import ds_resource_now  # noqa: E402

from benchmarks.connector.bench_transfer import SHAPES, gbps, start_worker, stop_worker  # noqa: E402
from yrpd.connector.config import parse_config  # noqa: E402
from yrpd.connector.transport import (  # noqa: E402
    BlockLayout, DsConnection, HostTransport, block_rows_u8, kvclient_factory, part_block_nbytes, write_mode)
from yrpd.provenance import record  # noqa: E402

#: seconds between the worker's resource.log lines (its log_monitor_interval_ms)
MONITOR_S = 1.0


def counters(log: Path) -> dict:
    return ds_resource_now(log, 10 * MONITOR_S + 5)


def drop_page_cache() -> bool:
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def tier_of(before: dict, after: dict, blocks: int) -> str:
    mem, disk = after["hits_memory"] - before["hits_memory"], after["hits_disk"] - before["hits_disk"]
    if mem >= blocks and disk == 0:
        return "memory"
    if disk >= blocks and mem == 0:
        return "disk"
    return f"mixed ({mem} memory, {disk} disk, {after['misses'] - before['misses']} missed)"


def run(args, home: Path) -> dict:
    layers, heads, head = SHAPES[args.model_shape]
    bs, nblk = args.block_size, args.tokens // args.block_size
    gen = torch.Generator().manual_seed(0)
    src = [torch.randn(nblk, heads, bs, 2 * head, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    dst = [torch.zeros_like(t) for t in src]
    layout = BlockLayout.from_sizes([part_block_nbytes(p) for p in src])
    staging = torch.empty((nblk, layout.block_nbytes), dtype=torch.uint8)
    rows = [block_rows_u8(p) for p in src]
    for i in range(nblk):
        for r, off, size in zip(rows, layout.offsets, layout.part_nbytes):
            staging[i, off:off + size].copy_(r[i])
    request_bytes = nblk * layout.block_nbytes

    cfg = parse_config("kv_producer", {"ds_address": args.ds_address}, env={})  # the connector's own write mode
    conn = DsConnection(kvclient_factory(cfg.ds_host, cfg.ds_port, 5000, 30000, True), "tiers", 5.0)
    if not conn.connect():
        raise SystemExit(f"cannot connect to the data system at {args.ds_address}: {conn.last_error}")
    t = HostTransport(conn, cfg.max_batch_keys, write_mode=write_mode(cfg))
    log = next(home.rglob("resource.log"), None) or home / "missing-resource.log"

    loads: list[dict] = []
    cold = []
    for rnd in range(args.rounds):
        keys = [[f"yrpd_tiers_{rnd:03d}_{r:03d}_{i:05d}" for i in range(nblk)] for r in range(args.requests)]
        for ks in keys:
            t.save(ks, staging, cfg.ttl_seconds)
        if args.cold:
            cold.append(drop_page_cache())
        before = counters(log)
        for age, ks in enumerate(reversed(keys)):
            t0 = time.perf_counter()
            ok = t.load(ks, dst, layout, list(range(nblk)))
            seconds = time.perf_counter() - t0
            after = counters(log)
            if not all(ok):
                raise SystemExit(f"round {rnd}, request of age {age}: {ok.count(False)} of {nblk} blocks missing")
            loads.append({"round": rnd, "age": age, "tier": tier_of(before, after, nblk), "ms": seconds * 1000})
            before = after
        for a, b in zip(src, dst):  # the bytes came back whichever tier held them
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), "a load returned other bytes"
            b.zero_()
        for ks in keys:
            t.delete(ks)
    conn.close()

    tiers = {}
    for name in ("memory", "disk"):
        ms = [x["ms"] / nblk for x in loads if x["tier"] == name]
        if ms:
            med = statistics.median(ms)
            tiers[name] = {"loads": len(ms), "ms_per_block_median": round(med, 3),
                           "ms_per_block_range": [round(min(ms), 3), round(max(ms), 3)],
                           "gbps_median": round(gbps(layout.block_nbytes, med / 1000), 3)}
    mixed = [x for x in loads if x["tier"] not in ("memory", "disk")]
    by_age = {age: [x["tier"] for x in loads if x["age"] == age] for age in range(args.requests)}
    return {
        "shape": {"model": args.model_shape, "layers": layers, "kv_heads": heads, "head_size": head,
                  "block_size": bs, "dtype": "bfloat16", "blocks_per_request": nblk,
                  "bytes_per_block": layout.block_nbytes, "request_bytes": request_bytes},
        "worker": {"memory_mb": args.memory_mb, "disk_mb": args.disk_mb,
                   "memory_in_blocks": (args.memory_mb << 20) // layout.block_nbytes,
                   "saved_per_round_blocks": args.requests * nblk},
        "page_cache_dropped": (all(cold) if cold else False),
        "rounds": args.rounds,
        "tiers": tiers,
        "disk_over_memory": (round(tiers["disk"]["ms_per_block_median"] / tiers["memory"]["ms_per_block_median"], 3)
                             if {"disk", "memory"} <= set(tiers) else None),
        "mixed_loads": mixed,
        "tier_by_age": by_age,
        "loads": [{**x, "ms": round(x["ms"], 3)} for x in loads],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-shape", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--memory-mb", type=int, default=256, help="the worker's shared memory")
    ap.add_argument("--requests", type=int, default=8, help="requests saved per round, newest loaded first")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens of each request (full blocks)")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="drop the page cache after each round's saves (root)")
    ap.add_argument("--port", type=int, default=41950)
    ap.add_argument("--out", default="", help="also write the JSON report (with its provenance) to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as a vLLM CPU worker pinned to one core
    layers, heads, head = SHAPES[args.model_shape]
    request_mb = (args.tokens // args.block_size) * layers * heads * args.block_size * 2 * head * 2 >> 20
    args.disk_mb = max(256, 2 * args.requests * request_mb)  # room for a round's spills, twice over
    venv_bin = Path(sys.executable).parent
    home = Path(tempfile.mkdtemp(prefix="yrpd-bench-tiers-"))
    start_worker(venv_bin, home, args.port, args.memory_mb, populate=False,
                 extra=["--spill_directory", str(home / "spill"), "--spill_size_limit", str(args.disk_mb << 20),
                        "--log_monitor", "true", "--log_monitor_interval_ms", str(int(MONITOR_S * 1000))])
    args.ds_address = f"127.0.0.1:{args.port}"
    command = "PYTHONPATH=. " + " ".join([sys.executable, *sys.argv])
    try:
        out = {"provenance": record([command], vllm_venv=venv_bin.parent), **run(args, home)}
    finally:
        stop_worker(venv_bin, args.port)
        shutil.rmtree(home, ignore_errors=True)
    text = json.dumps(out, indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
