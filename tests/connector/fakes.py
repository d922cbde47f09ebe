"""In-memory stand-ins for the data system's KVClient and for the vLLM objects the connector's halves read (pure
Python, used by unit and in-process checks)."""

from __future__ import annotations

import threading
from types import SimpleNamespace


class FakeKVClient:
    """In-memory KVClient with the calls HostTransport uses (mcreate/mset_buffer/get_read_only_buffers)."""

    class Buf:
        def __init__(self, size):
            self.data = bytearray(size)

        def MutableData(self):
            return self.data

        def immutable_data(self):
            return memoryview(bytes(self.data))

    def __init__(self):
        self.store: dict = {}
        self.pending: dict = {}
        self.ttl: dict = {}
        self.write_modes: list = []  # the write_mode of each mcreate call
        self.down = False  # True: every call fails like a dead worker
        self.calls: list = []
        self.key_log: list = []  # (op, keys) of every call that names keys, in call order
        self.fail: dict = {}  # op -> message: that call raises it (an error of the data system, not a dead worker)
        self.hold: dict = {}  # op -> threading.Event: that call waits for it (a slow data system)
        self.batch_limit: int | None = None  # refuse a call naming more keys, as the real one refuses 2000 and more
        # a worker whose memory is full of entries it may not evict, as a real one behaves (tests/connector/
        # test_ds_full.py): it answers mset_buffer with success, evicts some new blocks at once (`drop_writes`: those
        # keys, True: all) and, with `evict_previous`, the blocks of the mset_buffer before (the next write's room)
        self.drop_writes: bool | set = False
        self.evict_previous = False
        self._last_written: list = []

    def _check(self, op, keys=None):
        self.calls.append(op)
        if keys is not None:
            self.key_log.append((op, list(keys)))
        gate = self.hold.get(op)
        if gate is not None and not gate.wait(10):  # bounded, so a test that forgets to open it fails, not hangs
            raise RuntimeError(f"fake data system: {op} held past 10 s")
        if self.down:
            raise RuntimeError("code: [RPC unavailable], msg: [[UDS_CONNECT_FAILED] fake worker is down]")
        if op in self.fail:
            raise RuntimeError(self.fail[op])
        if keys is not None and self.batch_limit is not None and len(list(keys)) > self.batch_limit:
            raise RuntimeError(f"code: [Invalid parameter], msg: [fake: {len(list(keys))} keys in one {op}, "
                               f"at most {self.batch_limit}]")

    def health_check(self):
        fake = self

        class Status:
            def is_ok(self):
                return not fake.down

            def to_string(self):
                return "down" if fake.down else "ok"
        return Status()

    def exist(self, keys):
        self._check("exist", keys)
        return [k in self.store for k in keys]

    def mcreate(self, keys, sizes, ttl_second=0, write_mode=None):
        self._check("mcreate", keys)
        self.write_modes.append(write_mode)
        bufs = []
        for k, s in zip(keys, sizes):
            b = self.Buf(s)
            self.pending[id(b)] = k
            self.ttl[k] = ttl_second
            bufs.append(b)
        return bufs

    def mset_buffer(self, bufs):
        self._check("mset_buffer")
        if self.evict_previous:
            for key in self._last_written:
                self.store.pop(key, None)
        self._last_written = []
        for b in bufs:
            key = self.pending.pop(id(b))
            if self.drop_writes is True or (self.drop_writes and key in self.drop_writes):
                continue
            self.store[key] = b
            self._last_written.append(key)

    def get_read_only_buffers(self, keys, timeout_ms=0):
        self._check("get", keys)
        if not any(k in self.store for k in keys):
            raise RuntimeError("code: [Key not found], msg: [Cannot get objects from worker]")
        return [self.store.get(k) for k in keys]

    def delete(self, keys):
        self._check("delete", keys)
        for k in keys:
            self.store.pop(k, None)
        return []

    def expire(self, keys, ttl):
        self._check("expire", keys)
        for k in keys:
            self.ttl[k] = ttl
        return []


# ---------------------------------------------------------------------------------------------
# vLLM stand-ins: only the attributes the connector's halves read
# ---------------------------------------------------------------------------------------------

def vllm_config(role: str, extra: dict | None = None, *, block_size: int = 4, tp: int = 1, pp: int = 1,
                dtype: str = "bfloat16", model: str = "tiny-model", engine_id: str = "engine-0",
                failure_policy: str | None = None, parallel: dict | None = None) -> SimpleNamespace:
    """A VllmConfig as ConnectorContext reads it; `extra` is the kv_connector_extra_config, `parallel` more of the
    parallel config (a DP engine's `data_parallel_index` or `data_parallel_rank`)."""
    ktc = SimpleNamespace(kv_role=role, engine_id=engine_id, kv_load_failure_policy=failure_policy,
                          kv_connector_extra_config={"ds_address": "127.0.0.1:1", **(extra or {})})
    return SimpleNamespace(
        kv_transfer_config=ktc,
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, **(parallel or {})),
        model_config=SimpleNamespace(model=f"/models/{model}", dtype=dtype, hf_config=None),
    )


def kv_cache_config(groups: list[list[str]], num_blocks: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=list(g)) for g in groups],
                           num_blocks=num_blocks)


def request(req_id: str, tokens: list, params: dict | None = None, *, salt: str | None = None) -> SimpleNamespace:
    """A vllm.v1.request.Request as the scheduler half reads it."""
    return SimpleNamespace(request_id=req_id, prompt_token_ids=list(tokens), kv_transfer_params=params,
                           lora_request=None, cache_salt=salt, mm_features=[], prompt_embeds=None)


def new_req(req_id: str, tokens: list, block_ids, computed: int = 0, *, salt: str | None = None) -> SimpleNamespace:
    """A NewRequestData of a SchedulerOutput (one KV cache group)."""
    return SimpleNamespace(req_id=req_id, prompt_token_ids=list(tokens), block_ids=(list(block_ids),),
                           num_computed_tokens=computed, lora_request=None, cache_salt=salt, mm_features=[],
                           prompt_embeds=None)


def cached_req(req_id: str, new_block_ids, computed: int, *, resumed: bool = False) -> tuple:
    """One request of a CachedRequestData: (req_id, new block ids or None, num_computed_tokens, resumed)."""
    return req_id, (None if new_block_ids is None else (list(new_block_ids),)), computed, resumed


def scheduler_output(new=(), cached=(), num_scheduled: dict | None = None) -> SimpleNamespace:
    """A SchedulerOutput: `cached` holds `cached_req` tuples; `num_scheduled` maps req_id -> tokens this step."""
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[c[0] for c in cached], new_block_ids=[c[1] for c in cached],
                                              num_computed_tokens=[c[2] for c in cached],
                                              resumed_req_ids={c[0] for c in cached if c[3]}),
        num_scheduled_tokens=dict(num_scheduled or {}), finished_req_ids=set())


class KVCacheBlocks:
    """What update_state_after_alloc reads of vLLM's KVCacheBlocks: the block ids of the one KV cache group."""

    def __init__(self, block_ids) -> None:
        self._ids = list(block_ids)

    def get_block_ids(self) -> tuple:
        return (list(self._ids),)


def stray_threads(before: set, timeout_s: float = 5.0) -> list[str]:
    """Names of threads started since `before` that are still alive after waiting up to timeout_s for them."""
    import time

    deadline = time.monotonic() + timeout_s
    for t in set(threading.enumerate()) - before:
        t.join(max(0.0, deadline - time.monotonic()))
    return sorted(t.name for t in set(threading.enumerate()) - before if t.is_alive())
