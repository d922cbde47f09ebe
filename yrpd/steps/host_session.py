"""The session directory on each host (yrpd.layout) plus its `latest` link.

Made and removed on the host itself: under the docker runtime the container mounts the session root at the
same path, so the directory exists before the container and outlives it."""

from __future__ import annotations

import shlex

from yrpd.hostgroup import Command, on_host
from yrpd.placement import HostPlan
from yrpd.steps import StepContext, shell_command


def create(ctx: StepContext, host: HostPlan) -> Command:
    q, layout = shlex.quote, ctx.layout
    return on_host(shell_command(
        # secrets/ is private before anything is copied into it
        f"mkdir -p {q(layout.logs_dir)} {q(layout.run_dir)} && mkdir -p -m 700 {q(layout.secrets_dir)} && "
        f"chmod 700 {q(layout.secrets_dir)} && ln -sfn {q(ctx.session_id)} {q(layout.latest)}"
    ))


def exists(ctx: StepContext, host: HostPlan, **_: object) -> Command:
    q, layout = shlex.quote, ctx.layout
    return on_host(shell_command(f"test -d {q(layout.logs_dir)} -a -d {q(layout.run_dir)} -a -d {q(layout.secrets_dir)}"))


def purge(ctx: StepContext, host: HostPlan) -> Command:
    """Remove the host's session directory (logs included) and the latest link if it points at it."""
    q, layout = shlex.quote, ctx.layout
    sid = q(ctx.session_id)
    return on_host(shell_command(
        f'rm -rf {q(layout.dir)}; if [ "$(readlink {q(layout.latest)})" = {sid} ]; then rm -f {q(layout.latest)}; fi'
    ))
