"""The session directory on each host: `<remote_session_root>/<id>/{logs,run}` plus a `latest` link.

Made and removed on the host itself: under the docker runtime the container mounts the session root at the
same path, so the directory exists before the container and outlives it."""

from __future__ import annotations

import shlex

from yrpd.hostgroup import Command, on_host
from yrpd.placement import HostPlan
from yrpd.steps import StepContext, shell_command


def create(ctx: StepContext, host: HostPlan) -> Command:
    root = shlex.quote(ctx.spec.remote_session_root.rstrip("/"))
    sid = shlex.quote(ctx.session_id)
    return on_host(shell_command(
        f"mkdir -p {root}/{sid}/logs {root}/{sid}/run && ln -sfn {sid} {root}/latest"
    ))


def exists(ctx: StepContext, host: HostPlan, **_: object) -> Command:
    d = shlex.quote(ctx.host_session_dir)
    return on_host(shell_command(f"test -d {d}/logs -a -d {d}/run"))


def purge(ctx: StepContext, host: HostPlan) -> Command:
    """Remove the host's session directory (logs included) and the latest link if it points at it."""
    root = shlex.quote(ctx.spec.remote_session_root.rstrip("/"))
    sid = shlex.quote(ctx.session_id)
    return on_host(shell_command(
        f'rm -rf {root}/{sid}; if [ "$(readlink {root}/latest)" = {sid} ]; then rm -f {root}/latest; fi'
    ))
