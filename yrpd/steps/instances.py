"""The prefill and decode instances: start each detached on its host, wait for /health, stop them."""

from __future__ import annotations

import posixpath
import shlex
from dataclasses import replace

from yrpd.hostgroup import Command
from yrpd.placement import HostPlan
from yrpd.serving import launches_on_host
from yrpd.spec import KvConnector
from yrpd.steps import NotNeeded, StepContext, host_python, shell_command
from yrpd.steps.processes import _alive_test, start_scripts
from yrpd.steps.processes import stop as stop_processes
from yrpd.steps.vllm_env import paths


def _launches(ctx: StepContext, host: HostPlan):
    return launches_on_host(ctx.spec, ctx.plan, host.name, paths(ctx))


def start(ctx: StepContext, host: HostPlan) -> Command | NotNeeded:
    launches = _launches(ctx, host)
    if not launches:
        return NotNeeded("no instance on this host")
    script = start_scripts(ctx, [dict(name=launch.name, command=launch.exec_command, env=launch.env, settle=1.0,
                                      env_file=launch.env_file, health_url=launch.health_url, gang=launch.gang)
                                 for launch in launches])
    display = "\n".join(f"start {launch.name} detached: {' '.join(f'{k}={v}' for k, v in launch.env.items())} "
                        f"{launch.command}  (secrets from {launch.env_file}; log {ctx.layout.log(launch.name)})" for launch in launches)
    files = [(path, text) for launch in launches for path, text in launch.files]
    if files:  # before any process starts: a restart reads the same file
        q = shlex.quote
        script = "\n".join([*(f"mkdir -p {q(posixpath.dirname(path))} && printf '%s\\n' {q(text)} > {q(path)}"
                               for path, text in files), script])
        display = "\n".join([*(f"write {path}: {text}" for path, text in files), display])
    ray = paths(ctx).ray
    on_ray = [launch.name for launch in launches if launch.argv[0] == ray]
    if on_ray:  # one clear line here rather than a crash loop of `ray: not found` in the instance's log
        q = shlex.quote
        why = (f"{', '.join(on_ray)} run on Ray (multi_node_backend ray) and there is no {ray} here: the vllm-ascend "
               "images ship Ray beside vLLM; install it there, or set multi_node_backend: mp")
        script = f"command -v {q(ray)} >/dev/null 2>&1 || {{ echo {q(why)} >&2; exit 1; }}\n{script}"
        display = f"check that {ray} is here (Ray's CLI)\n{display}"
    return Command(script, display=display, timeout=60)


def running(ctx: StepContext, host: HostPlan, **_: object) -> Command | NotNeeded:
    tests = [_alive_test(ctx, launch.name) for launch in _launches(ctx, host)]
    return shell_command(" && ".join(f"( {t} )" for t in tests)) if tests else NotNeeded("no instance on this host")


def wait_healthy(ctx: StepContext, host: HostPlan) -> Command | NotNeeded:
    targets = [{"name": launch.name, "url": launch.health_url, **({"ds_link": True} if launch.ds_link else {})}
               for launch in _launches(ctx, host) if launch.health_url]
    if not targets:
        return NotNeeded("no instance on this host")
    timeout = ctx.spec.startup_timeout_s
    return host_python("wait_ready.py", {**ctx.layout.for_scripts(), "timeout": timeout, "targets": targets},
                       timeout=timeout + 30)


def stop(ctx: StepContext, host: HostPlan) -> Command | NotNeeded:
    launches = _launches(ctx, host)
    command = stop_processes(ctx, host, [launch.name for launch in launches], grace=20)
    # once nothing can write them any more: what the processes leave outside the session directory (Ray's temp
    # root), and the reference connector's KV files (tens of MB per prompt)
    left = [path for launch in launches for path in launch.leaves]
    if ctx.spec.kv_connector is KvConnector.example:
        left.append(ctx.layout.kv_files)
    if isinstance(command, NotNeeded) or not left:
        return command
    words = " ".join(shlex.quote(p) for p in left)
    return replace(command, script=f"{command.script}rm -rf {words}\n", display=f"{command.display}; rm -rf {words}")
