"""yrpd's vLLM KV connector over the openYuanrong data system.

vLLM loads it with kv_connector_module_path="yrpd.connector", kv_connector="YuanrongConnector".
The pure parts (keys, config, stats, transport argument building) import without vLLM; the
connector class itself is imported lazily on first attribute access.
"""

from __future__ import annotations

from yrpd.connector.config import ConfigError, ConnectorConfig, parse_config  # noqa: F401
from yrpd.connector.keys import Namespace, block_keys, key_for, loadable_blocks, prefix_digests  # noqa: F401
from yrpd.connector.stats import read_stats_file  # noqa: F401

CONNECTOR_NAME = "YuanrongConnector"
MODULE_PATH = "yrpd.connector"

_LAZY = {"YuanrongConnector", "YuanrongConnectorMetadata"}


def __getattr__(name: str):
    if name in _LAZY:
        from yrpd.connector import connector as _impl

        return getattr(_impl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Register the connector by name with vLLM's factory (for a `vllm.general_plugins` entry point),
    so `"kv_connector": "YuanrongConnector"` works without kv_connector_module_path."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "yrpd.connector.connector", CONNECTOR_NAME)
    except ValueError:
        pass  # already registered
