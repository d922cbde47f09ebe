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
  A request handed over to decode also saves its partial last block. `request_finished` returns
  {"yrpd": {"num_blocks": n, "tail": t, "ns": ...}} as kv_transfer_params.
* Consumer, scheduler side: `get_num_new_matched_tokens` asks the data system which of the
  request's loadable blocks exist (all TP/PP ranks) and promises only the leading run of present
  blocks. If prefill announced more blocks than are visible yet, the request waits (returns None)
  for at most ready_wait_ms. Worker side, `start_load_kv` copies the blocks into the paged cache
  before the forward; any block that cannot be read is reported through
  `get_block_ids_with_load_errors` and vLLM recomputes it (policy forced to "recompute").

On CPU, both halves also cap vLLM's 1 s busy wait after each queue message in their process (cpu_spin.py).

vLLM builds one instance per role, and the two never share state, so this class only holds one half
(`scheduler.ConnectorScheduler` or `worker.ConnectorWorker`) and hands each hook to it. What depends on
the running vLLM version is decided here, next to the base class it is read from.
"""

from __future__ import annotations

import inspect
import threading
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

# yrpd.connector exports YuanrongConnectorMetadata lazily from this module; BlockOp stays beside it
from yrpd.connector.common import BlockOp, YuanrongConnectorMetadata  # noqa: F401
from yrpd.connector.common import ConnectorContext, attach_vllm_logging
from yrpd.connector.cpu_spin import cap_spin
from yrpd.connector.scheduler import ConnectorScheduler
from yrpd.connector.stats import ConnectorStats
from yrpd.connector.worker import ConnectorWorker

try:  # vLLM >= 0.11: where external hits came from, for the prompt-token metrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as _CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    _CacheHitSource = None

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


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


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001
        return False


class YuanrongConnector(KVConnectorBase_V1):
    """vLLM KV connector storing content-addressed KV blocks in the openYuanrong data system."""

    if _CacheHitSource is not None:
        _cache_hit_source = _CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None):
        if _NEW_CTOR:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        else:  # vLLM <= 0.10 (vllm-ascend v0.10 image): (vllm_config, role)
            super().__init__(vllm_config=vllm_config, role=role)
        attach_vllm_logging()
        # what get_kv_connector_stats last handed vLLM (it wants increments, we keep totals)
        self._last_vllm_stats: dict[str, int] = {}
        self._stats_lock = threading.Lock()
        ctx = ConnectorContext(vllm_config, kv_cache_config)
        if ctx.cfg.cpu_spin_ms >= 0 and _on_cpu():
            cap_spin(ctx.cfg.cpu_spin_ms / 1000.0)
        self.connector_scheduler: ConnectorScheduler | None = None
        self.connector_worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            # read at construction, not import, so a test can stand in for an older vLLM
            self.connector_scheduler = ConnectorScheduler(ctx, can_wait=_CAN_WAIT, can_recompute=_CAN_RECOMPUTE)
        else:
            self.connector_worker = ConnectorWorker(ctx)

    @property
    def stats(self) -> ConnectorStats:
        half = self.connector_scheduler or self.connector_worker
        return half.stats

    # -- scheduler side --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        return self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]):
        if self.connector_scheduler is None:
            return False, None
        return self.connector_scheduler.request_finished(request, block_ids)

    @property
    def requires_kv_delivery(self) -> bool:
        # Saves are snapshotted at the end of the step that computed the blocks, so a preempted
        # request never hands off freed blocks: nothing to deliver reliably.
        return False

    # -- worker side -----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]):
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if self.has_connector_metadata():
            self.connector_worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks of all layers are saved once per step in wait_for_save

    def wait_for_save(self):
        if self.has_connector_metadata():
            self.connector_worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]):
        if self.connector_worker is None:
            return None, None
        return self.connector_worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.connector_worker is None:
            return set()
        return self.connector_worker.get_block_ids_with_load_errors()

    # -- both sides ------------------------------------------------------------------------------------
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

    def shutdown(self):
        (self.connector_scheduler or self.connector_worker).shutdown()
        return None
