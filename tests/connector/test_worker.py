"""The worker half of the connector (yrpd/connector/worker.py) on its own: CPU KV cache tensors in vLLM's CPU layout,
the step metadata a scheduler would send, an in-memory data system, and the in-process writer (`saver: thread`).

What a user sees of a worker: the bytes of exactly the planned blocks land under this rank's keys, loads fill exactly
the planned blocks, and whatever cannot be loaded is reported so vLLM recomputes it.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.connector import fakes
from tests.connector.fakes import FakeKVClient
from yrpd.connector import keys as K

pytestmark = pytest.mark.torch

try:
    import torch

    from yrpd.connector import common
    from yrpd.connector.common import BlockOp, YuanrongConnectorMetadata
    from yrpd.connector.worker import ConnectorWorker
except ImportError as exc:  # the main pass (`-m "not torch"`, no vLLM) collects this module and runs none of it
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

BS = 4
NUM_BLOCKS = 8
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def digests(n: int, seed: int) -> list[str]:
    r = random.Random(seed)
    return K.prefix_digests([r.randrange(3, 30000) for _ in range(n * BS)], BS)


def kv_caches(names=LAYERS, *, fill: bool = True, width: int = 8, seed: int = 0) -> dict:
    """Per layer one (num_blocks, kv_heads, block_size, 2 * head_size) tensor: vLLM's CPU attention layout."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in names:
        shape = (NUM_BLOCKS, 2, BS, width)
        out[name] = torch.randn(shape, generator=g).to(torch.bfloat16) if fill else \
            torch.zeros(shape, dtype=torch.bfloat16)
    return out


def block_bytes(caches: dict, names, block: int) -> bytes:
    """The value a block is stored as: its bytes in every layer, in the order given."""
    return b"".join(caches[n][block].contiguous().view(torch.uint8).numpy().tobytes() for n in names)


def stored(ds: FakeKVClient, key: str) -> bytes:
    return bytes(ds.store[key].data)


def put_value(ds: FakeKVClient, key: str, value: bytes) -> None:
    buf = FakeKVClient.Buf(len(value))
    buf.data[:] = value
    ds.store[key] = buf


def meta(loads=(), saves=()):
    return YuanrongConnectorMetadata(loads=list(loads), saves=list(saves))


def key_of(w, digest: str, tp_rank: int = 0) -> str:
    """The key the scheduler half checks for this rank (both halves derive it from the same context)."""
    return K.key_for(w.ctx.namespace(tp_rank, 0).digest, digest)


def wait_for(cond, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.fixture(autouse=True)
def _imported():
    if _IMPORT_ERROR is not None:
        raise _IMPORT_ERROR


@pytest.fixture
def make(ds, monkeypatch):
    """make(role, extra, caches=, tp_rank=, pp_rank=, **vllm_config kwargs) -> a ConnectorWorker, its caches
    registered."""
    before = set(threading.enumerate())
    made = []

    def build(role, extra=None, *, caches=None, tp_rank=None, pp_rank=0, **cfg):
        if tp_rank is not None:
            import vllm.distributed.parallel_state as ps

            monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: tp_rank)
            monkeypatch.setattr(ps, "get_pp_group", lambda: SimpleNamespace(rank_in_group=pp_rank))
        extra = {"saver": "thread", "retry_backoff_s": 0.05, **(extra or {})}
        w = ConnectorWorker(common.ConnectorContext(fakes.vllm_config(role, extra, block_size=BS, **cfg)))
        made.append(w)
        if caches is not None:
            w.register_kv_caches(caches)
        return w

    yield build
    for w in made:
        w.shutdown()
    assert not fakes.stray_threads(before), "a connector thread outlived shutdown()"


# --- saves ----------------------------------------------------------------------------------------------

def test_worker_saves_a_snapshot_of_exactly_the_planned_blocks_under_its_keys(make, ds):
    caches = kv_caches()
    original = {n: t.clone() for n, t in caches.items()}
    w = make("kv_producer", {"ttl_seconds": 42}, caches=caches)
    d = digests(3, 1)
    saved, nbytes = w.stats.get("saved_blocks"), w.stats.get("saved_bytes")
    staged = w.stats.snapshot()["latency_ms"]["stage"]["count"]
    gate = ds.hold["exist"] = threading.Event()  # the writer is slow: the engine reuses the blocks meanwhile
    w.wait_for_save(meta(saves=[BlockOp("r", d, [5, 1, 6])]))
    # the step's own cost of the save (the copy out of the paged cache) is timed, once per step
    assert w.stats.snapshot()["latency_ms"]["stage"]["count"] - staged == 1
    for t in caches.values():
        t[[5, 1, 6]] = 0
    gate.set()
    w.shutdown()
    want = {key_of(w, dg): block_bytes(original, LAYERS, b) for dg, b in zip(d, [5, 1, 6])}
    assert {k: stored(ds, k) for k in ds.store} == want
    assert all(ds.ttl[k] == 42 for k in want)
    block_nbytes = len(next(iter(want.values())))
    assert w.stats.get("saved_blocks") - saved == 3
    assert w.stats.get("saved_bytes") - nbytes == 3 * block_nbytes


def test_worker_value_puts_layers_in_index_order_not_name_order(make, ds):
    # as strings "layers.10" sorts before "layers.2": a name sort would lay a block out differently from an engine
    # whose layers are named otherwise, and its values would load into the wrong layers
    names = ["model.layers.10.attn", "model.layers.2.attn", "model.layers.1.attn"]
    caches = kv_caches(names)
    w = make("kv_producer", caches=caches)
    d = digests(1, 2)
    w.wait_for_save(meta(saves=[BlockOp("r", d, [3])]))
    w.shutdown()
    by_index = ["model.layers.1.attn", "model.layers.2.attn", "model.layers.10.attn"]
    assert stored(ds, key_of(w, d[0])) == block_bytes(caches, by_index, 3)


def test_worker_shutdown_writes_the_saves_still_pending(make, ds):
    caches = kv_caches()
    w = make("kv_producer", caches=caches)
    d = digests(2, 3)
    gate = ds.hold["exist"] = threading.Event()
    w.wait_for_save(meta(saves=[BlockOp("r", d, [0, 7])]))
    assert ds.store == {}  # control: still in the writer when shutdown begins
    opener = threading.Timer(0.05, gate.set)
    opener.start()
    w.shutdown()
    opener.join()
    assert set(ds.store) == {key_of(w, d[0]), key_of(w, d[1])}


def test_save_sync_returns_only_once_the_blocks_are_written(make, ds):
    caches = kv_caches()
    d = digests(2, 4)
    sync = make("kv_producer", {"save_sync": True}, caches=caches)
    sync.wait_for_save(meta(saves=[BlockOp("r", d[:1], [2])]))
    assert key_of(sync, d[0]) in ds.store
    # control: without save_sync the step goes on while the writer is still at it
    lazy = make("kv_producer", caches=caches)
    gate = ds.hold["exist"] = threading.Event()
    lazy.wait_for_save(meta(saves=[BlockOp("r", d[1:], [3])]))
    assert key_of(lazy, d[1]) not in ds.store
    gate.set()
    lazy.shutdown()
    assert key_of(lazy, d[1]) in ds.store


def big_caches() -> dict:
    # 64 KiB a block (32 KiB a layer): one 16-block staging slab takes all of a 1 MiB budget
    return kv_caches(width=2048)


def test_saves_past_the_staging_budget_are_dropped_and_counted(make, ds):
    w = make("kv_producer", {"staging_mb": 1}, caches=big_caches())
    d = digests(3, 5)
    gate = ds.hold["exist"] = threading.Event()
    dropped = w.stats.get("save_dropped_blocks")
    w.wait_for_save(meta(saves=[BlockOp("a", d[0:1], [1])]))  # its slab stays out while the writer is stuck
    w.wait_for_save(meta(saves=[BlockOp("b", d[1:2], [2])]))
    assert w.stats.get("save_dropped_blocks") - dropped == 1
    gate.set()
    wait_for(lambda: key_of(w, d[0]) in ds.store, "the first save")
    # control: once the writer caught up, the same budget takes the next save
    w.wait_for_save(meta(saves=[BlockOp("c", d[2:3], [3])]))
    w.shutdown()
    assert set(ds.store) == {key_of(w, d[0]), key_of(w, d[2])}
    assert w.stats.get("save_dropped_blocks") - dropped == 1


def test_a_block_that_cannot_be_staged_fails_its_save_and_frees_its_staging(make, ds):
    w = make("kv_producer", {"staging_mb": 1}, caches=big_caches())  # room for one slab only
    d = digests(2, 6)
    failed, dropped = w.stats.get("save_failed_blocks"), w.stats.get("save_dropped_blocks")
    w.wait_for_save(meta(saves=[BlockOp("bad", d[0:1], [NUM_BLOCKS + 5])]))  # no such block in the cache
    assert w.stats.get("save_failed_blocks") - failed == 1
    # had the failed save kept its slab, this one would be dropped for want of staging memory
    w.wait_for_save(meta(saves=[BlockOp("good", d[1:2], [4])]))
    w.shutdown()
    assert set(ds.store) == {key_of(w, d[1])}
    assert w.stats.get("save_dropped_blocks") == dropped


# --- loads ----------------------------------------------------------------------------------------------

def test_worker_loads_exactly_the_planned_blocks(make, ds):
    src = kv_caches(seed=1)
    dst = kv_caches(fill=False)
    w = make("kv_consumer", caches=dst)
    d = digests(3, 7)
    for dg, b in zip(d, [6, 0, 4]):
        put_value(ds, key_of(w, dg), block_bytes(src, LAYERS, b))
    loaded, nbytes = w.stats.get("loaded_blocks"), w.stats.get("loaded_bytes")
    w.start_load_kv(meta(loads=[BlockOp("r", d, [2, 3, 7])]))
    assert w.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        for s, t in zip([6, 0, 4], [2, 3, 7]):
            assert torch.equal(dst[name][t].view(torch.int16), src[name][s].view(torch.int16)), (name, t)
        untouched = [b for b in range(NUM_BLOCKS) if b not in (2, 3, 7)]
        assert not dst[name][untouched].any()
    assert w.stats.get("loaded_blocks") - loaded == 3
    assert w.stats.get("loaded_bytes") - nbytes == 3 * len(block_bytes(src, LAYERS, 0))


def test_worker_reports_each_block_it_could_not_load_once(make, ds):
    src = kv_caches(seed=2)
    dst = kv_caches(fill=False)
    w = make("kv_consumer", caches=dst)
    d = digests(3, 8)
    put_value(ds, key_of(w, d[0]), block_bytes(src, LAYERS, 1))  # control: loads
    # d[1] is not in the data system at all (evicted)
    put_value(ds, key_of(w, d[2]), b"\x01" * 10)  # not a block of this cache's size
    failed, loaded = w.stats.get("load_failed_blocks"), w.stats.get("loaded_blocks")
    w.start_load_kv(meta(loads=[BlockOp("r", d, [2, 3, 4]),
                                BlockOp("u", [], [6])]))  # an allocation the scheduler never promised
    assert w.get_block_ids_with_load_errors() == {3, 4, 6}
    assert w.get_block_ids_with_load_errors() == set()  # vLLM recomputes them once
    assert w.stats.get("load_failed_blocks") - failed == 3
    assert w.stats.get("loaded_blocks") - loaded == 1
    assert torch.equal(dst[LAYERS[0]][2].view(torch.int16), src[LAYERS[0]][1].view(torch.int16))
    assert not dst[LAYERS[0]][4].any()  # a wrong-sized value is not half copied


def test_worker_never_publishes_kv_of_a_request_whose_load_failed(make, ds):
    caches = kv_caches()
    w = make("kv_both", caches=caches)
    d = digests(5, 9)
    dropped = w.stats.get("save_dropped_blocks")
    # "q" failed to load its block 2: the blocks computed on top of it are wrong and must not reach other engines
    w.start_load_kv(meta(loads=[BlockOp("q", d[0:1], [2])]))
    assert w.get_block_ids_with_load_errors() == {2}
    w.wait_for_save(meta(saves=[BlockOp("q", d[1:3], [3, 4]), BlockOp("other", d[3:4], [5])]))
    assert w.stats.get("save_dropped_blocks") - dropped == 2
    # once vLLM is done with "q" (it recomputed), the request id may carry good KV again
    w.get_finished({"q"})
    w.wait_for_save(meta(saves=[BlockOp("q", d[4:5], [6])]))
    w.shutdown()
    assert set(ds.store) == {key_of(w, d[3]), key_of(w, d[4])}


def test_worker_loads_fail_fast_and_are_reported_while_the_data_system_is_down(make, ds):
    src = kv_caches(seed=3)
    w = make("kv_consumer", caches=kv_caches(fill=False))
    d = digests(1, 10)
    put_value(ds, key_of(w, d[0]), block_bytes(src, LAYERS, 0))
    plan = meta(loads=[BlockOp("r", d, [1])])
    ds.down = True
    w.start_load_kv(plan)
    assert w.get_block_ids_with_load_errors() == {1}
    asked = len(ds.calls)
    w.start_load_kv(plan)
    assert w.get_block_ids_with_load_errors() == {1}
    assert len(ds.calls) == asked  # known down: the forward is not held up by calls that will fail
    ds.down = False

    def loads_again():
        w.start_load_kv(plan)
        return not w.get_block_ids_with_load_errors()

    wait_for(loads_again, "loads after the data system came back")


def test_delete_after_load_removes_the_loaded_keys_only(make, ds):
    src = kv_caches(seed=4)
    d = digests(4, 11)
    keeper = make("kv_consumer", caches=kv_caches(fill=False))
    deleter = make("kv_consumer", {"delete_after_load": True}, caches=kv_caches(fill=False))
    for dg in d:
        put_value(ds, key_of(deleter, dg), block_bytes(src, LAYERS, 0))
    put_value(ds, key_of(deleter, d[2]), b"\x01" * 10)  # there, but not loadable: not this consumer's to drop
    plan = meta(loads=[BlockOp("r", d[:3], [1, 2, 3])])
    keeper.start_load_kv(plan)  # control: a consumer without the option leaves them for the next request
    assert set(ds.store) == {key_of(keeper, dg) for dg in d}
    deleted = deleter.stats.get("deleted_blocks")
    deleter.start_load_kv(plan)
    deleter.shutdown()
    assert set(ds.store) == {key_of(deleter, d[2]), key_of(deleter, d[3])}
    assert deleter.stats.get("deleted_blocks") - deleted == 2


# --- identity and layout --------------------------------------------------------------------------------

def test_worker_of_tp_rank_1_moves_rank_1_keys(make, ds):
    caches = kv_caches()
    w = make("kv_both", caches=caches, tp=2, tp_rank=1)
    d = digests(1, 12)
    w.wait_for_save(meta(saves=[BlockOp("r", d, [3])]))
    w.shutdown()
    assert set(ds.store) == {key_of(w, d[0], tp_rank=1)} and key_of(w, d[0], tp_rank=0) not in ds.store
    dst = kv_caches(fill=False)
    reader = make("kv_consumer", caches=dst, tp=2, tp_rank=1)
    reader.start_load_kv(meta(loads=[BlockOp("r", d, [5])]))
    assert reader.get_block_ids_with_load_errors() == set()
    assert torch.equal(dst[LAYERS[1]][5].view(torch.int16), caches[LAYERS[1]][3].view(torch.int16))


def test_each_pipeline_stage_and_dp_engine_of_an_instance_writes_its_own_stats_file(make, tmp_path):
    """The workers of one instance on a host under yrpd's stats file name (yrpd.layout): the stages of a pipeline
    each have TP rank 0, the engines of a DP instance too; each must write a file of its own, or status shows
    whichever wrote last. vLLM's own ranks are given here: its CPU backend (0.32) cannot run a pipeline (the second
    stage fails its first step) and runs DP only as whole engines (tests/connector/test_dp_engines.py)."""
    from yrpd.layout import HostSessionLayout

    layout = HostSessionLayout(str(tmp_path), "s")
    Path(layout.run_dir).mkdir(parents=True)
    extra = {"stats_file": layout.kv_stats("x"), "stats_interval_s": 0.1}
    for pp_rank in (0, 1):
        make("kv_producer", extra, caches=kv_caches(), pp=2, tp_rank=0, pp_rank=pp_rank)
    # the DP rank as vLLM 0.32 tells a dense model's engine (index), and as 0.10 did (rank)
    make("kv_producer", extra, caches=kv_caches(), tp_rank=0, parallel={"data_parallel_index": 1,
                                                                         "data_parallel_rank": 0})
    make("kv_producer", extra, caches=kv_caches(), tp_rank=0, parallel={"data_parallel_rank": 2})
    expected = {"kv-x-worker-dp0-rank0.json", "kv-x-worker-dp0-rank1.json", "kv-x-worker-dp1-rank0.json",
                "kv-x-worker-dp2-rank0.json"}
    deadline = time.monotonic() + 10
    while {p.name for p in Path(layout.run_dir).iterdir()} != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {p.name for p in Path(layout.run_dir).iterdir()} == expected
    docs = {p.name: json.loads(p.read_text()) for p in Path(layout.run_dir).iterdir()}
    assert (docs["kv-x-worker-dp0-rank1.json"]["rank"], docs["kv-x-worker-dp1-rank0.json"]["dp"]) == (1, 1)


def test_worker_under_tp_refuses_to_start_without_its_rank(make):
    make("kv_producer")  # control: a single rank needs no rank from vLLM (whose parallel state is not set up here)
    with pytest.raises(RuntimeError, match="cannot read this worker's tensor/pipeline parallel rank"):
        make("kv_producer", tp=2)


def test_worker_with_an_unsupported_cache_layout_stays_idle_and_vllm_recomputes(make, ds):
    d = digests(1, 13)
    ok = make("kv_both", caches=kv_caches())
    put_value(ds, key_of(ok, d[0]), block_bytes(kv_caches(), LAYERS, 0))
    # block b's bytes are not one contiguous range: a block value cannot be read or written with one copy
    strided = {n: torch.zeros(2, NUM_BLOCKS, BS, 8, dtype=torch.bfloat16).transpose(0, 1) for n in LAYERS}
    idle = make("kv_both", caches=strided)
    asked = len(ds.calls)
    idle.wait_for_save(meta(saves=[BlockOp("r", digests(1, 14), [1])]))
    idle.start_load_kv(meta(loads=[BlockOp("r", d, [2])]))
    assert idle.get_block_ids_with_load_errors() == {2}
    assert len(ds.calls) == asked
    # control: the same plan on a worker with vLLM's CPU layout loads
    ok.start_load_kv(meta(loads=[BlockOp("r", d, [2])]))
    assert ok.get_block_ids_with_load_errors() == set()
