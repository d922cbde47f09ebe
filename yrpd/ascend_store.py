"""vllm-ascend's own openYuanrong path (`kv_connector: ascend-store`): its `AscendStoreConnector` with the `yuanrong`
backend as the KV pool, beside its `MooncakeConnectorV1` for the prefill -> decode hand-over (upstream's PD recipe,
a `MultiConnector` of the two), on yrpd's data system.

Pure. Every name and key here was read from the vllm-ascend source distributions (tests/lab/test_ascend_store_sources.py
checks them against the real sources and against the data-system client yrpd installs):
- the backend's configuration changed across releases: up to 0.26.0rc1 it reads the environment (`DS_WORKER_ADDR`,
  `DS_ENABLE_REMOTE_H2D`, ...); from 0.27.1rc1 a JSON file named by `YR_CONFIG_PATH`, and then it calls
  `HeteroClient.batch_is_exist`, `mget_h2d_from_multi_buffers` and `mset_d2h_from_multi_buffers`, which
  openyuanrong-datasystem 0.8.1 (the newest on the package index, what yrpd installs) does not have: those releases
  are refused at plan time, naming the data-system version they need;
- 0.23.0 pre-registers device memory (`HeteroClient.pre_register_device_memory`, not in 0.8.1) only with
  `DS_ENABLE_REMOTE_H2D=1`: yrpd sets 0;
- the pool's keys hash vLLM's block hashes: every instance runs with `PYTHONHASHSEED=0`;
- `lookup_rpc_port` names an IPC socket under the instance's TMPDIR: unique per instance on a host;
- Mooncake's handshake ports are `kv_port + dp_rank * tp + tp_rank`: each instance gets a block of its own.
The data system's CURVE keys reach the backend's client through the environment (DATASYSTEM_CLIENT_*), which the
native client reads itself, as for yrpd's connector.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from packaging.version import Version

from yrpd.errors import SpecError
from yrpd.ports import INSTANCE_PORT_BLOCK

if TYPE_CHECKING:
    from yrpd.dswheels import BroughtDataSystem
    from yrpd.placement import InstancePlan
    from yrpd.spec import Ports

CONNECTOR = "AscendStoreConnector"
MODULE = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.ascend_store_connector"
BACKEND = "yuanrong"
BACKEND_MODULE = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.yuanrong_backend"
HANDOVER = "MooncakeConnectorV1"
MULTI = "MultiConnector"

#: the first release whose AscendStoreConnector has the yuanrong backend
FIRST = Version("0.19.1rc1")
#: from this release the backend reads YR_CONFIG_PATH and calls HeteroClient's multi-buffer API
JSON_CONFIG = Version("0.27.1rc1")
#: HeteroClient methods the releases from JSON_CONFIG on call that openyuanrong-datasystem 0.8.1 lacks, and the first
#: data-system release with all of them (its source tags; no such wheel is on the package index)
MISSING_IN_DATASYSTEM = ("batch_is_exist", "mget_h2d_from_multi_buffers", "mset_d2h_from_multi_buffers")
NEEDS_DATASYSTEM = "0.9.1rc5"

#: the environment the backend reads (releases FIRST .. JSON_CONFIG): the host's worker, remote H2D off (on, the
#: backend pre-registers device memory through a call 0.8.1 does not have)
WORKER_ENV = "DS_WORKER_ADDR"
REMOTE_H2D_ENV = "DS_ENABLE_REMOTE_H2D"
#: the pool's keys embed vLLM's block hashes: every instance must hash alike
HASH_SEED_ENV = {"PYTHONHASHSEED": "0"}
#: Mooncake handshake ports per instance (kv_port + dp_rank * tp + tp_rank), counted from ports.mooncake_base in
#: the blocks the instance's HCCL ports are counted in
PORT_BLOCK = INSTANCE_PORT_BLOCK


def handover_port(ports: "Ports", inst: "InstancePlan") -> int:
    """The first of the instance's Mooncake handshake ports (its `kv_port`)."""
    return ports.mooncake_base + (inst.hccl_port - ports.hccl_base)


def check(release: str | None, profile: str, brought: "BroughtDataSystem | None" = None) -> None:
    """SpecError unless the image's vllm-ascend has a yuanrong backend the data system yrpd installs can serve: the
    package index's, or the one the user brings (`datasystem_wheels`, read from its wheels: yrpd.dswheels)."""
    fix = ("use kv_connector: yuanrong (yrpd's connector), an image of vllm-ascend 0.19.1rc1 .. 0.26.0rc1, or bring "
           f"openyuanrong-datasystem >= {NEEDS_DATASYSTEM} (datasystem_wheels: DIR)")
    if release is None:
        raise SpecError("kv_connector", f"ascend-store: container profile {profile} does not say which vllm-ascend "
                        "release its image ships", "set vllm_ascend: in a copy of the profile")
    version = Version(release)
    if version < FIRST:
        raise SpecError("kv_connector", f"ascend-store: vllm-ascend {release} (profile {profile}) has no "
                        f"AscendStoreConnector with a yuanrong backend (it came in {FIRST})", fix)
    if version >= JSON_CONFIG and brought is None:
        raise SpecError("kv_connector", f"ascend-store: vllm-ascend {release}'s yuanrong backend calls HeteroClient."
                        f"{', '.join(MISSING_IN_DATASYSTEM)}, which openyuanrong-datasystem 0.8.1 (what yrpd installs, "
                        f"the newest on the package index) lacks: it needs openyuanrong-datasystem >= "
                        f"{NEEDS_DATASYSTEM}", fix)
    if version >= JSON_CONFIG and (lacking := brought.lacks(MISSING_IN_DATASYSTEM)):
        raise SpecError("kv_connector", f"ascend-store: vllm-ascend {release}'s yuanrong backend calls HeteroClient."
                        f"{', '.join(lacking)}, which the openyuanrong-datasystem {brought.version} brought in "
                        f"{brought.directory} lacks: it needs openyuanrong-datasystem >= {NEEDS_DATASYSTEM}", fix)


#: from JSON_CONFIG on: the variable naming the backend's JSON file, and the keys yrpd writes there (the backend reads
#: more, each with a default: tests/lab/test_ascend_store_sources.py checks these against every release's source)
CONFIG_PATH_ENV = "YR_CONFIG_PATH"
WORKER_KEY = "worker_addr"
REMOTE_H2D_KEY = "enable_remote_h2d"


def reads_json(release: str | None) -> bool:
    """The release's backend reads YR_CONFIG_PATH's JSON (and needs a data system brought for its calls)."""
    return release is not None and Version(release) >= JSON_CONFIG


def json_config(worker: str) -> dict:
    """The backend's JSON (releases from JSON_CONFIG on): the host's worker, remote H2D off as in worker_env."""
    return {WORKER_KEY: worker, REMOTE_H2D_KEY: False}


def config_env(path: str) -> dict[str, str]:
    """The environment of an instance whose backend reads its JSON at `path`."""
    return {CONFIG_PATH_ENV: path, **HASH_SEED_ENV}


def worker_env(worker: str) -> dict[str, str]:
    """The environment of an instance whose backend talks to the data system worker at `worker` (host:port); its
    scheduler process builds a client too (0.23.0), so the whole instance gets it."""
    return {WORKER_ENV: worker, REMOTE_H2D_ENV: "0", **HASH_SEED_ENV}


def pool(role: str, lookup_port: int) -> dict:
    return {"kv_connector": CONNECTOR, "kv_role": role,
            "kv_connector_extra_config": {"backend": BACKEND, "lookup_rpc_port": str(lookup_port)}}


def kv_transfer_config(role: str, *, lookup_port: int, handover: dict | None) -> dict:
    """The instance's --kv-transfer-config. `handover`: None for an instance without a PD partner (the pool alone),
    else {"kv_port": first handshake port, "prefill": {"dp_size", "tp_size"}, "decode": {...}} (Mooncake's)."""
    if handover is None:
        return {**pool(role, lookup_port), "kv_load_failure_policy": "recompute"}
    mooncake = {"kv_connector": HANDOVER, "kv_role": role, "kv_port": str(handover["kv_port"]),
                "kv_connector_extra_config": {"prefill": handover["prefill"], "decode": handover["decode"]}}
    return {"kv_connector": MULTI, "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"connectors": [mooncake, pool(role, lookup_port)]}}
