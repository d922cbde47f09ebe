"""The producer's writer (yrpd/connector/saver.py) on its own: staged blocks handed to a `Saver` thread over an
in-memory data system, and a `ProcessSaver` whose child is the real writer process with that in-memory data system
in place of the client library.

What a user sees of the writer: blocks land in the data system in the order the steps produced them, a write that
fails is counted as failed (never as saved), its staging memory comes back either way, and stopping it writes what
is pending or, where the data system is stuck, counts it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest

from tests.connector import fakes
from tests.connector.fakes import FakeKVClient
from yrpd.connector import saver as saver_module
from yrpd.connector.config import parse_config
from yrpd.connector.saver import Job, ProcessSaver, Saver, shared_slab_factory
from yrpd.connector.stats import ConnectorStats
from yrpd.connector.transport import DsConnection, StagingPool

pytestmark = pytest.mark.torch

try:
    import torch
except ImportError as exc:  # the main pass (`-m "not torch"`) collects this module and runs none of it
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

ROW = 16  # bytes of one staged block (one part)
EXTRA = {"ds_address": "127.0.0.1:1", "ttl_seconds": 600, "retry_backoff_s": 0.05}


def rows(*fills: int):
    """A staged job's data: one part, one row per block, row i filled with fills[i]."""
    return [torch.tensor([[f] * ROW for f in fills], dtype=torch.uint8)]


def save_job(keys, fills, req_id: str = "r") -> Job:
    return Job("save", list(keys), rows(*fills), len(keys) * ROW, req_id)


def value(ds: FakeKVClient, key: str) -> bytes:
    return bytes(ds.store[key].data)


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def since(stats: ConnectorStats):
    """How much a counter moved from now on: what the events after this call did, whatever ran before."""
    start = stats.snapshot()["counters"]
    return lambda name: stats.get(name) - start.get(name, 0)


@pytest.fixture(autouse=True)
def _imported():
    if _IMPORT_ERROR is not None:
        raise _IMPORT_ERROR


@pytest.fixture
def ds():
    return FakeKVClient()


@pytest.fixture
def make(ds):
    """make(max_pending_bytes=, pool=) -> a started Saver over `ds`, stopped at the end of the test."""
    before = set(threading.enumerate())
    made = []

    def build(max_pending_bytes: int = 1 << 20, pool=None) -> Saver:
        cfg = parse_config("kv_producer", EXTRA)
        saver = Saver(DsConnection(lambda: ds, "saver", cfg.retry_backoff_s), cfg,
                      ConnectorStats("worker", "kv_producer"), max_pending_bytes, pool=pool)
        saver.start()
        made.append(saver)
        return saver

    yield build
    for saver in made:
        if saver._thread.is_alive():  # a second stop() would wait out its whole flush timeout on a gone thread
            saver.stop(5.0)
    assert not fakes.stray_threads(before), "a writer thread outlived stop()"


def test_saver_writes_jobs_in_the_order_they_were_submitted(make, ds):
    saver = make()
    moved = since(saver.stats)
    ds.store["gone"] = FakeKVClient.Buf(ROW)
    gate = ds.hold["exist"] = threading.Event()  # every job queues up behind the first
    jobs = [save_job(["a1", "a2"], [1, 2]), save_job(["b1"], [3]), Job("delete", ["gone"]), save_job(["c1"], [4])]
    assert all(saver.submit(j) for j in jobs)
    gate.set()
    assert saver.flush(5)
    assert [(op, keys) for op, keys in ds.key_log if op in ("mcreate", "delete")] == [
        ("mcreate", ["a1", "a2"]), ("mcreate", ["b1"]), ("delete", ["gone"]), ("mcreate", ["c1"])]
    assert {k: value(ds, k) for k in ds.store} == {"a1": bytes([1] * ROW), "a2": bytes([2] * ROW),
                                                   "b1": bytes([3] * ROW), "c1": bytes([4] * ROW)}
    assert all(ds.ttl[k] == 600 for k in ds.store)
    assert moved("saved_blocks") == 4 and moved("deleted_blocks") == 1


def test_saver_keeps_a_present_block_and_only_refreshes_its_ttl(make, ds):
    saver = make()
    old = FakeKVClient.Buf(ROW)
    old.data[:] = bytes([9] * ROW)
    ds.store["hot"], ds.ttl["hot"] = old, 5
    moved = since(saver.stats)
    saver.submit(save_job(["hot", "new"], [1, 2]))
    assert saver.flush(5)
    assert value(ds, "hot") == bytes([9] * ROW) and ds.ttl["hot"] == 600
    assert value(ds, "new") == bytes([2] * ROW)
    assert moved("saved_blocks") == 1 and moved("save_skipped_existing") == 1


def test_a_failed_write_counts_as_failed_not_saved_and_the_saver_carries_on(make, ds):
    saver = make()
    moved = since(saver.stats)
    ds.fail["mcreate"] = "code: [K_OUT_OF_MEMORY], msg: [no space for the object]"
    saver.submit(save_job(["x1", "x2"], [1, 2]))
    assert saver.flush(5)
    assert "x1" not in ds.store and "x2" not in ds.store
    assert (moved("saved_blocks"), moved("save_failed_blocks"), moved("ds_errors")) == (0, 2, 1)
    del ds.fail["mcreate"]  # control: the same job once the data system takes writes again
    moved = since(saver.stats)
    saver.submit(save_job(["x1", "x2"], [1, 2]))
    assert saver.flush(5)
    assert value(ds, "x2") == bytes([2] * ROW)
    assert (moved("saved_blocks"), moved("save_failed_blocks")) == (2, 0)


def test_blocks_a_full_worker_takes_and_evicts_count_as_failed_for_want_of_memory_not_saved(make, ds, monkeypatch):
    """A worker whose memory is full of entries it may not evict answers every write with success, drops some new
    blocks at once and evicts the rest at the next write (tests/connector/test_ds_full.py measures a real one). Each
    job's one look after its write finds both: those blocks are failed saves, for want of memory, never saved ones;
    while the worker evicts that way, an idle writer does not count what it still holds (the next write evicts it).
    The control: the same writes into a worker that keeps them are saved, the last ones at an idle look."""
    monkeypatch.setattr(saver_module, "CONFIRM_IDLE_S", 0.05)
    saver = make()
    moved = since(saver.stats)
    ds.evict_previous, ds.drop_writes = True, {"a2"}
    saver.submit(save_job(["a1", "a2"], [1, 2]))
    saver.submit(save_job(["b1", "b2"], [3, 4]))
    wait_for(lambda: moved("save_failed_blocks") == 2)  # a2 at once, a1 when b was written
    time.sleep(0.3)  # idle, the b blocks still held: not counted while the worker evicts at each write
    assert sorted(ds.store) == ["b1", "b2"]
    assert (moved("saved_blocks"), moved("save_failed_blocks"), moved("save_failed_memory_full_blocks")) == (0, 2, 2)
    assert ("exist", ["a1", "b1", "b2"]) in ds.key_log  # one look after b's write: a's held block and b's
    saver.submit(save_job(["c1"], [5]))
    wait_for(lambda: moved("save_failed_blocks") == 4)
    assert moved("saved_blocks") == 0 and moved("ds_errors") == 0
    ds.evict_previous, ds.drop_writes = False, False  # control: a worker with room keeps what it takes
    saver.submit(save_job(["d1", "d2"], [6, 7]))
    wait_for(lambda: moved("saved_blocks") == 3)  # c1 held after d's write, then d's at an idle look
    assert (moved("saved_bytes"), moved("save_failed_blocks")) == (3 * ROW, 4)
    assert sorted(ds.store) == ["c1", "d1", "d2"]


def test_a_write_refused_for_want_of_memory_names_that_reason_and_other_failures_do_not(make, ds):
    saver = make()
    moved = since(saver.stats)
    ds.fail["mset_buffer"] = "code: [Out of memory], msg: [Shared memory no space in arena: 9, traceId: x]"
    saver.submit(save_job(["z1"], [1]))
    assert saver.flush(5)
    assert (moved("save_failed_blocks"), moved("save_failed_memory_full_blocks")) == (1, 1)
    ds.fail["mset_buffer"] = "code: [Invalid parameter], msg: [something else]"
    saver.submit(save_job(["z2"], [1]))
    assert saver.flush(5)
    assert (moved("save_failed_blocks"), moved("save_failed_memory_full_blocks")) == (2, 1)


def test_a_failed_delete_is_counted_as_an_error_and_deletes_nothing(make, ds):
    saver = make()
    for k in ("k1", "k2"):
        ds.store[k] = FakeKVClient.Buf(ROW)
    moved = since(saver.stats)
    ds.fail["delete"] = "code: [K_RUNTIME_ERROR], msg: [delete refused]"
    saver.submit(Job("delete", ["k1", "k2"]))
    assert saver.flush(5)
    assert set(ds.store) == {"k1", "k2"}
    assert (moved("ds_errors"), moved("deleted_blocks")) == (1, 0)
    del ds.fail["delete"]  # control: the same job once the data system takes it
    moved = since(saver.stats)
    saver.submit(Job("delete", ["k1", "k2"]))
    assert saver.flush(5)
    assert ds.store == {} and (moved("ds_errors"), moved("deleted_blocks")) == (0, 2)


def test_submit_refuses_work_past_the_pending_budget_until_the_writer_catches_up(make, ds):
    saver = make(max_pending_bytes=3 * ROW)
    gate = ds.hold["exist"] = threading.Event()
    assert saver.submit(save_job(["a", "b"], [1, 2]))
    assert not saver.submit(save_job(["c", "d"], [3, 4]))  # 4 blocks pending would pass the 3-block budget
    assert saver.submit(save_job(["e"], [5]))  # control: one more block still fits
    gate.set()
    assert saver.flush(5)
    assert set(ds.store) == {"a", "b", "e"}
    assert saver.submit(save_job(["c", "d"], [3, 4]))  # written, so no longer pending
    assert saver.flush(5)
    assert {"c", "d"} <= set(ds.store)


def test_staging_memory_comes_back_after_a_failed_write_too(make, ds):
    pool = StagingPool([ROW], max_bytes=16 * ROW)  # room for one slab
    saver = make(pool=pool)
    moved = since(saver.stats)
    slab = pool.acquire(1)
    gate = ds.hold["exist"] = threading.Event()
    ds.fail["mcreate"] = "code: [K_RUNTIME_ERROR], msg: [write refused]"
    job = save_job(["k"], [1])
    job.slab = slab
    saver.submit(job)
    assert pool.acquire(1) is None  # control: while the job is in the writer its slab is out
    gate.set()
    assert saver.flush(5)
    assert moved("save_failed_blocks") == 1
    assert pool.acquire(1) is slab


def test_stop_writes_the_jobs_still_pending(make, ds):
    saver = make()
    moved = since(saver.stats)
    gate = ds.hold["exist"] = threading.Event()
    for i in range(3):
        saver.submit(save_job([f"k{i}"], [i]))
    assert ds.store == {}  # control: nothing written before stop begins
    opener = threading.Timer(0.05, gate.set)
    opener.start()
    saver.stop(5.0)
    opener.join()
    assert set(ds.store) == {"k0", "k1", "k2"}
    assert moved("saved_blocks") == 3


def test_stop_on_a_stuck_data_system_returns_and_counts_what_it_could_not_write(make, ds):
    saver = make()
    moved = since(saver.stats)
    gate = ds.hold["exist"] = threading.Event()
    saver.submit(save_job(["a1", "a2"], [1, 2]))
    saver.submit(save_job(["b1"], [3]))
    t0 = time.monotonic()
    saver.stop(0.2)
    assert time.monotonic() - t0 < 2.0  # the engine's shutdown is not held by the data system
    # the stuck call returns after stop closed the connection: neither job can be finished, both are counted
    gate.set()
    deadline = time.monotonic() + 5
    while moved("save_failed_blocks") < 3:
        assert time.monotonic() < deadline, "the jobs stop() left behind were never counted"
        time.sleep(0.005)
    assert ds.store == {}
    assert (moved("save_failed_blocks"), moved("saved_blocks")) == (3, 0)


# --- the writer process --------------------------------------------------------------------------------------

# The real writer (saver.child_main), with the in-memory data system in place of the client library; after every write
# it leaves what it holds in $YRPD_TEST_DS_DUMP for the test to read (the child may end by a signal, so not at exit),
# $YRPD_TEST_DS_FAIL ({op: message}) makes its data system refuse those calls, and $YRPD_TEST_DS_DROP (a list of
# keys) and $YRPD_TEST_DS_EVICT make it a full worker that takes writes without error and evicts them (see fakes).
CHILD = """
import json, os, sys
from tests.connector.fakes import FakeKVClient
from yrpd.connector import saver, transport

class DumpingKVClient(FakeKVClient):
    def mset_buffer(self, bufs):
        super().mset_buffer(bufs)
        with open(os.environ["YRPD_TEST_DS_DUMP"], "w") as f:
            json.dump({k: bytes(v.data).hex() for k, v in self.store.items()}, f)

ds = DumpingKVClient()
ds.fail = json.loads(os.environ.get("YRPD_TEST_DS_FAIL", "{}"))
ds.drop_writes = set(json.loads(os.environ.get("YRPD_TEST_DS_DROP", "[]")))
ds.evict_previous = bool(os.environ.get("YRPD_TEST_DS_EVICT"))
transport.kvclient_factory = lambda *a, **k: (lambda: ds)  # what saver's connection makes
sys.exit(saver.child_main(sys.argv[1:]))
"""


def process_saver(command, pool) -> ProcessSaver:
    cfg = parse_config("kv_producer", EXTRA)
    saver = ProcessSaver("kv_producer", EXTRA, cfg, ConnectorStats("worker", "kv_producer"), 1 << 20, pool,
                         command=command)
    saver.start()
    return saver


def staged_job(pool: StagingPool, keys, fills) -> Job:
    slab = pool.acquire(len(keys))
    for i, f in enumerate(fills):
        slab[0][i].fill_(f)
        slab[1][i].fill_(f + 100)
    job = Job("save", list(keys), None, len(keys) * sum(pool.part_nbytes))
    job.slab = slab
    return job


def test_process_saver_writes_shared_staging_through_its_child_and_stops_it(tmp_path, monkeypatch):
    dump = tmp_path / "ds.json"
    monkeypatch.setenv("YRPD_TEST_DS_DUMP", str(dump))
    before = set(threading.enumerate())
    pool = StagingPool([ROW, 2 * ROW], 1 << 20, slab_factory=shared_slab_factory)
    saver = process_saver([sys.executable, "-c", CHILD], pool)
    moved = since(saver.stats)
    try:
        saver.submit(staged_job(pool, ["a", "b"], [1, 2]))
        assert saver.flush(30)
        child = saver.child_pid
        assert child is not None
        assert (moved("saved_blocks"), moved("saved_bytes")) == (2, 2 * 3 * ROW)
        saver.submit(staged_job(pool, ["b", "c"], [7, 3]))  # "b" is there: kept, not rewritten
        assert saver.flush(30)
        assert (moved("saved_blocks"), moved("save_skipped_existing")) == (3, 1)
    finally:
        saver.stop(10.0)
    assert not os.path.exists(f"/proc/{child}")  # stop leaves no writer process behind (reaped, too)
    stored = {k: bytes.fromhex(v) for k, v in json.loads(dump.read_text()).items()}
    assert stored == {k: bytes([f] * ROW + [f + 100] * 2 * ROW) for k, f in (("a", 1), ("b", 2), ("c", 3))}
    assert moved("save_failed_blocks") == 0
    assert not fakes.stray_threads(before)


@pytest.mark.parametrize("nice", [10, 0], ids=["writer_nice 10", "default (control)"])
def test_process_saver_starts_its_child_at_the_nice_value_asked(tmp_path, monkeypatch, nice):
    """writer_nice lowers only the writer's priority, by that much: the worker (this process) keeps its own."""
    monkeypatch.setenv("YRPD_TEST_DS_DUMP", str(tmp_path / "ds.json"))
    extra = {**EXTRA, "writer_nice": nice} if nice else EXTRA
    pool = StagingPool([ROW, 2 * ROW], 1 << 20, slab_factory=shared_slab_factory)
    saver = ProcessSaver("kv_producer", extra, parse_config("kv_producer", extra),
                         ConnectorStats("worker", "kv_producer"), 1 << 20, pool, command=[sys.executable, "-c", CHILD])
    saver.start()
    try:
        saver.submit(staged_job(pool, ["a"], [1]))
        assert saver.flush(30)  # the child has answered: it set its priority before its first read
        assert os.getpriority(os.PRIO_PROCESS, saver.child_pid) == os.getpriority(os.PRIO_PROCESS, 0) + nice
    finally:
        saver.stop(10.0)


def test_process_saver_counts_a_write_its_child_could_not_make_as_failed(tmp_path, monkeypatch):
    monkeypatch.setenv("YRPD_TEST_DS_DUMP", str(tmp_path / "ds.json"))
    monkeypatch.setenv("YRPD_TEST_DS_FAIL", json.dumps({"mcreate": "code: [K_OUT_OF_MEMORY], msg: [full]"}))
    before = set(threading.enumerate())
    pool = StagingPool([ROW, 2 * ROW], 1 << 20, slab_factory=shared_slab_factory)
    saver = process_saver([sys.executable, "-c", CHILD], pool)
    moved = since(saver.stats)
    try:
        saver.submit(staged_job(pool, ["a", "b"], [1, 2]))
        assert saver.flush(30)
        assert (moved("save_failed_blocks"), moved("saved_blocks")) == (2, 0)
        assert saver.child_pid is not None  # a refused write is the data system's answer, not a broken writer
    finally:
        saver.stop(10.0)
    assert not (tmp_path / "ds.json").exists()
    assert not fakes.stray_threads(before)


def test_process_saver_counts_blocks_its_childs_full_worker_took_and_evicted_as_failed(tmp_path, monkeypatch):
    monkeypatch.setenv("YRPD_TEST_DS_DUMP", str(tmp_path / "ds.json"))
    monkeypatch.setenv("YRPD_TEST_DS_DROP", json.dumps(["b"]))
    monkeypatch.setenv("YRPD_TEST_DS_EVICT", "1")
    before = set(threading.enumerate())
    pool = StagingPool([ROW, 2 * ROW], 1 << 20, slab_factory=shared_slab_factory)
    saver = process_saver([sys.executable, "-c", CHILD], pool)
    moved = since(saver.stats)
    try:
        saver.submit(staged_job(pool, ["a", "b"], [1, 2]))  # b dropped at once
        saver.submit(staged_job(pool, ["c"], [3]))  # a evicted by this write
        assert saver.flush(30)  # c, still held, counted at the flush
        assert (moved("saved_blocks"), moved("saved_bytes"), moved("save_failed_blocks"),
                moved("save_failed_memory_full_blocks"), moved("ds_errors")) == (1, 3 * ROW, 2, 2, 0)
        assert saver.child_pid is not None
    finally:
        saver.stop(10.0)
    assert sorted(json.loads((tmp_path / "ds.json").read_text())) == ["c"]
    assert not fakes.stray_threads(before)


def test_process_saver_counts_saves_as_failed_while_its_child_cannot_start(tmp_path):
    before = set(threading.enumerate())
    pool = StagingPool([ROW, 2 * ROW], 16 * 3 * ROW, slab_factory=shared_slab_factory)  # room for one slab
    saver = process_saver([str(tmp_path / "no-such-writer")], pool)
    moved = since(saver.stats)
    try:
        saver.submit(staged_job(pool, ["a", "b"], [1, 2]))
        assert saver.flush(10)
        assert (moved("save_failed_blocks"), moved("saved_blocks"), moved("ds_errors")) == (2, 0, 1)
        assert pool.acquire(1) is not None  # its staging came back: the next save is not dropped
    finally:
        saver.stop(5.0)
    assert not fakes.stray_threads(before)
