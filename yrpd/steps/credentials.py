"""The deployment's secrets on the hosts (yrpd.credentials): copied over SFTP into the session's 0700 `secrets/`,
never through a command line; removed by the teardown."""

from __future__ import annotations

import shlex

from yrpd import credentials
from yrpd.hostgroup import Command, on_host
from yrpd.placement import HostPlan
from yrpd.serving import launches_on_host, proxy_launch
from yrpd.steps import StepContext, shell_command
from yrpd.steps.vllm_env import paths

#: what `yrpd plan` shows for the controller's copy before a session exists
PLANNED_DIR = "<session>/secrets"


def _env_files(ctx: StepContext, host: HostPlan) -> list[str]:
    """The environment files the processes on this host read; every host's data system checks read theirs."""
    p = paths(ctx)
    wanted = [launch.env_file for launch in launches_on_host(ctx.spec, ctx.plan, host.name, p)]
    proxy = proxy_launch(ctx.spec, ctx.plan, p)
    if proxy is not None and proxy.host == host.name:
        wanted.append(proxy.env_file)
    wanted.append(ctx.layout.env_file(credentials.DATASYSTEM))
    return sorted({f for f in wanted if f})


def ship(ctx: StepContext, host: HostPlan) -> Command:
    """Before anything that needs them starts: the data system's keys to every host, the environment files to
    the hosts whose processes read them."""
    files = _env_files(ctx, host)
    local = ctx.options.secrets_dir or PLANNED_DIR
    layout = ctx.layout
    uploads = tuple((f"{local}/{f.rsplit('/', 1)[1]}", f) for f in files)
    uploads += tuple((f"{local}/{credentials.CURVE_DIR}/{name}", f"{layout.curve_dir}/{name}")
                     for name in credentials.CURVE_FILES)
    etcd = credentials.ETCD_SERVER_FILES + credentials.ETCD_CLIENT_FILES[1:] if host.is_master else \
        credentials.ETCD_CLIENT_FILES
    uploads += tuple((f"{local}/{credentials.ETCD_DIR}/{name}", f"{layout.etcd_tls_dir}/{name}") for name in etcd)
    q = shlex.quote
    script = (f"chmod -R go-rwx {q(layout.secrets_dir)} && chmod 700 {q(layout.secrets_dir)} "
              f"{q(layout.curve_dir)} {q(layout.curve_dir)}/worker_authorized_clients {q(layout.etcd_tls_dir)}")
    names = [f.rsplit('/', 1)[1] for f in files] + [f"{credentials.CURVE_DIR}/ (the data system's keys)",
                                                    f"{credentials.ETCD_DIR}/ (etcd's TLS files)"]
    display = f"copy {', '.join(names)} from {local} to {layout.secrets_dir} (owner only)"
    return on_host(Command(script, display=display, timeout=60, uploads=uploads, fresh_uploads=True))


def remove(ctx: StepContext, host: HostPlan) -> Command:
    return on_host(shell_command(f"rm -rf {shlex.quote(ctx.layout.secrets_dir)}"))
