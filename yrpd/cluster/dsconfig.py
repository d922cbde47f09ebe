"""The dscli launcher: etcd and one data system worker per host, without openYuanrong's `yr` CLI.

This is how openYuanrong's own vLLM deployment runs the data system: a plain etcd, then on every host
`dscli start -w --worker_address IP:PORT --etcd_address ETCD --shared_memory_size_mb N ...`. `dscli start` execs
`<openyuanrong-datasystem>/datasystem_worker --FLAG=VALUE ...` in a session of its own and returns once the worker's
ready file appears; nothing would bring the worker back if it died. So yrpd runs that same worker command line in the
foreground under its own supervisor (deploy_scripts/supervise.py: restart with backoff, the whole process group
stopped), and etcd beside it the same way. Only `openyuanrong-datasystem` is needed (cp311 and cp312 wheels) and a
static etcd binary; the `yr` CLI (cp310/cp311 only) is not.

Pure functions of a `YrNode` (yrpd.cluster.yrconfig, the inputs both launchers share) returning bash command lines.
Unlike the `yr` launcher there is no separate data system master: the workers share its work through etcd
(`enable_distributed_master`, the worker's default).
"""

from __future__ import annotations

import shlex

from yrpd.cluster.yrconfig import YrNode, validate, worker_tuning

#: the session's process names of the two components (also their names in `yrpd status`)
ETCD = "etcd"
WORKER = "ds_worker"
#: where the static etcd binary lies under the env root, and the file naming the wheel it came from
ETCD_DIR = "etcd"
ETCD_SOURCE_FILE = "SOURCE"

# etcd's TLS cipher suites: the ones openYuanrong's own config allows (TLS 1.2 AEAD suites and TLS 1.3's)
_CIPHERS = ("TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,"
            "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,"
            "TLS_AES_128_GCM_SHA256,TLS_AES_256_GCM_SHA384")


def components(node: YrNode) -> tuple[str, ...]:
    return (ETCD, WORKER) if node.is_master else (WORKER,)


def listen_ports(node: YrNode) -> dict[str, tuple[str, int]]:
    """port name -> (component, port) this node listens on (all on host_ip)."""
    p = node.ports
    ports = {"ds_worker": (WORKER, p.ds_worker)}
    if node.is_master:
        ports = {"etcd_client": (ETCD, p.etcd_client), "etcd_peer": (ETCD, p.etcd_peer), **ports}
    return ports


def worker_dir(node: YrNode) -> str:
    """The worker's own files under the deploy path: rocksdb, its socket directory, ready and health files."""
    return f"{node.deploy_path}/ds_worker_0"


def ready_file(node: YrNode) -> str:
    """Written by the worker once clients can connect (what `dscli start` waits for)."""
    return f"{worker_dir(node)}/ready"


def _scheme(node: YrNode) -> str:
    return "https" if node.etcd_tls_dir else "http"


def etcd_endpoint(node: YrNode) -> str:
    m = node.remote_ports
    return f"{node.master_ip}:{m.etcd_client}"


#: `dscli start -w` passes the worker every non-empty value of its worker_config.json; where one differs from the
#: binary's own default (`datasystem_worker --help`) yrpd passes it too, so the worker runs as dscli would start it.
#: In openyuanrong-datasystem 0.8.1 those are the paths (set under the session instead: PATHS_UNDER_SESSION), the
#: stream cache's socket counts (DIFFERS_FROM_DSCLI) and these (tests/lab/test_dscli_flags.py compares both files of
#: the installed package with yrpd's flags)
DSCLI_DEFAULTS: dict[str, object] = {"client_reconnect_wait_s": 5}
#: flags dscli makes relative paths under its home directory (`./datasystem/...`): yrpd puts each under the session,
#: absolute, so two sessions or two hosts' workers on one machine never share a file
PATHS_UNDER_SESSION = ("log_dir", "ready_check_path", "health_check_path", "rocksdb_store_dir",
                       "unix_domain_socket_dir", "monitor_config_file")
#: where yrpd's worker deliberately runs otherwise than dscli's, and why (flag -> reason)
DIFFERS_FROM_DSCLI = {
    "sc_regular_socket_num": "0 in ds_only mode: nothing uses the stream cache, whose socket threads poll all the time",
    "sc_stream_socket_num": "0 in ds_only mode, as sc_regular_socket_num",
    "enable_worker_worker_batch_get": "true, as openYuanrong's vLLM deployment passes it to dscli",
    "memory_reclamation_time_second": "datasystem_memory_reclamation_s (5 s): freed memory is reused soon",
    "log_monitor": "on, 5 s: its resource.log is how `yrpd status` reads the worker's use and hits",
    "log_monitor_interval_ms": "5000, as log_monitor",
    "add_node_wait_time_s": "0: a worker registering after the ring formed joins it at once, not a minute later "
                            "(under the first requests)",
    "enable_curve_zmq": "on with the deployment's CURVE keys (curve_key_dir)",
    "curve_key_dir": "the session's CURVE keys",
    "enable_etcd_auth": "on where etcd serves TLS (etcd_ca, etcd_cert, etcd_key)",
    "etcd_ca": "the session's CA", "etcd_cert": "the session's client certificate",
    "etcd_key": "the session's client key",
    "spill_directory": "the disk tier (datasystem_spill_mb)", "spill_size_limit": "datasystem_spill_mb",
    "kv_events_config": "a unix socket in the session's run directory where the proxy follows the caches' events: what "
                        "the worker stores and removes of the connector's blocks",
}


def worker_args(node: YrNode) -> dict[str, object]:
    """The worker's flags: those openYuanrong's vLLM deployment gives `dscli start -w`, dscli's own defaults where
    they are not the binary's (DSCLI_DEFAULTS), the paths under this session, then what both launchers tune alike
    (yrconfig.worker_tuning), the CURVE keys and etcd's TLS files."""
    validate(node)
    d = worker_dir(node)
    args: dict[str, object] = {
        "worker_address": f"{node.host_ip}:{node.ports.ds_worker}",
        "etcd_address": etcd_endpoint(node),
        "shared_memory_size_mb": node.shared_memory_mb,
        "enable_worker_worker_batch_get": True,
        **DSCLI_DEFAULTS,
        "log_dir": f"{node.deploy_path}/logs/data_system/worker",
        "ready_check_path": ready_file(node),
        "health_check_path": f"{d}/health",
        "rocksdb_store_dir": f"{d}/rocksdb",
        "unix_domain_socket_dir": f"{d}/socket",
        # the binary's default is under $HOME, shared by every worker of the machine; dscli's under its home
        "monitor_config_file": f"{d}/config/datasystem.config",
        **worker_tuning(node),
    }
    if node.curve_key_dir:
        args.update(enable_curve_zmq=True, curve_key_dir=node.curve_key_dir)
    if node.etcd_tls_dir:
        tls = node.etcd_tls_dir
        args.update(enable_etcd_auth=True, etcd_ca=f"{tls}/ca.crt", etcd_cert=f"{tls}/client.crt",
                    etcd_key=f"{tls}/client.key")
    return args


def _flag(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def worker_command(node: YrNode) -> str:
    """bash: the worker in the foreground, its libraries first on the library path, the host's after them (CANN's on
    NPU hosts: the worker's device plugin needs them). The package directory is found where the venv's Python put it
    (python3.11 or python3.12)."""
    flags = " ".join(shlex.quote(f"--{k}={_flag(v)}") for k, v in worker_args(node).items())
    pkg = f"{shlex.quote(node.ds_venv)}/lib/python3*/site-packages/yr/datasystem"
    return (f"mkdir -p {shlex.quote(worker_dir(node))} && rm -f {shlex.quote(ready_file(node))} && "
            f"d=$(ls -d {pkg} | head -n1) && "
            f'LD_LIBRARY_PATH="$d/lib${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" exec "$d/datasystem_worker" {flags}')


def etcd_command(node: YrNode, etcd_dir: str) -> str:
    """bash: a one-member etcd on the master (as openYuanrong's single-master config runs it), TLS with client
    certificates of the deployment's CA when etcd_tls_dir is set."""
    if not node.is_master:
        raise ValueError("etcd runs on the master only")
    validate(node)
    s, ip, p = _scheme(node), node.host_ip, node.ports
    peer = f"{s}://{ip}:{p.etcd_peer}"
    args = [f"{etcd_dir}/etcd", "--name", "etcd0", "--data-dir", f"{node.deploy_path}/third_party/etcd",
            "--listen-client-urls", f"{s}://{ip}:{p.etcd_client}", "--advertise-client-urls",
            f"{s}://{ip}:{p.etcd_client}", "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"etcd0={peer}", "--unsafe-no-fsync", "--auto-compaction-mode", "revision",
            "--auto-compaction-retention", "100000", "--quota-backend-bytes", str(8 << 30)]
    if node.etcd_tls_dir:
        tls = node.etcd_tls_dir
        args += ["--client-cert-auth", "--trusted-ca-file", f"{tls}/ca.crt", "--cert-file", f"{tls}/server.crt",
                 "--key-file", f"{tls}/server.key", "--peer-client-cert-auth", "--peer-trusted-ca-file",
                 f"{tls}/ca.crt", "--peer-cert-file", f"{tls}/server.crt", "--peer-key-file", f"{tls}/server.key",
                 "--cipher-suites", _CIPHERS]
    return "exec " + " ".join(shlex.quote(a) for a in args)
