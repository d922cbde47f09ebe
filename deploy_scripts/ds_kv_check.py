#!/usr/bin/env python3
"""Write a random key through one data-system worker and read it back through another.

Run with the python of the data-system venv (openyuanrong-datasystem), never with the
`yr` venv's python: the two packages cannot be imported in one process, and
LD_LIBRARY_PATH must not point at the `yr` package.

    ds_kv_check.py --write 10.0.0.1:31501 --read 10.0.0.2:31501 [--size 4096] [--timeout-ms 5000] [--env-file F]
                   [--attempts 3] [--within-s 60]

Prints exactly one JSON line on stdout:
    {"ok": true, "write": "IP:PORT", "read": "IP:PORT", "key": "...", "bytes": N, "ms": total, ...}
    {"ok": false, "write": ..., "read": ..., "error": "..."}
and exits 0 on success, 1 on failure, 2 on bad arguments. The key is deleted afterwards
(a failed delete is reported as "cleanup_error" but does not fail the check). A try that fails on the data
system's side (unreachable, timed out) is tried again, up to --attempts, 2 s apart, none starting after
--within-s: a worker that just started on a host busy loading a model can miss one request's timeout;
the errors of the tries before a success are reported as "retried".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid


def parse_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected IP:PORT, got {text!r}")
    return host, int(port)


def connect(kv_client_cls, addr: tuple[str, int], timeout_ms: int):
    client = kv_client_cls(host=addr[0], port=addr[1], connect_timeout_ms=timeout_ms, req_timeout_ms=timeout_ms)
    client.init()
    return client


def as_bytes(value) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, memoryview):
        return value.tobytes()
    if isinstance(value, str):
        return value.encode("latin-1")
    return bytes(value)


class Mismatch(Exception):
    """The value read back is not the one written: never tried again."""


def run_check(write: tuple[str, int], read: tuple[str, int], size: int, timeout_ms: int) -> dict:
    from yr.datasystem import KVClient  # imported late so a wrong venv becomes a JSON error

    key = f"yrpd-kvcheck-{uuid.uuid4().hex}"
    value = os.urandom(size)
    result: dict = {"key": key, "bytes": size}

    t0 = time.perf_counter()
    writer = connect(KVClient, write, timeout_ms)
    reader = writer if read == write else connect(KVClient, read, timeout_ms)
    t1 = time.perf_counter()
    writer.set(key, value)
    t2 = time.perf_counter()
    try:
        got = reader.get([key])
        t3 = time.perf_counter()
        if not got or as_bytes(got[0]) != value:
            raise Mismatch(f"value read back differs from value written ({len(got or [])} values)")
    finally:
        try:
            writer.delete([key])
        except Exception as exc:  # cleanup only: report, do not fail
            result["cleanup_error"] = str(exc).strip()
    result.update(
        ok=True,
        connect_ms=round((t1 - t0) * 1000, 2),
        set_ms=round((t2 - t1) * 1000, 2),
        get_ms=round((t3 - t2) * 1000, 2),
        ms=round((t3 - t0) * 1000, 2),
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", required=True, type=parse_addr, help="IP:PORT of the worker to write through")
    parser.add_argument("--read", required=True, type=parse_addr, help="IP:PORT of the worker to read through")
    parser.add_argument("--size", type=int, default=4096, help="value size in bytes (default 4096)")
    parser.add_argument("--timeout-ms", type=int, default=5000, help="connect/request timeout (default 5000)")
    parser.add_argument("--attempts", type=int, default=3, help="tries before it fails (default 3)")
    parser.add_argument("--within-s", type=float, default=60.0,
                        help="no try starts after this many seconds (default 60)")
    parser.add_argument("--env-file", help="KEY=VALUE lines added to the environment first: the client's CURVE keys "
                                           "(DATASYSTEM_CLIENT_PUBLIC_KEY ...), which the client reads from there")
    args = parser.parse_args(argv)
    if args.size <= 0:
        parser.error("--size must be positive")
    if args.env_file:
        with open(args.env_file) as fh:
            for line in fh:
                key, sep, value = line.rstrip("\n").partition("=")
                if sep and key:
                    os.environ[key] = value

    out = {"write": "%s:%d" % args.write, "read": "%s:%d" % args.read}
    errors: list[str] = []
    checked = None
    deadline = time.monotonic() + args.within_s
    for attempt in range(max(1, args.attempts)):
        if attempt:
            if time.monotonic() + 2 >= deadline:
                break
            time.sleep(2)
        try:
            checked = run_check(args.write, args.read, args.size, args.timeout_ms)
            break
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {str(exc).strip()}")
            # the data system client raises RuntimeError for what a retry can cure (unreachable, timed out);
            # a wrong value or a wrong venv (ImportError) is the answer at once
            if type(exc) is not RuntimeError:
                break
    if checked is not None:
        # keep "ok" first for people reading the line
        out = {"ok": True, **out, **{k: v for k, v in checked.items() if k != "ok"}}
        if errors:
            out["retried"] = errors
        code = 0
    else:
        out = {"ok": False, **out, "error": errors[-1], "attempts": len(errors)}
        code = 1
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
