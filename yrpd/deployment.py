"""From a spec to what acts on hosts: host connections, device inventory, plan, and a session's context."""

from __future__ import annotations

import ipaddress
import json
import socket
from dataclasses import dataclass
from pathlib import Path

from yrpd.errors import SessionError
from yrpd.hostgroup import GroupResult, Host, HostGroup, env_preamble
from yrpd.placement import HostInventory, Plan, instances_from_dicts, make_plan
from yrpd.serving import endpoint_url, sample_request
from yrpd.session import Session
from yrpd.spec import DeploySpec, DeviceKind, Dtype, HostSpec, Runtime, stored_spec
from yrpd.steps import RunOptions, StepContext, host_python
from yrpd import credentials
from yrpd.containers import container_name, container_profile


def host_group(spec: DeploySpec) -> HostGroup:
    hosts = [
        Host(name=h.name, hostname=h.hostname, user=h.user, port=h.port, identity=h.identity, local=h.is_local)
        for h in spec.hosts
    ]
    return HostGroup(hosts, spec.ssh)


@dataclass(frozen=True)
class SessionContainer:
    """Where a session's step commands run under the docker runtime: its container (one name on every host), the
    engine that execs into it, and the preamble that sources the profile's env scripts first."""

    name: str
    engine: str
    preamble: str


def session_container(spec: DeploySpec, session_id: str) -> SessionContainer | None:
    """The session's container, under the docker runtime; None where the steps run on the hosts themselves."""
    if spec.runtime is not Runtime.docker:
        return None
    return SessionContainer(container_name(session_id), spec.container_engine.value,
                            env_preamble(container_profile(spec).env_scripts))


def runtime_group(group: HostGroup, spec: DeploySpec, session_id: str, absent_ok: bool = False) -> HostGroup:
    """The group as the session's steps see it: under the docker runtime, a view whose commands run in each
    host's container of the session (except those marked on_host); `absent_ok` for teardown."""
    where = session_container(spec, session_id)
    if where is None:
        return group
    return group.in_containers({h.name: where.name for h in group.hosts}, where.engine, absent_ok, where.preamble)


def devices_given(spec: DeploySpec, host: HostSpec) -> bool:
    """Whether the spec names the host's devices (its own list, else the top-level one)."""
    return (host.devices if host.devices is not None else spec.devices) is not None


def needs_probe(spec: DeploySpec, deploying: bool = False) -> list[str]:
    """Hosts whose devices are not given in the spec, or whose CPU decides the dtype (auto on a CPU host), and
    must be detected on the host; when deploying under runtime docker, every host (its architecture picks the
    wheels yrpd brings into the container; `yrpd plan` assumes x86_64 there rather than touch the host)."""
    missing = []
    for h in spec.hosts:
        kind = h.device_kind or spec.device_kind
        cpu_decides = spec.dtype is Dtype.auto and kind in (DeviceKind.auto, DeviceKind.cpu)
        arch_matters = deploying and spec.runtime is Runtime.docker
        # an instance of several ranks may span hosts, and its ranks then talk over the interface that holds the ip
        nic_matters = deploying and not (h.nic or spec.nic) and any(
            spec.parallelism(r)[0] * spec.pipeline(r) > 1 for r in ("prefill", "decode"))
        if not devices_given(spec, h) or cpu_decides or arch_matters or nic_matters:
            missing.append(h.name)
    return missing


def resolve_inventory(spec: DeploySpec, group: HostGroup | None = None,
                      deploying: bool = False) -> dict[str, HostInventory]:
    """Devices per host: from the spec where given, detected on the host (deploy_scripts/inventory.py) otherwise."""
    inventory: dict[str, HostInventory] = {}
    probe = needs_probe(spec, deploying)
    detected: dict[str, dict] = {}
    if probe:
        own = group is None
        group = group or host_group(spec)
        try:
            results = group.subset(probe).run(host_python("inventory.py", {}, timeout=30))
        finally:
            if own:
                group.close()
        # without its devices a host cannot be planned; its CPU flags and architecture are only refinements (an
        # unreachable host is then reported per host by the deploy's own first step, and the deploy resumes)
        unknown = {h.name for h in spec.hosts if not devices_given(spec, h)}
        GroupResult({n: r for n, r in results.items() if n in unknown}).raise_on_failure("detecting devices")
        for name, result in results.items():
            if result.ok:
                detected[name] = json.loads(result.stdout.strip().splitlines()[-1])
    for h in spec.hosts:
        kind = h.device_kind or spec.device_kind
        devices = h.devices if h.devices is not None else spec.devices
        found = detected.get(h.name, {})
        if found:
            if kind is DeviceKind.auto:
                kind = DeviceKind(found["kind"])
            if devices is None:
                devices = {"npu": found["npus"], "gpu": found["gpus"], "cpu": found["cores"]}[kind.value]
        ip = resolve_host_ip(spec, h)
        nic = next((n for n, a in (found.get("nics") or {}).items() if a == ip), None)
        inventory[h.name] = HostInventory(kind=kind, devices=tuple(devices or ()), ip=ip,
                                          cpu_bf16=found.get("cpu_bf16"), arch=found.get("arch"), nic=nic)
    return inventory


def resolve_host_ip(spec: DeploySpec, host: HostSpec) -> str | None:
    """The address the other hosts use to reach `host`: spec `ip`, else the SSH target resolved here.

    None when it cannot be resolved from here (`yrpd plan` still works; `deploy` asks for `ip:`).
    """
    if host.ip:
        return host.ip
    if host.is_local:
        return "127.0.0.1"
    target = host.hostname
    config_file = Path(spec.ssh.config_file).expanduser()
    if config_file.is_file():
        import paramiko

        target = paramiko.SSHConfig.from_path(str(config_file)).lookup(target).get("hostname", target)
    try:
        return str(ipaddress.ip_address(target))
    except ValueError:
        pass
    try:
        return socket.gethostbyname(target)
    except OSError:
        return None


def inventory_to_json(inventory: dict[str, HostInventory]) -> dict:
    return {name: {"kind": inv.kind.value, "devices": list(inv.devices), "ip": inv.ip, "cpu_bf16": inv.cpu_bf16,
                   "arch": inv.arch, "nic": inv.nic} for name, inv in inventory.items()}


def inventory_from_json(data: dict) -> dict[str, HostInventory]:
    return {name: HostInventory(DeviceKind(v["kind"]), tuple(v["devices"]), v.get("ip"), v.get("cpu_bf16"),
                                v.get("arch"), v.get("nic")) for name, v in data.items()}


@dataclass
class Deployment:
    """A session's deployment as recorded: spec, inventory and the plan recomputed from them."""

    session: Session
    spec: DeploySpec
    inventory: dict[str, HostInventory]
    plan: Plan

    @property
    def url(self) -> str:
        """The serving endpoint's base URL (the proxy's; a plain instance's own), without /v1."""
        return endpoint_url(self.spec, self.plan)

    @property
    def sample_request(self) -> str:
        """A curl line a user can try against the endpoint (it reads a token from its file, never shows it)."""
        return sample_request(self.spec, self.plan, str(self.session.token_file))

    @classmethod
    def load(cls, session: Session) -> "Deployment":
        spec = stored_spec(session.spec_data)
        plan_data = session.plan_data
        if plan_data is None or "inventory" not in plan_data:
            raise SessionError(f"session {session.id} has no plan.json: the deploy stopped before planning")
        inventory = inventory_from_json(plan_data["inventory"])
        # planned again keeping the stored placement: a deployment changed while running (yrpd scale) may sit
        # where a plan from nothing would not put it
        keep = instances_from_dicts(plan_data.get("instances") or [])
        return cls(session, spec, inventory, make_plan(spec, inventory, keep=keep, cordoned=drained_hosts(session)))

    def context(self, options: RunOptions | None = None) -> StepContext:
        return StepContext(spec=self.spec, plan=self.plan, session_id=self.session.id, options=options or RunOptions())

    def group(self, absent_ok: bool = False) -> HostGroup:
        return runtime_group(host_group(self.spec), self.spec, self.session.id, absent_ok)

    def endpoint_key(self) -> str | None:
        """What a client of the endpoint sends as its bearer token: the proxy's key (from the variable the spec
        names, here), or, without a proxy, the token the instances require."""
        if self.spec.disaggregated:
            return self.spec.proxy_key()
        return credentials.instance_token(self.session.path)


def drained_hosts(session: Session) -> list[str]:
    """The session's hosts in maintenance (`yrpd drain HOST`): no instance is placed there until `yrpd undrain`."""
    return list(session.state.get("drained", []))


def save_deployment(session: Session, spec: DeploySpec, inventory: dict[str, HostInventory], plan: Plan) -> None:
    session.write_spec(spec.model_dump(mode="json"))
    session.write_plan({**plan.to_dict(), "inventory": inventory_to_json(inventory)})

