"""A real data-system worker smaller than what is saved into it (audit item 10): the connector's writes are
evictable, so a full worker drops old blocks and keeps accepting new saves; non-evictable writes with a TTL (what
the connector did before) start failing once the worker is full. Runs the connector's own transport in the vLLM
venv (tests/connector/scripts/ds_fill.py) against a worker started with dscli; about 20 s."""

from __future__ import annotations


import pytest

from tests.connector.harness import Stack, run_script

pytestmark = pytest.mark.e2e

SHM_MB = 64
BLOCKS, BLOCK_BYTES = 200, 1 << 20  # about three times the worker's memory


def fill(stack: Stack, address: str, evictable: bool, stop_after_failures: int = BLOCKS) -> dict:
    return run_script(stack.venv, "ds_fill.py", address, str(evictable).lower(), str(BLOCKS), str(BLOCK_BYTES),
                      str(stop_after_failures))


def test_full_worker_keeps_accepting_evictable_saves(vllm_venv, session_stack, e2e_root):
    stack = Stack(e2e_root / "capacity", venv=vllm_venv, ports=session_stack.ports)
    try:
        ds = stack.start_ds(shm_mb=SHM_MB)
        got = fill(stack, ds.address, evictable=True)
        assert got["failed"] == 0 and got["ok"] == BLOCKS, got
        assert got["last_exist"] == got["tenth"], got  # the newest blocks are there to be loaded
        assert got["first_exist"] < got["tenth"], got  # room was made by evicting the oldest
        stack.stop_ds(ds)

        ds = stack.start_ds(shm_mb=SHM_MB)
        pinned = fill(stack, ds.address, evictable=False, stop_after_failures=3)
        print(f"measured: {BLOCKS} x {BLOCK_BYTES >> 20} MiB into a {SHM_MB} MiB worker: evictable {got}, "
              f"non-evictable {pinned}")
        assert pinned["failed"] == 3 and pinned["ok"] < BLOCKS // 2, pinned  # the trap the default avoids
    finally:
        stack.close()


def test_with_a_disk_tier_a_full_worker_spills_instead_of_evicting_and_reads_back(vllm_venv, session_stack, e2e_root):
    """`datasystem_spill_mb`: the same 200 MiB into the same 64 MiB worker with 512 MiB of disk behind it
    (the flags yrpd's cluster config gives the worker): nothing evicted, the oldest block read back from disk."""
    stack = Stack(e2e_root / "spill", venv=vllm_venv, ports=session_stack.ports)
    spill = e2e_root / "spill" / "disk"
    try:
        ds = stack.start_ds(shm_mb=SHM_MB, extra=("--spill_directory", str(spill),
                                                  "--spill_size_limit", str(512 << 20)))
        got = fill(stack, ds.address, evictable=True)
        on_disk = sum(f.stat().st_size for f in spill.rglob("*") if f.is_file())
        print(f"measured: {BLOCKS} x {BLOCK_BYTES >> 20} MiB into a {SHM_MB} MiB worker with a 512 MiB disk tier: "
              f"{got}, {on_disk >> 20} MiB spilled")
        assert got["failed"] == 0 and got["ok"] == BLOCKS, got
        assert got["first_exist"] == got["tenth"] == got["last_exist"], got  # kept, not evicted
        assert got["first_reads_back"], got  # from disk, with its bytes
        assert on_disk >= (BLOCKS * BLOCK_BYTES) // 2, on_disk
    finally:
        stack.close()
