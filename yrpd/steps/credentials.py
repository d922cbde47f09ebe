"""The deployment's secrets on the hosts (yrpd.credentials): copied over SFTP into the session's 0700 `secrets/`,
never through a command line; removed by the teardown."""

from __future__ import annotations

import shlex

from yrpd.hostgroup import Command, on_host
from yrpd.placement import HostPlan
from yrpd.serving import launches_on_host, proxy_launch
from yrpd.steps import NotNeeded, StepContext, shell_command
from yrpd.steps.vllm_env import paths

#: what `yrpd plan` shows for the controller's copy before a session exists
PLANNED_DIR = "<session>/secrets"


def _files(ctx: StepContext, host: HostPlan) -> list[str]:
    """The environment files the processes on this host read."""
    p = paths(ctx)
    wanted = [launch.env_file for launch in launches_on_host(ctx.spec, ctx.plan, host.name, p)]
    proxy = proxy_launch(ctx.spec, ctx.plan, p)
    if proxy is not None and proxy.host == host.name:
        wanted.append(proxy.env_file)
    return sorted({f for f in wanted if f})


def ship(ctx: StepContext, host: HostPlan) -> Command | NotNeeded:
    files = _files(ctx, host)
    if not files:
        return NotNeeded("no instance or proxy on this host")
    local = ctx.options.get("secrets_dir") or PLANNED_DIR
    uploads = tuple((f"{local}/{f.rsplit('/', 1)[1]}", f) for f in files)
    q = shlex.quote
    script = f"chmod 700 {q(ctx.layout.secrets_dir)} && chmod 600 {' '.join(q(f) for f in files)}"
    display = f"copy {', '.join(f.rsplit('/', 1)[1] for f in files)} from {local} to {ctx.layout.secrets_dir} (mode 0600)"
    return on_host(Command(script, display=display, timeout=60, uploads=uploads, fresh_uploads=True))


def remove(ctx: StepContext, host: HostPlan) -> Command:
    return on_host(shell_command(f"rm -rf {shlex.quote(ctx.layout.secrets_dir)}"))
