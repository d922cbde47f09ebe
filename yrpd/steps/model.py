"""The model on the hosts: a user's model is a path that preflight already checked; the built-in demo model is
built on each host that serves it, offline and deterministically (yrpd.demo.tiny_model)."""

from __future__ import annotations

import shlex

from yrpd.hostgroup import Command
from yrpd.placement import HostPlan
from yrpd.serving import builtin_model, model_path
from yrpd.steps import StepContext, shell_command
from yrpd.steps.vllm_env import paths


def _needs_build(ctx: StepContext, host: HostPlan) -> bool:
    return builtin_model(ctx.spec) is not None and any(h == host.name for i in ctx.plan.instances for h in i.hosts)


def build(ctx: StepContext, host: HostPlan) -> Command | None:
    if not _needs_build(ctx, host):
        return None
    p = paths(ctx)
    out = model_path(ctx.spec, p)
    script = (f"PYTHONPATH={shlex.quote(p.bundle_dir)} HF_HUB_OFFLINE=1 {shlex.quote(p.python)} "
              f"-m yrpd.demo.tiny_model --recipe {shlex.quote(builtin_model(ctx.spec))} {shlex.quote(out)}")
    return Command(script, display=f"build the demo model {builtin_model(ctx.spec)} into {out}", timeout=900)


def built(ctx: StepContext, host: HostPlan, **_: object) -> Command | None:
    if not _needs_build(ctx, host):
        return None
    out = shlex.quote(model_path(ctx.spec, paths(ctx)))
    # the builder writes its recipe file last; the recipe hash itself is re-checked by the builder if run
    return shell_command(f"[ -f {out}/yrpd_recipe.json ] && [ -f {out}/config.json ]")
