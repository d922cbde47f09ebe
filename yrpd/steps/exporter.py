"""Every host's metrics exporter (deploy_scripts/exporter.py): the data system worker's figures and the KV
connector's counters in the Prometheus format. Written into the session's run directory and started under its
supervisor like the instances; the teardown stops it with everything else of the session."""

from __future__ import annotations

import json
import shlex

from yrpd.assets import deploy_script
from yrpd.hostgroup import Command
from yrpd.placement import HostPlan
from yrpd.serving import EXPORTER_NAME
from yrpd.steps import StepContext
from yrpd.steps.cluster import deploy_path
from yrpd.steps.processes import running as process_running
from yrpd.steps.processes import start_script, supervisor_install


def start(ctx: StepContext, host: HostPlan) -> Command:
    q = shlex.quote
    path = ctx.layout.exporter
    body = deploy_script("exporter.py")
    assert "YRPD_EXPORTER_END" not in body
    port = ctx.spec.ports.exporter
    args = {"host": host.reach_ip, "port": port, "host_name": host.name, "stats": ctx.layout.kv_stats_glob,
            "resource_log": f"{deploy_path(ctx)}/logs/data_system/worker/resource.log"}
    # its arguments in a file: on its command line the resource.log path would name the cluster's directory, and
    # the cluster's teardown keeps that directory's data while a process names it (yr_cluster.py stop)
    config = f"{path.removesuffix('.py')}.json"
    # -I: the host's own Python, nothing of its site-packages or environment (the script is stdlib only)
    command = f"python3 -I {q(path)} {q(config)}"
    script = "\n".join([supervisor_install(ctx),
                        f"cat > {q(path)}.$$ <<'YRPD_EXPORTER_END' && mv -f {q(path)}.$$ {q(path)}\n{body}\n"
                        "YRPD_EXPORTER_END",
                        f"printf '%s\\n' {q(json.dumps(args, sort_keys=True))} > {q(config)}",
                        start_script(ctx, EXPORTER_NAME, command, health_url=f"http://{host.reach_ip}:{port}/health",
                                     installed=True)])
    return Command(script, display=f"write {path} (deploy_scripts/exporter.py) and start it detached: {command}  "
                                   f"(log {ctx.layout.log(EXPORTER_NAME)})", timeout=60)


def running(ctx: StepContext, host: HostPlan, **_: object) -> Command:
    return process_running(ctx, host, EXPORTER_NAME)
