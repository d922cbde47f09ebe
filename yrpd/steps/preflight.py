"""Check the hosts: python, tools, disk, free ports, planned devices present, model path exists."""

from __future__ import annotations


from yrpd.hostgroup import Command
from yrpd.placement import HostPlan, ports_on_host
from yrpd.steps import StepContext, host_python, passed_before_with_this_spec, recording_pass


def check_hosts(ctx: StepContext, host: HostPlan) -> Command:
    model = ctx.spec.model
    args = {
        "session_root": ctx.spec.remote_session_root,
        "session": ctx.session_id,
        "min_free_disk_gb": ctx.spec.min_free_disk_gb,
        "ports": [[port, what] for port, what in ports_on_host(ctx.plan, host.name, ctx.spec)],
        "device_kind": host.kind.value,
        "devices": list(host.used),
        "model": model if model and not model.startswith("builtin:") else None,
    }
    # on the host itself, also under the docker runtime: its ports, disk, devices and model path are the host's
    return recording_pass(ctx, host_python("preflight.py", args, timeout=60), "preflight.ok")


def passed_before(ctx: StepContext, host: HostPlan, **_: object) -> Command:
    """Skip preflight on re-runs of the same session: its ports are then held by our own services."""
    return passed_before_with_this_spec(ctx, "preflight.ok")

