"""Unit tests of the transport layer with fake data-system clients (no data system, no vLLM).

The NPU path cannot run here (the device client needs Ascend + CANN); its argument building is
tested with tensor stand-ins. The host-path round trip needs torch and is skipped without it.
"""

from __future__ import annotations

import time

import pytest

from tests.connector.fakes import FakeKVClient
from yrpd.connector.transport import (
    BlockLayout,
    DsConnection,
    DsUnavailable,
    HostTransport,
    NpuTransport,
    TransportError,
    block_blobs,
    classify_error,
    device_blob_lists,
    set_param_for,
)


class FakeTensor:
    """Just what the argument builders use: shape, stride(0), element_size(), data_ptr()."""

    def __init__(self, base: int, shape: tuple, elem: int = 2) -> None:
        self.base, self.shape, self.elem = base, shape, elem

    def stride(self, dim: int) -> int:
        n = 1
        for d in self.shape[dim + 1:]:
            n *= d
        return n

    def element_size(self) -> int:
        return self.elem

    def data_ptr(self) -> int:
        return self.base


class Blob:
    def __init__(self, dev_ptr, size):
        self.dev_ptr, self.size = dev_ptr, size


class DeviceBlobList:
    def __init__(self, dev_idx, blob_list, src_offset=0):
        self.dev_idx, self.blob_list, self.src_offset = dev_idx, blob_list, src_offset


class SetParam:
    def __init__(self):
        self.ttl_second = 0
        self.write_mode = "NONE_L2_CACHE"


# vllm-ascend layout: per layer a (K, V) pair, each (num_blocks, block_size, kv_heads, head_size) fp16
NB, BS, H, D = 16, 128, 8, 128
PER_BLOCK = BS * H * D * 2


def npu_parts(layers: int = 3):
    parts = []
    for layer in range(layers):
        for kv in range(2):
            parts.append(FakeTensor(0x10_0000_0000 + (layer * 2 + kv) * 0x1_0000_0000, (NB, BS, H, D)))
    return parts


def test_block_blobs_address_every_part_of_a_block():
    parts = npu_parts()
    blobs = block_blobs(parts, 5)
    assert len(blobs) == 6
    for part, (ptr, size) in zip(parts, blobs):
        assert ptr == part.base + 5 * PER_BLOCK
        assert size == PER_BLOCK
    with pytest.raises(IndexError):
        block_blobs(parts, NB)


def test_device_blob_lists_one_list_per_key_in_value_order():
    parts = npu_parts()
    dbls = device_blob_lists(parts, [3, 0, 15], 6, Blob, DeviceBlobList)
    assert [d.dev_idx for d in dbls] == [6, 6, 6]
    assert [len(d.blob_list) for d in dbls] == [6, 6, 6]
    assert [b.dev_ptr for b in dbls[0].blob_list] == [p.base + 3 * PER_BLOCK for p in parts]
    assert dbls[1].blob_list[0].dev_ptr == parts[0].base
    assert all(b.size == PER_BLOCK for d in dbls for b in d.blob_list)
    with pytest.raises(ValueError):
        device_blob_lists(parts, [0], -1, Blob, DeviceBlobList)


def test_set_param_carries_ttl():
    sp = set_param_for(90, SetParam)
    assert sp.ttl_second == 90 and sp.write_mode == "NONE_L2_CACHE"
    # evictable writes: a full data system drops old blocks instead of refusing new saves
    assert set_param_for(90, SetParam, "NONE_L2_CACHE_EVICT").write_mode == "NONE_L2_CACHE_EVICT"


class FakeHeteroClient:
    def __init__(self):
        self.calls = []
        self.missing: set = set()

    def mset_d2h(self, keys, dbls, set_param):
        self.calls.append(("mset_d2h", keys, dbls, set_param.ttl_second))

    def mget_h2d(self, keys, dbls, timeout_ms):
        self.calls.append(("mget_h2d", keys, dbls, timeout_ms))
        return [k for k in keys if k in self.missing]

    def exist(self, keys):
        return [k not in self.missing for k in keys]

    def delete(self, keys):
        self.calls.append(("delete", keys))
        return []


def test_npu_transport_builds_the_device_client_calls():
    client = FakeHeteroClient()
    conn = DsConnection(lambda: client, "npu0")
    assert conn.connect()
    t = NpuTransport(conn, device_id=2, blob_cls=Blob, dbl_cls=DeviceBlobList, set_param_cls=SetParam)
    parts = npu_parts(2)
    written = t.save_blocks(["k1", "k2"], parts, [4, 9], ttl_seconds=120)
    assert written == 2 * 4 * PER_BLOCK
    name, keys, dbls, ttl = client.calls[-1]
    assert (name, keys, ttl) == ("mset_d2h", ["k1", "k2"], 120)
    assert [b.dev_ptr for b in dbls[1].blob_list] == [p.base + 9 * PER_BLOCK for p in parts]
    client.missing = {"k2"}
    layout = BlockLayout.from_sizes([PER_BLOCK] * 4)
    assert t.load(["k1", "k2"], parts, layout, [1, 2]) == [True, False]
    assert client.calls[-1][0] == "mget_h2d" and client.calls[-1][2][0].dev_idx == 2
    assert t.exists(["k1", "k2"]) == [True, False]


# --- connection health ------------------------------------------------------------------------------

class FlakyClient:
    def __init__(self, behaviour):
        self.behaviour = behaviour

    def exist(self, keys):
        b = self.behaviour()
        if isinstance(b, Exception):
            raise b
        return [True] * len(keys)

    def health_check(self):
        class S:
            def is_ok(self):
                return True
        return S()


def test_classify_error():
    assert classify_error(RuntimeError("code: [Key not found], msg: [Cannot get objects]")) == "miss"
    assert classify_error(RuntimeError("code: [RPC unavailable], msg: [[UDS_CONNECT_FAILED] ...")) == "down"
    assert classify_error(RuntimeError("code: [RPC unavailable], msg: [[RPC_RECV_TIMEOUT] ...")) == "down"
    assert classify_error(RuntimeError("code: [Invalid parameter], msg: [key contains illegal char]")) == "error"


def test_connection_goes_down_fails_fast_and_reconnects():
    state = {"fail": True, "made": 0}
    events = []

    def behaviour():
        return RuntimeError("code: [RPC unavailable], msg: [UDS_CONNECT_FAILED]") if state["fail"] else None

    def factory():
        state["made"] += 1
        if state["made"] > 1 and state["fail"]:
            raise RuntimeError("code: [RPC unavailable], msg: [RPC_RECV_TIMEOUT]")
        return FlakyClient(behaviour)

    conn = DsConnection(factory, "t", backoff_s=0.05, on_event=events.append)
    assert conn.connect() and conn.healthy
    with pytest.raises(DsUnavailable):
        conn.call("exist", lambda c: c.exist(["a"]))
    assert not conn.healthy and events == ["down"]
    t0 = time.monotonic()
    with pytest.raises(DsUnavailable):  # while down: no call reaches the client
        conn.call("exist", lambda c: c.exist(["a"]))
    assert time.monotonic() - t0 < 0.05
    state["fail"] = False
    deadline = time.monotonic() + 5
    while not conn.healthy and time.monotonic() < deadline:
        time.sleep(0.02)
    assert conn.healthy and events == ["down", "up"]
    assert conn.call("exist", lambda c: c.exist(["a", "b"])) == [True, True]
    conn.close()


def test_a_connection_with_the_workers_address_reconnects_as_soon_as_its_port_accepts_again():
    """A restarted worker (its port refused, then accepting again) is used within a probe or two, not at the next
    backoff: here the backoff is 30 s and the reconnect must come within a second."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.close()  # the worker is gone: its port refuses
    state = {"up": False, "made": 0}
    events = []

    def factory():
        state["made"] += 1
        if not state["up"]:
            raise RuntimeError("code: [RPC unavailable], msg: [UDS_CONNECT_FAILED]")
        return FlakyClient(lambda: None)

    conn = DsConnection(factory, "t", backoff_s=30, on_event=events.append, address=("127.0.0.1", port))
    assert not conn.connect() and events == ["down"]
    time.sleep(0.5)
    assert state["made"] == 1  # nothing tried while the port refuses
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(16)
    try:
        state["up"] = True
        answered = time.monotonic()
        while not conn.healthy and time.monotonic() - answered < 5:
            time.sleep(0.02)
        took = time.monotonic() - answered
        assert conn.healthy and events == ["down", "up"] and took < 1.0, took
        # the control: the port accepts but clients fail (a restarted worker that listens before it serves): one
        # try at once (the client may only have been stale), then one a second, not one a probe
        state["up"] = False
        made = state["made"]
        with pytest.raises(DsUnavailable):
            conn.call("exist", lambda c: (_ for _ in ()).throw(RuntimeError("code: [RPC unavailable]")))
        time.sleep(2.5)
        assert 2 <= state["made"] - made <= 4 and not conn.healthy, state["made"] - made
    finally:
        conn.close()
        listener.close()


def test_a_client_left_stale_by_a_worker_that_restarted_unasked_is_replaced_at_its_first_failure():
    """An idle instance's worker restarted: its client's first call fails, and a new one is made at once (the port
    accepts), not after the 30 s backoff."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    events = []
    clients = [FlakyClient(lambda: RuntimeError("code: [RPC unavailable], msg: [UDS_CONNECT_FAILED]")),
               FlakyClient(lambda: None)]
    conn = DsConnection(lambda: clients.pop(0), "t", backoff_s=30, on_event=events.append,
                        address=listener.getsockname())
    try:
        assert conn.connect() and conn.healthy
        with pytest.raises(DsUnavailable):
            conn.call("exist", lambda c: c.exist(["a"]))
        failed = time.monotonic()
        while not conn.healthy and time.monotonic() - failed < 5:
            time.sleep(0.02)
        assert conn.healthy and events == ["down", "up"] and time.monotonic() - failed < 1.0
        assert conn.call("exist", lambda c: c.exist(["a"])) == [True]
    finally:
        conn.close()
        listener.close()


def test_while_the_worker_is_not_ready_each_try_is_the_quick_clients_and_the_real_one_follows_once_it_is():
    """A restarted worker listens before it serves: a try then costs the quick client's short timeout, not the real
    client's, and the real client is made as soon as the quick one gets through."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    state = {"ready": False, "quick": 0, "real": 0}

    def quick():
        state["quick"] += 1
        if not state["ready"]:
            raise RuntimeError("code: [Not ready], msg: [Worker not ready]")
        return object()

    def real():
        state["real"] += 1
        return FlakyClient(lambda: None)

    conn = DsConnection(real, "t", backoff_s=30, address=listener.getsockname(), quick_factory=quick)
    try:
        conn._mark_down(RuntimeError("code: [RPC unavailable]"))
        time.sleep(2.5)
        assert state["real"] == 0 and state["quick"] >= 2 and not conn.healthy  # every try stopped at the quick one
        state["ready"] = True
        ready = time.monotonic()
        while not conn.healthy and time.monotonic() - ready < 5:
            time.sleep(0.02)
        assert conn.healthy and state["real"] == 1 and time.monotonic() - ready < 1.5
    finally:
        conn.close()
        listener.close()


def test_connection_miss_and_other_errors_do_not_mark_down():
    conn = DsConnection(lambda: object(), "t")
    conn.connect()

    def missing(_c):
        raise RuntimeError("code: [Key not found]")

    def bad(_c):
        raise RuntimeError("code: [Invalid parameter]")

    with pytest.raises(KeyError):
        conn.call("get", missing)
    with pytest.raises(TransportError):
        conn.call("set", bad)
    assert conn.healthy


def test_connect_failure_at_startup_is_not_fatal():
    def factory():
        raise RuntimeError("code: [RPC unavailable], msg: [RPC_RECV_TIMEOUT]")

    conn = DsConnection(factory, "t", backoff_s=10)
    assert conn.connect() is False
    assert not conn.healthy
    with pytest.raises(DsUnavailable):
        conn.call("exist", lambda c: c.exist(["a"]))
    conn.close()


# --- host path round trip (torch) -------------------------------------------------------------------

@pytest.mark.torch
def test_host_round_trip_is_bit_exact_for_the_cpu_layout():
    import torch
    from yrpd.connector.transport import part_block_nbytes

    # CPU layout per layer: (num_blocks, kv_heads, block_size, 2*head_size), bf16
    src = [torch.randn(8, 2, 32, 64).to(torch.bfloat16) for _ in range(2)]
    dst = [torch.zeros_like(t) for t in src]
    layout = BlockLayout.from_sizes([part_block_nbytes(p) for p in src])
    client = FakeKVClient()
    conn = DsConnection(lambda: client, "t")
    conn.connect()
    t = HostTransport(conn, max_batch_keys=2, write_mode="EVICT")  # forces batching
    blocks = [1, 4, 6]
    idx = torch.tensor(blocks)
    staging = torch.empty((3, layout.block_nbytes), dtype=torch.uint8)
    for p, off, size in zip(src, layout.offsets, layout.part_nbytes):
        staging[:, off:off + size].copy_(p.index_select(0, idx).reshape(3, -1).view(torch.uint8))
    keys = ["a", "b", "c"]
    assert t.save(keys, staging, ttl_seconds=60) == 3 * layout.block_nbytes
    assert client.ttl == {"a": 60, "b": 60, "c": 60} and client.write_modes == ["EVICT", "EVICT"]
    ok = t.load(keys + ["zz"], dst, layout, [0, 2, 7, 5])  # different destination blocks, one missing
    assert ok == [True, True, True, False]
    for p_src, p_dst in zip(src, dst):
        for s, d in zip(blocks, [0, 2, 7]):
            assert torch.equal(p_src[s].view(torch.int16), p_dst[d].view(torch.int16))
        assert not p_dst[5].any()
    # a value of the wrong size is refused, not half-copied
    client.store["a"] = FakeKVClient.Buf(10)
    assert t.load(["a"], dst, layout, [3]) == [False]
    assert not dst[0][3].any()
    assert t.load(["nothing"], dst, layout, [3]) == [False]


@pytest.mark.torch
def test_staging_pool_reuses_and_bounds_memory():
    import torch
    from yrpd.connector.transport import StagingPool, block_rows_u8, stage_blocks, values_from_staged

    parts = [torch.randn(8, 2, 32, 64).to(torch.bfloat16) for _ in range(3)]
    rows = [block_rows_u8(p) for p in parts]
    per_block = rows[0].shape[1]
    pool = StagingPool([per_block] * 3, max_bytes=16 * 3 * per_block)
    slab = pool.acquire(5)
    assert slab is not None and slab[0].shape == (16, per_block)
    assert pool.acquire(5) is None  # budget exhausted while the first slab is in flight
    staged = stage_blocks(parts, rows, [6, 2, 4], slab)
    assert all(s.data_ptr() == sl.data_ptr() for s, sl in zip(staged, slab))  # no fresh allocation
    vals = values_from_staged(staged, [0, 2])
    assert torch.equal(torch.cat(vals[1]), torch.cat([p[4].reshape(-1).view(torch.uint8) for p in parts]))
    pool.release(slab)
    assert pool.acquire(3) is slab
    # a non-contiguous part is staged block by block
    nc = torch.randn(2, 8, 16).to(torch.bfloat16).transpose(0, 1)  # (8, 2, 16), not contiguous
    st = stage_blocks([nc], [block_rows_u8(nc)], [1, 7])
    assert torch.equal(st[0][1], nc[7].reshape(-1).view(torch.uint8))
