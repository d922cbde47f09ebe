"""Connector settings parsed from `kv_connector_extra_config` (pure Python, no vLLM needed).

Keys (all optional except the data system address):

  ds_address            "host:port" of the local data-system worker (or ds_host + ds_port;
                        env YRPD_DS_ADDRESS as a fallback)
  model_id              explicit model identity for the key namespace (recommended in deployments)
  namespace             extra user partition mixed into the namespace (e.g. a deployment id)
  ttl_seconds           expiry of stored blocks in the data system (0 = never; default 600)
  evictable             write blocks the data system may evict when its memory is full (default true), so
                        a full cache drops its oldest blocks instead of refusing new saves
  delete_after_load     consumer deletes the blocks it loaded (default false)
  save_sync             producer waits for its saves at the end of each step (default false)
  ready_wait_ms         consumer: how long a request announced by prefill may wait for its blocks
                        to appear before it is recomputed instead (default 3000)
  connect_timeout_ms    data-system connect timeout (default 2000)
  request_timeout_ms    data-system request timeout (default 5000)
  retry_backoff_s       after a data-system failure, skip it for this long where its worker's port cannot be
                        watched (default 5); a watched port is tried every 0.2 s, a client every 1 s while it accepts
  exclusive_connection  KVClient exclusive connection (default true; faster IPC)
  stats_interval_s      INFO counter log and stats-file period (default 10)
  stats_file            path of a JSON file rewritten with the counters each period; may contain
                        {side} (scheduler|worker), {rank}, {dp} (the engine's data-parallel rank: the
                        engines of one DP instance on a host share their TP ranks), {pid}, {role}, {engine}
  max_batch_keys        keys per data-system batch call (default 512; the API caps at < 2000)
  staging_mb            producer: host staging memory for saves in flight (default 1024); when the
                        background writer falls this far behind, further saves are dropped (counted)
  transport             "auto" (default), "host" (KVClient) or "npu" (DsTensorClient)
  device_id             NPU device index for the npu transport (default: the tensor's device)
  saver                 where the producer's data-system writes run: "process" (default: a child process, as the
                        data system's client holds the GIL for each call) or "thread" (inside the vLLM worker)
  layout                the memory-layout tag in the key namespace (default: the platform's device type and KV
                        layout); instances that must share blocks need the same tag
  resave_after_s        producer: a request that does not hand over to decode leaves out the blocks vLLM's own
                        prefix cache supplied that this instance saved less than this long ago (the copy is on the
                        engine's step); a block it computed is always saved, and so is every block of a hand-over;
                        0 saves every block of every request (default 300, at most half of ttl_seconds; given, below
                        it)
  cpu_spin_ms           CPU instances only: how long vLLM's message-queue readers spin after a message before
                        they sleep (default 2; vLLM's own is 1 s; negative leaves vLLM's; see cpu_spin.py)
  writer_nice           the writer process's nice value, 0-19 (default 0; `saver: thread` is not niced): where no
                        one waits for its puts (an instance that hands nothing over) it can yield the CPU to the
                        engine; yrpd sets 10 there
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

ROLES = ("kv_producer", "kv_consumer", "kv_both")


class ConfigError(ValueError):
    pass


def _bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off", ""):
            return False
    raise ConfigError(f"{name}: expected a boolean, got {value!r}")


def _num(value: Any, name: str, cast=int, minimum=None):
    try:
        out = cast(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    if not math.isfinite(out):  # nan passes every comparison below, inf every minimum
        raise ConfigError(f"{name}: expected a finite number, got {value!r}")
    if minimum is not None and out < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, got {out}")
    return out


def parse_address(text: str) -> tuple[str, int]:
    text = str(text).strip()
    if not text:
        raise ConfigError("ds_address is empty")
    if text.startswith("["):  # [v6]:port
        host, _, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise ConfigError(f"ds_address {text!r}: expected host:port")
    port_n = _num(port, "ds_address port", int, 1)
    if port_n > 65535 or not host:
        raise ConfigError(f"ds_address {text!r}: bad host or port")
    return host, port_n


@dataclass
class ConnectorConfig:
    role: str
    ds_host: str
    ds_port: int
    model_id: str | None = None
    namespace: str = ""
    ttl_seconds: int = 600
    evictable: bool = True
    delete_after_load: bool = False
    save_sync: bool = False
    ready_wait_ms: int = 3000
    connect_timeout_ms: int = 2000
    request_timeout_ms: int = 5000
    retry_backoff_s: float = 5.0
    exclusive_connection: bool = True
    stats_interval_s: float = 10.0
    stats_file: str | None = None
    max_batch_keys: int = 512
    staging_mb: int = 1024
    transport: str = "auto"
    device_id: int | None = None
    cpu_spin_ms: float = 2.0
    resave_after_s: float = 300.0
    writer_nice: int = 0
    saver: str = "process"
    unknown: dict = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    def stats_path(self, side: str, rank: int = 0, engine: str = "", dp: int = 0) -> str | None:
        if not self.stats_file:
            return None
        return self.stats_file.format(side=side, rank=rank, dp=dp, pid=os.getpid(), role=self.role, engine=engine)


_KNOWN = {
    "ds_address", "ds_host", "ds_port", "model_id", "namespace", "ttl_seconds", "evictable", "delete_after_load", "save_sync",
    "ready_wait_ms", "connect_timeout_ms", "request_timeout_ms", "retry_backoff_s", "exclusive_connection",
    "stats_interval_s", "stats_file", "max_batch_keys", "staging_mb", "transport", "device_id", "cpu_spin_ms",
    "saver", "layout", "resave_after_s", "writer_nice",
}


def user_settings(extra: Mapping[str, Any], known_only: bool = True) -> ConnectorConfig:
    """A deployment's own overrides (the spec's `connector`) as the connector will read them, checked before any
    host is touched: an unknown key is refused here (the connector itself would only warn, so a misspelt key would
    go unnoticed; `known_only=False` passes it, as the connector does), a value out of range as the connector would
    refuse it. The address is yrpd's to give; a placeholder stands in where the overrides have none."""
    unknown = sorted(set(extra) - _KNOWN)
    if unknown and known_only:
        close = difflib.get_close_matches(unknown[0], sorted(_KNOWN), n=1)
        raise ConfigError(f"unknown key {unknown[0]!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    placeholder = {} if {"ds_address", "ds_host", "ds_port"} & set(extra) else {"ds_address": "127.0.0.1:1"}
    return parse_config("kv_both", {**placeholder, **extra}, env={})


def parse_config(role: str | None, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
                 ) -> ConnectorConfig:
    env = os.environ if env is None else env
    extra = dict(extra or {})
    if role not in ROLES:
        raise ConfigError(f"kv_role must be one of {', '.join(ROLES)}, got {role!r}")
    if "ds_address" in extra:
        host, port = parse_address(extra["ds_address"])
    elif "ds_host" in extra or "ds_port" in extra:
        if "ds_port" not in extra:
            raise ConfigError("ds_host given without ds_port")
        host = str(extra.get("ds_host") or "127.0.0.1")
        port = _num(extra["ds_port"], "ds_port", int, 1)
    elif env.get("YRPD_DS_ADDRESS"):
        host, port = parse_address(env["YRPD_DS_ADDRESS"])
    else:
        raise ConfigError("no data-system address: set kv_connector_extra_config.ds_address (host:port) "
                          "or YRPD_DS_ADDRESS")
    saver = str(extra.get("saver", "process")).lower()
    if saver not in ("process", "thread"):
        raise ConfigError(f"saver must be process or thread, got {saver!r}")
    transport = str(extra.get("transport", "auto")).lower()
    if transport not in ("auto", "host", "npu"):
        raise ConfigError(f"transport must be auto, host or npu, got {transport!r}")
    cfg = ConnectorConfig(
        role=role,
        ds_host=host,
        ds_port=port,
        model_id=(str(extra["model_id"]) if extra.get("model_id") else None),
        namespace=str(extra.get("namespace", "")),
        ttl_seconds=_num(extra.get("ttl_seconds", 600), "ttl_seconds", int, 0),
        evictable=_bool(extra.get("evictable", True), "evictable"),
        delete_after_load=_bool(extra.get("delete_after_load", False), "delete_after_load"),
        save_sync=_bool(extra.get("save_sync", False), "save_sync"),
        ready_wait_ms=_num(extra.get("ready_wait_ms", 3000), "ready_wait_ms", int, 0),
        connect_timeout_ms=_num(extra.get("connect_timeout_ms", 2000), "connect_timeout_ms", int, 1),
        request_timeout_ms=_num(extra.get("request_timeout_ms", 5000), "request_timeout_ms", int, 1),
        retry_backoff_s=_num(extra.get("retry_backoff_s", 5.0), "retry_backoff_s", float, 0),
        exclusive_connection=_bool(extra.get("exclusive_connection", True), "exclusive_connection"),
        stats_interval_s=_num(extra.get("stats_interval_s", 10.0), "stats_interval_s", float, 0.1),
        stats_file=(str(extra["stats_file"]) if extra.get("stats_file") else None),
        max_batch_keys=_num(extra.get("max_batch_keys", 512), "max_batch_keys", int, 1),
        staging_mb=_num(extra.get("staging_mb", 1024), "staging_mb", int, 1),
        transport=transport,
        device_id=(None if extra.get("device_id") is None else _num(extra["device_id"], "device_id", int, 0)),
        cpu_spin_ms=_num(extra.get("cpu_spin_ms", 2.0), "cpu_spin_ms", float),
        resave_after_s=_num(extra.get("resave_after_s", 300.0), "resave_after_s", float, 0),
        writer_nice=_num(extra.get("writer_nice", 0), "writer_nice", int, 0),
        saver=saver,
        unknown={k: v for k, v in extra.items() if k not in _KNOWN},
    )
    if cfg.ttl_seconds and "resave_after_s" not in extra:
        cfg.resave_after_s = min(cfg.resave_after_s, cfg.ttl_seconds / 2)
    if cfg.ttl_seconds and cfg.resave_after_s >= cfg.ttl_seconds:
        # a block not saved again would expire while this instance still takes it for stored
        raise ConfigError(f"resave_after_s ({cfg.resave_after_s:g}) must be below ttl_seconds ({cfg.ttl_seconds})")
    if cfg.writer_nice > 19:
        raise ConfigError(f"writer_nice must be 0-19 (19 yields the most), got {cfg.writer_nice}")
    if cfg.max_batch_keys >= 2000:
        raise ConfigError("max_batch_keys must be < 2000 (data-system batch limit)")
    return cfg
