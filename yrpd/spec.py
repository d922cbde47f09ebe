"""The deploy spec: what the user asked for, validated before any host is touched.

Sources, lowest precedence first: built-in defaults, the YAML config file, command-line flags.
Every problem becomes one `SpecError` naming the field and the fix (exit code 2).
"""

from __future__ import annotations

import getpass
import hashlib
import ipaddress
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from yrpd.models import BUILTIN_MODELS, BUILTIN_SHAPES, DEFAULT_BUILTIN
from yrpd.ports import RAY_PORT_BLOCK
from yrpd.errors import SpecError
from yrpd.hostgroup import SshOptions
from yrpd.proxy.routing import Routing
from yrpd.connector.config import ConfigError, user_settings
from yrpd import ascend_store, dswheels
from yrpd.containers import check_image, container_profile, default_npu_image
from yrpd.versions import DATASYSTEM_PYTHONS, DEFAULT_ENV_ROOT, OPENYUANRONG_DATASYSTEM, YR_PYTHONS

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
BUILTIN_MODEL = f"builtin:{DEFAULT_BUILTIN}"
DEFAULT_CONFIG_NAME = "yrpd.yaml"

_HOSTNAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
_USER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class DeviceKind(str, Enum):
    auto = "auto"
    npu = "npu"
    gpu = "gpu"
    cpu = "cpu"


class ClusterMode(str, Enum):
    auto = "auto"  # full when the function system is installed on the hosts, else ds_only
    full = "full"
    ds_only = "ds_only"


class ClusterLauncher(str, Enum):
    """What starts and keeps the data system (and etcd) running on the hosts."""

    auto = "auto"  # dscli unless cluster_mode is full
    #: openYuanrong's own vLLM deployment: a plain etcd and one `datasystem_worker` per host with dscli's flags, kept
    #: by yrpd's supervisor; needs only `openyuanrong-datasystem` (Python 3.11 or 3.12) and etcd
    dscli = "dscli"
    #: openYuanrong's `yr` CLI and its daemon (Python 3.10/3.11 only); the only launcher of full mode
    yr = "yr"


class MultiNodeBackend(str, Enum):
    """How vLLM runs an instance whose TP x PP group spans hosts."""

    auto = "auto"  # ray on NPU and GPU hosts (vllm-ascend's multi-node tutorials), mp on CPU (Ray refuses it)
    #: vLLM's multi-node recipe: a Ray cluster per instance (`ray start --head` on its first host, `ray start
    #: --address` on the others), then `vllm serve --distributed-executor-backend ray` on the first host
    ray = "ray"
    #: vLLM's own launcher (>= 0.11, no Ray): the same `vllm serve` on every host with `--nnodes --node-rank
    #: --master-addr --master-port`, `--headless` on all but the first
    mp = "mp"


class Runtime(str, Enum):
    auto = "auto"  # docker with the newest vllm-ascend release's image where every host has NPUs, else host
    docker = "docker"
    host = "host"


class Dtype(str, Enum):
    """The dtype vLLM computes in (and stores KV in): `--dtype`."""

    auto = "auto"  # CPU hosts: what the CPU computes fastest; NPU/GPU: the model's own (vLLM's auto)
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class KvConnector(str, Enum):
    """What moves KV between the instances and keeps it beyond their own memory."""

    yuanrong = "yuanrong"  # yrpd's connector: the openYuanrong data system
    example = "example"  # vLLM's reference connector (files on one host): a peer `yrpd bench` compares against
    lmcache = "lmcache"  # LMCache's multi-process server beside each plain instance: another peer of `yrpd bench`
    #: vLLM's NixlConnector: decode pulls the prompt's blocks from prefill's memory over UCX (no store beyond the
    #: instances); a PD peer of `yrpd bench` on CPU hosts
    nixl = "nixl"
    #: vllm-ascend's own: AscendStoreConnector (backend yuanrong) as the pool on yrpd's data system, with its
    #: MooncakeConnectorV1 for the PD hand-over (yrpd.ascend_store); vllm-ascend images 0.19.1rc1 .. 0.26.0rc1
    ascend_store = "ascend-store"


class ContainerEngine(str, Enum):
    docker = "docker"
    podman = "podman"  # where its CLI is docker's (docs/dev/containers.md)


def parse_device_list(text: str | list[int] | None, field: str) -> list[int] | None:
    """`0-3`, `0,1,2,3`, `0-1,4-5` or a YAML list -> sorted ids; duplicates and bad ranges are errors."""
    if text is None:
        return None
    if isinstance(text, list):
        items = [str(x) for x in text]
    else:
        items = [p.strip() for p in str(text).split(",")]
    ids: list[int] = []
    for item in items:
        if not item:
            raise SpecError(field, f"empty entry in device list {text!r}", "write ids like 0-3 or 0,1,2,3")
        if "-" in item:
            lo_text, _, hi_text = item.partition("-")
            if not (lo_text.isdigit() and hi_text.isdigit()):
                raise SpecError(field, f"{item!r} is not a device range", "write ranges like 0-3")
            lo, hi = int(lo_text), int(hi_text)
            if lo > hi:
                raise SpecError(field, f"range {item!r} runs backwards", f"write {hi}-{lo}")
            ids.extend(range(lo, hi + 1))
        elif item.isdigit():
            ids.append(int(item))
        else:
            raise SpecError(field, f"{item!r} is not a device id", "device ids are non-negative integers, e.g. 0-3")
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise SpecError(field, f"device {duplicates[0]} is listed twice", "list each device once")
    return sorted(ids)


def format_device_list(ids: list[int]) -> str:
    """Inverse of parse_device_list, compact: [0,1,2,3,6] -> '0-3,6'."""
    if not ids:
        return "-"
    parts = []
    start = prev = ids[0]
    for i in ids[1:] + [None]:  # type: ignore[list-item]
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)


def parse_host_address(text: str, field: str) -> tuple[str | None, str, int | None]:
    """`user@host:port` -> (user, host, port); user and port optional. Host may be an ssh_config alias."""
    text = text.strip()
    if not text:
        raise SpecError(field, "empty host name", "give names like h1, root@10.0.0.5 or root@h1:2222")
    user = None
    if "@" in text:
        user, _, text = text.rpartition("@")
        if not _USER_RE.match(user):
            raise SpecError(field, f"{user!r} is not a valid user name", "write user@host")
    port = None
    if text.startswith("["):  # [v6addr]:port
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise SpecError(field, f"cannot parse {text!r}", "write [addr]:port")
            port = _parse_port(rest[1:], field)
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = _parse_port(port_text, field)
    else:
        host = text
    if ":" not in host and not _HOSTNAME_RE.match(host):
        raise SpecError(field, f"{host!r} is not a valid host name", "use letters, digits, dots and dashes")
    return user, host, port


def _parse_port(text: str, field: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise SpecError(field, f"port {text!r} is not in 1-65535", "write host:port with a valid port")
    return int(text)


class HostSpec(BaseModel):
    """One host as the user named it, plus per-host overrides from the config file."""

    model_config = ConfigDict(extra="forbid")

    #: name, user@host:port or ssh_config alias
    address: str
    #: address the other hosts use to reach this one (cluster traffic); default: the SSH target resolved
    ip: str | None = None
    #: private key for this host (or, under ssh:, for every host) (`-i`)
    identity: str | None = None
    #: this host's device kind (default: the top-level device_kind)
    device_kind: DeviceKind | None = None
    #: this host's device ids (default: the top-level devices, else detected)
    devices: list[int] | None = None
    #: the network interface that holds `ip`: an instance spanning hosts names it to gloo, HCCL and NCCL
    #: (GLOO_SOCKET_IFNAME and the like); default: detected at deploy
    nic: str | None = None

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, value: Any) -> Any:
        return parse_device_list(value, "devices") if value is not None else None

    @property
    def user(self) -> str | None:
        return parse_host_address(self.address, "hosts")[0]

    @property
    def hostname(self) -> str:
        return parse_host_address(self.address, "hosts")[1]

    @property
    def port(self) -> int | None:
        return parse_host_address(self.address, "hosts")[2]

    @property
    def name(self) -> str:
        """Display and key name: the address without the user."""
        _, host, port = parse_host_address(self.address, "hosts")
        return f"{host}:{port}" if port else host

    @property
    def is_local(self) -> bool:
        return self.hostname in LOCAL_NAMES and self.port is None and self.user in (None, getpass.getuser())


class RestartPolicy(BaseModel):
    """How a dead instance or proxy is brought back (each runs under deploy_scripts/supervise.py on its host)."""

    model_config = ConfigDict(extra="forbid")

    #: restarts allowed within window_s; then it stays down and `yrpd status` says why (0: never restart;
    #: `yrpd deploy` then starts what is dead)
    max: int = Field(default=3, ge=0, le=100)
    #: seconds over which restarts are counted
    window_s: int = Field(default=600, ge=1)
    #: seconds a stopping process gets after TERM before it and its whole process group are killed
    grace_s: int = Field(default=15, ge=1, le=600)
    #: seconds an instance or the proxy may go without answering its /health probe, once it has answered, before
    #: its supervisor takes it for hung (alive, but stopped or deadlocked: it never exits) and restarts it; the
    #: probe runs every third of this (at most 5 s). 0: no probe
    hang_after_s: int = Field(default=30, ge=0, le=3600)


class PlannerSettings(BaseModel):
    """The SLA planner (`yrpd planner`, opt-in): from the proxy's recent TTFT and ITL it adds, removes or moves
    prefill/decode instances within the hosts' devices to hold the targets (yrpd/planner.py)."""

    model_config = ConfigDict(extra="forbid")

    #: 90th percentile of time to first token to hold, over streamed requests of the last window_s
    ttft_p90_ms: float = Field(gt=0)
    #: 90th percentile of the time between tokens to hold (streamed requests); unset: decode is judged by TTFT alone
    itl_p90_ms: float | None = Field(default=None, gt=0)
    #: the planner keeps the prefill instances within these bounds
    min_prefill: int = Field(default=1, ge=1)
    max_prefill: int = Field(default=4, ge=1)
    #: and the decode instances within these
    min_decode: int = Field(default=1, ge=1)
    max_decode: int = Field(default=4, ge=1)
    #: seconds of requests a decision looks at
    window_s: float = Field(default=30, ge=5)
    #: seconds between looks
    interval_s: float = Field(default=5, ge=1)
    #: seconds after a change before the next one: its effect shows in the window first
    cooldown_s: float = Field(default=60, ge=0)
    #: streamed requests a window needs before it is judged
    min_samples: int = Field(default=10, ge=1)
    #: an instance is removed only while the role's p90 stays under this share of its target
    scale_in_below: float = Field(default=0.5, gt=0, lt=1)

    @model_validator(mode="after")
    def _bounds(self) -> "PlannerSettings":
        for role in ("prefill", "decode"):
            if getattr(self, f"min_{role}") > getattr(self, f"max_{role}"):
                raise SpecError(f"planner.min_{role}", f"is above planner.max_{role}", "lower it or raise the max")
        return self


class Ports(BaseModel):
    """Fixed service ports plus the bases from which per-instance ports are counted on each host."""

    model_config = ConfigDict(extra="forbid")

    #: the proxy, on the master (`--proxy-port`)
    proxy: int = 8000
    #: the data system worker, every host
    datasystem: int = 31501
    #: the data system master, on the master (cluster_launcher yr; dscli's workers share the master's work)
    ds_master: int = 12123
    #: etcd client port on the master; etcd+1 is its peer port
    etcd: int = 32379
    #: LMCache's server beside the instances (`kv_connector: lmcache`); lmcache+1 is its HTTP port
    lmcache: int = 32600
    #: every host's metrics exporter (the data system's and the connector's figures for Prometheus)
    exporter: int = 32700
    #: the KV-event relay on each host but the proxy's whose instances publish KV-cache events (prefix routing);
    #: kv_relay+1 answers replays
    kv_relay: int = 32710
    #: the k-th instance on a host listens on instance_base+k
    instance_base: int = 8100
    #: the k-th instance's DP rpc port, used only by a DP group spanning hosts (on its head host); a TP x PP group
    #: spanning hosts: its rendezvous (backend mp) on its head, its gang port on each other host
    kv_base: int = 8300
    #: the k-th instance gets hccl_base+16k .. +15 for collective communication
    hccl_base: int = 61000
    #: the k-th instance's hand-over block, mooncake_base+16k .. +15: kv_connector ascend-store's Mooncake listens
    #: there, kv_connector nixl's side channel on its first port
    mooncake_base: int = 62600
    #: the k-th instance's Ray node ports, ray_base+8k .. +7 (multi_node_backend ray: an instance spanning hosts)
    ray_base: int = 64200
    #: instances a host may run: instance_base and kv_base reserve this many ports, hccl_base 16 each
    span: int = 100

    @model_validator(mode="after")
    def _check(self) -> "Ports":
        for name in ("proxy", "datasystem", "ds_master", "etcd", "lmcache", "exporter", "kv_relay", "instance_base",
                     "kv_base", "hccl_base", "mooncake_base", "ray_base"):
            value = getattr(self, name)
            if not 1 <= value <= 65535:
                raise ValueError(f"{name}: {value} is not in 1-65535")
        for name in ("etcd", "lmcache", "kv_relay"):  # the next port is theirs too
            if getattr(self, name) + 1 > 65535:
                raise ValueError(f"{name}: {getattr(self, name)} leaves no port after it (it takes two)")
        if not 1 <= self.span <= 1000:
            raise ValueError(f"span: {self.span} is not in 1-1000")
        widths = {"instance_base": self.span, "kv_base": self.span, "hccl_base": 16 * self.span,
                  "mooncake_base": 16 * self.span, "ray_base": RAY_PORT_BLOCK * self.span}
        for name, width in widths.items():
            top = getattr(self, name) + width - 1
            if top > 65535:
                raise ValueError(f"{name}: range {getattr(self, name)}-{top} runs past 65535")
        ranges = {
            "proxy": (self.proxy, self.proxy),
            "datasystem": (self.datasystem, self.datasystem),
            "ds_master": (self.ds_master, self.ds_master),
            "etcd": (self.etcd, self.etcd + 1),  # client and peer port
            "lmcache": (self.lmcache, self.lmcache + 1),  # its ZMQ and HTTP ports
            "exporter": (self.exporter, self.exporter),
            "kv_relay": (self.kv_relay, self.kv_relay + 1),  # events and replays
            "instance_base": (self.instance_base, self.instance_base + self.span - 1),
            "kv_base": (self.kv_base, self.kv_base + self.span - 1),
            "hccl_base": (self.hccl_base, self.hccl_base + 16 * self.span - 1),
            "mooncake_base": (self.mooncake_base, self.mooncake_base + 16 * self.span - 1),
            "ray_base": (self.ray_base, self.ray_base + RAY_PORT_BLOCK * self.span - 1),
        }
        names = list(ranges)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                (a_lo, a_hi), (b_lo, b_hi) = ranges[a], ranges[b]
                if a_lo <= b_hi and b_lo <= a_hi:
                    raise ValueError(
                        f"{a}: {a} ({_fmt_range(ranges[a])}) collides with {b} ({_fmt_range(ranges[b])})"
                    )
        return self


def _fmt_range(r: tuple[int, int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"


#: the parallelism fields' short names, kept as aliases (flags and config files): field -> short name
PARALLEL_ALIASES = {"prefill_tensor_parallel_size": "ptp", "decode_tensor_parallel_size": "dtp",
                    "prefill_data_parallel_size": "pdp", "decode_data_parallel_size": "ddp",
                    "prefill_pipeline_parallel_size": "ppp", "decode_pipeline_parallel_size": "dpp"}


def _parallel_size(field: str) -> Any:
    """A parallelism field: 1 to 64, read under its own name or its short one."""
    return Field(1, ge=1, le=64, validation_alias=AliasChoices(field, PARALLEL_ALIASES[field]))


class TopologySection(BaseModel):
    """Where the deployment runs and how it is cut into instances: hosts, devices, instances and their
    parallelism."""

    #: hosts: names, user@host:port, ssh_config aliases, or entries with per-host settings (`--hosts`)
    hosts: list[HostSpec]
    #: the host that holds etcd, the cluster master and the proxy; default the first host (`--master`)
    master: str | None = None
    #: device kind of every host; auto = detected at deploy: /dev/davinci*, /dev/nvidia*, else CPU cores (`--device-kind`)
    device_kind: DeviceKind = DeviceKind.auto
    #: this host's device ids (default: the top-level devices, else detected)
    devices: list[int] | None = None
    #: prefill instances, the guide's PREFILL_INS_NUM (`--prefill`)
    prefill: int = Field(1, ge=1, le=64)
    #: decode instances, the guide's DECODE_INS_NUM (`--decode`)
    decode: int = Field(1, ge=1, le=64)
    #: tensor parallel size of each prefill instance (`--prefill-tensor-parallel-size` or `--ptp`)
    prefill_tensor_parallel_size: int = _parallel_size("prefill_tensor_parallel_size")
    #: tensor parallel size of each decode instance (`--decode-tensor-parallel-size` or `--dtp`)
    decode_tensor_parallel_size: int = _parallel_size("decode_tensor_parallel_size")
    #: data parallel ranks of each prefill instance (`--prefill-data-parallel-size` or `--pdp`)
    prefill_data_parallel_size: int = _parallel_size("prefill_data_parallel_size")
    #: data parallel ranks of each decode instance (`--decode-data-parallel-size` or `--ddp`)
    decode_data_parallel_size: int = _parallel_size("decode_data_parallel_size")
    #: pipeline stages of each prefill instance (`--prefill-pipeline-parallel-size` or `--ppp`); an instance's
    #: TP x PP ranks that no one host holds span hosts (docs/architecture.md, "Instances bigger than a host")
    prefill_pipeline_parallel_size: int = _parallel_size("prefill_pipeline_parallel_size")
    #: pipeline stages of each decode instance (`--decode-pipeline-parallel-size` or `--dpp`)
    decode_pipeline_parallel_size: int = _parallel_size("decode_pipeline_parallel_size")
    #: how an instance spanning hosts runs: ray (vLLM's multi-node recipe), mp (vLLM's --nnodes launcher); auto: ray
    #: on NPU/GPU hosts, mp on CPU hosts (`--multi-node-backend`)
    multi_node_backend: MultiNodeBackend = MultiNodeBackend.auto
    #: the network interface of every host that holds its `ip` (a host's own `nic` wins); default: detected
    nic: str | None = None
    #: CPU hosts only: cores each TP rank binds (devices are cores there)
    cores_per_rank: int = Field(1, ge=1, le=256)
    #: prefill/decode instances behind the proxy; false = `prefill` plain vLLM instances ("single-N", no
    #: connector, no proxy): the non-disaggregated baseline `yrpd bench` compares against
    disaggregated: bool = True

    @model_validator(mode="before")
    @classmethod
    def _one_name_each(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for field, short in PARALLEL_ALIASES.items():
                if field in data and short in data:
                    raise SpecError(field, f"given twice, as {field} and as {short}", "keep one of them")
        return data

    @field_validator("hosts", mode="before")
    @classmethod
    def _hosts(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [h for h in value.split(",")]
        if not isinstance(value, list):
            return value
        return [{"address": h} if isinstance(h, str) else h for h in value]

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, value: Any) -> Any:
        return parse_device_list(value, "devices") if value is not None else None

    @property
    def master_host(self) -> HostSpec:
        name = self.master or self.hosts[0].name
        for host in self.hosts:
            if host.name == name or host.address == name:
                return host
        raise AssertionError("validated in check()")  # pragma: no cover

    def host(self, name: str) -> HostSpec:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    def parallelism(self, role: str) -> tuple[int, int]:
        """(tensor, data) parallel size of each instance of `role`: prefill, decode, or single (plain instances,
        which take prefill's)."""
        if role == "decode":
            return self.decode_tensor_parallel_size, self.decode_data_parallel_size
        return self.prefill_tensor_parallel_size, self.prefill_data_parallel_size

    def pipeline(self, role: str) -> int:
        """Pipeline stages of each instance of `role` (plain instances take prefill's)."""
        return self.decode_pipeline_parallel_size if role == "decode" else self.prefill_pipeline_parallel_size

    def multi_node(self, kind: DeviceKind) -> MultiNodeBackend:
        """The backend in effect for hosts of `kind`: auto resolved."""
        if self.multi_node_backend is not MultiNodeBackend.auto:
            return self.multi_node_backend
        return MultiNodeBackend.mp if kind is DeviceKind.cpu else MultiNodeBackend.ray

    def _check_topology(self) -> None:
        if not self.hosts:
            raise SpecError("hosts", "no hosts given", "pass --hosts h1,h2 or list hosts: in yrpd.yaml")
        seen: dict[str, int] = {}
        for i, host in enumerate(self.hosts):
            parse_host_address(host.address, f"hosts[{i}]")
            if host.name in seen:
                raise SpecError(
                    f"hosts[{i}]", f"{host.name} is listed twice (also hosts[{seen[host.name]}])", "list each host once"
                )
            seen[host.name] = i
            if host.ip is not None:
                try:
                    ipaddress.ip_address(host.ip)
                except ValueError:
                    raise SpecError(f"hosts[{i}].ip", f"{host.ip!r} is not an IP address", "give the host's IP address") from None
        if self.master is not None and not any(self.master in (h.name, h.address) for h in self.hosts):
            names = ",".join(h.name for h in self.hosts)
            raise SpecError("master", f"{self.master!r} is not one of the hosts ({names})", "pick one of the hosts")
        named = {h.name: h.device_kind or self.device_kind for h in self.hosts}
        if len({k for k in named.values() if k is not DeviceKind.auto}) > 1:
            described = ", ".join(f"{n}={k.value}" for n, k in named.items())
            raise SpecError("device_kind", f"hosts mix device kinds ({described})", "deploy one kind of device per run")


class RuntimeSection(BaseModel):
    """How yrpd reaches the hosts and runs processes there: container or not, environments, ports, restarts, session
    directories."""

    #: host = processes on the hosts; docker = one container per host; auto = docker on NPU hosts (the vllm-ascend
    #: image: `image`, default the newest vllm-ascend release's), host elsewhere (`--runtime`)
    runtime: Runtime = Runtime.auto
    #: container image for runtime docker (`--image`)
    image: str | None = None
    #: runtime docker: a profile in containers/ by name, or a profile file; default: the one made for `image`
    container_profile: str | None = None
    #: runtime docker: the container CLI (podman is documented, not tested)
    container_engine: ContainerEngine = ContainerEngine.docker
    #: the ports the deployment listens on (see the ports section)
    ports: Ports = Ports()
    #: automatic restart of dead instances and the proxy (`restart: {max: 0}` turns it off)
    restart: RestartPolicy = RestartPolicy()
    #: the SLA planner's targets and bounds (`yrpd planner` acts on them); unset: no planner
    planner: PlannerSettings | None = None
    #: extra environment for every service (`--env KEY=VALUE`)
    env: dict[str, str] = {}
    #: prepared environments on the hosts (yr/, ds/, vllm/ venvs): skips installs (`--env-path`)
    env_path: str | None = None
    #: directory on the hosts with wheel files, for hosts without a package index
    wheels: str | None = None
    #: local session directories (or $YRPD_HOME/sessions)
    session_root: str = "~/.yrpd/sessions"
    #: session directories on the hosts (logs, pid files, cluster state)
    remote_session_root: str = "/tmp/yrpd_sessions"
    #: how yrpd reaches the hosts (see the ssh section)
    ssh: SshOptions = SshOptions()
    #: preflight: free disk needed under remote_session_root
    min_free_disk_gb: float = Field(2.0, ge=0)
    #: how long deploy waits for an instance to answer /health
    startup_timeout_s: int = Field(900, ge=10)

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): "" if v is None else str(v) for k, v in value.items()}
        return value

    @property
    def env_root(self) -> str:
        """Where the environments (yr, ds, vllm venvs) live on the hosts."""
        return (self.env_path or DEFAULT_ENV_ROOT).rstrip("/")

    def resolve_runtime(self, kinds: set[DeviceKind]) -> "DeploySpec":
        """runtime auto made concrete once the hosts' device kinds are known: docker where every host has NPUs (the
        image given, else the newest vllm-ascend release's), host elsewhere. Checked again as resolved."""
        if self.runtime is not Runtime.auto:
            return self
        on_npus = self._auto_on_npus() if kinds == {DeviceKind.npu} else {"runtime": Runtime.host}
        return self.model_copy(update=on_npus).check()

    def _auto_on_npus(self) -> dict[str, Any]:
        """What runtime auto becomes on NPU hosts: docker, with the image given or the newest release's."""
        return {"runtime": Runtime.docker, "image": self.image or default_npu_image()}

    def _check_runtime(self) -> None:
        if self.runtime is Runtime.auto and all((h.device_kind or self.device_kind) is DeviceKind.npu for h in self.hosts):
            # NPU hosts named as such: resolved here, so every check after this sees the runtime they get
            for key, value in self._auto_on_npus().items():
                setattr(self, key, value)
        if self.runtime is Runtime.docker and not self.image:
            raise SpecError("image", "runtime docker needs an image", "pass --image NAME:TAG or use --runtime host")
        self._check_container()
        for key in self.env:
            if not _ENV_NAME_RE.match(key):
                raise SpecError(f"env.{key}", "is not a valid environment variable name", "use letters, digits and _")
        for field, path in (("ssh.identity", self.ssh.identity), *((f"hosts[{i}].identity", h.identity) for i, h in enumerate(self.hosts))):
            if path and not Path(path).expanduser().is_file():
                raise SpecError(field, f"identity file {path} does not exist", "pass an existing private key with -i")
        if self.ssh.config_file != "~/.ssh/config" and not Path(self.ssh.config_file).expanduser().is_file():
            raise SpecError("ssh.config_file", f"{self.ssh.config_file} does not exist", "pass an existing file to --ssh-config")
        for field, path in (("env_path", self.env_path), ("wheels", self.wheels)):
            if path is not None and not path.startswith("/"):
                raise SpecError(field, f"{path!r} is not an absolute path", "give the directory's absolute path on the hosts")
        if not self.remote_session_root.startswith("/"):
            raise SpecError("remote_session_root", "must be an absolute path", "e.g. /tmp/yrpd_sessions")
        # vLLM binds IPC sockets at $TMPDIR/<uuid4> and TMPDIR is <root>/<session id>/tmp; a unix socket
        # path longer than 107 bytes fails deep inside engine start-up
        longest = len(self.remote_session_root.rstrip("/")) + len("/20261122-181524-3086ce/tmp/") + 36
        if longest > 107:
            raise SpecError("remote_session_root", f"is too long ({len(self.remote_session_root)} characters): vLLM's "
                            f"IPC socket paths under it would exceed the 107-byte limit of unix sockets",
                            f"use a path of at most {107 - longest + len(self.remote_session_root)} characters")

    def _check_container(self) -> None:
        if self.runtime is Runtime.auto:
            return  # resolve_runtime checks again once the hosts' kinds are known
        if self.runtime is not Runtime.docker:
            if self.container_profile is not None:
                raise SpecError("container_profile", "is only used with runtime docker",
                                "drop it, or pass --runtime docker --image NAME:TAG")
            return
        try:
            check_image(self.image)
        except ValueError as exc:
            raise SpecError("image", str(exc), "write it as docker does, e.g. quay.io/ascend/vllm-ascend:v0.10.0rc1-openeuler") from None
        profile = container_profile(self)  # loads and validates it (SpecError naming the profile field)
        if self.kv_connector is KvConnector.ascend_store:
            ascend_store.check(profile.vllm_ascend, profile.name, self.brought_data_system())
            for role, tp, dp in (("prefill", self.prefill_tensor_parallel_size, self.prefill_data_parallel_size), ("decode", self.decode_tensor_parallel_size, self.decode_data_parallel_size)):
                if tp * dp > ascend_store.PORT_BLOCK:
                    raise SpecError("kv_connector", f"ascend-store: a {role} instance of tp {tp} x dp {dp} needs "
                                    f"{tp * dp} Mooncake handshake ports, yrpd reserves {ascend_store.PORT_BLOCK} an "
                                    "instance", f"keep tp x dp at most {ascend_store.PORT_BLOCK}, or use kv_connector: yuanrong")
        py, version = profile.cluster_interpreter
        if self.launcher is ClusterLauncher.yr and version not in YR_PYTHONS:
            raise SpecError("cluster_launcher", f"yr needs Python {' or '.join(YR_PYTHONS)} (openyuanrong's wheels) and "
                            f"the container's is {version} ({py}, profile {profile.name})",
                            "use cluster_launcher: dscli (the default), or name a Python 3.11 of the image as "
                            "cluster_python in a copy of the profile")
        if self.launcher is ClusterLauncher.dscli and version not in DATASYSTEM_PYTHONS:
            raise SpecError("container_profile", f"{profile.name}: the data system's wheels exist for Python "
                            f"{' and '.join(DATASYSTEM_PYTHONS)}, the container's Python is {version} ({py})",
                            "name a Python 3.11 or 3.12 of the image as cluster_python in a copy of the profile")


class DataSystemSection(BaseModel):
    """openYuanrong: its mode, what starts it, and the data system's memory and disk tiers."""

    #: openYuanrong mode: full needs the function system; auto picks by what is installed (dscli: ds_only)
    cluster_mode: ClusterMode = ClusterMode.auto
    #: what starts the data system and etcd: dscli (etcd + one worker per host under yrpd's supervisor, no `yr`
    #: CLI; Python 3.11 or 3.12), yr (openYuanrong's CLI and daemon, Python 3.10/3.11); auto = dscli unless
    #: cluster_mode is full
    cluster_launcher: ClusterLauncher = ClusterLauncher.auto
    #: shared memory of each data system worker (the host-side KV cache), MB
    datasystem_memory_mb: int = Field(1024, ge=64)
    #: disk tier of each data system worker, MB (0: none): what its shared memory cannot hold is spilled here and
    #: read back on a hit, instead of being evicted
    datasystem_spill_mb: int = Field(0, ge=0)
    #: where the disk tier lives on the hosts (a local SSD); default: the session directory (removed by `down`)
    datasystem_spill_dir: str | None = None
    #: with `disaggregated: false`: the instances keep their KV in the data system too (connector kv_both), a
    #: prefix store beyond their own memory (the `single-yr` target of `yrpd bench`)
    single_kv_store: bool = False
    #: a directory here (where yrpd runs) holding openyuanrong-datasystem wheels of the user's, one per Python and
    #: architecture of the hosts: installed instead of the package index's (0.8.1). Their version and client API are
    #: read from the wheels at plan time (yrpd.dswheels): with HeteroClient's multi-buffer calls they serve
    #: `kv_connector: ascend-store` for vllm-ascend 0.27.1rc1 and later
    datasystem_wheels: str | None = None

    @property
    def launcher(self) -> ClusterLauncher:
        """The launcher in effect: auto resolved (yr only where the function system is asked for)."""
        if self.cluster_launcher is not ClusterLauncher.auto:
            return self.cluster_launcher
        return ClusterLauncher.yr if self.cluster_mode is ClusterMode.full else ClusterLauncher.dscli

    @field_validator("datasystem_wheels", mode="after")
    @classmethod
    def _absolute_wheels(cls, value: str | None) -> str | None:
        # kept in the session as an absolute path: a later command from another directory finds the same wheels
        return str(Path(value).expanduser().resolve()) if value else value

    def brought_data_system(self) -> "dswheels.BroughtDataSystem | None":
        """The data system of `datasystem_wheels`, read from its wheels; None: the package index's."""
        return dswheels.bring(self.datasystem_wheels) if self.datasystem_wheels else None

    @property
    def datasystem_version(self) -> str:
        """The openyuanrong-datasystem every host gets: the one brought, else yrpd's pin (the package index's)."""
        brought = self.brought_data_system()
        return brought.version if brought else OPENYUANRONG_DATASYSTEM

    def _check_data_system(self) -> None:
        if self.datasystem_wheels:
            self._check_brought()
        if self.cluster_launcher is ClusterLauncher.dscli and self.cluster_mode is ClusterMode.full:
            raise SpecError("cluster_launcher", "dscli starts the data system alone; full mode needs openYuanrong's "
                            "function system, which only the yr CLI starts", "set cluster_launcher: yr (or auto), or "
                            "cluster_mode: ds_only")

    def _check_brought(self) -> None:
        self.brought_data_system()  # SpecError naming datasystem_wheels where its wheels cannot serve
        if self.runtime is Runtime.host:
            raise SpecError("datasystem_wheels", "brought wheels are installed inside the containers (runtime docker)",
                            "on hosts without containers install them into a prepared environment and give env_path")
        if self.wheels or self.env_path:
            other = "wheels" if self.wheels else "env_path"
            raise SpecError("datasystem_wheels", f"is brought to hosts that have nothing, and {other} says they have "
                            "their own", f"put the data system's wheels into the hosts' {other} instead, or drop it")


# -- what a change of each field does to a running deployment ------------------------------------------
# Fields fall in four kinds (ChangeKind): an instance's own settings (INSTANCE_FIELDS) roll, instance by instance
# (yrpd.reconcile: the new one starts and joins before the old one drains and stops, or the other way round where no
# device is spare); the instance counts (COUNT_FIELDS) scale; a few settings (FREE_FIELDS) take effect without
# restarting anything; everything else (the cluster, the data system, ports, the runtime, a host taken away) cannot
# change under a running deployment and needs `--recreate` (down, then deploy). Hosts added at the end of the list
# join: their data system workers join the cluster, and instances go there where a count change or a later scale
# places them. `yrpd plan` shows the same diff and steps `yrpd deploy` then takes.

#: the fields an instance runs with: a change of them replaces instances one by one
INSTANCE_FIELDS = ("model", "served_model_name", "dtype", "prefix_reuse", "engine_args", "connector",
                   "prefill_engine_args", "decode_engine_args")
#: the instance fields that reach the instances of one role alone: a change of one rolls that role's instances
ROLE_ENGINE_ARGS = {"prefill": "prefill_engine_args", "decode": "decode_engine_args"}


class ChangeKind(str, Enum):
    roll = "roll"  # instances are replaced one by one
    scale = "scale"  # instances are added or removed
    free = "free"  # read by yrpd itself: nothing restarts
    join = "join"  # hosts added after the others: they join the cluster, nothing that runs restarts
    recreate = "recreate"  # cannot change under a running deployment


COUNT_FIELDS = ("prefill", "decode")
#: read where yrpd runs (how to reach the hosts, how long to wait), never by a running process
FREE_FIELDS = ("ssh", "startup_timeout_s", "min_free_disk_gb", "planner")


@dataclass(frozen=True)
class Change:
    field: str
    old: object
    new: object
    kind: ChangeKind

    def line(self) -> str:
        return f"{self.field}: {self.old!r} -> {self.new!r} ({self.kind.value})"


def kind_of(name: str) -> ChangeKind:
    if name in INSTANCE_FIELDS:
        return ChangeKind.roll
    if name in COUNT_FIELDS:
        return ChangeKind.scale
    if name in FREE_FIELDS:
        return ChangeKind.free
    return ChangeKind.recreate


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


class ServingSection(BaseModel):
    """What is served and how: the model, the vLLM instances' settings, the KV connector, the proxy."""

    #: absolute model directory on the hosts, or builtin:smollm2 (the embedded default's) / builtin:tiny-qwen2 /
    #: builtin:bench-qwen2 (`--model`)
    model: str | None = None
    #: what the instances compute and keep KV in; auto = on CPU hosts the fastest dtype of their CPUs (float32
    #: without AVX512-BF16 or with AMX, else bfloat16; builtin:smollm2 float32 on every CPU, its answers need it),
    #: elsewhere the model's own (`--dtype`)
    dtype: Dtype = Dtype.auto
    #: model name clients use; default the model directory's name (`--served-model-name`)
    served_model_name: str | None = None
    #: prefill instances also load prefixes stored earlier (connector role kv_both instead of kv_producer)
    prefix_reuse: bool = True
    #: extra `vllm serve` arguments, after yrpd's own (the last occurrence of a flag wins)
    engine_args: list[str] = []
    #: more `vllm serve` arguments for the prefill instances alone, after engine_args (PD recipes size the two roles
    #: apart: a decode instance holds every running request's KV, a prefill instance only those it computes)
    prefill_engine_args: list[str] = []
    #: the same for the decode instances alone
    decode_engine_args: list[str] = []
    #: the KV connector: yrpd's own through the data system; vLLM's reference `ExampleConnector` (safetensors
    #: files under the session directory, one host only; the `peer-example-pd` target of `yrpd bench`); or
    #: `lmcache`, LMCache's multi-process server as the store of plain instances (`disaggregated: false`; CPU
    #: hosts, LMCache in its own venv <env_root>/lmcache; the `peer-lmcache` target of `yrpd bench`); or `nixl`,
    #: vLLM's NixlConnector: decode pulls the prompt's blocks from prefill over UCX, nothing kept beyond the
    #: instances (PD on CPU hosts, NIXL in its own venv <env_root>/nixl; the `peer-nixl-pd` target)
    kv_connector: KvConnector = KvConnector.yuanrong
    #: overrides for the connector's kv_connector_extra_config (docs/dev/connector.md lists the keys); a key the
    #: connector does not know, or a value it would refuse, is refused before any host is touched
    connector: dict[str, Any] = {}
    #: how the proxy picks an instance: `prefix` (cache-aware) sends a prefill leg where it costs least: the
    #: prompt's chunks that instance was never sent (counted twice) plus the chunks queued there, in the time each
    #: instance was measured to take per chunk, so a request goes back to the instance that likely holds its prefix
    #: unless that one is busy with more than the prefix saves;
    #: `load` goes by requests in flight alone. Neither sends a leg to an instance `routing_bound` busier than the
    #: least busy one. Default prefix: measured even with load routing where the data system holds every prefix, and
    #: with half the prefill work where it holds fewer than are reused (docs/benchmarks.md, "Cache-aware")
    routing: Routing = Routing.prefix
    routing_bound: int = Field(2, ge=1, le=1000)
    #: with prefix routing, follow what the instances' KV-cache events say their prefix caches hold (vLLM's
    #: publisher on unix sockets beside each instance; docs/dev/kv-events.md); off: prefix routing estimates it from
    #: what it sent where. `round-robin` routing sends each leg to the next instance in turn (a benchmark's baseline)
    routing_kv_events: bool = True
    #: with the events followed: before each leg is routed, the proxy also fetches what they have not delivered yet
    #: from the replay socket of each instance whose copy lacks the last block of a leg that ended there, so it
    #: routes on the caches exactly as they are (the `pd-oracle` target of `yrpd bench`)
    routing_kv_exact: bool = False
    #: with the events followed: the data system's workers publish what they hold of the connector's blocks, and the
    #: proxy counts a prompt's blocks held there as loads found for sure instead of estimating how often such loads
    #: were found (docs/dev/kv-events.md; off: the `pd-nostore` target of `yrpd bench`)
    routing_store_events: bool = True
    #: address the proxy listens on; default the master's cluster address (127.0.0.1 for localhost)
    proxy_host: str | None = None
    #: name of an environment variable (read where yrpd runs) holding the proxy's API key
    api_key_env: str | None = None

    @property
    def follows_kv_events(self) -> bool:
        """The proxy routes on what the caches say they hold: a PD deployment's prefix routing with the events on
        (each instance's own cache from vLLM's events; the data system's holdings from its workers' own, where the
        connector is yrpd's, whose keys they name)."""
        return self.disaggregated and self.routing is Routing.prefix and self.routing_kv_events

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        model = self.model or BUILTIN_MODEL
        return model.rstrip("/").rsplit("/", 1)[-1].removeprefix("builtin:")

    def engine_args_of(self, role: str) -> list[str]:
        """The extra `vllm serve` arguments of an instance of `role`: engine_args, then its role's own."""
        field = ROLE_ENGINE_ARGS.get(role)
        return [*self.engine_args, *(getattr(self, field) if field else [])]

    def instance_config(self, role: str) -> str:
        """Digest of what an instance of `role` runs with (INSTANCE_FIELDS, of the role fields its own alone): an
        instance started with another one is replaced by a rolling change (yrpd.reconcile). Without role arguments it
        is the digest sessions recorded before those existed, so they do not roll for nothing."""
        fields = {k: getattr(self, k) for k in INSTANCE_FIELDS if k not in ROLE_ENGINE_ARGS.values()}
        own = ROLE_ENGINE_ARGS.get(role)
        if own and getattr(self, own):
            fields[own] = getattr(self, own)
        return _digest(fields)

    @property
    def model_group(self) -> str:
        """The served name and a digest of the weights and dtype behind it: the proxy pairs a prefill with a decode
        instance of one group only, so an answer never mixes two models while a model change rolls."""
        return f"{self.model_name}#{_digest([self.model or BUILTIN_MODEL, self.dtype.value])[:8]}"

    @property
    def builtin_model(self) -> str | None:
        """Name of the built-in model the hosts build and serve, if the spec asks for one."""
        model = self.model or (BUILTIN_MODEL if self.is_embedded_default else None)
        return model.removeprefix("builtin:") if model and model.startswith("builtin:") else None

    @property
    def is_embedded_default(self) -> bool:
        """One local host on CPU: the demo deployment that needs no model path."""
        return len(self.hosts) == 1 and self.hosts[0].is_local and self.device_kind in (DeviceKind.auto, DeviceKind.cpu)

    def proxy_key(self) -> str | None:
        """The proxy's API key, read where yrpd runs from the variable `api_key_env` names (None: no key)."""
        return (os.environ.get(self.api_key_env) or None) if self.api_key_env else None

    def _check_shapes(self) -> None:
        """Each role's TP x PP against the built-in model's heads and layers, and prefill's shape against decode's
        where the connector hands KV over per rank."""
        roles = ("prefill", "decode") if self.disaggregated else ("single",)
        shape = self.builtin_model and BUILTIN_SHAPES.get(self.builtin_model)
        for role in roles:
            tp, pp = self.parallelism(role)[0], self.pipeline(role)
            short = "p" if role != "decode" else "d"
            if shape and shape[0] % tp:
                raise SpecError(f"{'decode' if role == 'decode' else 'prefill'}_tensor_parallel_size",
                                f"builtin:{self.builtin_model} has {shape[0]} attention heads, which {tp} does not "
                                "divide", f"use --{short}tp " + " or ".join(
                                    str(d) for d in range(1, shape[0] + 1) if shape[0] % d == 0))
            if shape and pp > shape[1]:
                raise SpecError(f"{'decode' if role == 'decode' else 'prefill'}_pipeline_parallel_size",
                                f"builtin:{self.builtin_model} has {shape[1]} layers, fewer than {pp} stages",
                                f"use --{short}pp {shape[1]} or less")
        if self.disaggregated and self.kv_connector is KvConnector.yuanrong:
            ps = (self.prefill_tensor_parallel_size, self.prefill_pipeline_parallel_size)
            ds = (self.decode_tensor_parallel_size, self.decode_pipeline_parallel_size)
            if ps != ds:
                raise SpecError("decode_tensor_parallel_size" if ps[0] != ds[0] else "decode_pipeline_parallel_size",
                                f"the yuanrong connector keys KV by TP rank and PP stage: decode (tp {ds[0]}, pp "
                                f"{ds[1]}) would find none of prefill's (tp {ps[0]}, pp {ps[1]}) blocks",
                                "give decode prefill's TP and PP sizes (DP may differ), or kv_connector: ascend-store")

    def _check_serving(self) -> None:
        if self.model is None and not self.is_embedded_default:
            raise SpecError(
                "model", "no model path given", "pass --model /path/on/hosts or set model: in yrpd.yaml"
            )
        if self.model is not None and self.model.startswith("builtin:"):
            if self.model.removeprefix("builtin:") not in BUILTIN_MODELS:
                raise SpecError("model", f"{self.model!r} is not a built-in model",
                                "use " + " or ".join(f"builtin:{n}" for n in BUILTIN_MODELS) + ", or an absolute path")
        if self.model is not None and not self.model.startswith("builtin:") and not self.model.startswith("/"):
            raise SpecError("model", f"{self.model!r} is not an absolute path", "give the model directory's absolute path on the hosts")
        self._check_shapes()
        if self.served_model_name is not None and not re.match(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$", self.served_model_name):
            raise SpecError("served_model_name", f"{self.served_model_name!r} is not a usable name", "use letters, digits, . _ - /")
        if self.kv_connector is KvConnector.example and len(self.hosts) > 1:
            raise SpecError("kv_connector", "example shares KV through files, which only one host can see",
                            "deploy it on one host, or use kv_connector: yuanrong")
        if self.kv_connector is KvConnector.ascend_store and self.runtime is Runtime.host:
            raise SpecError("kv_connector", "ascend-store is vllm-ascend's own connector: it runs in the vllm-ascend "
                            "image", "deploy NPU hosts with runtime docker (the default there), or use kv_connector: "
                            "yuanrong")
        if self.kv_connector is KvConnector.nixl and not self.disaggregated:
            raise SpecError("kv_connector", "nixl hands KV from prefill to decode: it needs a PD deployment",
                            "set disaggregated: true with it, or use kv_connector: yuanrong")
        if self.kv_connector is KvConnector.lmcache and self.disaggregated:
            raise SpecError("kv_connector", "lmcache is a prefix store for plain instances here, not a PD handoff",
                            "set disaggregated: false with it, or use kv_connector: yuanrong")
        try:
            user_settings(self.connector)
        except ConfigError as e:
            raise SpecError("connector", str(e), "docs/dev/connector.md lists the keys and their ranges") from None
        owned = ("--port", "--host", "--served-model-name", "--kv-transfer-config", "--tensor-parallel-size",
                 "--data-parallel-size", "--headless", "--dtype", "--pipeline-parallel-size", "--nnodes",
                 "--node-rank", "--master-addr", "--master-port", "--distributed-executor-backend")
        given = [f for f in ROLE_ENGINE_ARGS.values() if getattr(self, f)]
        if given and not self.disaggregated:
            raise SpecError(given[0], "set for one PD role's instances, but disaggregated: false runs one plain "
                            "instance", "put the flags in engine_args, or deploy PD (disaggregated: true)")
        for field in ("engine_args", *ROLE_ENGINE_ARGS.values()):
            for arg in getattr(self, field):
                flag = arg.split("=", 1)[0]
                if flag in owned:
                    raise SpecError(field, f"{flag} is set by yrpd from the plan",
                                    "use the spec field instead (ports, served_model_name, ptp/dtp, pdp/ddp, "
                                    "connector, dtype)")
        if self.proxy_host is not None:
            try:
                ipaddress.ip_address(self.proxy_host)
            except ValueError:
                raise SpecError("proxy_host", f"{self.proxy_host!r} is not an IP address",
                                "give the address to listen on, e.g. 0.0.0.0") from None
        if self.api_key_env is not None:
            if not _ENV_NAME_RE.match(self.api_key_env):
                raise SpecError("api_key_env", f"{self.api_key_env!r} is not an environment variable name",
                                "name the variable that holds the key, e.g. YRPD_API_KEY")
            if not self.proxy_key():
                raise SpecError("api_key_env", f"${self.api_key_env} is not set or empty here",
                                f"export {self.api_key_env}=<key> before running yrpd")



class DeploySpec(TopologySection, RuntimeSection, DataSystemSection, ServingSection):
    """Everything a deployment needs; serialised into the session so status/logs/down can reuse it. Its settings
    come in sections (one flat mapping in a config file); each section checks its own, in this order, each seeing
    what the earlier ones settled (raise SpecError: one line, field + fix)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def check(self) -> "DeploySpec":
        self._check_topology()
        self._check_data_system()
        self._check_runtime()
        self._check_serving()
        return self

    def fingerprint(self) -> str:
        """Identity of a deployment: everything in the spec but how the hosts are reached (ssh settings may change)."""
        data = self.model_dump(mode="json", exclude={"ssh"})
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]




# -- a changed spec against a running one ------------------------------------------------------------

def spec_diff(old: DeploySpec, new: DeploySpec) -> list[Change]:
    """Every top-level spec field whose value differs, in the spec's field order (hosts by name)."""
    a, b = old.model_dump(mode="json"), new.model_dump(mode="json")
    changes = []
    for k in b:
        if a.get(k) == b.get(k):
            continue
        if k == "hosts":
            names = [h.name for h in old.hosts], [h.name for h in new.hosts]
            if joined_hosts(old, new):
                changes.append(Change(k, *names, ChangeKind.join))
            elif names[0] != names[1]:
                changes.append(Change(k, *names, ChangeKind.recreate))
            else:  # the same hosts with other settings: show those
                was, now = _set(a[k]), _set(b[k])
                changes.append(Change(k, [h for h in was if h not in now], [h for h in now if h not in was],
                                      ChangeKind.recreate))
        else:
            changes.append(Change(k, a.get(k), b.get(k), kind_of(k)))
    return changes


def _set(hosts: list[dict]) -> list[dict]:
    """Host entries with only the settings given (None left out), for a readable diff line."""
    return [{k: v for k, v in h.items() if v is not None} for h in hosts]


def joined_hosts(old: DeploySpec, new: DeploySpec) -> list[str]:
    """The hosts `new` adds after all of `old`'s, each of those unchanged and in its place (so the master stays);
    [] where the lists differ any other way."""
    before, after = old.model_dump(mode="json")["hosts"], new.model_dump(mode="json")["hosts"]
    if len(after) <= len(before) or after[:len(before)] != before:
        return []
    return [h.name for h in new.hosts[len(before):]]


def refuse_unrollable(changes: list[Change], session_id: str) -> None:
    blocked = [c.field for c in changes if c.kind is ChangeKind.recreate]
    if blocked:
        raise SpecError("deploy", f"session {session_id} is running and {', '.join(blocked)} cannot change under it "
                        "(only instance settings roll, instance counts scale and hosts added after the others join)",
                        "pass --recreate to tear it down and deploy anew (requests fail meanwhile), or undo that change")


# -- loading -----------------------------------------------------------------------------------

def stored_spec(data: dict[str, Any]) -> DeploySpec:
    """The spec a session stored. Sessions deployed before `cluster_launcher` existed ran openYuanrong's `yr` CLI:
    their status and teardown must keep reading it that way."""
    return DeploySpec.model_validate({"cluster_launcher": ClusterLauncher.yr.value, **data})


def load_config_file(path: str | None) -> dict[str, Any]:
    """Read the YAML config. An explicit path must exist; the default yrpd.yaml is optional."""
    if path is None:
        default = Path(DEFAULT_CONFIG_NAME)
        if not default.is_file():
            return {}
        path = str(default)
    file = Path(path).expanduser()
    if not file.is_file():
        raise SpecError("--config", f"{path} does not exist", "pass the path of an existing yrpd.yaml")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise SpecError("--config", f"{path} is not valid YAML{where}: {problem}", "fix the file's syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecError("--config", f"{path} must hold a mapping of settings, not {type(data).__name__}", "see docs/configuration.md")
    return data


def merge_hosts(config_hosts: list[Any] | None, flag_hosts: str | None) -> list[Any] | None:
    """`--hosts` replaces the list, but keeps per-host settings the config file gives for the same host."""
    if flag_hosts is None:
        return config_hosts
    by_address: dict[str, dict[str, Any]] = {}
    for entry in config_hosts or []:
        if isinstance(entry, dict) and "address" in entry:
            by_address[str(entry["address"])] = entry
            try:
                by_address[HostSpec(address=str(entry["address"])).name] = entry
            except (SpecError, ValidationError):
                pass
    merged: list[Any] = []
    for raw in flag_hosts.split(","):
        name = raw.strip()
        entry = by_address.get(name)
        merged.append(dict(entry, address=name) if entry else name)
    return merged


def build_spec(config: dict[str, Any], overrides: dict[str, Any]) -> DeploySpec:
    """Config mapping + flag overrides (None means 'not given') -> a checked DeploySpec."""
    data = dict(config)
    flags = {k: v for k, v in overrides.items() if v is not None}
    if "hosts" in flags:
        data["hosts"] = merge_hosts(data.get("hosts"), flags.pop("hosts"))
    for key in ("ssh", "ports"):
        nested = flags.pop(key, None)
        if nested:
            base = data.get(key) or {}
            if not isinstance(base, dict):
                raise SpecError(key, "must be a mapping", f"write {key}: with one setting per line")
            data[key] = {**base, **{k: v for k, v in nested.items() if v is not None}}
    if "env" in flags:
        data["env"] = {**(data.get("env") or {}), **flags.pop("env")}
    for field, short in PARALLEL_ALIASES.items():
        if field in flags:  # a flag overrides the config file's setting under either name
            data.pop(short, None)
    data.update(flags)
    if "hosts" not in data:
        raise SpecError("hosts", "no hosts given", "pass --hosts h1,h2 or list hosts: in yrpd.yaml")
    try:
        spec = DeploySpec.model_validate(data)
    except SpecError:
        raise
    except ValidationError as exc:
        raise _one_line(exc) from None
    return spec.check()


#: the flags for the SSH settings (every command that reaches hosts has them): flag -> SshOptions field
SSH_FLAGS = {"ssh_config": "config_file", "identity": "identity", "known_hosts": "known_hosts",
             "accept_new_host_keys": "accept_new_host_keys"}


def ssh_from_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """The SSH settings the flags give (None: not given)."""
    return {field: flags.get(flag) for flag, field in SSH_FLAGS.items()}


def spec_from_flags(flags: Mapping[str, Any]) -> DeploySpec:
    """`yrpd deploy`'s and `yrpd plan`'s flags over the config file (`--config`, else ./yrpd.yaml if present) -> a
    checked DeploySpec; SpecError (exit 2) on any problem, before any host is touched. A flag is named as the field
    it sets (a parallelism field by its short name too); the others are `--config`, `--env`, `--proxy-port` and the
    SSH flags."""
    overrides = {name: flags[name] for name in DeploySpec.model_fields if name in flags}
    overrides |= {field: flags[short] for field, short in PARALLEL_ALIASES.items() if short in flags}
    overrides["env"] = _env_pairs(flags.get("env_pairs") or ())
    overrides["ports"] = {"proxy": flags.get("proxy_port")}
    overrides["ssh"] = ssh_from_flags(flags)
    return build_spec(load_config_file(flags.get("config_file")), overrides)


def _env_pairs(pairs: Iterable[str]) -> dict[str, str] | None:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SpecError("--env", f"{pair!r} is not KEY=VALUE", "write --env NAME=value")
        env[key] = value
    return env or None


def _one_line(exc: ValidationError) -> SpecError:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
    msg = err["msg"].removeprefix("Value error, ")
    sub = re.match(r"^([a-z_]+): (.*)$", msg)
    if sub and err["type"] == "value_error":  # a model validator naming the sub-field it rejects
        loc = f"{loc}.{sub.group(1)}" if loc else sub.group(1)
        msg = sub.group(2)
    if err["type"] == "extra_forbidden":
        return SpecError(loc, "is not a known setting", "check the spelling against docs/configuration.md")
    if err["type"] == "missing":
        return SpecError(loc, "is required", f"set {loc} in yrpd.yaml")
    given = err.get("input")
    shown = f" (got {given!r})" if isinstance(given, (str, int, float)) else ""
    return SpecError(loc or "config", f"{msg}{shown}", _fix_for(loc))


def _fix_for(loc: str) -> str:
    hints = {
        "device_kind": "use auto, npu, gpu or cpu",
        "runtime": "use auto, docker or host",
        "container_engine": "use docker or podman",
        "cluster_mode": "use auto, full or ds_only",
        "cluster_launcher": "use auto, dscli or yr",
        "dtype": "use auto, float32, bfloat16 or float16",
    }
    if loc in hints:
        return hints[loc]
    if loc.startswith("ports"):
        return "pick ports in 1-65535 whose ranges do not overlap"
    if loc in ("prefill", "decode"):
        return f"give --{loc} a whole number from 1 to 64"
    if loc in PARALLEL_ALIASES or loc in PARALLEL_ALIASES.values():
        return f"give --{PARALLEL_ALIASES.get(loc, loc)} a whole number from 1 to 64"
    return "see docs/configuration.md"
