"""The session directory on each host: `<remote_session_root>/<id>/{logs,run}` plus a `latest` link."""

from __future__ import annotations

import shlex

from yrpd.hostgroup import Command
from yrpd.placement import HostPlan
from yrpd.steps import StepContext, shell_command


def create(ctx: StepContext, host: HostPlan) -> Command:
    root = shlex.quote(ctx.spec.remote_session_root.rstrip("/"))
    sid = shlex.quote(ctx.session_id)
    return shell_command(
        f"mkdir -p {root}/{sid}/logs {root}/{sid}/run && ln -sfn {sid} {root}/latest"
    )


def exists(ctx: StepContext, host: HostPlan, **_: object) -> Command:
    d = shlex.quote(ctx.host_session_dir)
    return shell_command(f"test -d {d}/logs -a -d {d}/run")


def purge(ctx: StepContext, host: HostPlan) -> Command:
    """Remove the host's session directory (logs included) and the latest link if it points at it."""
    root = shlex.quote(ctx.spec.remote_session_root.rstrip("/"))
    sid = shlex.quote(ctx.session_id)
    return shell_command(
        f'rm -rf {root}/{sid}; if [ "$(readlink {root}/latest)" = {sid} ]; then rm -f {root}/latest; fi'
    )
