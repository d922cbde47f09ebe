"""How the instances and the proxy of a plan are launched: pure functions from (spec, plan) to command lines.

Nothing here touches a host. yrpd.steps.instances and yrpd.steps.proxy wrap these in host commands, and
`yrpd plan` prints them, so what a user reads in the plan is exactly what runs.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from yrpd.layout import MAX_UNIX_SOCKET_PATH, HostPaths
from yrpd.peers import PEER_VENVS
from yrpd.placement import InstancePlan, Plan
from yrpd import ascend_store, credentials
from yrpd.containers import container_profile
from yrpd.ports import INSTANCE_PORT_BLOCK, RAY_PORT_BLOCK
from yrpd.proxy.routing import Routing
from yrpd.connector.config import ConfigError, user_settings
from yrpd.spec import BUILTIN_MODEL, DeploySpec, DeviceKind, KvConnector, MultiNodeBackend

#: role -> connector role; with prefix reuse, prefill also loads prefixes other requests stored
CONNECTOR_ROLES = {("prefill", False): "kv_producer", ("prefill", True): "kv_both",
                   ("decode", False): "kv_consumer", ("decode", True): "kv_consumer",
                   ("single", False): "kv_both", ("single", True): "kv_both"}

#: vLLM flags yrpd sets per device kind before the user's engine_args (argparse: the last one wins).
#: CPU: eager start (36 s instead of 95 s of torch.compile) and a bounded KV pool so two instances fit
#: on a small machine.
KIND_ENGINE_ARGS = {
    # the proxy probes /health every 2 s and status reads /metrics: without the filter their access lines bury the
    # instance's own log (vLLM >= 0.11 has it; the vllm-ascend images' older vLLM does not know the flag)
    DeviceKind.cpu: ["--enforce-eager", "--kv-cache-memory-bytes", str(512 * 2**20), "--max-model-len", "4096",
                     "--disable-access-log-for-endpoints", "/health,/metrics"],
    DeviceKind.npu: [],
    DeviceKind.gpu: [],
}

#: environment every vLLM process gets; the model is a local path, nothing is downloaded
BASE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false", "VLLM_USE_V1": "1"}
#: the guide's settings for Ascend (multiprocess workers must spawn: forked workers lose the NPU context)
NPU_ENV = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "HCCL_OP_EXPANSION_MODE": "AIV"}

STATS_INTERVAL_S = 5


@dataclass(frozen=True)
class Launch:
    """One detached process on one host."""

    name: str
    host: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    health_url: str | None = None
    #: where its secrets are (yrpd.credentials): its supervisor adds them to its environment, off every command line
    env_file: str | None = None
    #: its KV connector talks to the data system: ready only once that link is up (it starts before openYuanrong)
    ds_link: bool = False
    #: one of the processes of an instance spanning hosts, which live and die together (supervise.py's "gang":
    #: {"role": "leader", "members": [[name, "IP:PORT"], ..]} or {"role": "follower", "listen": .., "leader": ..})
    gang: dict | None = None
    #: what it writes outside the session directory, removed when it is stopped (Ray's temp root)
    leaves: tuple[str, ...] = ()
    #: files written before it starts, (path, text) each (vllm-ascend's backend JSON under ascend-store)
    files: tuple[tuple[str, str], ...] = ()

    @property
    def command(self) -> str:
        return " ".join(shlex.quote(a) for a in self.argv)

    @property
    def exec_command(self) -> str:
        # exec: the server itself is the command its supervisor watches and signals, not a shell around it
        return "exec " + self.command


def model_path(spec: DeploySpec, paths: HostPaths) -> str:
    model = spec.model or BUILTIN_MODEL
    if model.startswith("builtin:"):
        return f"{paths.models_dir}/{model.removeprefix('builtin:')}"
    return model.rstrip("/")


def builtin_model(spec: DeploySpec) -> str | None:
    """Name of the demo model to build on the hosts, if the spec asks for one."""
    return spec.builtin_model


def instance_url(plan: Plan, inst: InstancePlan) -> str:
    return f"http://{plan.host(inst.host).reach_ip}:{inst.port}"


def endpoint_url(spec: DeploySpec, plan: Plan) -> str:
    """Where clients send requests: the proxy, or the first instance when there is no proxy."""
    return proxy_url(spec, plan) if spec.disaggregated else instance_url(plan, plan.instances[0])


def proxy_url(spec: DeploySpec, plan: Plan) -> str:
    bind = spec.proxy_host or plan.host(plan.proxy_host).reach_ip
    shown = plan.host(plan.proxy_host).reach_ip if bind == "0.0.0.0" else bind
    return f"http://{shown}:{plan.proxy_port}"


def kv_transfer_config(spec: DeploySpec, plan: Plan, inst: InstancePlan, paths: HostPaths,
                       on: str | None = None) -> dict:
    """The instance's --kv-transfer-config for its ranks on host `on` (default its head host): each host's ranks
    talk to their own host's data system worker (shared memory, not the network)."""
    if spec.kv_connector is KvConnector.lmcache:
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                              "lmcache.mp.port": spec.ports.lmcache}}
    if spec.kv_connector is KvConnector.example:
        # it stores what it has not found and loads what it finds, whatever the role
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": paths.session.kv_files}}
    if spec.kv_connector is KvConnector.nixl:
        # decode reads the blocks out of prefill's KV cache where vLLM keeps it: host memory on a CPU host
        return {"kv_connector": "NixlConnector", "kv_role": UPSTREAM_ROLES[inst.role],
                "kv_buffer_device": "cpu" if plan.host(inst.host).kind is DeviceKind.cpu else "cuda"}
    host = plan.host(on or inst.host)
    if spec.kv_connector is KvConnector.ascend_store:
        return ascend_store_config(spec, plan, inst)
    extra = {
        "ds_address": f"{host.reach_ip}:{spec.ports.datasystem}",
        "stats_file": paths.stats_file(inst.name),
        "stats_interval_s": STATS_INTERVAL_S,
    }
    if inst.role == "single" and not _saves_in_step(spec):
        # nothing waits for a plain instance's puts (no decode reads them now; with save_sync its own step does), so
        # its writer yields to the engine
        extra["writer_nice"] = ALONE_WRITER_NICE
    extra.update(spec.connector)
    return {
        "kv_connector": "YuanrongConnector",
        "kv_connector_module_path": "yrpd.connector",
        "kv_role": CONNECTOR_ROLES[(inst.role, spec.prefix_reuse)],
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def _saves_in_step(spec: DeploySpec) -> bool:
    """Whether the connector's `save_sync` is on, read as the connector reads it. A session stored before its spec's
    keys were checked may hold a value the connector refuses: its instances fail to start with that error (which
    status reports), and this answer does not matter."""
    try:
        return user_settings(spec.connector, known_only=False).save_sync
    except ConfigError:
        return False


#: the writer's nice value where no instance waits for its puts (connector key writer_nice): it gets about a tenth of
#: a CPU the engine also wants, and all of an idle one
ALONE_WRITER_NICE = 10

#: upstream's roles in its PD recipes (vllm-ascend's pool saves on prefill and decode only reads it; NIXL's decode
#: pulls from prefill)
UPSTREAM_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "single": "kv_both"}


def ascend_store_config(spec: DeploySpec, plan: Plan, inst: InstancePlan) -> dict:
    """vllm-ascend's PD recipe on yrpd's data system (yrpd.ascend_store): Mooncake hands KV over between the
    disaggregated instances, AscendStoreConnector keeps it in the pool."""
    handover = None
    if inst.role != "single":
        sizes = {role: next({"dp_size": i.dp, "tp_size": i.tp} for i in plan.instances if i.role == role)
                 for role in ("prefill", "decode")}
        handover = {"kv_port": ascend_store.handover_port(spec.ports, inst), **sizes}
    # the lookup socket is named by this port: unique among the host's instances like their kv ports
    return ascend_store.kv_transfer_config(UPSTREAM_ROLES[inst.role], lookup_port=inst.kv_port, handover=handover)


#: the variables that name the interface an instance spanning hosts talks over, per device kind: gloo (vLLM's CPU
#: groups, and every kind's CPU-side groups), HCCL and its TCP side (vllm-ascend's multi-node tutorials), NCCL
NIC_ENV = {DeviceKind.cpu: ("GLOO_SOCKET_IFNAME",),
           DeviceKind.npu: ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME"),
           DeviceKind.gpu: ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}


def device_env(kind: DeviceKind, devices: tuple[int, ...], ranks: int) -> dict[str, str]:
    """Which devices the process(es) of `ranks` ranks on one host use."""
    ids = ",".join(map(str, devices))
    if kind is DeviceKind.npu:
        return {"ASCEND_RT_VISIBLE_DEVICES": ids}
    if kind is DeviceKind.gpu:
        return {"CUDA_VISIBLE_DEVICES": ids}
    # CPU: each rank gets its share of the planned cores ("0,1|2,3" binds rank 0 to 0-1, rank 1 to 2-3)
    per_rank = max(1, len(devices) // ranks)
    groups = [devices[i:i + per_rank] for i in range(0, per_rank * ranks, per_rank)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, g)) for g in groups)}


def instance_launches(spec: DeploySpec, plan: Plan, inst: InstancePlan, paths: HostPaths) -> list[Launch]:
    """The process(es) of one instance: its API server on the head host, plus one headless engine per other
    host its DP ranks span (vLLM's multi-node data parallel)."""
    head = plan.host(inst.host)
    kind = head.kind
    # a peer's connector imports its own package (lmcache, nixl): vLLM runs from the venv that has both
    peer = PEER_VENVS.get(spec.kv_connector)
    vllm = [f"{paths.peer_venv(peer.name)}/bin/python", "-m", "vllm.entrypoints.cli.main"] if peer else [paths.vllm]
    common = [*vllm, "serve", model_path(spec, paths), "--served-model-name", spec.model_name,
              "--tensor-parallel-size", str(inst.tp)]
    if inst.pp > 1:
        common += ["--pipeline-parallel-size", str(inst.pp)]
    uses_store = spec.single_kv_store or spec.kv_connector is KvConnector.lmcache
    # else the non-disaggregated baseline: plain vLLM
    with_kv = inst.role != "single" or uses_store
    common += KIND_ENGINE_ARGS.get(kind, [])
    if spec.kv_connector is KvConnector.lmcache and kind is DeviceKind.cpu:
        common += ["--gpu-memory-utilization", "0.3"]  # LMCache's connector refuses vLLM's default 0.92 of RAM
    if plan.dtype.dtype:
        common += ["--dtype", plan.dtype.dtype]
    env = {**BASE_ENV, **(NPU_ENV if kind is DeviceKind.npu else {}),
           "PYTHONPATH": paths.bundle_dir, "VLLM_CACHE_ROOT": paths.vllm_cache,
           "TMPDIR": paths.session.tmp_dir, "VLLM_HOST_IP": head.reach_ip}
    if kind is DeviceKind.npu:
        env["HCCL_IF_BASE_PORT"] = str(inst.hccl_port)
    if events := kv_events_config(spec, plan, inst, paths):
        common += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
    if with_kv and spec.kv_connector in (KvConnector.yuanrong, KvConnector.ascend_store):
        # the data-system client's own logs, per instance under the session (without it: $HOME/.datasystem/logs,
        # every session's instances in one file, left behind by `down`); the client makes the directory
        env["DATASYSTEM_CLIENT_LOG_DIR"] = f"{paths.session.client_logs}/{inst.name}"
    if spec.kv_connector is KvConnector.lmcache:
        env["LMCACHE_TRACK_USAGE"] = "false"
    if spec.kv_connector is KvConnector.nixl:  # the side channel decode asks prefill's block layout on
        env.update(VLLM_NIXL_SIDE_CHANNEL_HOST=head.reach_ip,
                   VLLM_NIXL_SIDE_CHANNEL_PORT=str(ascend_store.handover_port(spec.ports, inst)))
    by_host: dict[str, list] = {}
    for rank in inst.ranks:
        by_host.setdefault(rank.host, []).append(rank)
    dp_args: dict[str, list[str]] = {h: [] for h in by_host}
    if inst.dp > 1:
        start = 0
        for h, ranks in by_host.items():
            dp_args[h] = ["--data-parallel-size", str(inst.dp), "--data-parallel-size-local", str(len(ranks))]
            if inst.spans_hosts:
                dp_args[h] += ["--data-parallel-address", head.reach_ip, "--data-parallel-rpc-port", str(inst.kv_port)]
                if h != inst.host:
                    dp_args[h] += ["--headless", "--data-parallel-start-rank", str(start)]
            start += len(ranks)
    secrets = paths.session.env_file(credentials.INSTANCE) if paths.session else None
    ds_link = with_kv and spec.kv_connector is KvConnector.yuanrong
    launches = []
    # ranks each host runs: a DP rank's TP x PP group, or a share of the group that spans hosts
    for h, ranks in by_host.items():
        devices = tuple(d for r in ranks for d in r.devices)
        host_env = {**env, **device_env(plan.host(h).kind, devices, inst.node_ranks),
                    "VLLM_HOST_IP": plan.host(h).reach_ip}
        if inst.split and plan.host(h).nic:
            host_env.update((k, plan.host(h).nic) for k in NIC_ENV.get(kind, ()))
        if spec.kv_connector is KvConnector.nixl:  # each host's ranks answer on their own host
            host_env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = plan.host(h).reach_ip
        if inst.spans_hosts and kind is DeviceKind.npu:  # its block on this host: slots differ from host to host
            slot = inst.slot_on(h, spec.ports.instance_base)
            host_env["HCCL_IF_BASE_PORT"] = str(spec.ports.hccl_base + INSTANCE_PORT_BLOCK * slot)
        files: tuple[tuple[str, str], ...] = ()
        if with_kv and spec.kv_connector is KvConnector.ascend_store:
            worker = f"{plan.host(h).reach_ip}:{spec.ports.datasystem}"
            if ascend_store.reads_json(container_profile(spec).vllm_ascend):
                config = paths.session.backend_config(inst.name if h == inst.host else f"{inst.name}-{h}")
                host_env.update(ascend_store.config_env(config))
                files = ((config, json.dumps(ascend_store.json_config(worker), sort_keys=True)),)
            else:
                host_env.update(ascend_store.worker_env(worker))
        host_env.update(spec.env)
        ray = inst.split and spec.multi_node(kind) is MultiNodeBackend.ray
        if with_kv and ray and spec.kv_connector is KvConnector.yuanrong:
            # one --kv-transfer-config reaches the Ray workers of every host: each finds its own host's data system
            # worker in the environment its Ray node gives it
            host_env["YRPD_DS_ADDRESS"] = f"{plan.host(h).reach_ip}:{spec.ports.datasystem}"
        if with_kv:
            config = kv_transfer_config(spec, plan, inst, paths, on=h)
            if ray and spec.kv_connector is KvConnector.yuanrong:
                config["kv_connector_extra_config"].pop("ds_address")
            kv = json.dumps(config, separators=(",", ":"))
            dp_args[h] = ["--kv-transfer-config", kv, *dp_args[h]]
        if inst.split:
            launches += split_launches(spec, plan, inst, paths, h, [*common, *dp_args[h]], host_env, secrets, ds_link)
        elif h == inst.host:
            argv = [*common, "--host", head.reach_ip, "--port", str(inst.port), *dp_args[h], *spec.engine_args_of(inst.role)]
            launches.append(Launch(inst.name, h, argv, host_env, f"{instance_url(plan, inst)}/health", secrets, ds_link,
                                   files=files))
        else:
            argv = [*common, *dp_args[h], *spec.engine_args_of(inst.role)]
            launches.append(Launch(f"{inst.name}-{h}", h, argv, host_env, env_file=secrets, files=files))
    return launches


def ray_ports(spec: DeploySpec, slot: int) -> dict[str, int]:
    """A Ray node's ports (yrpd.ports.RAY_PORT_BLOCK) from the instance's port slot on its host."""
    base = spec.ports.ray_base + RAY_PORT_BLOCK * slot
    names = ("port", "node-manager-port", "object-manager-port", "runtime-env-agent-port",
             "dashboard-agent-grpc-port", "dashboard-agent-listen-port", "metrics-export-port",
             "ray-client-server-port")
    return {name: base + i for i, name in enumerate(names)}


def split_launches(spec: DeploySpec, plan: Plan, inst: InstancePlan, paths: HostPaths, h: str, argv: list[str],
                   env: dict[str, str], secrets: str | None, ds_link: bool) -> list[Launch]:
    """The processes on host `h` of an instance whose TP x PP group spans hosts: one vLLM world over the network.

    mp (vLLM's own launcher): the same `vllm serve` on each host, `--node-rank` its place, `--headless` but on the
    head; the head's rank 0 holds the rendezvous on its kv_port. ray (vLLM's recipe): a Ray node on each host
    (`ray start --head` on the head host, `--address` of it on the others), and `vllm serve` with the Ray executor on
    the head. Either way the processes are one gang (supervise.py): one leads, every other follows on the port
    kv_base + its slot on its host, and a dead one restarts them all."""
    head = plan.host(inst.host)
    slots = {o: inst.slot_on(o, spec.ports.instance_base) for o in inst.hosts}
    ip = plan.host(h).reach_ip
    listen = f"{ip}:{spec.ports.kv_base + slots[h]}"
    health = f"{instance_url(plan, inst)}/health"
    if spec.multi_node(head.kind) is MultiNodeBackend.mp:
        rank = inst.hosts.index(h)
        nodes = ["--nnodes", str(len(inst.hosts)), "--node-rank", str(rank), "--master-addr", head.reach_ip,
                 "--master-port", str(inst.kv_port)]
        if h != inst.host:
            follower = {"role": "follower", "listen": listen, "leader": f"{inst.name} on {inst.host}"}
            return [Launch(f"{inst.name}-{h}", h, [*argv, *nodes, "--headless", *spec.engine_args_of(inst.role)], env,
                           env_file=secrets, gang=follower)]
        members = [[f"{inst.name}-{o}", f"{plan.host(o).reach_ip}:{spec.ports.kv_base + slots[o]}"]
                   for o in inst.hosts if o != inst.host]
        return [Launch(inst.name, h, [*argv, "--host", ip, "--port", str(inst.port), *nodes, *spec.engine_args_of(inst.role)],
                       env, health, secrets, ds_link, gang={"role": "leader", "members": members})]
    # Ray: its workers are the raylet's children and get the node's environment, ours included (PYTHONPATH, NICs)
    gcs = f"{head.reach_ip}:{ray_ports(spec, slots[inst.host])['port']}"
    # Ray's own temp root: its unix sockets' paths must stay under 108 bytes, which the session's tmp would not
    temp = f"/tmp/yrpd-ray-{paths.session.session_id[-6:] if paths.session else 'x'}-{slots[h]}"
    node = [paths.ray, "start", "--block", "--node-ip-address", ip, "--disable-usage-stats", f"--temp-dir={temp}"]
    own = ray_ports(spec, slots[h])
    leader = f"{inst.name}-ray on {inst.host}"
    if h != inst.host:
        ports = [f"--{k}={v}" for k, v in own.items() if k not in ("port", "ray-client-server-port")]
        return [Launch(f"{inst.name}-ray-{h}", h, [*node, f"--address={gcs}", *ports], env, env_file=secrets,
                       gang={"role": "follower", "listen": listen, "leader": leader}, leaves=(temp,))]
    members = [[inst.name, listen]] + [
        [f"{inst.name}-ray-{o}", f"{plan.host(o).reach_ip}:{spec.ports.kv_base + slots[o]}"]
        for o in inst.hosts if o != inst.host]
    ray_head = Launch(f"{inst.name}-ray", h, [*node, "--head", *(f"--{k}={v}" for k, v in own.items()),
                                              "--include-dashboard=false"], env, env_file=secrets,
                      gang={"role": "leader", "members": members}, leaves=(temp,))
    serve = Launch(inst.name, h, [*argv, "--host", ip, "--port", str(inst.port), "--distributed-executor-backend",
                                  "ray", *spec.engine_args_of(inst.role)], {**env, "RAY_ADDRESS": gcs}, health, secrets, ds_link,
                   gang={"role": "follower", "listen": listen, "leader": leader})
    return [ray_head, serve]


LMCACHE_NAME = "lmcache-server"


def lmcache_launch(spec: DeploySpec, plan: Plan, host: str, paths: HostPaths) -> Launch | None:
    """LMCache's multi-process server on a host whose instances use it as their store; it holds as much memory as
    a data system worker would (`datasystem_memory_mb`), so the two stores compare at one size."""
    ports = plan.host(host).ports
    if spec.kv_connector is not KvConnector.lmcache or "lmcache" not in ports:
        return None
    argv = [f"{paths.peer_venv(PEER_VENVS[KvConnector.lmcache].name)}/bin/lmcache", "server",
            "--host", "127.0.0.1", "--port", str(ports["lmcache"]),
            "--http-host", "127.0.0.1", "--http-port", str(ports["lmcache_http"]), "--chunk-size", "256",
            "--l1-size-gb", f"{spec.datasystem_memory_mb / 1024:g}", "--eviction-policy", "LRU",
            # without it vLLM's CPU build waits at register_kv_caches until it gives up
            "--supported-transfer-mode", "auto", "--shm-name", f"yrpd-lmcache-{paths.session.session_id}"]
    env = {"LMCACHE_TRACK_USAGE": "false", "TMPDIR": paths.session.tmp_dir}
    return Launch(LMCACHE_NAME, host, argv, env, f"http://127.0.0.1:{ports['lmcache_http']}/healthcheck")


def kv_relay_launch(spec: DeploySpec, plan: Plan, host: str, paths: HostPaths) -> Launch | None:
    """The KV-event relay (yrpd.proxy.kvrelay) on a host other than the proxy's whose instances publish their
    KV-cache events on unix sockets: it republishes them to the proxy over tcp, CURVE-encrypted, only the proxy's key
    let in. It finds the instances' sockets itself, so scaling changes nothing of its command."""
    h = plan.host(host)
    if "kv_relay" not in h.ports or paths.session is None or not any(
            inst.host == host and kv_events_config(spec, plan, inst, paths) for inst in plan.instances):
        return None
    argv = [paths.python, "-m", "yrpd.proxy.kvrelay", "--run-dir", paths.session.run_dir,
            "--listen", h.reach_ip, "--port", str(h.ports["kv_relay"])]
    return Launch(KV_RELAY_NAME, host, argv, {"PYTHONPATH": paths.bundle_dir}, None,
                  paths.session.env_file(credentials.KV_RELAY))


def launches_on_host(spec: DeploySpec, plan: Plan, host: str, paths: HostPaths) -> list[Launch]:
    """What serves on the host: its instances, after the store they need (LMCache's server) and the relay of their
    KV-cache events."""
    beside = [lmcache_launch(spec, plan, host, paths), kv_relay_launch(spec, plan, host, paths)]
    return [*(launch for launch in beside if launch),
            *(launch for inst in plan.instances for launch in instance_launches(spec, plan, inst, paths)
              if launch.host == host)]


PROXY_NAME = "proxy"
KV_RELAY_NAME = "kv-relay"
EXPORTER_NAME = "exporter"  # every host's metrics exporter (yrpd.steps.exporter)


#: the longest path a unix socket may have on Linux (sun_path is 108 bytes with its terminating NUL)


def kv_events_config(spec: DeploySpec, plan: Plan, inst: InstancePlan, paths: HostPaths) -> dict | None:
    """vLLM's --kv-events-config for an instance whose KV-cache events the proxy follows (prefix routing), or None.
    The events carry the prompts' token ids and vLLM's publisher has no authentication, so they go to unix sockets
    on the instance's host (the proxy there subscribes; elsewhere it routes on its estimate). One-rank-group,
    one-host instances of vLLM 0.32 on CPU so far: vLLM names a DP rank's socket by adding to a tcp port, which an
    ipc path has not, and the proxy finds the sockets through /kv_event_sources, which the vllm-ascend images' older
    vLLM lacks."""
    if (not spec.follows_kv_events or paths.session is None or inst.dp > 1
            or inst.spans_hosts or inst.role not in ("prefill", "decode") or plan.host(inst.host).kind
            is not DeviceKind.cpu):
        return None
    sockets = [paths.session.kv_events(inst.name, what) for what in ("events", "replay")]
    if max(map(len, sockets)) > MAX_UNIX_SOCKET_PATH:  # vLLM would fail to bind it: the proxy says "no events"
        return None
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{sockets[0]}",
            "replay_endpoint": f"ipc://{sockets[1]}"}


def proxy_launch(spec: DeploySpec, plan: Plan, paths: HostPaths) -> Launch | None:
    if not spec.disaggregated:
        return None
    bind = spec.proxy_host or plan.host(plan.proxy_host).reach_ip
    argv = [paths.python, "-m", "yrpd.proxy", "--host", bind, "--port", str(plan.proxy_port),
            "--served-model-name", spec.model_name, "--routing", spec.routing.value,
            "--routing-bound", str(spec.routing_bound)]
    for inst in plan.instances:
        argv += [f"--{inst.role}", instance_url(plan, inst)]
    if paths.session:  # where it exists, the file replaces the lists above: the membership yrpd scale changes
        argv += ["--instances-file", paths.session.proxy_members]
    env = {"PYTHONPATH": paths.bundle_dir}
    if spec.api_key_env:
        argv += ["--api-key-env", credentials.PROXY_KEY_ENV]
    if not spec.routing_kv_events:
        argv.append("--no-kv-events")
    elif spec.routing is Routing.prefix:
        # where a host's relay would listen: a scale that places instances on a new host then changes nothing here
        argv += ["--kv-relay-port", str(spec.ports.kv_relay)]
        if spec.routing_kv_exact:
            argv.append("--kv-exact")
        if spec.datasystem_spill_mb and spec.routing_store_events:
            argv += ["--store-memory-mb", str(spec.datasystem_memory_mb)]
    seeds = {l.env.get("PYTHONHASHSEED") for inst in plan.instances if inst.role in ("prefill", "decode")
             for l in instance_launches(spec, plan, inst, paths)[:1]}
    if len(seeds) == 1 and (seed := seeds.pop()) is not None:  # the instances' block hashes start from it
        argv += ["--kv-hash-seed", seed]
    return Launch(PROXY_NAME, plan.proxy_host, argv, env, f"{proxy_url(spec, plan)}/health",
                  paths.session.env_file(credentials.PROXY) if paths.session else None)


def proxy_members(plan: Plan, draining: frozenset[str] = frozenset()) -> dict:
    """The proxy's membership file's content for `plan`: every prefill and decode instance, those named in
    `draining` taken out of routing."""
    return {"instances": [{"name": inst.name, "url": instance_url(plan, inst), "role": inst.role,
                           "draining": inst.name in draining, "group": inst.group}
                          for inst in plan.instances if inst.role in ("prefill", "decode")]}


def sample_request(spec: DeploySpec, plan: Plan, token_file: str | None = None) -> str:
    """A curl line for the endpoint; without a proxy the instance wants its token (`token_file`, read by the shell:
    the token itself is never printed)."""
    body = json.dumps({"model": spec.model_name, "prompt": "The capital of France is", "max_tokens": 16,
                       "temperature": 0})
    auth = ""
    if spec.disaggregated and spec.api_key_env:
        auth = f" -H \"Authorization: Bearer ${spec.api_key_env}\""
    elif not spec.disaggregated and token_file:
        auth = f" -H \"Authorization: Bearer $(cat {token_file})\""
    return (f"curl -s {endpoint_url(spec, plan)}/v1/completions -H 'Content-Type: application/json'{auth} "
            f"-d '{body}'")


def scrape_targets(spec: DeploySpec, plan: Plan, session_id: str) -> list[dict]:
    """The deployment's Prometheus scrape targets in the `file_sd` format (`yrpd metrics targets`): the proxy's
    /metrics, every host's exporter (the data system's and the connector's figures) and every vLLM API server's.
    None asks for a token there (the instances' token guards /v1 only); who may reach the ports is in `yrpd plan`'s
    exposure table."""
    common = {"yrpd_session": session_id}
    groups = []
    if spec.disaggregated:
        groups.append({"targets": [proxy_url(spec, plan).removeprefix("http://")],
                       "labels": {**common, "job": "yrpd_proxy", "host": plan.proxy_host}})
    for host in plan.hosts:
        groups.append({"targets": [f"{host.reach_ip}:{host.ports['exporter']}"],
                       "labels": {**common, "job": "yrpd_host", "host": host.name}})
    for inst in plan.instances:
        groups.append({"targets": [instance_url(plan, inst).removeprefix("http://")],
                       "labels": {**common, "job": "yrpd_vllm", "role": inst.role, "yrpd_instance": inst.name,
                                  "host": inst.host, **({"model_group": inst.group} if inst.group else {})}})
    return groups
