"""Render the per-host ``config.toml`` for ``yr -c config.toml start`` and the ``yr`` command lines.

Pure functions, no I/O. Verified against openyuanrong 9.9.9 (``yr`` CLI) with
openyuanrong-datasystem 0.8.1 in data-system-only mode; see docs/dev/openyuanrong.md.

How ``yr`` builds its config: ``<yr pkg>/cli/values.toml`` gives ``[values]`` defaults, our
``[values]`` are merged over them, ``<yr pkg>/cli/config.toml.jinja`` is rendered from the
result, then every other table of our file is merged over the rendered config. So:

* every address and port is set in ``[values]`` as a plain int. A value left to the defaults
  goes through ``check_port()``, which silently swaps a busy port for a random free one; a
  value we set is used as is (a busy pinned port makes the component fail to start);
* ``values.host_ip`` is always set (the default is an outward UDP probe);
* which components run is ``[mode.master]`` / ``[mode.agent]``;
* ``[ds_master]`` / ``[ds_worker]`` ``bin_path`` and ``env.LD_LIBRARY_PATH`` point at the
  data-system venv in ``ds_only`` mode. In ``full`` mode (complete openYuanrong wheels, data
  system inside the ``yr`` package) the package defaults are kept.

LD_LIBRARY_PATH rules (9.9.9): ``import yr`` needs ``LD_LIBRARY_PATH=<yr pkg>`` (its libbrpc.so
needs libprotoc.so.25.5.0 and has no RUNPATH), but the components ``yr start`` spawns inherit
the CLI's environment with the config's LD_LIBRARY_PATH *appended*, so the 0.8.1
``datasystem_worker`` would load the ``yr`` package's libraries first and die (exit 127,
undefined symbol). :func:`start_command` therefore runs the CLI through a one-line Python shim
that replaces LD_LIBRARY_PATH in ``os.environ`` before anything is imported: the dynamic loader
of the CLI process keeps the value it read at exec time, its children get the data system's
library directory first, then the host's own library path (``YRPD_INHERITED_LD_LIBRARY_PATH``,
moved aside by deploy_scripts/yr_cluster.py). On NPU hosts that host path is CANN's (its
``set_env.sh``): the worker's ``libacl_plugin.so`` needs libascendcl, libhccl and libruntime from
it for device-to-device and remote host-to-device copies.
"""

from __future__ import annotations

import ipaddress
import json
import shlex
from dataclasses import dataclass, field
from typing import Mapping

MODES = ("full", "ds_only")

# Components of each role, in the order of config.toml.jinja's [mode.*] tables.
_MASTER_COMPONENTS = ("etcd", "ds_master", "ds_worker", "function_master", "function_proxy", "function_agent")
_AGENT_COMPONENTS = ("ds_worker", "function_proxy", "function_agent")
_FUNCTION_COMPONENTS = ("function_master", "function_proxy", "function_agent")
# Optional components the template knows; always off (they would need more packages and ports).
_OFF_COMPONENTS = ("frontend", "dashboard", "collector", "meta_service", "function_scheduler")

# Run the yr CLI with LD_LIBRARY_PATH in effect for this process only (see module doc).
# `yr start` also probes its address with a UDP "connect" to a public address, even when values.host_ip
# is set, and dies with ENETUNREACH on hosts without a default route: answer that probe with our host_ip.
YR_CLI_SHIM = (
    'import os, sys; libs = ":".join(p for p in (os.environ.pop("YRPD_CHILD_LD_LIBRARY_PATH", ""), '
    'os.environ.pop("YRPD_INHERITED_LD_LIBRARY_PATH", "")) if p); os.environ.pop("LD_LIBRARY_PATH", None); '
    'os.environ.update({"LD_LIBRARY_PATH": libs} if libs else {}); sys.argv[0] = "yr"; '
    'import yr.cli.config as c; ip = os.environ.get("YRPD_HOST_IP"); '
    "c.get_ip = (lambda dst=None: ip) if ip else c.get_ip; "
    "from yr.cli.main import main; main()"
)


@dataclass(frozen=True)
class YrPorts:
    """Ports one node listens on (defaults are the yr 9.9.9 defaults from values.toml)."""

    etcd_client: int = 32379
    etcd_peer: int = 32380
    ds_master: int = 12123
    ds_worker: int = 31501
    function_master: int = 22770  # values.function_master.global_scheduler_port
    function_proxy: int = 22772
    function_proxy_grpc: int = 22773
    function_proxy_exec_grpc: int = 22774
    function_agent: int = 58866


@dataclass(frozen=True)
class YrNode:
    """Inputs for one host's openYuanrong config and commands."""

    host_ip: str
    is_master: bool
    master_ip: str  # the master's host_ip (etcd, ds_master, function_master live there)
    deploy_path: str  # session dir: logs, etcd data, rocksdb, session.json
    mode: str = "ds_only"  # "ds_only" | "full"
    ports: YrPorts = field(default_factory=YrPorts)  # what this node listens on
    master_ports: YrPorts | None = None  # the master's ports; None = same as `ports`
    yr_venv: str = "/opt/yrpd/venvs/yr"  # openyuanrong (yr CLI, etcd)
    ds_venv: str = "/opt/yrpd/venvs/ds"  # openyuanrong-datasystem (datasystem_worker)
    python_tag: str = "python3.11"  # the wheels are cp311 only
    shared_memory_mb: int = 1024  # ds_worker shared memory pool
    memory_reclamation_s: int = 5  # ds_worker memory_reclamation_time_second
    spill_mb: int = 0  # ds_worker disk tier (0: none; full memory then evicts)
    spill_dir: str = ""  # default: <deploy_path>/ds-spill
    node_id: str = ""  # "" = yr default (<hostname>-<pid of yr start>)
    #: the data system's CURVE keys (yrpd.credentials); set: the master and every worker accept only clients
    #: holding a key listed there, and talk to each other with the workers' shared pair
    curve_key_dir: str = ""
    #: etcd's TLS files (yrpd.credentials); set: etcd takes only clients with a certificate of the deployment's CA
    #: (yr's template turns on client-cert-auth and gives the data system its client pair)
    etcd_tls_dir: str = ""
    #: set: the worker publishes its own KV events (what it stores and removes of keys in the connector's form) on
    #: this unix socket, where the proxy, or the host's relay, subscribes
    kv_events_socket: str = ""

    @property
    def spill_directory(self) -> str:
        return self.spill_dir or f"{self.deploy_path}/ds-spill"

    @property
    def remote_ports(self) -> YrPorts:
        return self.master_ports or self.ports

    @property
    def yr_pkg_dir(self) -> str:
        return f"{self.yr_venv}/lib/{self.python_tag}/site-packages/yr"

    @property
    def ds_pkg_dir(self) -> str:
        return f"{self.ds_venv}/lib/{self.python_tag}/site-packages/yr/datasystem"

    @property
    def ds_worker_bin(self) -> str:
        return f"{self.ds_pkg_dir}/datasystem_worker"

    @property
    def ds_lib_dir(self) -> str:
        return f"{self.ds_pkg_dir}/lib"

    @property
    def session_file(self) -> str:
        return f"{self.deploy_path}/session.json"

    @property
    def config_file(self) -> str:
        return f"{self.deploy_path}/config.toml"


@dataclass(frozen=True)
class YrCommand:
    """One command: argv plus the environment variables to set (everything else inherited)."""

    argv: tuple[str, ...]
    env: Mapping[str, str]

    def shell(self) -> str:
        """One shell line, e.g. to run over SSH: ``env K=V ... argv...``."""
        pairs = [f"{k}={v}" for k, v in sorted(self.env.items())]
        return " ".join(shlex.quote(p) for p in ("env", *pairs, *self.argv))


def validate(node: YrNode) -> None:
    """Raise ValueError for inputs yr would misread or silently change."""
    if node.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {node.mode!r}")
    for name in ("host_ip", "master_ip"):
        value = getattr(node, name)
        try:
            addr = ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"{name} must be an IP address, got {value!r}") from None
        if addr.is_unspecified:
            raise ValueError(f"{name} must be a routable address, not {value}")
    if node.is_master and node.master_ip != node.host_ip:
        raise ValueError(f"master node: master_ip {node.master_ip} != host_ip {node.host_ip}")
    for name in ("deploy_path", "yr_venv", "ds_venv"):
        if not getattr(node, name).startswith("/"):
            raise ValueError(f"{name} must be an absolute path, got {getattr(node, name)!r}")
    for ports in {node.ports, node.remote_ports}:
        for name, port in vars(ports).items():
            if not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"port {name} out of range: {port!r}")
    own = listen_ports(node)
    if len(set(own.values())) != len(own):
        raise ValueError(f"two components of this node share a port: {own}")
    if node.shared_memory_mb <= 0 or node.memory_reclamation_s < 0:
        raise ValueError("shared_memory_mb must be > 0 and memory_reclamation_s >= 0")


def components(node: YrNode) -> dict[str, bool]:
    """The [mode.master] / [mode.agent] table for this node."""
    names = _MASTER_COMPONENTS if node.is_master else _AGENT_COMPONENTS
    table = {name: not (node.mode == "ds_only" and name in _FUNCTION_COMPONENTS) for name in names}
    table.update(dict.fromkeys(_OFF_COMPONENTS, False))
    return table


def listen_ports(node: YrNode) -> dict[str, int]:
    """Ports this node's components listen on (all on host_ip), for checks with ``ss -ltn``."""
    p = node.ports
    on = components(node)
    wanted = {
        "etcd_client": ("etcd", p.etcd_client),
        "etcd_peer": ("etcd", p.etcd_peer),
        "ds_master": ("ds_master", p.ds_master),
        "ds_worker": ("ds_worker", p.ds_worker),
        "function_master": ("function_master", p.function_master),
        "function_proxy": ("function_proxy", p.function_proxy),
        "function_proxy_grpc": ("function_proxy", p.function_proxy_grpc),
        "function_proxy_exec_grpc": ("function_proxy", p.function_proxy_exec_grpc),
        "function_agent": ("function_agent", p.function_agent),
    }
    return {name: port for name, (component, port) in wanted.items() if on.get(component)}


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    raise TypeError(f"unsupported TOML value {value!r}")


def _table(header: str, items: Mapping[str, object]) -> list[str]:
    return [header, *(f"{key} = {_toml_value(value)}" for key, value in items.items()), ""]


def render_config(node: YrNode) -> str:
    """The config.toml text for ``yr -c FILE start [--master]`` on this node."""
    validate(node)
    p, m = node.ports, node.remote_ports
    role = "master" if node.is_master else "agent"
    values: dict[str, object] = {
        "host_ip": node.host_ip,
        "deploy_path": node.deploy_path,
        "shared_memory_num": node.shared_memory_mb,
    }
    if node.mode == "full":
        # Library path handed to runtimes started by function_agent (yr default: the CLI's
        # LD_LIBRARY_PATH, which the start shim removes).
        values["ld_library_path"] = node.yr_pkg_dir
    if node.node_id:
        values["node_id"] = node.node_id

    lines = [
        "# Generated by yrpd.cluster.yrconfig; do not edit.",
        f"# role={role} mode={node.mode} host_ip={node.host_ip} master_ip={node.master_ip}",
        "",
        *_table("[values]", values),
        *(_table("[values.etcd]", {"auth_type": "TLS"}) + _table("[values.etcd.auth]", {"base_path": node.etcd_tls_dir})
          if node.etcd_tls_dir else []),
        *_table(
            "[[values.etcd.address]]",
            {"ip": node.master_ip, "port": m.etcd_client, "peer_port": m.etcd_peer},
        ),
        *_table("[values.ds_master]", {"ip": node.master_ip, "port": m.ds_master}),
        *_table("[values.ds_worker]", {"ip": node.host_ip, "port": p.ds_worker}),
        # yr's template hands these to the data system master and worker as enable_curve_zmq/curve_key_dir
        *(_table("[values.ds.curve]", {"enable": True, "base_path": node.curve_key_dir}) if node.curve_key_dir
          else []),
        *_table(
            "[values.function_master]",
            {"ip": node.master_ip, "global_scheduler_port": m.function_master},
        ),
        *_table(
            "[values.function_proxy]",
            {
                "ip": node.host_ip,
                "port": p.function_proxy,
                "grpc_listen_port": p.function_proxy_grpc,
                "exec_grpc_port": p.function_proxy_exec_grpc,
            },
        ),
        *_table("[values.function_agent]", {"ip": node.host_ip, "port": p.function_agent}),
        *_table(f"[mode.{role}]", components(node)),
    ]
    ds_sections = ("ds_master", "ds_worker") if node.is_master else ("ds_worker",)
    for section in ds_sections:
        if node.mode == "ds_only":
            lines += _table(f"[{section}]", {"bin_path": node.ds_worker_bin})
            lines += _table(f"[{section}.env]", {"LD_LIBRARY_PATH": node.ds_lib_dir})
    lines += _table("[ds_worker.args]", worker_tuning(node))
    return "\n".join(lines).rstrip("\n") + "\n"


def worker_tuning(node: YrNode) -> dict[str, object]:
    """The data system worker's flags yrpd sets under either launcher (yr's config, dscli's command line)."""
    # log_monitor: yr turns it off; its resource.log line is how `yrpd status` sees the cache's use and hits
    # add_node_wait_time_s: the ring forms from the workers registered within the first one's 5 s, and one that
    # registers later waits this long (the binary's 60 s) before it joins: on a 4-host lab deploy the 3 workers after
    # the master's joined 14 s after the deploy had reported ready, moving the keys' owners under the first requests
    # (a block saved on one host went unseen from another for seconds). yrpd starts every worker at once, so a late
    # one joins at once; the ring then settles while the instances start
    args: dict[str, object] = {"memory_reclamation_time_second": node.memory_reclamation_s, "log_monitor": True,
                               "log_monitor_interval_ms": 5000, "add_node_wait_time_s": 0}
    if node.mode == "ds_only":
        # nothing in this mode uses the data system's stream cache, whose 32 socket threads poll all the time:
        # without them an idle worker took 2.0 % of a core instead of 7.4 % (docs/dev/notes.md)
        args.update(sc_regular_socket_num=0, sc_stream_socket_num=0)
    if node.spill_mb:
        # the worker spills any write mode once its memory passes 90 % full; spill_size_limit is in bytes
        args.update(spill_directory=node.spill_directory, spill_size_limit=node.spill_mb << 20)
    if node.kv_events_socket:
        args["kv_events_config"] = json.dumps({"bind_endpoint": f"ipc://{node.kv_events_socket}",
                                               "backend_id": node.host_ip}, separators=(",", ":"))
    return args


def _yr_env(node: YrNode) -> dict[str, str]:
    return {"LD_LIBRARY_PATH": node.yr_pkg_dir}


def start_command(node: YrNode, config_file: str | None = None) -> YrCommand:
    """``yr -c CONFIG start [--master]``; an agent joins through the addresses in its config.

    Returns when every component passed its health check (exit 0) or failed (exit 1); the
    components keep running under a detached ``yr`` daemon that restarts any that exits.
    """
    argv = [f"{node.yr_venv}/bin/python", "-c", YR_CLI_SHIM, "-c", config_file or node.config_file, "start"]
    if node.is_master:
        argv.append("--master")
    children = {"YRPD_CHILD_LD_LIBRARY_PATH": node.ds_lib_dir} if node.mode == "ds_only" else {}
    return YrCommand(tuple(argv), {**_yr_env(node), **children, "YRPD_HOST_IP": node.host_ip})


def stop_command(node: YrNode, force: bool = False) -> YrCommand:
    """``yr stop -f SESSION``: SIGTERM the daemon, which stops its components (5 s each, then
    SIGKILL). ``force``: SIGKILL the daemon and every component of the session at once."""
    argv = [f"{node.yr_venv}/bin/yr", "stop", *(["--force"] if force else []), "-f", node.session_file]
    return YrCommand(tuple(argv), _yr_env(node))

