"""YuanrongConnector: a vLLM v1 KV connector over the openYuanrong data system.

Select it with

    --kv-transfer-config '{"kv_connector": "YuanrongConnector",
                           "kv_connector_module_path": "yrpd.connector",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"ds_address": "127.0.0.1:31501", ...}}'

Flow (see docs/dev/connector.md for the design notes):

* Producer, scheduler side: every step, for every running request, the prompt blocks that became
  complete in this step (whatever the chunking) are listed in the step's metadata as
  (prefix digest, block id) pairs. Worker side, after the forward (`wait_for_save`), those blocks
  are copied out of the paged cache into one staging tensor (a plain memcpy, so the engine may
  reuse the blocks right after) and a background thread writes them to the data system
  (`exist` -> skip present keys -> `mcreate` -> copy -> `mset_buffer`, with a TTL).
  `request_finished` returns {"yrpd": {"num_blocks": n, "ns": ...}} as kv_transfer_params.
* Consumer, scheduler side: `get_num_new_matched_tokens` asks the data system which of the
  request's loadable blocks exist (all TP/PP ranks) and promises only the leading run of present
  blocks. If prefill announced more blocks than are visible yet, the request waits (returns None)
  for at most ready_wait_ms. Worker side, `start_load_kv` copies the blocks into the paged cache
  before the forward; any block that cannot be read is reported through
  `get_block_ids_with_load_errors` and vLLM recomputes it (policy forced to "recompute").
"""

from __future__ import annotations

import inspect
import logging
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from yrpd.connector import keys as K
from yrpd.connector.config import ConfigError, ConnectorConfig, parse_config
from yrpd.connector.stats import ConnectorStats, StatsReporter
from yrpd.connector.transport import (
    BlockLayout,
    DsConnection,
    HostTransport,
    NpuTransport,
    TransportError,
    check_block_contiguous,
    hetero_client_factory,
    kvclient_factory,
    part_block_nbytes,
    StagingPool,
    split_kv_parts,
    stage_blocks,
    values_from_staged,
    block_rows_u8,
)

try:  # vLLM >= 0.11: where external hits came from, for the prompt-token metrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as _CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    _CacheHitSource = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("yrpd.connector")


def _attach_vllm_logging() -> None:
    """Route our logger through vLLM's handlers so INFO lines show up in the server log."""
    if logger.handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    for h in vllm_logger.handlers:
        logger.addHandler(h)
    if logger.handlers:
        logger.propagate = False
    logger.setLevel(logging.INFO)


def _base_takes_kv_cache_config() -> bool:
    try:
        return "kv_cache_config" in inspect.signature(KVConnectorBase_V1.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def _scheduler_may_wait() -> bool:
    """vLLM lets get_num_new_matched_tokens return None ("ask again") since 0.11."""
    try:
        ann = inspect.signature(KVConnectorBase_V1.get_num_new_matched_tokens).return_annotation
    except (TypeError, ValueError):  # pragma: no cover
        return False
    return "None" in str(ann)


_NEW_CTOR = _base_takes_kv_cache_config()
_CAN_WAIT = _scheduler_may_wait()
# vLLM >= 0.11 asks the connector which loaded blocks failed and recomputes them; before that (the vllm-ascend
# v0.10 image) a block that fails to load after its existence was confirmed would be used uninitialised
def can_recompute(base: type) -> bool:
    return hasattr(base, "get_block_ids_with_load_errors")


_CAN_RECOMPUTE = can_recompute(KVConnectorBase_V1)
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")
_POLL_S = 0.01  # consumer: at most one existence query per waiting request per 10 ms


def _write_mode(cfg: ConnectorConfig) -> Any:
    """The data system's write mode for saved blocks: evictable unless the config says otherwise (a full worker
    then drops old blocks instead of failing new saves; vllm-ascend's own yuanrong backend writes the same way)."""
    if not cfg.evictable:
        return None
    try:
        from yr.datasystem.kv_client import WriteMode
    except ImportError:  # pragma: no cover - a client without write modes: its default
        return None
    return getattr(WriteMode, "NONE_L2_CACHE_EVICT", None)


def _layer_sort_key(name: str):
    m = _LAYER_RE.search(name)
    return (int(m.group(1)) if m else 1 << 30, name)


# ---------------------------------------------------------------------------------------------
# Scheduler -> worker metadata
# ---------------------------------------------------------------------------------------------

@dataclass
class BlockOp:
    req_id: str
    digests: list  # prefix digests (hex); keys are formed per rank on the worker
    block_ids: list


@dataclass
class YuanrongConnectorMetadata(KVConnectorMetadata):
    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)


@dataclass
class _ReqState:
    """Producer-side tracking of one request (scheduler side)."""

    req_id: str
    token_ids: list
    extra: tuple
    block_ids: list = field(default_factory=list)
    saved_upto: int = 0
    digests: list = field(default_factory=list)

    def digests_upto(self, n: int, block_size: int) -> list:
        if len(self.digests) < n:
            self.digests = K.prefix_digests(self.token_ids, block_size, n, self.extra)
        return self.digests[:n]


@dataclass
class _Lookup:
    start: int  # first block index not computed locally
    hits: int  # leading present blocks from start
    digests: list  # digests of blocks [0, start + hits)
    checked_at: float = 0.0
    first_at: float = 0.0


# ---------------------------------------------------------------------------------------------
# Background saver (worker side)
# ---------------------------------------------------------------------------------------------

class _Job:
    __slots__ = ("kind", "keys", "data", "nbytes", "done", "req_id", "slab")

    def __init__(self, kind: str, keys: list, data: Any = None, nbytes: int = 0, req_id: str = "") -> None:
        self.kind = kind
        self.keys = keys
        self.data = data
        self.nbytes = nbytes
        self.req_id = req_id
        self.slab = None
        self.done = threading.Event()


class _Saver:
    """Writes staged blocks (and deletes) to the data system off the engine's critical path."""

    def __init__(self, conn: DsConnection, cfg: ConnectorConfig, stats: ConnectorStats,
                 max_pending_bytes: int, pool: StagingPool | None = None) -> None:
        self.pool = pool
        self.conn = conn
        self.transport = HostTransport(conn, cfg.max_batch_keys, write_mode=_write_mode(cfg))
        self.cfg = cfg
        self.stats = stats
        self.max_pending_bytes = max_pending_bytes
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="yrpd-kv-saver", daemon=True)
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def submit(self, job: _Job) -> bool:
        with self._lock:
            if job.nbytes and self._pending_bytes + job.nbytes > self.max_pending_bytes:
                return False
            self._pending_bytes += job.nbytes
        self._q.put(job)
        return True

    def flush(self, timeout_s: float) -> bool:
        marker = _Job("flush", [])
        self._q.put(marker)
        return marker.done.wait(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._started:
            self.flush(timeout_s)
            self._q.put(None)
            self._thread.join(timeout_s)
        self.conn.close()

    def _run(self) -> None:
        self.conn.connect()
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                if job.kind == "save":
                    self._save(job)
                elif job.kind == "delete":
                    self._delete(job)
            except Exception as e:  # noqa: BLE001 - never let the saver die
                logger.warning("yrpd connector: %s job failed: %s", job.kind, e)
            finally:
                with self._lock:
                    self._pending_bytes -= job.nbytes
                job.data = None
                if job.slab is not None and self.pool is not None:
                    self.pool.release(job.slab)
                    job.slab = None
                job.done.set()

    def _save(self, job: _Job) -> None:
        n = len(job.keys)
        t0 = time.perf_counter()
        try:
            present = self.transport.exists(job.keys)
            missing = [i for i in range(n) if not present[i]]
            existing = [job.keys[i] for i in range(n) if present[i]]
            if existing and self.cfg.ttl_seconds > 0:
                try:  # keep hot prefixes alive
                    self.transport.expire(existing, self.cfg.ttl_seconds)
                except (TransportError, KeyError):
                    pass
            written = 0
            if missing:
                written = self.transport.save([job.keys[i] for i in missing], values_from_staged(job.data, missing),
                                              self.cfg.ttl_seconds)
        except (TransportError, KeyError) as e:
            self.stats.inc("save_failed_blocks", n)
            self.stats.inc("ds_errors")
            logger.debug("yrpd connector: save of %d blocks for %s failed: %s", n, job.req_id, e)
            return
        self.stats.inc("saved_blocks", len(missing))
        self.stats.inc("saved_bytes", written)
        self.stats.inc("save_skipped_existing", n - len(missing))
        self.stats.observe("save", (time.perf_counter() - t0) * 1000.0)

    def _delete(self, job: _Job) -> None:
        try:
            self.transport.delete(job.keys)
            self.stats.inc("deleted_blocks", len(job.keys))
        except (TransportError, KeyError) as e:
            self.stats.inc("ds_errors")
            logger.debug("yrpd connector: delete failed: %s", e)


# ---------------------------------------------------------------------------------------------
# The connector
# ---------------------------------------------------------------------------------------------

class YuanrongConnector(KVConnectorBase_V1):
    """vLLM KV connector storing content-addressed KV blocks in the openYuanrong data system."""

    if _CacheHitSource is not None:
        _cache_hit_source = _CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None):
        if _NEW_CTOR:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        else:  # vLLM <= 0.10 (vllm-ascend v0.10 image): (vllm_config, role)
            super().__init__(vllm_config=vllm_config, role=role)
        _attach_vllm_logging()
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._ktc = vllm_config.kv_transfer_config
        self._side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        extra = dict(getattr(self._ktc, "kv_connector_extra_config", None) or {})
        try:
            self.cfg = parse_config(self._ktc.kv_role, extra)
        except ConfigError as e:
            raise ValueError(f"YuanrongConnector: {e}") from e
        if self.cfg.unknown:
            logger.warning("yrpd connector: ignoring unknown kv_connector_extra_config keys: %s",
                           sorted(self.cfg.unknown))
        self.block_size = int(vllm_config.cache_config.block_size)
        pc = vllm_config.parallel_config
        self.tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        self.pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        self._model_identity = self._compute_model_identity()
        self._kv_dtype = self._compute_kv_dtype()
        self._layout_tag = self._compute_layout_tag(extra)

        # Only one KV cache group can be named by a flat list of block ids (and reported on failure).
        groups = getattr(kv_cache_config, "kv_cache_groups", None) if kv_cache_config is not None else None
        self._active = True
        if groups is not None and len(groups) != 1:
            self._active = False
            logger.warning("yrpd connector: %d KV cache groups (hybrid model); the connector stays idle "
                           "(no save, no load)", len(groups))

        self.stats = ConnectorStats(self._side, self.cfg.role, 0, "", f"{self.cfg.ds_host}:{self.cfg.ds_port}")
        self._reporter: StatsReporter | None = None
        self._conn: DsConnection | None = None

        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler_side()
        else:
            self._init_worker_side()

    # -- identity --------------------------------------------------------------------------------
    def _compute_model_identity(self) -> str:
        mc = self._vllm_config.model_config
        hf = getattr(mc, "hf_config", None)
        cfg_dict: dict = {}
        if hf is not None and hasattr(hf, "to_dict"):
            try:
                cfg_dict = {k: v for k, v in hf.to_dict().items()
                            if not k.startswith("_") and k not in ("transformers_version", "name_or_path")}
            except Exception:  # noqa: BLE001
                cfg_dict = {}
        served = getattr(mc, "model", "") or ""
        return K.model_identity(str(served), cfg_dict, self.cfg.model_id)

    def _compute_kv_dtype(self) -> str:
        cache_dtype = str(getattr(self._vllm_config.cache_config, "cache_dtype", "auto"))
        if cache_dtype != "auto":
            return cache_dtype
        return str(getattr(self._vllm_config.model_config, "dtype", "auto")).replace("torch.", "")

    def _compute_layout_tag(self, extra: dict) -> str:
        if extra.get("layout"):
            return str(extra["layout"])
        try:
            from vllm.platforms import current_platform

            dev = str(getattr(current_platform, "device_type", "") or current_platform.device_name)
        except Exception:  # noqa: BLE001
            dev = "unknown"
        return f"{dev}/{os.environ.get('VLLM_KV_CACHE_LAYOUT', 'default')}"

    def namespace(self, tp_rank: int, pp_rank: int) -> K.Namespace:
        return K.Namespace(
            model=self._model_identity, kv_dtype=self._kv_dtype, layout=self._layout_tag,
            block_size=self.block_size, tp_rank=tp_rank, tp_size=self.tp_size, layer_group=0,
            extra={"pp_rank": pp_rank, "pp_size": self.pp_size, "user": self.cfg.namespace},
        )

    def _all_rank_digests(self) -> list[str]:
        return [self.namespace(t, p).digest for p in range(self.pp_size) for t in range(self.tp_size)]

    @staticmethod
    def _request_extra(lora_request: Any, cache_salt: Any, mm_ids: list) -> tuple:
        extra: list = []
        if lora_request is not None:
            extra.append(("lora", getattr(lora_request, "lora_name", None) or str(lora_request)))
        if cache_salt:
            extra.append(("salt", str(cache_salt)))
        extra.extend(("mm", str(ident)) for ident in mm_ids)
        return tuple(extra)

    @staticmethod
    def _mm_ids(obj: Any) -> list:
        """Identities of a request's multimodal inputs: `mm_features` (vLLM >= 0.11) or `mm_hashes` (vLLM 0.10,
        the vllm-ascend v0.10 image), on a Request and on the scheduler's NewRequestData alike."""
        features = getattr(obj, "mm_features", None)
        if features:
            return [getattr(f, "identifier", None) or getattr(f, "mm_hash", None) for f in features]
        return list(getattr(obj, "mm_hashes", None) or ())

    def _eligible(self, request: "Request") -> tuple[list, tuple] | None:
        tokens = getattr(request, "prompt_token_ids", None)
        if not tokens or getattr(request, "prompt_embeds", None) is not None:
            return None
        extra = self._request_extra(getattr(request, "lora_request", None), getattr(request, "cache_salt", None),
                                    self._mm_ids(request))
        return tokens, extra

    def _start_reporter(self, rank: int, namespace: str, engine: str = "") -> None:
        self.stats.rank = rank
        self.stats.namespace = namespace
        path = self.cfg.stats_path(self._side, rank, engine)
        self._reporter = StatsReporter(self.stats, self.cfg.stats_interval_s, path, logger,
                                       extra=self._stats_extra).start()

    def _stats_extra(self) -> dict:
        out = {"block_size": self.block_size, "model_identity": self._model_identity,
               "kv_dtype": self._kv_dtype, "layout": self._layout_tag}
        if self._conn is not None:
            self.stats.ds_healthy = self._conn.healthy
            out["ds_healthy"] = self._conn.healthy
            if not self._conn.healthy:
                out["ds_last_error"] = self._conn.last_error
        return out

    def _on_ds_event(self, event: str) -> None:
        if event == "down":
            self.stats.inc("ds_errors")
            self.stats.ds_healthy = False
        elif event == "up":
            self.stats.inc("ds_reconnects")
            self.stats.ds_healthy = True
        elif event == "error":
            self.stats.inc("ds_errors")

    def _make_conn(self, name: str) -> DsConnection:
        c = self.cfg
        factory = kvclient_factory(c.ds_host, c.ds_port, c.connect_timeout_ms, c.request_timeout_ms,
                                   c.exclusive_connection)
        return DsConnection(factory, name, c.retry_backoff_s, self._on_ds_event)

    # ==============================================================================================
    # Scheduler side
    # ==============================================================================================
    def _init_scheduler_side(self) -> None:
        self._states: dict[str, _ReqState] = {}
        self._lookups: dict[str, _Lookup] = {}
        self._loaded_upto: dict[str, int] = {}
        self._pending_loads: list[BlockOp] = []
        self._refused_logged: dict[str, float] = {}
        self._rank_ns = self._all_rank_digests()
        self._last_vllm_stats: dict[str, int] = {}
        self._stats_lock = threading.Lock()
        policy = getattr(self._ktc, "kv_load_failure_policy", None)
        if policy is not None and policy != "recompute":
            try:
                self._ktc.kv_load_failure_policy = "recompute"
                logger.warning("yrpd connector: kv_load_failure_policy=%s changed to 'recompute' (a block that "
                               "cannot be loaded is recomputed instead of failing the request)", policy)
            except Exception as e:  # noqa: BLE001
                logger.warning("yrpd connector: cannot set kv_load_failure_policy=recompute (%s); pass it in "
                               "--kv-transfer-config", e)
        self._loads = self._active and self.cfg.is_consumer
        if self._loads and not _CAN_RECOMPUTE:
            self._loads = False
            logger.warning("yrpd connector: this vLLM cannot recompute KV blocks that fail to load (it has no "
                           "get_block_ids_with_load_errors; vLLM >= 0.11 has): the %s role loads nothing here and "
                           "every prompt is computed, so a failed load can never be used as KV", self.cfg.role)
        if self._loads:
            self._conn = self._make_conn("scheduler")
            self._conn.connect()
        engine = str(getattr(self._ktc, "engine_id", "") or "")
        self._start_reporter(0, ",".join(self._rank_ns), engine)
        logger.info("yrpd connector (scheduler, %s): ds=%s:%d block_size=%d model=%s ns=%s ttl=%ds "
                    "delete_after_load=%s", self.cfg.role, self.cfg.ds_host, self.cfg.ds_port, self.block_size,
                    self._model_identity, ",".join(self._rank_ns), self.cfg.ttl_seconds, self.cfg.delete_after_load)

    def _exists_all_ranks(self, digests: list[str]) -> list[bool]:
        assert self._conn is not None
        all_keys = [K.key_for(ns, d) for ns in self._rank_ns for d in digests]
        res = self._conn.call("exist", lambda c: c.exist(all_keys))
        n = len(digests)
        return [all(bool(res[r * n + i]) for r in range(len(self._rank_ns))) for i in range(n)]

    def _handoff_mismatch(self, info: dict) -> str | None:
        """What makes KV a producer announced unusable here, in words; None when it matches this instance."""
        theirs = {"dtype": info.get("kv_dtype"), "block size": info.get("block_size"), "model": info.get("model")}
        ours = {"dtype": self._kv_dtype, "block size": self.block_size, "model": self._model_identity}
        differ = [f"{what} {theirs[what]} there, {ours[what]} here" for what in theirs
                  if theirs[what] is not None and theirs[what] != ours[what]]
        return "; ".join(differ) or None

    def _refuse_handoff(self, req_id: str, mismatch: str) -> None:
        self.stats.inc("handoff_refused")
        now = time.monotonic()
        if now - self._refused_logged.get(mismatch, -1e9) >= 60.0:  # one line a minute per kind of mismatch
            self._refused_logged[mismatch] = now
            logger.error("yrpd connector: refusing the KV prefill computed for %s (%s): recomputing the prompt; "
                         "deploy prefill and decode with the same model and --dtype", req_id, mismatch)

    def _announced_blocks(self, request: "Request") -> int:
        params = getattr(request, "kv_transfer_params", None) or {}
        info = params.get("yrpd") if isinstance(params, dict) else None
        if not isinstance(info, dict):
            return 0
        mismatch = self._handoff_mismatch(info)
        if mismatch:
            self._refuse_handoff(request.request_id, mismatch)
            return 0
        if info.get("ns") and info.get("ns") != ",".join(self._rank_ns):
            return 0  # produced under another namespace: those keys will never show up here
        try:
            return max(0, int(info.get("num_blocks", 0)))
        except (TypeError, ValueError):
            return 0

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        if not self._loads or self._conn is None:
            return 0, False
        elig = self._eligible(request)
        if elig is None:
            return 0, False
        tokens, extra = elig
        bs = self.block_size
        n_max = K.loadable_blocks(len(tokens), bs)
        start = num_computed_tokens // bs
        if n_max <= start:
            return 0, False
        req_id = request.request_id
        now = time.monotonic()
        lk = self._lookups.get(req_id)
        if lk is not None and lk.start != start:
            lk = None
        announced = min(self._announced_blocks(request), n_max)

        def may_wait(since: float) -> bool:
            return _CAN_WAIT and (now - since) * 1000.0 < self.cfg.ready_wait_ms

        if lk is not None and start + lk.hits < announced and may_wait(lk.first_at) \
                and now - lk.checked_at < _POLL_S:
            return None, False  # still waiting; do not hammer the data system
        if not self._conn.healthy:
            self._lookups.pop(req_id, None)
            return 0, False
        t0 = time.perf_counter()
        digests = lk.digests if (lk is not None and len(lk.digests) >= n_max) else \
            K.prefix_digests(tokens, bs, n_max, extra)
        try:
            present = self._exists_all_ranks(digests[start:n_max])
        except (TransportError, KeyError) as e:
            self.stats.inc("lookup_errors")
            logger.debug("yrpd connector: lookup for %s failed: %s", req_id, e)
            self._lookups.pop(req_id, None)
            return 0, False
        self.stats.observe("lookup", (time.perf_counter() - t0) * 1000.0)
        hits = K.leading_hits(present)
        first_at = lk.first_at if lk is not None else now
        self._lookups[req_id] = _Lookup(start, hits, digests, now, first_at)
        if start + hits < announced and may_wait(first_at):
            if lk is None:
                self.stats.inc("lookup_waits")
            return None, False  # prefill announced more blocks than are visible yet: ask again soon
        return hits * bs, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        req_id = request.request_id
        lk = self._lookups.pop(req_id, None)
        if num_external_tokens <= 0:
            if lk is not None:
                self._count_lookup(lk, 0)
            return
        bs = self.block_size
        n = num_external_tokens // bs
        block_ids = list(blocks.get_block_ids()[0])
        if lk is None or lk.hits < n or num_external_tokens % bs:
            # We never promised this: make the worker report the blocks as failed (recompute).
            start = (lk.start if lk is not None else 0)
            logger.warning("yrpd connector: unexpected external load of %d tokens for %s; reporting as failed",
                           num_external_tokens, req_id)
            self._pending_loads.append(BlockOp(req_id, [], block_ids[start:start + max(1, n)]))
            return
        self._count_lookup(lk, n)
        self._pending_loads.append(BlockOp(req_id, lk.digests[lk.start:lk.start + n],
                                           block_ids[lk.start:lk.start + n]))
        self._loaded_upto[req_id] = lk.start + n

    def _count_lookup(self, lk: _Lookup, used: int) -> None:
        asked = len(lk.digests) - lk.start
        self.stats.inc("lookup_requests")
        self.stats.inc("lookup_blocks", asked)
        self.stats.inc("lookup_hit_blocks", used)
        self.stats.inc("lookup_miss_blocks", asked - used)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = YuanrongConnectorMetadata(loads=self._pending_loads, saves=[])
        self._pending_loads = []
        if not (self._active and self.cfg.is_producer):
            return meta
        num_sched = scheduler_output.num_scheduled_tokens
        for new_req in scheduler_output.scheduled_new_reqs:
            tokens = new_req.prompt_token_ids
            if not tokens or getattr(new_req, "prompt_embeds", None) is not None:
                continue
            st = _ReqState(new_req.req_id, tokens,
                           self._request_extra(new_req.lora_request, getattr(new_req, "cache_salt", None),
                                               self._mm_ids(new_req)))
            st.block_ids = list(new_req.block_ids[0]) if new_req.block_ids else []
            st.saved_upto = self._loaded_upto.pop(new_req.req_id, 0)
            prev = self._states.get(new_req.req_id)
            if prev is not None:
                st.saved_upto = max(st.saved_upto, prev.saved_upto)
            self._states[new_req.req_id] = st
            self._emit_saves(st, new_req.num_computed_tokens + num_sched.get(new_req.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._states.get(req_id)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            resumed = req_id in getattr(cached, "resumed_req_ids", ()) or \
                (hasattr(cached, "resumed_from_preemption") and cached.resumed_from_preemption[i])
            if resumed:
                st.block_ids = list(nb[0]) if nb else []
                st.saved_upto = max(st.saved_upto, self._loaded_upto.pop(req_id, 0))
            elif nb:
                st.block_ids.extend(nb[0])
            self._emit_saves(st, cached.num_computed_tokens[i] + num_sched.get(req_id, 0), meta)
        return meta

    def _emit_saves(self, st: _ReqState, computed_after: int, meta: YuanrongConnectorMetadata) -> None:
        bs = self.block_size
        rng = K.saveable_range(len(st.token_ids), st.saved_upto * bs, computed_after, bs)
        if not rng:
            return
        hi = min(rng.stop, len(st.block_ids))
        if hi <= st.saved_upto:
            return
        digests = st.digests_upto(hi, bs)
        meta.saves.append(BlockOp(st.req_id, digests[st.saved_upto:hi], st.block_ids[st.saved_upto:hi]))
        st.saved_upto = hi

    def request_finished(self, request: "Request", block_ids: list[int]):
        req_id = request.request_id
        st = self._states.pop(req_id, None) if hasattr(self, "_states") else None
        if hasattr(self, "_lookups"):
            self._lookups.pop(req_id, None)
            self._loaded_upto.pop(req_id, None)
        if not (self._active and self.cfg.is_producer):
            return False, None
        if self.cfg.role == "kv_both" and getattr(request, "kv_transfer_params", None) is None:
            return False, None
        n = st.saved_upto if st is not None else 0
        # what the consumer checks before trusting the hand-over (namespaces alone cannot say what differs)
        return False, {"yrpd": {"num_blocks": n, "block_size": self.block_size, "ns": ",".join(self._rank_ns),
                                "kv_dtype": self._kv_dtype, "model": self._model_identity}}

    @property
    def requires_kv_delivery(self) -> bool:
        # Saves are snapshotted at the end of the step that computed the blocks, so a preempted
        # request never hands off freed blocks: nothing to deliver reliably.
        return False

    # vLLM's connector metrics (>= 0.11); older releases lack the module: no vLLM-side stats then.
    def get_kv_connector_stats(self):
        try:
            from yrpd.connector.vllm_stats import delta_stats
        except ImportError:
            return None
        return delta_stats(self)

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None):
        try:
            from yrpd.connector.vllm_stats import YuanrongKVStats
        except ImportError:
            return None
        return YuanrongKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        try:
            from yrpd.connector.vllm_stats import YuanrongPromMetrics
        except ImportError:
            return None
        return YuanrongPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ==============================================================================================
    # Worker side
    # ==============================================================================================
    def _init_worker_side(self) -> None:
        self._parts: list = []
        self._rows_u8: list = []
        self._layout: BlockLayout | None = None
        self._load_transport: Any = None
        self._saver: _Saver | None = None
        self._pool: StagingPool | None = None
        self._load_errors: set[int] = set()
        self._bad_reqs: set[str] = set()
        self._last_vllm_stats = {}
        self._stats_lock = threading.Lock()
        self._npu = False
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            self.tp_rank = int(get_tensor_model_parallel_rank())
            self.pp_rank = int(get_pp_group().rank_in_group)
        except Exception:  # noqa: BLE001 - not initialised (tests) -> single rank
            self.tp_rank, self.pp_rank = 0, 0
        self._ns_digest = self.namespace(self.tp_rank, self.pp_rank).digest

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        if not self._active:
            return
        names = sorted(kv_caches, key=_layer_sort_key)
        if self._kv_cache_config is not None and getattr(self._kv_cache_config, "kv_cache_groups", None):
            group_layers = set(self._kv_cache_config.kv_cache_groups[0].layer_names)
            names = [n for n in names if n in group_layers] or names
        first = kv_caches[names[0]]
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None) if self._kv_cache_config is not None \
            else None
        if not num_blocks:
            if hasattr(first, "shape"):
                shape = tuple(first.shape)
                num_blocks = shape[1] if (len(shape) >= 5 and shape[0] == 2) else shape[0]
            else:
                num_blocks = tuple(first[0].shape)[0]
        parts, seen = [], set()
        for name in names:
            for p in split_kv_parts(kv_caches[name], num_blocks):
                key = (p.data_ptr(), tuple(p.shape))
                if key in seen:  # layers sharing one cache tensor
                    continue
                seen.add(key)
                if p.shape[0] != num_blocks or not check_block_contiguous(p):
                    logger.warning("yrpd connector: KV cache of %s has an unsupported layout %s; connector idle",
                                   name, tuple(p.shape))
                    self._active = False
                    return
                parts.append(p)
        self._parts = parts
        self._rows_u8 = [block_rows_u8(p) for p in parts]
        self._layout = BlockLayout.from_sizes([part_block_nbytes(p) for p in parts])
        device_type = parts[0].device.type
        use_npu = self.cfg.transport == "npu" or (self.cfg.transport == "auto" and device_type == "npu")
        c = self.cfg
        if use_npu:
            self._init_npu_transport(parts)
        else:
            if device_type != "cpu":
                logger.warning("yrpd connector: %s KV cache through the host path is staged via CPU copies",
                               device_type)
            self._conn = self._make_conn(f"worker{self.tp_rank}")
            self._conn.connect()
            self._load_transport = HostTransport(self._conn, c.max_batch_keys)
            saver_conn = self._make_conn(f"saver{self.tp_rank}")
            budget = c.staging_mb << 20
            self._pool = StagingPool(self._layout.part_nbytes, budget)
            self._saver = _Saver(saver_conn, c, self.stats, max_pending_bytes=budget, pool=self._pool)
            self._saver.start()
        self.stats.rank = self.tp_rank
        engine = str(getattr(self._ktc, "engine_id", "") or "")
        self._start_reporter(self.tp_rank, self._ns_digest, engine)
        logger.info("yrpd connector (worker rank %d, %s): %d cache parts over %d layers, %d blocks, %d bytes per "
                    "block value, transport=%s, ns=%s", self.tp_rank, self.cfg.role, len(parts), len(names),
                    num_blocks, self._layout.block_nbytes, "npu" if use_npu else "host", self._ns_digest)

    def _init_npu_transport(self, parts: list) -> None:  # pragma: no cover - needs Ascend NPU + CANN
        from yr.datasystem import Blob, DeviceBlobList
        from yr.datasystem.kv_client import SetParam

        c = self.cfg
        device_id = c.device_id if c.device_id is not None else (parts[0].device.index or 0)
        conn = DsConnection(hetero_client_factory(c.ds_host, c.ds_port, c.connect_timeout_ms, c.request_timeout_ms),
                            f"npu{self.tp_rank}", c.retry_backoff_s, self._on_ds_event)
        conn.connect()
        self._conn = conn
        self._load_transport = NpuTransport(conn, device_id, Blob, DeviceBlobList, SetParam,
                                            write_mode=_write_mode(c))
        self._npu = True

    def _key(self, digest: str) -> str:
        return K.key_for(self._ns_digest, digest)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, YuanrongConnectorMetadata) or not meta.loads:
            return
        for op in meta.loads:
            self._load_one(op)

    def _load_one(self, op: BlockOp) -> None:
        n = len(op.block_ids)
        if not n:
            return
        t0 = time.perf_counter()
        ok = [False] * n
        if self._active and self._load_transport is not None and self._layout is not None \
                and len(op.digests) == n:
            keys = [self._key(d) for d in op.digests]
            try:
                ok = self._load_transport.load(keys, self._parts, self._layout, op.block_ids)
            except (TransportError, KeyError) as e:
                logger.warning("yrpd connector: load of %d blocks for %s failed (%s); recomputing", n, op.req_id, e)
                ok = [False] * n
            except Exception as e:  # noqa: BLE001 - a bug must not kill the engine either
                logger.exception("yrpd connector: unexpected load error for %s: %s", op.req_id, e)
                ok = [False] * n
        good = sum(ok)
        if good < n:
            failed = [b for b, g in zip(op.block_ids, ok) if not g]
            self._load_errors.update(failed)
            self._bad_reqs.add(op.req_id)
            self.stats.inc("load_failed_blocks", len(failed))
            logger.info("yrpd connector: %d of %d blocks for %s not loadable; vLLM recomputes them",
                        len(failed), n, op.req_id)
        self.stats.inc("loaded_blocks", good)
        if self._layout is not None:
            self.stats.inc("loaded_bytes", good * self._layout.block_nbytes)
        self.stats.observe("load", (time.perf_counter() - t0) * 1000.0)
        if good and self.cfg.delete_after_load and self.cfg.role == "kv_consumer":
            done = [self._key(d) for d, g in zip(op.digests, ok) if g]
            if self._saver is not None:
                self._saver.submit(_Job("delete", done, req_id=op.req_id))
            elif self._load_transport is not None:
                try:
                    self._load_transport.delete(done)
                except (TransportError, KeyError):
                    pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks of all layers are saved once per step in wait_for_save

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, YuanrongConnectorMetadata) or not meta.saves or not self._active \
                or self._layout is None:
            return
        jobs = []
        for op in meta.saves:
            if op.req_id in self._bad_reqs or not op.block_ids:
                # its KV may rest on a block that failed to load: never publish it
                self.stats.inc("save_dropped_blocks", len(op.block_ids))
                continue
            try:
                job = self._stage(op)
            except Exception as e:  # noqa: BLE001
                logger.warning("yrpd connector: staging %d blocks for %s failed: %s", len(op.block_ids), op.req_id, e)
                self.stats.inc("save_failed_blocks", len(op.block_ids))
                continue
            if job is not None:
                jobs.append(job)
        if self.cfg.save_sync and self._saver is not None:
            deadline = time.monotonic() + self.cfg.request_timeout_ms / 1000.0 * 2
            for job in jobs:
                job.done.wait(max(0.0, deadline - time.monotonic()))

    def _stage(self, op: BlockOp) -> _Job | None:
        keys = [self._key(d) for d in op.digests]
        if self._npu:  # pragma: no cover - needs NPU: device -> data-system host memory directly
            t0 = time.perf_counter()
            try:
                written = self._load_transport.save_blocks(keys, self._parts, op.block_ids, self.cfg.ttl_seconds)
                self.stats.inc("saved_blocks", len(keys))
                self.stats.inc("saved_bytes", written)
            except (TransportError, KeyError):
                self.stats.inc("save_failed_blocks", len(keys))
            self.stats.observe("save", (time.perf_counter() - t0) * 1000.0)
            return None
        layout = self._layout
        assert layout is not None and self._saver is not None
        n = len(op.block_ids)
        slab = self._pool.acquire(n) if self._pool is not None else None
        if slab is None and self._pool is not None:
            self.stats.inc("save_dropped_blocks", n)  # saver far behind: staging budget exhausted
            return None
        staged = stage_blocks(self._parts, self._rows_u8, op.block_ids, slab)
        job = _Job("save", keys, staged, n * layout.block_nbytes, op.req_id)
        job.slab = slab
        if not self._saver.submit(job):
            self._pool.release(slab)
            self.stats.inc("save_dropped_blocks", n)
            return None
        return job

    def get_finished(self, finished_req_ids: set[str]):
        if finished_req_ids and self._side == "worker":
            self._bad_reqs.difference_update(finished_req_ids)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._side != "worker" or not self._load_errors:
            return set()
        out, self._load_errors = self._load_errors, set()
        return out

    # ==============================================================================================
    # Both sides
    # ==============================================================================================
    def shutdown(self):
        if getattr(self, "_saver", None) is not None:
            self._saver.stop(5.0)
            self._saver = None
        if self._reporter is not None:
            self._reporter.stop()
        if self._conn is not None:
            self._conn.close()
        return None
