"""Placement planner: which host and devices each prefill/decode instance gets, its ports, and the dtype all of them
compute in.

Pure and deterministic: the same spec and inventory always give the same plan.

Rules (documented in docs/architecture.md):
- Every instance has `dp` data-parallel ranks; every rank is one group of `tp` x `pp` devices (tensor x
  pipeline parallel) on one host where a host has room for it. DP ranks of one instance may be on several hosts.
- A group no host has room for spans hosts when the instance has one DP rank: the fewest hosts that can hold equal
  shares of its ranks (the hosts with most free devices, taken in host order: ranks contiguous, the first host is
  its head). Equal shares because vLLM's launchers run the same number of ranks on every node.
- Instances are placed prefill first, then decode, in index order. A rank goes to the host with the most
  free devices (ties: host order), except that later ranks of an instance stay on the host of its previous
  rank while it has room. This spreads prefill and decode over hosts: with two 8-NPU hosts and
  ptp=dtp=4, prefill-0 gets h1 0-3 and decode-0 gets h2 0-3.
- A rank takes the lowest free device ids of its host.
- Ports are counted per host: the k-th (instance, host) pair on a host gets instance_base+k (HTTP),
  kv_base+k (DP rpc port of a group spanning hosts) and hccl_base+16k (a block of 16 for collective communication).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Iterable

from yrpd.models import CPU_DTYPE
from yrpd.errors import SpecError
from yrpd.ports import INSTANCE_PORT_BLOCK, RAY_PORT_BLOCK
from yrpd.spec import (COUNT_FIELDS, ClusterLauncher, DeploySpec, DeviceKind, Dtype, KvConnector, MultiNodeBackend,
                       format_device_list)


@dataclass(frozen=True)
class HostInventory:
    """What a host offers: its device kind (or auto when not yet detected) and device ids."""

    kind: DeviceKind
    devices: tuple[int, ...]
    ip: str | None = None  # address other hosts reach it at; None until resolved
    cpu_bf16: bool | None = None  # its CPU has bf16 instructions; None until detected
    arch: str | None = None  # `uname -m` (x86_64, aarch64); None until detected
    nic: str | None = None  # the interface that holds `ip`; None until detected


@dataclass(frozen=True)
class RankPlacement:
    host: str
    dp_rank: int
    devices: tuple[int, ...]


@dataclass(frozen=True)
class InstancePlan:
    name: str
    role: str  # "prefill" | "decode"
    index: int
    tp: int
    dp: int
    host: str  # head host: where its HTTP server listens
    ranks: tuple[RankPlacement, ...]
    port: int
    kv_port: int
    hccl_port: int
    pp: int = 1
    #: the port slot it holds on each of its other hosts (a headless node's, or a Ray node's, ports count from it)
    node_slots: tuple[tuple[str, int], ...] = ()
    #: what it was started with (DeploySpec.instance_config) and the model group it answers for (model_group):
    #: instances of one deployment differ while a rolling change replaces them one by one
    config: str = ""
    group: str = ""

    @property
    def devices(self) -> tuple[int, ...]:
        """Devices on the head host (all of them when the instance lives on one host)."""
        return tuple(d for r in self.ranks if r.host == self.host for d in r.devices)

    @property
    def spans_hosts(self) -> bool:
        """Its ranks run on more than one host: its DP ranks (vLLM's DP coordination then listens on the head's
        cluster address, its rpc port is kv_port; on one host it stays on 127.0.0.1), or its one TP x PP group
        (`split`)."""
        return len(self.hosts) > 1

    @property
    def split(self) -> bool:
        """Its TP x PP group spans hosts (one DP rank over several hosts): one vLLM world over the network."""
        return len({r.host for r in self.ranks if r.dp_rank == 0}) > 1

    @property
    def node_ranks(self) -> int:
        """TP x PP ranks on each of its hosts: a group's share where it is split, else a whole group."""
        return self.tp * self.pp // (len(self.hosts) if self.split else 1)

    def slot_on(self, host: str, instance_base: int) -> int:
        """Its port slot on `host`, one of its hosts: the head's from its HTTP port, another's as placed there."""
        return dict(self.node_slots).get(host, self.port - instance_base)

    @property
    def hosts(self) -> tuple[str, ...]:
        seen: list[str] = []
        for r in self.ranks:
            if r.host not in seen:
                seen.append(r.host)
        return tuple(seen)


@dataclass(frozen=True)
class HostPlan:
    name: str
    address: str
    is_master: bool
    kind: DeviceKind
    devices: tuple[int, ...]
    used: tuple[int, ...]
    ports: dict[str, int] = field(default_factory=dict)
    ip: str | None = None  # None only in a plan made where the host's name does not resolve (deploy needs `ip:`)
    arch: str | None = None
    nic: str | None = None  # the interface that holds `ip` (spec `nic`, else detected)

    #: shown in place of an address that could not be resolved (TEST-NET-1: routes nowhere)
    UNRESOLVED = "192.0.2.1"

    @property
    def reach_ip(self) -> str:
        """The address other hosts, and the processes yrpd starts, use to reach this host."""
        return self.ip or self.UNRESOLVED


# -- the dtype -------------------------------------------------------------------------------------
# Which dtype the instances compute (and keep KV) in: pure, from the spec and the hosts' inventory.
#
# One dtype per deployment: every prefill instance hands KV to every decode instance, and KV of another dtype is
# useless to the receiver. On CPU hosts `auto` picks what their CPUs compute fastest. Measured with vLLM's CPU build
# (SmolLM2-135M, one core, 2.5k-token prompt, prefix caching off; docs/dev/notes.md, issue 12):
# - AMD EPYC without AVX512-BF16 (Zen 3): uncached prefill 72 s in bfloat16 vs 15 s in float32 (4.8x), decode
#   1.2x faster in bfloat16 (memory-bound): float32 serves long prompts far better.
# - AMD EPYC with AVX512-BF16 (Zen 4): prefill 6.3 s in bfloat16 vs 8.6 s in float32, decode 41 vs 64 ms per
#   token: bfloat16 wins both.
# - Intel Xeon with AMX: vLLM routes bfloat16 attention to its AMX kernels. On one such machine SmolLM2's greedy answers
#   changed (session 11); on another the decode instance's worker died of an illegal instruction in
#   `cpu_attention_with_kv_cache` on its first request over loaded KV (session 13, faulthandler). float32 there.
# NPU and GPU hosts keep the model's own dtype (vLLM's `auto`).

BF16_FLAGS = "AVX512-BF16 (without AMX)"


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str | None  # what `vllm serve --dtype` gets; None = vLLM's own choice (the model's dtype)
    reason: str

    @property
    def shown(self) -> str:
        return self.dtype or "the model's"


def choose_dtype(requested: Dtype, kind: DeviceKind, cpu_bf16: dict[str, bool | None],
                 pinned: tuple[str, str] | None = None) -> DtypeChoice:
    """`cpu_bf16`: for each host that runs an instance, whether its CPU has bf16 instructions (None: unknown);
    `pinned`: (dtype, why) of a model that must be served in that dtype on CPUs (yrpd.models.CPU_DTYPE)."""
    if requested is not Dtype.auto:
        return DtypeChoice(requested.value, "set with --dtype")
    if kind is not DeviceKind.cpu:
        return DtypeChoice(None, "auto: the model's own dtype (vLLM's auto)")
    if pinned is not None:
        return DtypeChoice(pinned[0], f"auto: the model is served in {pinned[0]} on every CPU: {pinned[1]}")
    lacking = sorted(h for h, has in cpu_bf16.items() if has is False)
    unknown = sorted(h for h, has in cpu_bf16.items() if has is None)
    if lacking:
        return DtypeChoice("float32", f"auto: the CPU of {', '.join(lacking)} has no AVX512-BF16, so bfloat16 is "
                                      "emulated there (prefill measured 4.8x slower than float32), or it has AMX, "
                                      "where vLLM's CPU build runs bfloat16 attention in AMX kernels that failed on "
                                      "every AMX machine measured (wrong answers; an illegal instruction)")
    if unknown:
        return DtypeChoice("float32", f"auto: the CPU features of {', '.join(unknown)} were not detected; float32 is "
                                      "right on every CPU")
    return DtypeChoice("bfloat16", f"auto: every CPU has {BF16_FLAGS}, where bfloat16 measured faster than "
                                   "float32 in prefill and decode")


@dataclass(frozen=True)
class Plan:
    hosts: tuple[HostPlan, ...]
    instances: tuple[InstancePlan, ...]
    proxy_host: str
    proxy_port: int
    dtype: DtypeChoice = DtypeChoice(None, "not chosen")

    def serves(self, host: str) -> bool:
        """Whether the host runs an instance (any of its ranks) or the proxy: both need vLLM's Python there."""
        return host == self.proxy_host or any(host in i.hosts for i in self.instances)

    def to_dict(self) -> dict:
        return {
            "hosts": [
                {
                    "name": h.name,
                    "address": h.address,
                    "master": h.is_master,
                    "device_kind": h.kind.value,
                    "devices": list(h.devices),
                    "used_devices": list(h.used),
                    "ports": dict(h.ports),
                    "ip": h.ip,
                    "arch": h.arch,
                    "nic": h.nic,
                }
                for h in self.hosts
            ],
            "instances": [
                {
                    "name": i.name,
                    "role": i.role,
                    "index": i.index,
                    "host": i.host,
                    "devices": list(i.devices),
                    "tp": i.tp,
                    "dp": i.dp,
                    "pp": i.pp,
                    "port": i.port,
                    "kv_port": i.kv_port,
                    "hccl_port": i.hccl_port,
                    "config": i.config,
                    "group": i.group,
                    "node_slots": [list(x) for x in i.node_slots],
                    "ranks": [asdict(r) | {"devices": list(r.devices)} for r in i.ranks],
                }
                for i in self.instances
            ],
            "proxy": {"host": self.proxy_host, "port": self.proxy_port},
            "dtype": {"dtype": self.dtype.dtype, "reason": self.dtype.reason},
        }

    def instance(self, name: str) -> InstancePlan:
        for inst in self.instances:
            if inst.name == name:
                return inst
        raise KeyError(name)

    def host(self, name: str) -> HostPlan:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)


def unit_name(kind: DeviceKind) -> str:
    return {DeviceKind.npu: "NPUs", DeviceKind.gpu: "GPUs", DeviceKind.cpu: "CPU cores"}.get(kind, "devices")


@dataclass(frozen=True)
class RoleRequest:
    """What the spec asks of one role: `count` instances of `dp` ranks of `tp` devices each."""

    role: str  # prefill | decode | single
    count: int
    tp: int
    dp: int
    tp_field: str  # the spec field that sets tp, for error messages
    pp: int = 1

    @property
    def world(self) -> int:
        """Devices of one of its groups (TP x PP ranks, one device each)."""
        return self.tp * self.pp


@dataclass(frozen=True)
class PlacedInstance:
    """An instance whose ranks have devices, before ports are assigned."""

    name: str
    role: str
    index: int
    tp: int
    dp: int
    ranks: tuple[RankPlacement, ...]
    pp: int = 1


def role_requests(spec: DeploySpec) -> list[RoleRequest]:
    if spec.disaggregated:
        return [RoleRequest("prefill", spec.prefill, *spec.parallelism("prefill"), "prefill_tensor_parallel_size (--ptp)",
                            spec.pipeline("prefill")),
                RoleRequest("decode", spec.decode, *spec.parallelism("decode"), "decode_tensor_parallel_size (--dtp)",
                            spec.pipeline("decode"))]
    return [RoleRequest("single", spec.prefill, *spec.parallelism("single"), "prefill_tensor_parallel_size (--ptp)",
                        spec.pipeline("single"))]


def make_plan(spec: DeploySpec, inventory: dict[str, HostInventory],
              keep: Iterable[InstancePlan] = (), cordoned: Iterable[str] = ()) -> Plan:
    """Place every instance; raise SpecError naming the numbers when the request cannot fit.

    `keep`: the instances of the deployment running now (its plan's, or `instances_from_dicts` of the stored one).
    Per role, up to the count the spec asks for of them (lowest index first; with the role's TP and DP, on hosts
    still in the spec) keep their names, devices, ports and config, and only the others are placed, on what is left,
    under the lowest indices free: a change of a running deployment moves nothing that need not move.
    `cordoned`: hosts in maintenance (`yrpd drain HOST`): they stay in the deployment (the data system, the master)
    but no instance stays or goes there."""
    host_names = [h.name for h in spec.hosts]
    kinds = {inventory[n].kind for n in host_names if inventory[n].kind is not DeviceKind.auto}
    if len(kinds) > 1:
        described = ", ".join(f"{n}={inventory[n].kind.value}" for n in host_names)
        raise SpecError("device_kind", f"hosts mix device kinds ({described})", "deploy one kind of device per run")
    kind = kinds.pop() if kinds else DeviceKind.auto
    units = unit_name(kind)

    roles = role_requests(spec)
    # devices a TP rank takes: one per rank on accelerators; on CPU a rank may bind several cores
    per_rank = spec.cores_per_rank if kind is DeviceKind.cpu else 1

    for req in roles:
        if kind is DeviceKind.cpu and req.pp > 1:
            field = req.tp_field.replace("tensor", "pipeline").replace("tp)", "pp)")
            raise SpecError(field, f"vLLM's CPU build fails at its first request with {req.pp} pipeline stages "
                            "(measured on 0.32, on one host as across two: its later stage gets no intermediate "
                            "tensors)", "use pipeline size 1 on CPU hosts; TP spans hosts there too")
        if kind is not DeviceKind.cpu:
            for name in host_names:
                n = len(inventory[name].devices)
                # a group fills hosts whole or shares one evenly: anything else strands devices
                if n and (n % req.world if req.world <= n else req.world % n):
                    divisors = [d for d in range(1, n + 1) if n % d == 0]
                    what = f"{req.tp}" if req.pp == 1 else f"tp {req.tp} x pp {req.pp} = {req.world}"
                    raise SpecError(
                        req.tp_field,
                        f"{what} neither divides the {n} {units} of {name} nor is a multiple of them",
                        f"use one of {', '.join(map(str, divisors))}, or a multiple of {n} to span hosts",
                    )

    # a drained host keeps what runs there (until a change moves it) but takes nothing new
    cordoned = set(cordoned)
    kept = _kept(keep, roles, {n: set(inventory[n].devices) for n in host_names})
    free = {n: [] if n in cordoned else list(inventory[n].devices) for n in host_names}
    for inst in kept:
        for r in inst.ranks:
            free[r.host] = [d for d in free[r.host] if d not in r.devices]
    needed = sum(r.count * r.world * per_rank * r.dp for r in roles)
    offered = [len(free[n]) + sum(len(r.devices) for k in kept for r in k.ranks if r.host == n) for n in host_names]
    if needed > sum(offered):
        need_text = " and ".join(f"{r.role} {r.count * r.dp} x {r.world * per_rank} {units}" for r in roles)
        need_text = need_text.replace(" ", " needs ", 1)
        raise SpecError(
            "devices",
            f"{need_text} = {needed}; hosts {','.join(host_names)} offer {' + '.join(map(str, offered))} = {sum(offered)}"
            + (f" ({', '.join(sorted(cordoned))} drained: `yrpd undrain` brings it back)" if cordoned else ""),
            "add hosts or devices, or lower --prefill/--decode/--ptp/--dtp/--pdp/--ddp/--ppp/--dpp",
        )

    order = {n: i for i, n in enumerate(host_names)}
    placed: list[PlacedInstance] = []
    for req in roles:
        mine = [PlacedInstance(k.name, k.role, k.index, k.tp, k.dp, k.ranks, k.pp) for k in kept if k.role == req.role]
        # a new instance takes the lowest index no kept one has: names stay put while a change replaces some
        indices = (n for n in itertools.count() if n not in {p.index for p in mine})
        for index in itertools.islice(indices, req.count - len(mine)):
            ranks: list[RankPlacement] = []
            width = req.world * per_rank
            for dp_rank in range(req.dp):
                previous = ranks[-1].host if ranks else None
                if previous is not None and len(free[previous]) >= width:
                    shares = [(previous, width)]
                else:
                    fitting = [n for n in host_names if len(free[n]) >= width]
                    if fitting:
                        shares = [(min(fitting, key=lambda n: (-len(free[n]), order[n])), width)]
                    else:
                        shares = _spread(req, index, dp_rank, per_rank, free, host_names, units)
                for host, n in shares:
                    taken = tuple(free[host][:n])
                    del free[host][:n]
                    ranks.append(RankPlacement(host=host, dp_rank=dp_rank, devices=taken))
            mine.append(PlacedInstance(f"{req.role}-{index}", req.role, index, req.tp, req.dp, tuple(ranks), req.pp))
        placed += sorted(mine, key=lambda p: p.index)
    kept_by_name = {k.name: k for k in kept}

    ports = spec.ports
    taken: dict[str, set[int]] = {n: set() for n in host_names}  # port slots in use on each host
    for inst in kept:
        taken[inst.host].add(inst.port - ports.instance_base)
        for h, slot in inst.node_slots:
            taken[h].add(slot)
    instances: list[InstancePlan] = []
    for p in placed:
        head = p.ranks[0].host
        old = kept_by_name.get(p.name)
        slot_per_host: dict[str, int] = {}
        for r in p.ranks:
            if r.host not in slot_per_host:
                if old is not None and r.host == head:
                    slot_per_host[r.host] = old.port - ports.instance_base
                    continue
                if old is not None and r.host in (old_slots := dict(old.node_slots)):
                    slot_per_host[r.host] = old_slots[r.host]
                    continue
                slot_per_host[r.host] = min(set(range(len(taken[r.host]) + 1)) - taken[r.host])
                taken[r.host].add(slot_per_host[r.host])
        slot = slot_per_host[head]
        instances.append(
            InstancePlan(
                name=p.name,
                role=p.role,
                index=p.index,
                tp=p.tp,
                dp=p.dp,
                pp=p.pp,
                node_slots=tuple((h, n) for h, n in slot_per_host.items() if h != head),
                host=head,
                ranks=p.ranks,
                port=ports.instance_base + slot,
                kv_port=ports.kv_base + slot,
                hccl_port=ports.hccl_base + INSTANCE_PORT_BLOCK * slot,
                # kept: what it runs with still (one stored before these were recorded runs with its stored spec's)
                config=(old.config if old is not None and old.config else spec.instance_config(p.role)),
                group=(old.group if old is not None and old.group else spec.model_group),
            )
        )
    for inst in instances:
        if inst.split and spec.kv_connector is KvConnector.ascend_store:
            raise SpecError("kv_connector", f"ascend-store counts {inst.name}'s Mooncake hand-over ports on its head "
                            f"host, and it spans {', '.join(inst.hosts)}", "use kv_connector: yuanrong for instances "
                            "bigger than a host, or TP x PP sizes that fit one")
        if inst.split and kind is DeviceKind.cpu and spec.multi_node(kind) is MultiNodeBackend.ray:
            raise SpecError("multi_node_backend", f"ray cannot run {inst.name} across {', '.join(inst.hosts)}: vLLM's "
                            "Ray executor refuses the CPU platform", "use multi_node_backend: mp (auto on CPU hosts)")
    for name, used in taken.items():
        if used and max(used) + 1 > ports.span:
            raise SpecError("ports.span", f"{name} would run {max(used) + 1} instances but the port ranges hold "
                            f"{ports.span}", "raise ports.span")

    master = spec.master_host.name
    hosts = []
    for h in spec.hosts:
        used_devices = sorted(d for i in instances for r in i.ranks if r.host == h.name for d in r.devices)
        host_ports = {"datasystem": ports.datasystem, "exporter": ports.exporter}
        if spec.kv_connector is KvConnector.lmcache and any(i.host == h.name for i in instances):
            host_ports.update(lmcache=ports.lmcache, lmcache_http=ports.lmcache + 1)
        if (h.name != master and kind is DeviceKind.cpu and spec.follows_kv_events
                and any(i.host == h.name for i in instances)):
            # the relay of its instances' KV-cache events to the proxy (yrpd.serving.kv_relay_launch)
            host_ports.update(kv_relay=ports.kv_relay, kv_relay_replay=ports.kv_relay + 1)
        if h.name == master:
            # dscli's workers share the data system master's work among themselves: no master process, no port
            own_master = {"ds_master": ports.ds_master} if spec.launcher is ClusterLauncher.yr else {}
            host_ports = {"proxy": ports.proxy, "etcd": ports.etcd, "etcd_peer": ports.etcd + 1,
                          **own_master, **host_ports}
        hosts.append(
            HostPlan(
                name=h.name,
                address=h.address,
                is_master=h.name == master,
                kind=inventory[h.name].kind,
                devices=tuple(inventory[h.name].devices),
                used=tuple(used_devices),
                ports=host_ports,
                ip=inventory[h.name].ip,
                arch=inventory[h.name].arch,
                nic=h.nic or spec.nic or inventory[h.name].nic,
            )
        )
    serving = {r.host for i in instances for r in i.ranks}
    dtype = choose_dtype(spec.dtype, kind, {n: inventory[n].cpu_bf16 for n in host_names if n in serving},
                   CPU_DTYPE.get(spec.builtin_model or ""))
    return Plan(hosts=tuple(hosts), instances=tuple(instances), proxy_host=master, proxy_port=ports.proxy, dtype=dtype)


def _spread(req: RoleRequest, index: int, dp_rank: int, per_rank: int, free: dict[str, list[int]],
            host_names: list[str], units: str) -> list[tuple[str, int]]:
    """(host, devices) shares of one group that no host holds alone: the fewest hosts with room for equal shares,
    those with most free devices first, listed in host order (its ranks contiguous, the first host its head)."""
    order = {n: i for i, n in enumerate(host_names)}
    name = f"{req.role}-{index}"
    left = ", ".join(f"{n} {len(free[n])}" for n in host_names)
    if req.dp > 1:
        raise SpecError("devices", f"{name} rank {dp_rank} needs {req.world * per_rank} {units} on one host; free: "
                        f"{left}", "a TP x PP group spans hosts only in an instance of one DP rank: use TP x PP "
                        "sizes that fit a host, or DP size 1")
    for k in range(2, len(host_names) + 1):
        if req.world % k:
            continue
        share = req.world // k * per_rank
        roomy = sorted((n for n in host_names if len(free[n]) >= share), key=lambda n: (-len(free[n]), order[n]))
        if len(roomy) >= k:
            return [(n, share) for n in sorted(roomy[:k], key=order.__getitem__)]
    raise SpecError("devices", f"{name} needs {req.world * per_rank} {units} for its TP x PP group and no hosts have "
                    f"room for equal shares of it (free: {left})",
                    "add hosts or devices, or use TP x PP sizes that split evenly over hosts with room")


def _kept(keep: Iterable[InstancePlan], roles: list[RoleRequest], devices: dict[str, set[int]]
          ) -> list[InstancePlan]:
    """The instances of the running plan that the new request keeps as they are: per role, up to the count asked
    for, lowest index first, of those with the role's TP and DP still and on devices their hosts still have (the
    others are the ones a scale-in or a change removes)."""
    wanted = {r.role: r for r in roles}
    out: list[InstancePlan] = []
    for inst in sorted(keep, key=lambda i: (i.role, i.index)):
        req = wanted.get(inst.role)
        if req and (req.tp, req.dp, req.pp) == (inst.tp, inst.dp, inst.pp) and \
                sum(1 for k in out if k.role == inst.role) < req.count and \
                all(r.host in devices and set(r.devices) <= devices[r.host] for r in inst.ranks):
            out.append(inst)
    return out


def instances_from_dicts(rows: list[dict]) -> tuple[InstancePlan, ...]:
    """The instances of a stored plan (Plan.to_dict's "instances"), to keep where they are when it is planned again."""
    return tuple(InstancePlan(name=r["name"], role=r["role"], index=r["index"], tp=r["tp"], dp=r["dp"], host=r["host"],
                              ranks=tuple(RankPlacement(x["host"], x["dp_rank"], tuple(x["devices"])) for x in r["ranks"]),
                              port=r["port"], kv_port=r["kv_port"], hccl_port=r["hccl_port"], pp=r.get("pp", 1),
                              config=r.get("config", ""), group=r.get("group", ""),
                              node_slots=tuple((h, n) for h, n in r.get("node_slots", ()))) for r in rows)


def ports_on_host(plan: Plan, host: str, spec: DeploySpec | None = None) -> list[tuple[int, str]]:
    """Every port this deployment listens on at `host`, with what owns it (for preflight and status); given the
    spec, also those an instance spanning hosts holds on the others (its gang's, Ray's)."""
    owned: list[tuple[int, str]] = []
    kinds = {h.name: h.kind for h in plan.hosts}
    for h in plan.hosts:
        if h.name == host:
            owned.extend((port, name) for name, port in h.ports.items())
    for inst in plan.instances:
        if inst.host == host:
            owned.append((inst.port, inst.name))
            owned.append((inst.kv_port, f"{inst.name} kv"))
        if spec is None or not inst.split or host not in inst.hosts:
            continue
        slot = inst.slot_on(host, spec.ports.instance_base)
        if host != inst.host:
            owned.append((spec.ports.kv_base + slot, f"{inst.name} gang"))
        if spec.multi_node(kinds[inst.host]) is MultiNodeBackend.ray:
            base = spec.ports.ray_base + RAY_PORT_BLOCK * slot
            owned.extend((p, f"{inst.name} ray") for p in range(base, base + RAY_PORT_BLOCK))
    return sorted(owned)


def describe_devices(devices: tuple[int, ...] | list[int]) -> str:
    return format_device_list(list(devices))


# -- a running plan against a changed spec ------------------------------------------------------------

def stale(plan: Plan, spec: DeploySpec, evacuate=()) -> list[InstancePlan]:
    """The instances of `plan` started with other settings than `spec` gives them, or on a host of `evacuate` (a
    drain's), prefill first."""
    leaving = set(evacuate)
    return sorted((i for i in plan.instances if i.config != spec.instance_config(i.role) or leaving & set(i.hosts)),
                  key=lambda i: (i.role != "prefill", i.index))


def counts(plan: Plan) -> dict[str, int]:
    return counts_of(plan.instances)


def counts_of(instances) -> dict[str, int]:
    return {role: sum(1 for i in instances if i.role == role) for role in COUNT_FIELDS}


def with_counts(spec: DeploySpec, plan: Plan, **change: int) -> DeploySpec:
    """`spec` asking for the instances `plan` runs, `change` added per role."""
    return _asking(spec, plan.instances, change)


def _asking(spec: DeploySpec, instances, change: dict[str, int]) -> DeploySpec:
    now = counts_of(instances)
    return spec.model_copy(update={role: now[role] + change.get(role, 0) for role in COUNT_FIELDS})


def replan(spec: DeploySpec, inventory: dict[str, HostInventory], instances, cordoned=(), **change: int) -> Plan:
    """The plan of `instances` as they run, with `change` more (or fewer) per role placed on free devices of hosts
    not `cordoned`: what a change's next step runs (SpecError where it does not fit)."""
    return make_plan(_asking(spec, instances, change), inventory, keep=instances, cordoned=cordoned)


def surge(plan: Plan, spec: DeploySpec) -> dict[str, int]:
    """What a rolling change starts before it retires: one instance of the first replaced role, or, where the model
    changes (an old instance's group differs), one of each replaced role at once, so a complete pair of the new model
    serves before the old pair drains (the proxy never pairs two models)."""
    old = stale(plan, spec)
    if not old:
        return {}
    if any(i.group != spec.model_group for i in old):
        return {i.role: 1 for i in old}
    return {old[0].role: 1}


def default_max_unavailable(spec: DeploySpec, inventory: dict[str, HostInventory], plan: Plan,
                            cordoned: list[str] = ()) -> int:
    """0 where the surge (above) fits beside everything `plan` runs (each new instance then starts before its old
    one drains), else 1."""
    try:
        make_plan(with_counts(spec, plan, **surge(plan, spec)), inventory, keep=plan.instances, cordoned=cordoned)
    except SpecError:
        return 1
    return 0
