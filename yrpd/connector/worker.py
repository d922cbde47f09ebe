"""The worker half of YuanrongConnector (runs in every TP/PP worker process, on that rank's KV cache).

* Loads (consumer): synchronously before the forward, the blocks the scheduler planned are copied from the
  data system into the paged cache; a block that cannot be read is reported back through
  `get_block_ids_with_load_errors` so vLLM recomputes it.
* Saves (producer): after the forward, the blocks the scheduler planned are copied out of the paged cache
  into pooled host staging memory (a memcpy, so the engine may reuse the blocks right away) and the writer
  (saver.py: a child process by default, as the data system's client holds the GIL for each call) writes them
  (`exist` -> skip present keys -> `mcreate` -> copy -> `mset_buffer`).
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from yrpd.connector import keys as K
from yrpd.connector.common import (
    BlockOp,
    ConnectorContext,
    ConnectorHalf,
    YuanrongConnectorMetadata,
    logger,
)
from yrpd.connector.saver import Job, ProcessSaver, Saver, shared_slab_factory
from yrpd.connector.transport import (
    BlockLayout,
    DsConnection,
    HostTransport,
    NpuTransport,
    StagingPool,
    TransportError,
    block_rows_u8,
    check_block_contiguous,
    hetero_client_factory,
    part_block_nbytes,
    split_kv_parts,
    stage_blocks,
    write_mode,
)

if TYPE_CHECKING:
    import torch

_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")


def _layer_sort_key(name: str):
    m = _LAYER_RE.search(name)
    return (int(m.group(1)) if m else 1 << 30, name)


# ---------------------------------------------------------------------------------------------
# The worker half
# ---------------------------------------------------------------------------------------------

class ConnectorWorker(ConnectorHalf):
    """Moves this rank's blocks between the paged KV cache and the data system."""

    side = "worker"

    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        self._parts: list = []
        self._rows_u8: list = []
        self._layout: BlockLayout | None = None
        self._load_transport: Any = None
        self._saver: Saver | None = None
        self._pool: StagingPool | None = None
        self._load_errors: set[int] = set()
        self._bad_reqs: set[str] = set()
        self._npu = False
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            self.tp_rank = int(get_tensor_model_parallel_rank())
            self.pp_rank = int(get_pp_group().rank_in_group)
        except Exception as exc:  # noqa: BLE001 - vLLM's parallel state is not initialised
            if ctx.tp_size > 1 or ctx.pp_size > 1:
                # rank 0's keys for every rank would load one rank's KV into another's cache
                raise RuntimeError(f"yrpd connector: cannot read this worker's tensor/pipeline parallel rank from vLLM "
                                   f"(tp {ctx.tp_size}, pp {ctx.pp_size}): {exc}") from exc
            self.tp_rank, self.pp_rank = 0, 0  # a single rank: nothing to tell apart
        self._ns_digest = ctx.namespace(self.tp_rank, self.pp_rank).digest

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        if not self._active:
            return
        kv_cache_config = self.ctx.kv_cache_config
        names = sorted(kv_caches, key=_layer_sort_key)
        if kv_cache_config is not None and getattr(kv_cache_config, "kv_cache_groups", None):
            group_layers = set(kv_cache_config.kv_cache_groups[0].layer_names)
            names = [n for n in names if n in group_layers] or names
        first = kv_caches[names[0]]
        num_blocks = getattr(kv_cache_config, "num_blocks", None) if kv_cache_config is not None else None
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
            if c.is_producer or c.delete_after_load:  # a consumer that deletes nothing writes nothing: no writer
                self._saver = self._make_saver(c.staging_mb << 20)
                self._saver.start()
        # the worker's rank in its engine (TP x PP): an instance's pipeline stages on one host each have TP ranks
        # from 0, and each writes a stats file of its own
        self._start_reporter(self.pp_rank * self.ctx.tp_size + self.tp_rank, self._ns_digest)
        logger.info("yrpd connector (worker rank %d, %s): %d cache parts over %d layers, %d blocks, %d bytes per "
                    "block value, transport=%s, ns=%s", self.tp_rank, self.cfg.role, len(parts), len(names),
                    num_blocks, self._layout.block_nbytes, "npu" if use_npu else "host", self._ns_digest)

    def _init_npu_transport(self, parts: list) -> None:  # pragma: no cover - needs Ascend NPU + CANN
        from yr.datasystem import Blob, DeviceBlobList
        from yr.datasystem.kv_client import SetParam

        c = self.cfg
        device_id = c.device_id if c.device_id is not None else (parts[0].device.index or 0)
        conn = DsConnection(hetero_client_factory(c.ds_host, c.ds_port, c.connect_timeout_ms, c.request_timeout_ms),
                            f"npu{self.tp_rank}", c.retry_backoff_s, self._on_ds_event, (c.ds_host, c.ds_port))
        conn.connect()
        self._conn = conn
        self._load_transport = NpuTransport(conn, device_id, Blob, DeviceBlobList, SetParam,
                                            write_mode=write_mode(c))
        self._npu = True

    def _key(self, digest: str) -> str:
        return K.key_for(self._ns_digest, digest)

    # -- loads -----------------------------------------------------------------------------------------
    def start_load_kv(self, meta: Any) -> None:
        """Loads the step's planned blocks (`meta`: the metadata vLLM bound for this step)."""
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
                self._saver.submit(Job("delete", done, req_id=op.req_id))
            elif self._load_transport is not None:
                try:
                    self._load_transport.delete(done)
                except (TransportError, KeyError):
                    pass

    def get_block_ids_with_load_errors(self) -> set[int]:
        if not self._load_errors:
            return set()
        out, self._load_errors = self._load_errors, set()
        return out

    def get_finished(self, finished_req_ids: set[str]):
        if finished_req_ids:
            self._bad_reqs.difference_update(finished_req_ids)
        return None, None

    # -- saves -----------------------------------------------------------------------------------------
    def wait_for_save(self, meta: Any) -> None:
        """Stages the step's planned blocks and hands them to the saver (`meta`: the metadata vLLM bound)."""
        if not isinstance(meta, YuanrongConnectorMetadata) or not meta.saves or not self._active \
                or self._layout is None:
            return
        jobs = []
        started = time.perf_counter()
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
        if not self._npu:  # the step waits for this: the engine's own cost of saving (issue 47's breakdown)
            self.stats.observe("stage", (time.perf_counter() - started) * 1000.0)
        if self.cfg.save_sync and self._saver is not None:
            deadline = time.monotonic() + self.cfg.request_timeout_ms / 1000.0 * 2
            for job in jobs:
                job.done.wait(max(0.0, deadline - time.monotonic()))

    def _make_saver(self, budget: int) -> Saver:
        """The writer and its staging pool: in a child process (`saver: process`) or a thread of this one."""
        c = self.cfg
        if c.saver == "process":
            self._pool = StagingPool(self._layout.part_nbytes, budget, slab_factory=shared_slab_factory)
            extra = dict(getattr(self.ctx.ktc, "kv_connector_extra_config", None) or {})
            return ProcessSaver(c.role, extra, c, self.stats, budget, self._pool, on_event=self._on_ds_event)
        self._pool = StagingPool(self._layout.part_nbytes, budget)
        return Saver(self._make_conn(f"saver{self.tp_rank}"), c, self.stats, max_pending_bytes=budget,
                     pool=self._pool)

    def _stage(self, op: BlockOp) -> Job | None:
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
        try:
            staged = stage_blocks(self._parts, self._rows_u8, op.block_ids, slab)
        except Exception:
            if self._pool is not None:
                self._pool.release(slab)  # or the staging budget would shrink for good
            raise
        job = Job("save", keys, staged, n * layout.block_nbytes, op.req_id)
        job.slab = slab
        if not self._saver.submit(job):
            self._pool.release(slab)
            self.stats.inc("save_dropped_blocks", n)
            return None
        return job

    def shutdown(self) -> None:
        # drain the saver before the reporter's last flush, so the final stats include its last writes
        if self._saver is not None:
            self._saver.stop(5.0)
            self._saver = None
        super().shutdown()
