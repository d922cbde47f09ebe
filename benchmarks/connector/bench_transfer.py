"""Save + load throughput of one request's KV blocks through the openYuanrong data system,
compared with an in-process memcpy of the same bytes and with the data system's own benchmark (`dsbench kv`)
writing and reading values of the same size, in the same batches, on the same worker.

Run in the vLLM venv (torch + yr.datasystem), from the repository root:

    PYTHONPATH=. /opt/yrpd/venvs/vllm/bin/python benchmarks/connector/bench_transfer.py \
        [--ds-address HOST:PORT] [--model-shape smollm2,qwen2-7b] [--tokens 4096] [--iters 10] [--out FILE]

Without --ds-address it starts its own data-system worker with `dscli` on 127.0.0.1 (ports from
41900 up) and stops it at the end. The KV cache is a synthetic CPU cache in vLLM's CPU layout,
(num_blocks, kv_heads, block_size, 2 * head_size) per layer; one stored value = one block of
every layer, exactly as YuanrongConnector stores it.

Measured per iteration (median reported):
  memcpy        one torch copy of all the request's bytes into a preallocated tensor
  save          HostTransport.save: mcreate + copy into shared memory + mset_buffer
  stage         the producer's snapshot in wait_for_save: one index_select gather per layer
  save+stage    the whole producer path: snapshot, then mcreate + copy of the pieces + mset_buffer
  load          HostTransport.load: get_read_only_buffers (zero copy) + copy into the paged cache
  dsbench set   `dsbench kv` set of the same number of values of one block's size, in one batch per request
  dsbench get   its get of them (the client maps the values; nothing is copied into a cache)
Throughput = request bytes / time; ratio = throughput / memcpy throughput, and connector / dsbench.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from yrpd.provenance import record
from yrpd.connector.transport import (
    BlockLayout,
    DsConnection,
    HostTransport,
    StagingPool,
    block_rows_u8,
    kvclient_factory,
    part_block_nbytes,
    stage_blocks,
    values_from_staged,
)

SHAPES = {
    # name: (layers, kv_heads, head_size)
    "smollm2": (30, 3, 64),  # SmolLM2-135M, the embedded default
    "qwen2-7b": (28, 4, 128),
    "llama3-8b": (32, 8, 128),
    "tiny": (2, 2, 32),
}


def start_worker(venv_bin: Path, home: Path, port: int, shm_mb: int, populate: bool, extra: list[str] = ()) -> int:
    cmd = [str(venv_bin / "dscli"), "start", "-d", str(home), "-w", "--worker_address", f"127.0.0.1:{port}",
           "--metastore_address", f"127.0.0.1:{port + 1}", "--start_metastore_service", "true",
           "--shared_memory_size_mb", str(shm_mb), "--memory_reclamation_time_second", "2"]
    if populate:  # pre-fault the shared-memory arena (production setting); needs these two as well
        cmd += ["--shared_memory_populate", "true", "--arena_per_tenant", "1", "--enable_fallocate", "false"]
    cmd += list(extra)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    m = re.search(r"success, PID: (\d+)", out.stdout + out.stderr)
    if out.returncode != 0 or not m:
        raise SystemExit(f"dscli start failed:\n{out.stdout}\n{out.stderr}")
    return int(m.group(1))


def stop_worker(venv_bin: Path, port: int) -> None:
    subprocess.run([str(venv_bin / "dscli"), "stop", "-w", f"127.0.0.1:{port}"], capture_output=True, timeout=60)


#: dsbench finds its own package with `bash -l -c "pip show openyuanrong-datasystem"` in an empty environment, so a
#: venv install is never found (it aborts "Required datasystem package not found"): the shim tells it where first
DSBENCH_SHIM = """import os, sys
import yr.datasystem
from yr.datasystem.cli.benchmark.executor import Executor
Executor.get_instance().pkg_location_cache[sys.argv[1]] = os.path.dirname(os.path.dirname(os.path.dirname(
    yr.datasystem.__file__)))
from yr.datasystem.cli.benchmark.main import main
sys.argv = ["dsbench", *sys.argv[2:]]
sys.exit(main())
"""
DSBENCH_ROW = re.compile(r"^\s*\d+\s+(set|get|del)\s+(\d+)\s+(\d+)\s+(\d+)\s+\d+\s+\d+\s+\S+\s+([\d.]+)\s+[\d.]+\s+"
                         r"[\d.]+\s+[\d.]+\s+[\d.]+\s+\d+\s+([\d.]+)\s*$")


def dsbench(address: str, value_bytes: int, batch: int, requests: int) -> tuple[dict, str]:
    """`dsbench kv` on the worker at `address`: `requests` batches of `batch` values of `value_bytes` each, one
    client, one thread. ({action: {"avg_ms": per batch, "gbps"}}, the command as run)."""
    argv = [sys.executable, "-c", DSBENCH_SHIM, address, "kv", "-S", address, "-G", address, "-n",
            str(batch * requests), "-s", str(value_bytes), "-b", str(batch), "-c", "1", "-t", "1",
            "-p", f"yrpd_dsb{os.getpid() % 1000}"]
    with tempfile.TemporaryDirectory(prefix="yrpd-dsbench-") as cwd:  # it leaves a result directory where it runs
        out = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=cwd)
    rows = {m.group(1): {"avg_ms": float(m.group(5)), "gbps": round(float(m.group(6)) * 2**20 / 1e9, 3)}
            for m in map(DSBENCH_ROW.match, (out.stdout + out.stderr).splitlines()) if m}  # its table: stderr
    if "set" not in rows or "get" not in rows:
        raise SystemExit(f"dsbench gave no set/get figures (exit {out.returncode}):\n{out.stdout[-2000:]}\n"
                         f"{out.stderr[-2000:]}")
    return rows, "dsbench " + " ".join(argv[4:])


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def run(args, shape: str) -> dict:
    layers, heads, head = SHAPES[shape]
    bs = args.block_size
    nblk = args.tokens // bs
    num_blocks = nblk * 2 + 8
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    src = [torch.randn(num_blocks, heads, bs, 2 * head, generator=gen).to(dtype) for _ in range(layers)]
    dst = [torch.zeros_like(t) for t in src]
    layout = BlockLayout.from_sizes([part_block_nbytes(p) for p in src])
    total = nblk * layout.block_nbytes
    src_ids = list(range(nblk))
    dst_ids = list(range(nblk + 8, 2 * nblk + 8))

    host, _, port = args.ds_address.rpartition(":")
    conn = DsConnection(kvclient_factory(host, int(port), 5000, 30000, True), "bench", 5.0)
    if not conn.connect():
        raise SystemExit(f"cannot connect to the data system at {args.ds_address}: {conn.last_error}")
    t = HostTransport(conn, max_batch_keys=512)

    rows = [block_rows_u8(p) for p in src]
    staging = torch.empty((nblk, layout.block_nbytes), dtype=torch.uint8)
    for i, b in enumerate(src_ids):  # the request's bytes, contiguous, for the memcpy baseline
        for p, off, size in zip(src, layout.offsets, layout.part_nbytes):
            staging[i, off:off + size].copy_(p[b].reshape(-1).view(torch.uint8))
    copy_dst = torch.empty_like(staging)
    copy_dst.copy_(staging)
    pool = StagingPool(layout.part_nbytes, 4 * total)
    res = {"memcpy": [], "save": [], "stage": [], "save+stage": [], "load": []}
    for it in range(args.iters + 1):
        keys = [f"yrpd_bench{os.getpid() % 1000:03d}_{it:04d}_{i:05d}" for i in range(nblk)]
        t0 = time.perf_counter()
        copy_dst.copy_(staging)
        t1 = time.perf_counter()
        t.save(keys, staging, ttl_seconds=600)
        t2 = time.perf_counter()
        ok = t.load(keys, dst, layout, dst_ids)
        t3 = time.perf_counter()
        assert all(ok), "load failed"
        t.delete(keys)
        keys2 = [k + "s" for k in keys]
        t4 = time.perf_counter()
        slab = pool.acquire(nblk)
        staged = stage_blocks(src, rows, src_ids, slab)  # the producer's snapshot (engine's critical path)
        t45 = time.perf_counter()
        t.save(keys2, values_from_staged(staged, range(nblk)), ttl_seconds=600)  # the saver thread's part
        t5 = time.perf_counter()
        pool.release(slab)
        t.delete(keys2)
        if it == 0:
            # check bit-exactness once (and warm up page mappings)
            for a, b in zip(src, dst):
                assert torch.equal(a[src_ids].view(torch.int16), b[dst_ids].view(torch.int16)), "round trip differs"
            continue
        res["memcpy"].append(t1 - t0)
        res["save"].append(t2 - t1)
        res["load"].append(t3 - t2)
        res["save+stage"].append(t5 - t4)
        res["stage"].append(t45 - t4)
        time.sleep(args.pause)
    conn.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    mem = gbps(total, med["memcpy"])
    out = {
        "shape": {"model": shape, "layers": layers, "kv_heads": heads, "head_size": head,
                  "block_size": bs, "dtype": "bfloat16", "tokens": nblk * bs, "blocks": nblk,
                  "bytes_per_block": layout.block_nbytes, "request_bytes": total},
        "iterations": args.iters,
        "torch_threads": torch.get_num_threads(),
        "median_ms": {k: round(v * 1000, 3) for k, v in med.items()},
        "gbps": {k: round(gbps(total, v), 3) for k, v in med.items()},
        "ratio_vs_memcpy": {k: round(gbps(total, v) / mem, 3) for k, v in med.items() if k != "memcpy"},
        "round_trip_ratio_vs_2_memcpy": round((2 * med["memcpy"]) / (med["save"] + med["load"]), 3),
    }
    if args.dsbench:
        # it writes every value before it reads one back: 2 requests' worth fits the worker this script starts
        # (3 requests' bytes + 256 MB), where --iters of them would not
        rows, command = dsbench(args.ds_address, layout.block_nbytes, nblk, 2)
        out["dsbench"] = {"command": command, **rows}
        out["ratio_vs_dsbench"] = {"save/set": round(out["gbps"]["save"] / rows["set"]["gbps"], 3),
                                   "save+stage/set": round(out["gbps"]["save+stage"] / rows["set"]["gbps"], 3),
                                   "load/get": round(out["gbps"]["load"] / rows["get"]["gbps"], 3)}
        out["dsbench_vs_memcpy"] = {k: round(rows[k]["gbps"] / mem, 3) for k in ("set", "get")}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ds-address", default=None, help="existing worker HOST:PORT (default: start one)")
    ap.add_argument("--model-shape", default="smollm2,qwen2-7b",
                    help=f"comma-separated, each measured in turn on the one worker: {', '.join(sorted(SHAPES))}")
    ap.add_argument("--no-dsbench", dest="dsbench", action="store_false",
                    help="leave out `dsbench kv` at the same sizes")
    ap.add_argument("--out", default="", help="also write the JSON report (with its provenance) to this file")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens of the request (full blocks)")
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--pause", type=float, default=0.2, help="seconds between iterations")
    ap.add_argument("--port", type=int, default=41900, help="port for a self-started worker")
    ap.add_argument("--no-populate", dest="populate", action="store_false",
                    help="self-started worker without --shared_memory_populate (arena pages fault on first use)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 = like a vLLM CPU worker pinned to one core, as in the e2e tests)")
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    venv_bin = Path(sys.executable).parent
    shapes = [s.strip() for s in args.model_shape.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not shapes:
        ap.error(f"--model-shape: unknown {', '.join(unknown) or '(none)'}; pick from {', '.join(sorted(SHAPES))}")
    home = None
    if args.ds_address is None:
        home = Path(tempfile.mkdtemp(prefix="yrpd-bench-ds-"))
        need_mb = max((args.tokens // args.block_size) * la * he * args.block_size * 2 * hs * 2 * 3 >> 20
                      for la, he, hs in (SHAPES[s] for s in shapes))
        start_worker(venv_bin, home, args.port, max(1024, need_mb + 256), args.populate)
        args.ds_address = f"127.0.0.1:{args.port}"
    command = "PYTHONPATH=. " + " ".join([sys.executable, *sys.argv])
    try:
        out = {"provenance": record([command], vllm_venv=venv_bin.parent), "worker": args.ds_address,
               "shapes": [run(args, shape) for shape in shapes]}
    finally:
        if home is not None:
            stop_worker(venv_bin, args.port)
            shutil.rmtree(home, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
