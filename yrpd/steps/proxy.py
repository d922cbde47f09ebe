"""The OpenAI-compatible proxy on the master host (yrpd.proxy, run by the vLLM venv's python)."""

from __future__ import annotations

import json
import shlex

from yrpd.hostgroup import Command
from yrpd.placement import HostPlan
from yrpd.serving import PROXY_NAME, proxy_launch, proxy_members, proxy_url
from yrpd.steps import NotNeeded, StepContext, host_python
from yrpd.steps.processes import running as process_running
from yrpd.steps.processes import start_script
from yrpd.steps.processes import stop as stop_processes
from yrpd.steps.vllm_env import paths

READY_TIMEOUT = 60


def start(ctx: StepContext, host: HostPlan) -> Command | NotNeeded:
    launch = proxy_launch(ctx.spec, ctx.plan, paths(ctx))
    if launch is None:
        return NotNeeded("not disaggregated: no proxy")
    display = (f"start {PROXY_NAME} detached: {' '.join(f'{k}={v}' for k, v in launch.env.items())} {launch.command}  "
               f"(secrets from {launch.env_file}; log {ctx.layout.log(PROXY_NAME)})")
    return Command(start_script(ctx, PROXY_NAME, launch.exec_command, launch.env, env_file=launch.env_file,
                                health_url=launch.health_url),
                   display=display, timeout=60)


def write_members(ctx: StepContext, host: HostPlan, draining: frozenset[str] = frozenset()) -> Command | NotNeeded:
    """The proxy's membership file from the plan (`draining`: instance names taken out of routing), replaced whole
    by rename so the proxy never reads half of it. No check: a running proxy takes a changed file at its next probe
    round, so writing the same content again is the way to be sure it is current."""
    if not ctx.spec.disaggregated:
        return NotNeeded("not disaggregated: no proxy")
    members = shlex.quote(ctx.layout.proxy_members)
    content = shlex.quote(json.dumps(proxy_members(ctx.plan, draining)))
    return Command(f"mkdir -p {shlex.quote(ctx.layout.run_dir)} && printf '%s\\n' {content} > {members}.tmp "
                   f"&& mv -f {members}.tmp {members}",
                   display=f"write {ctx.layout.proxy_members}: " + ", ".join(
                       i.name + (" (draining)" if i.name in draining else "") for i in ctx.plan.instances), timeout=30)


def running(ctx: StepContext, host: HostPlan, **_: object) -> Command | NotNeeded:
    if not ctx.spec.disaggregated:
        return NotNeeded("not disaggregated: no proxy")
    return process_running(ctx, host, PROXY_NAME)


def wait_ready(ctx: StepContext, host: HostPlan) -> Command | NotNeeded:
    launch = proxy_launch(ctx.spec, ctx.plan, paths(ctx))
    if launch is None:
        return NotNeeded("not disaggregated: no proxy")
    # every member up in the proxy, not only one per role: a change that started instances drains the old ones
    # next, and they must not go before the proxy routes to their replacements
    members = [m["url"] for m in proxy_members(ctx.plan)["instances"]]
    target = {"name": PROXY_NAME, "url": launch.health_url, "members": members,
              "status_url": proxy_url(ctx.spec, ctx.plan) + "/yrpd/status"}
    return host_python("wait_ready.py", {**ctx.layout.for_scripts(), "timeout": READY_TIMEOUT, "targets": [target]},
                       timeout=READY_TIMEOUT + 30)


def stop(ctx: StepContext, host: HostPlan) -> Command:
    return stop_processes(ctx, host, [PROXY_NAME], grace=10)
