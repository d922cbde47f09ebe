"""What the scheduler half and the worker half of the connector share.

The two halves run in different processes and never see each other: all they have in common is what
they read from the same vLLM config (the parsed options and the identity that names the key
namespace, `ConnectorContext`), the metadata the scheduler sends the worker every step, and the way
each runs its own data-system connection and counters (`ConnectorHalf`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from yrpd.connector import keys as K
from yrpd.connector.config import ConfigError, ConnectorConfig, parse_config
from yrpd.connector.stats import ConnectorStats, StatsReporter
from yrpd.connector.transport import DsConnection, kv_connection

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("yrpd.connector")


def attach_vllm_logging() -> None:
    """Route our logger through vLLM's handlers so INFO lines show up in the server log."""
    if logger.handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    for h in vllm_logger.handlers:
        logger.addHandler(h)
    if logger.handlers:
        logger.propagate = False
    logger.setLevel(logging.INFO)


# ---------------------------------------------------------------------------------------------
# Scheduler -> worker metadata (pickled across the process boundary every step)
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


# ---------------------------------------------------------------------------------------------
# Configuration and identity
# ---------------------------------------------------------------------------------------------

class ConnectorContext:
    """The connector's options and the identity of the KV it handles, read once from vLLM's config.

    Both halves must derive the very same namespace from it: the scheduler computes every rank's namespace
    to check existence, each worker its own to read and write, and a mismatch would turn every hit into a miss.
    """

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: Any = None) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.ktc = vllm_config.kv_transfer_config
        extra = dict(getattr(self.ktc, "kv_connector_extra_config", None) or {})
        try:
            self.cfg = parse_config(self.ktc.kv_role, extra)
        except ConfigError as e:
            raise ValueError(f"YuanrongConnector: {e}") from e
        if self.cfg.unknown:
            logger.warning("yrpd connector: ignoring unknown kv_connector_extra_config keys: %s",
                           sorted(self.cfg.unknown))
        self.block_size = int(vllm_config.cache_config.block_size)
        pc = vllm_config.parallel_config
        self.tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        # the engine's rank among the instance's DP engines (0 without DP): vLLM 0.32 keeps it in
        # data_parallel_index and leaves data_parallel_rank 0 on the engines of a dense model; 0.10 has only the latter
        dp = getattr(pc, "data_parallel_index", None)
        self.dp_rank = int((getattr(pc, "data_parallel_rank", 0) if dp is None else dp) or 0)
        self.pp_size = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        self.model_identity = self._compute_model_identity()
        self.kv_dtype = self._compute_kv_dtype()
        self.layout_tag = self._compute_layout_tag(extra)

        # Only one KV cache group can be named by a flat list of block ids (and reported on failure).
        groups = getattr(kv_cache_config, "kv_cache_groups", None) if kv_cache_config is not None else None
        self.active = True
        self.block_bytes = self._compute_block_bytes(groups)
        if groups is not None and len(groups) != 1:
            self.active = False
            logger.warning("yrpd connector: %d KV cache groups (hybrid model); the connector stays idle "
                           "(no save, no load)", len(groups))

    @property
    def engine_id(self) -> str:
        return str(getattr(self.ktc, "engine_id", "") or "")

    def _compute_model_identity(self) -> str:
        mc = self.vllm_config.model_config
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
        cache_dtype = str(getattr(self.vllm_config.cache_config, "cache_dtype", "auto"))
        if cache_dtype != "auto":
            return cache_dtype
        return str(getattr(self.vllm_config.model_config, "dtype", "auto")).replace("torch.", "")

    def _compute_block_bytes(self, groups) -> int | None:
        """What one block of a request takes in the data system, every rank's key together: a page (vLLM's
        page_size_bytes) of every layer the scheduler's config names, on each of the TP x PP ranks (each writes a
        key; with PP the scheduler's config is the first stage's, taken for each stage's); None where
        vLLM gave no KV cache config (an older vLLM) or more than one group. Cache-aware routing infers from it how
        many blocks a worker's memory holds before it spills (yrpd.proxy.kvindex.Store.memory_blocks)."""
        try:
            (group,) = groups
            return int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names) * self.tp_size * self.pp_size
        except (TypeError, ValueError, AttributeError):
            return None

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
            model=self.model_identity, kv_dtype=self.kv_dtype, layout=self.layout_tag,
            block_size=self.block_size, tp_rank=tp_rank, tp_size=self.tp_size, layer_group=0,
            extra={"pp_rank": pp_rank, "pp_size": self.pp_size, "user": self.cfg.namespace},
        )


# ---------------------------------------------------------------------------------------------
# What each half runs for itself
# ---------------------------------------------------------------------------------------------

class ConnectorHalf:
    """Counters, stats reporter and data-system connection of one side.

    Each process reports and connects on its own (the scheduler to look blocks up, each worker rank to move
    them), so every half owns a set; a subclass sets `side` and decides when to connect and start reporting.
    """

    side = ""

    def __init__(self, ctx: ConnectorContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.block_size = ctx.block_size
        # the worker may still switch itself off once it sees the KV cache layout
        self._active = ctx.active
        self.stats = ConnectorStats(self.side, self.cfg.role, 0, "", f"{self.cfg.ds_host}:{self.cfg.ds_port}")
        self._reporter: StatsReporter | None = None
        self._conn: DsConnection | None = None

    def _make_conn(self, name: str) -> DsConnection:
        return kv_connection(self.cfg, name, self._on_ds_event)

    def _on_ds_event(self, event: str) -> None:
        if event == "down":
            self.stats.inc("ds_errors")
            self.stats.ds_healthy = False
        elif event == "up":
            self.stats.inc("ds_reconnects")
            self.stats.ds_healthy = True
        elif event == "error":
            self.stats.inc("ds_errors")
        if event in ("down", "up") and self._reporter is not None:
            self._reporter.wake()

    def _start_reporter(self, rank: int, namespace: str) -> None:
        self.stats.rank = rank
        self.stats.dp = self.ctx.dp_rank
        self.stats.namespace = namespace
        path = self.cfg.stats_path(self.side, rank, self.ctx.engine_id, self.ctx.dp_rank)
        self._reporter = StatsReporter(self.stats, self.cfg.stats_interval_s, path, logger,
                                       extra=self._stats_extra).start()

    def _stats_extra(self) -> dict:
        ctx = self.ctx
        out = {"block_size": self.block_size, "model_identity": ctx.model_identity,
               "kv_dtype": ctx.kv_dtype, "layout": ctx.layout_tag}
        if self._conn is not None:
            self.stats.ds_healthy = self._conn.healthy
            out["ds_healthy"] = self._conn.healthy
            if not self._conn.healthy:
                out["ds_last_error"] = self._conn.last_error
        return out

    def shutdown(self) -> None:
        if self._reporter is not None:
            self._reporter.stop()
        if self._conn is not None:
            self._conn.close()
