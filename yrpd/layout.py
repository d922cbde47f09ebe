"""Where a session's files live on each host, named in this one place.

`<remote_session_root>/<session id>/` holds `logs/<process>.log`, `run/<process>.pid` (its supervisor's pid),
`run/<process>.state.json` (what its supervisor knows), `run/supervise.py`, the connector's stats files
`run/kv-<instance>-<side>-dp<D>-rank<N>.json` (per DP engine and worker rank), `tmp/`, `secrets/` (0700: the environment files with the deployment's secrets), and `kv-files/` (KV as files, `kv_connector: example`); `<remote_session_root>/latest` links the newest session.
`HostPaths` adds where the installed parts live (the venvs, the models, the image's Python) for one session.
Steps, status and the CLI build their paths here. The host scripts (deploy_scripts/) get the paths they need in
their JSON arguments, as `{name}` templates from `for_scripts()`, so they spell none of it themselves.
"""

from __future__ import annotations

from dataclasses import dataclass


#: an instance's KV-cache event sockets in the session's run directory (the relay finds them by these names)
KV_EVENTS_SOCKET = "kv-events-{name}.sock"
KV_REPLAY_SOCKET = "kv-replay-{name}.sock"
#: the name the host's data-system worker publishes its own KV events under, as an instance would (no instance is
#: named so): what it holds of the connector's blocks (docs/dev/kv-events.md, "The data system's tiers")
DATASYSTEM_EVENTS = "datasystem"
#: the longest path a unix socket may have (sun_path, less its terminating NUL): a publisher fails to bind a longer one
MAX_UNIX_SOCKET_PATH = 107


@dataclass(frozen=True)
class HostSessionLayout:
    root: str  # the spec's remote_session_root
    session_id: str

    @property
    def dir(self) -> str:
        return f"{self.root.rstrip('/')}/{self.session_id}"

    @property
    def latest(self) -> str:
        return f"{self.root.rstrip('/')}/latest"

    @property
    def logs_dir(self) -> str:
        return f"{self.dir}/logs"

    @property
    def run_dir(self) -> str:
        return f"{self.dir}/run"

    @property
    def tmp_dir(self) -> str:
        return f"{self.dir}/tmp"

    @property
    def dirs(self) -> tuple[str, ...]:
        """What a started process needs to exist."""
        return self.logs_dir, self.run_dir, self.tmp_dir

    def log(self, name: str) -> str:
        return f"{self.logs_dir}/{name}.log"

    def pidfile(self, name: str) -> str:
        return f"{self.run_dir}/{name}.pid"

    def state(self, name: str) -> str:
        """The supervisor's state file of a process (deploy_scripts/supervise.py)."""
        return f"{self.run_dir}/{name}.state.json"

    @property
    def supervisor(self) -> str:
        return f"{self.run_dir}/supervise.py"

    @property
    def exporter(self) -> str:
        """The host's metrics exporter script (deploy_scripts/exporter.py), written there by its start step."""
        return f"{self.run_dir}/exporter.py"

    @property
    def kv_stats_glob(self) -> str:
        """Every connector stats file of the session on the host (kv_stats of each instance, side, DP engine and
        rank)."""
        return self.kv_stats_of("*")

    @property
    def proxy_members(self) -> str:
        """The proxy's membership file: which instances it routes to, which of them drain (yrpd.proxy)."""
        return f"{self.run_dir}/proxy-members.json"

    def kv_events(self, instance: str, what: str = "events") -> str:
        """The unix socket an instance publishes its KV-cache events on (`what`: "events", or "replay" for the
        one that answers what a subscriber missed): on its host only; the proxy subscribes there, or through the
        host's relay (yrpd.proxy.kvfeed, yrpd.proxy.kvrelay)."""
        return f"{self.run_dir}/" + (KV_EVENTS_SOCKET if what == "events" else KV_REPLAY_SOCKET).format(name=instance)

    def backend_config(self, launch: str) -> str:
        """vllm-ascend's yuanrong backend's JSON of one instance process (`kv_connector: ascend-store`, releases that
        read YR_CONFIG_PATH), written by the instances' start step."""
        return f"{self.run_dir}/{launch}.yr-config.json"

    def kv_stats(self, instance: str) -> str:
        """The connector's stats file per side, DP engine and rank; the connector fills in `{side}`, `{dp}` and
        `{rank}` (an instance's DP engines on one host each have TP ranks from 0: without `{dp}` they would take
        turns writing one file)."""
        return f"{self.run_dir}/kv-{instance}-{{side}}-dp{{dp}}-rank{{rank}}.json"

    def kv_stats_of(self, instance: str) -> str:
        """A glob of every stats file kv_stats names for `instance` (all sides, DP engines and ranks), and the
        names without `dp` that connectors of sessions deployed before it write until they are restarted."""
        return f"{self.run_dir}/kv-{instance}-*-rank*.json"

    @property
    def secrets_dir(self) -> str:
        """The deployment's secrets on the host (mode 0700; yrpd.credentials)."""
        return f"{self.dir}/secrets"

    @property
    def curve_dir(self) -> str:
        """The data system's CURVE keys on the host (`curve_key_dir` of every worker and the master)."""
        return f"{self.secrets_dir}/curve"

    @property
    def etcd_tls_dir(self) -> str:
        """etcd's CA and certificates on the host (the server pair on the master only)."""
        return f"{self.secrets_dir}/etcd"

    def env_file(self, kind: str) -> str:
        """The environment file a process's supervisor reads when it starts it (mode 0600)."""
        return f"{self.secrets_dir}/{kind}.env"

    @property
    def kv_files(self) -> str:
        """Where vLLM's reference connector keeps KV as files (`kv_connector: example`); `down` removes it."""
        return f"{self.dir}/kv-files"

    @property
    def client_logs(self) -> str:
        """Logs of the data-system clients yrpd's own checks start."""
        return f"{self.logs_dir}/ds-client"

    def for_scripts(self) -> dict[str, str]:
        """The templates the host scripts format with a process or instance `name`."""
        return {"dir": self.dir, "log": self.log("{name}"), "pidfile": self.pidfile("{name}"),
                "state": self.state("{name}"),
                "kv_stats": self.kv_stats_of("{name}")}


@dataclass(frozen=True)
class HostPaths:
    """Where things live on a host (the same layout on every host)."""

    env_root: str
    session: HostSessionLayout | None  # None: paths that belong to no session (the model builder)
    bundle_dir: str
    #: the Python that has vLLM when it is not yrpd's venv: a container image's own (its profile's `python`)
    image_python: str | None = None

    @property
    def vllm_venv(self) -> str:
        return f"{self.env_root}/vllm"

    @property
    def python(self) -> str:
        return self.image_python or f"{self.vllm_venv}/bin/python"

    @property
    def vllm(self) -> str:
        """The `vllm` command installed beside that Python."""
        return f"{self.python.rsplit('/', 1)[0]}/vllm" if "/" in self.python else "vllm"

    @property
    def ray(self) -> str:
        """Ray's CLI beside that Python (the vllm-ascend images ship Ray with vLLM)."""
        return f"{self.python.rsplit('/', 1)[0]}/ray" if "/" in self.python else "ray"

    def peer_venv(self, name: str) -> str:
        """A bench peer's venv of its own that also sees the vLLM venv (yrpd.peers)."""
        return f"{self.env_root}/{name}"

    @property
    def models_dir(self) -> str:
        return f"{self.env_root}/models"

    @property
    def vllm_cache(self) -> str:
        # shared by sessions: a second deploy starts from warm caches
        return f"{self.env_root}/cache/vllm"

    def stats_file(self, instance: str) -> str:
        return self.session.kv_stats(instance)
