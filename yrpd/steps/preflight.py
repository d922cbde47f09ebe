"""Check the hosts: python, tools, disk, free ports, planned devices present, model path exists."""

from __future__ import annotations

import shlex

from yrpd.hostgroup import Command, on_host
from yrpd.placement import HostPlan, ports_on_host
from yrpd.steps import StepContext, host_python, shell_command


def check_hosts(ctx: StepContext, host: HostPlan) -> Command:
    model = ctx.spec.model
    args = {
        "session_root": ctx.spec.remote_session_root,
        "min_free_disk_gb": ctx.spec.min_free_disk_gb,
        "ports": [[port, what] for port, what in ports_on_host(ctx.plan, host.name)],
        "device_kind": host.kind.value,
        "devices": list(host.used),
        "model": model if model and not model.startswith("builtin:") else None,
    }
    check = host_python("preflight.py", args, timeout=60)
    marker = shlex.quote(f"{ctx.host_session_dir}/preflight.ok")
    record = f"mkdir -p {shlex.quote(ctx.host_session_dir)} && echo {shlex.quote(ctx.spec_hash)} > {marker}"
    # on the host itself, also under the docker runtime: its ports, disk, devices and model path are the host's
    return Command(script=f"{check.script}\n{record}", display=check.display, timeout=check.timeout, on_host=True)


def passed_before(ctx: StepContext, host: HostPlan, **_: object) -> Command:
    """Skip preflight on re-runs of the same session: its ports are then held by our own services."""
    marker = f"{ctx.host_session_dir}/preflight.ok"
    return on_host(shell_command(f"grep -qx {shlex.quote(ctx.spec_hash)} {shlex.quote(marker)} 2>/dev/null"))

