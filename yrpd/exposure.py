"""Who may reach each port a deployment opens, and what checks a caller there: the table `yrpd plan` prints and
docs/security.md explains. Pure: a function of the spec and the plan.

What is protected: the proxy (the user's API key, where `api_key_env` is set), every vLLM instance (the
deployment's own token on /v1), the data system's master and workers (CURVE keys) and etcd (TLS with client
certificates of a CA made per session; yrpd.credentials). What is not: the coordination ports of a DP group that
spans hosts and the NPUs' collective ports. Those listen on each host's cluster address only, never on all addresses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum

from yrpd.placement import InstancePlan, Plan
from yrpd.spec import DeploySpec, DeviceKind, KvConnector, MultiNodeBackend
from yrpd.ascend_store import handover_port
from yrpd.ports import INSTANCE_PORT_BLOCK
from yrpd.serving import ray_ports


class Guard(str, Enum):
    """What a caller must present."""

    api_key = "the proxy's API key"
    token = "the deployment's token on /v1 (/health, /metrics open)"
    curve = "the deployment's CURVE key (ZeroMQ CURVE, the data system's own check)"
    certificate = "a client certificate of the deployment's CA (TLS)"
    nothing = "nothing: NOT protected"
    loopback = "nothing, but it listens on 127.0.0.1 only"


@dataclass(frozen=True)
class PortAccess:
    host: str
    port: str  # one port or a range
    what: str
    listens_on: str
    callers: str  # who needs to reach it
    guard: Guard

    def to_dict(self) -> dict:
        return {**asdict(self), "guard": self.guard.value}


def exposure(spec: DeploySpec, plan: Plan) -> list[PortAccess]:
    ip = {h.name: h.reach_ip for h in plan.hosts}
    kind = {h.name: h.kind for h in plan.hosts}
    rows: list[PortAccess] = []
    if spec.disaggregated:
        bind = spec.proxy_host or ip[plan.proxy_host]
        rows.append(PortAccess(plan.proxy_host, str(plan.proxy_port), "proxy (OpenAI API)", bind, "clients",
                               Guard.api_key if spec.api_key_env else _open(bind)))
    callers = "the proxy, yrpd status/bench" if spec.disaggregated else "clients (with the token), yrpd status/bench"
    for inst in plan.instances:
        rows.append(PortAccess(inst.host, str(inst.port), f"{inst.name} (vLLM API)", ip[inst.host], callers,
                               Guard.token))
        if spec.kv_connector is KvConnector.ascend_store and spec.disaggregated:
            first = handover_port(spec.ports, inst)
            rows.append(PortAccess(inst.host, f"{first}-{first + inst.tp * inst.dp - 1}",
                                   f"{inst.name} Mooncake KV hand-over (vllm-ascend's MooncakeConnectorV1)",
                                   ip[inst.host], "the other role's instances", _open(ip[inst.host])))
        others = ", ".join(h for h in inst.hosts if h != inst.host)
        if inst.split:
            rows += _split_rows(spec, inst, ip, spec.multi_node(kind[inst.host]), others)
        elif inst.spans_hosts:
            rows.append(PortAccess(inst.host, str(inst.kv_port), f"{inst.name} DP coordination (and ports vLLM "
                                   "picks for its engine sockets)", ip[inst.host], f"its DP ranks on {others}",
                                   _open(ip[inst.host])))
        if kind[inst.host] is DeviceKind.npu and inst.split:
            for h in inst.hosts:
                first = spec.ports.hccl_base + INSTANCE_PORT_BLOCK * inst.slot_on(h, spec.ports.instance_base)
                rows.append(PortAccess(h, f"{first}-{first + INSTANCE_PORT_BLOCK - 1}", f"{inst.name} HCCL", ip[h],
                                       f"its NPU ranks on {', '.join(inst.hosts)}", _open(ip[h])))
        elif kind[inst.host] is DeviceKind.npu:
            rows.append(PortAccess(inst.host, f"{inst.hccl_port}-{inst.hccl_port + 15}", f"{inst.name} HCCL",
                                   ip[inst.host], "its own NPU ranks", _open(ip[inst.host])))
    for h in plan.hosts:
        for name, port in h.ports.items():
            if name == "proxy":
                continue
            if name.startswith("lmcache"):
                rows.append(PortAccess(h.name, str(port), f"LMCache server ({name})", "127.0.0.1",
                                       "the instances on this host", Guard.loopback))
                continue
            what, callers = {
                "etcd": ("etcd client port (cluster metadata)", "openYuanrong on every host"),
                "etcd_peer": ("etcd peer port", "etcd members"),
                "ds_master": ("data system master", "data system workers"),
                "datasystem": ("data system worker (the KV cache)", "instances on every host, other workers"),
                "exporter": ("metrics exporter (read-only: the data system's and the connector's figures)",
                             "the fleet's Prometheus (`yrpd metrics targets`)"),
            }.get(name, (name, "the deployment"))
            guard = Guard.curve if name in ("ds_master", "datasystem") else \
                Guard.certificate if name in ("etcd", "etcd_peer") else _open(h.reach_ip)
            rows.append(PortAccess(h.name, str(port), what, h.reach_ip, callers, guard))
    return rows


def _split_rows(spec: DeploySpec, inst: InstancePlan, ip: dict[str, str], backend: MultiNodeBackend,
                others: str) -> list[PortAccess]:
    """The ports of an instance whose TP x PP group spans hosts: its rendezvous or Ray's, and its gang's."""
    rows = []
    slots = {h: inst.slot_on(h, spec.ports.instance_base) for h in inst.hosts}
    if backend is MultiNodeBackend.mp:
        rows.append(PortAccess(inst.host, str(inst.kv_port), f"{inst.name} rendezvous (torch's store in rank 0; "
                               "vLLM's message queues and gloo pick ports of their own)", ip[inst.host],
                               f"its ranks on {others}", _open(ip[inst.host])))
    for h in inst.hosts:
        if backend is MultiNodeBackend.ray:
            ports = ray_ports(spec, slots[h])
            first, last = min(ports.values()), max(ports.values())
            rows.append(PortAccess(h, f"{first}-{last}", f"{inst.name} Ray node ({'head: GCS ' + str(first) if h == inst.host else 'worker'}"
                                   "; its workers take Ray's range 10002-19999)", ip[h],
                                   f"the Ray nodes of {inst.name} on {', '.join(inst.hosts)}", _open(ip[h])))
        if h != inst.host or backend is MultiNodeBackend.ray:
            rows.append(PortAccess(h, str(spec.ports.kv_base + slots[h]), f"{inst.name} supervisor (its gang: one "
                                   "dead process restarts the instance)", ip[h], f"the supervisor leading {inst.name} "
                                   f"(on {inst.host})", _open(ip[h])))
    return rows


def _open(address: str) -> Guard:
    """An unchecked port: at least say when only this host can reach it."""
    return Guard.loopback if address.startswith("127.") else Guard.nothing
