"""Steps of the docker runtime: Ascend preflight, the container per host, the patch series in it, the derived
image, removal. Under runtime host every step but the NPU preflight is a no-op (run gives None, check `true`).

Where each runs: the preflight, `ensure`, `commit` and `remove` act on the host itself (the container engine
lives there; their commands are marked `on_host`); `patch` runs inside the container like every other step
of a docker deployment (yrpd.hostgroup.ContainerRunner wraps those into `docker exec`).

Options (StepContext.options, from `yrpd deploy`): `recreate` replaces a container whose spec differs
instead of refusing; `pull` is never (default), missing or always.
"""

from __future__ import annotations

import shlex
from functools import lru_cache

from yrpd.containers import ContainerRun, Mount, container_name, container_run, \
    derived_image
from yrpd.hostgroup import Command, on_host
from yrpd.placement import HostPlan
from yrpd.spec import DeviceKind, Runtime
from yrpd.steps import NotNeeded, StepContext, host_python, passed_before_with_this_spec, recording_pass, shell_command
from yrpd import patches
from yrpd.assets import patches_dir
from yrpd.steps.vllm_env import bundle, bundle_archive, paths, unpack_script
from yrpd.versions import OPENYUANRONG

PULL_POLICIES = ("never", "missing", "always")
#: the Ascend driver's files the preflight reads (the profile mounts the same paths)
NPU_SMI = "/usr/local/bin/npu-smi"
DRIVER_VERSION_FILE = "/usr/local/Ascend/driver/version.info"
HCCN_CONF = "/etc/hccn.conf"


def docker(ctx: StepContext) -> bool:
    return ctx.spec.runtime is Runtime.docker


def engine(ctx: StepContext) -> str:
    return ctx.spec.container_engine.value


def name(ctx: StepContext) -> str:
    return container_name(ctx.session_id)


def hccl_across_hosts(ctx: StepContext) -> bool:
    """Whether collective communication (HCCL) crosses hosts: only when an instance's ranks span hosts. A PD
    deployment whose instances each fit one host moves KV through the data system, not HCCL, so it needs neither
    hccn_tool nor /etc/hccn.conf."""
    return any(len(inst.hosts) > 1 for inst in ctx.plan.instances)


def pull_policy(ctx: StepContext) -> str:
    return ctx.options.pull


def deployment_mounts(ctx: StepContext) -> list[Mount]:
    """What the deployment adds to the profile's mounts: the session directories (logs and pid files stay
    readable on the host and outlive the container) and the model, read-only."""
    mounts = [Mount(source=ctx.spec.remote_session_root.rstrip("/"), create=True,
                    purpose="yrpd's session directories")]
    model = ctx.spec.model
    if model and model.startswith("/"):
        mounts.append(Mount(source=model.rstrip("/"), read_only=True, purpose="the model"))
    # the installs run inside the container: what the spec points them at on the host must be there too
    if ctx.spec.wheels:
        mounts.append(Mount(source=ctx.spec.wheels.rstrip("/"), read_only=True, purpose="wheels (the spec's wheels)"))
    if ctx.spec.env_path:
        mounts.append(Mount(source=ctx.spec.env_path.rstrip("/"),
                            purpose="prepared environments (the spec's env_path; models and caches are written there)"))
    else:
        # vLLM keeps what it learns of a model's code (model info, found in a subprocess that imports the model: 9.5
        # CPU-s on CPU) and its compiled graphs under VLLM_CACHE_ROOT: on the host, each new container starts warm
        mounts.append(Mount(source=paths(ctx).vllm_cache, create=True, purpose="vLLM's caches, kept across containers"))
    return mounts


def run_spec(ctx: StepContext, host: HostPlan) -> ContainerRun:
    npus = host.used if host.kind is DeviceKind.npu else ()
    return container_run(ctx.profile, name=name(ctx), image=ctx.spec.image, npus=npus,
                         mounts=deployment_mounts(ctx), multi_host=hccl_across_hosts(ctx), session_id=ctx.session_id,
                         engine=engine(ctx))


@lru_cache(maxsize=1)
def series_digest() -> str:
    """Identity of every shipped patch series together (any change makes a new derived image)."""
    import hashlib

    digests = sorted(f"{s.id} {s.digest()}" for s in patches.load_all(patches.default_root()))
    return hashlib.sha256("\n".join(digests).encode()).hexdigest()[:16]


def derived_inputs(ctx: StepContext) -> dict:
    """Everything yrpd puts into the container before it is committed."""
    p = ctx.profile
    inputs = {"schema": "yrpd.derived-image/1", "patches": series_digest(), "host_code": bundle()[0],
              "openyuanrong": OPENYUANRONG, "datasystem": ctx.spec.datasystem_version, "env_root": ctx.spec.env_root,
              "source_tree": p.source_tree, "reinstall": p.reinstall, "patch_bundle": patch_bundle()[0]}
    brought = ctx.spec.brought_data_system()
    if brought is not None:  # the user's build of that version: another build is another image
        inputs["datasystem_wheels"] = brought.digest
    return inputs


def derived(ctx: StepContext) -> str:
    return derived_image(ctx.spec.image, derived_inputs(ctx))


def _runtime_args(ctx: StepContext, action: str, **extra) -> dict:
    return {"action": action, "engine": engine(ctx), "name": name(ctx), "image": ctx.spec.image,
            "derived": derived(ctx), **extra}


# -- preflight -----------------------------------------------------------------------------------

def preflight(ctx: StepContext, host: HostPlan) -> Command | NotNeeded:
    """NPU hosts: device nodes, `npu-smi info`, driver version, hccn.conf across hosts. Docker runtime: the
    engine answers, the image is here (or --pull), every mount source the profile needs exists."""
    npu = None
    if host.kind is DeviceKind.npu:
        extra = ctx.profile.devices if docker(ctx) else ["/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"]
        npu = {"devices": list(host.used), "npu_device": ctx.profile.npu_device if docker(ctx) else "/dev/davinci{id}",
               "nodes": list(extra), "npu_smi": NPU_SMI, "version_file": DRIVER_VERSION_FILE,
               "hccn_conf": HCCN_CONF if hccl_across_hosts(ctx) and host.used else None}
    box = None
    if docker(ctx):
        required = [m for m in ctx.profile.mounts_for(hccl_across_hosts(ctx)) if not m.create]
        box = {"engine": engine(ctx), "image": ctx.spec.image, "derived": derived(ctx), "pull": pull_policy(ctx),
               "mounts": [[m.source, m.purpose] for m in required]}
    if npu is None and box is None:
        return NotNeeded("runtime host, no NPUs")
    return recording_pass(ctx, host_python("ascend_preflight.py", {"npu": npu, "container": box}, timeout=90),
                          "ascend_preflight.ok")


def preflight_passed(ctx: StepContext, host: HostPlan, **_: object) -> Command | NotNeeded:
    if host.kind is not DeviceKind.npu and not docker(ctx):
        return NotNeeded("runtime host, no NPUs")
    return passed_before_with_this_spec(ctx, "ascend_preflight.ok")


# -- the container ---------------------------------------------------------------------------------

def ensure(ctx: StepContext, host: HostPlan) -> Command | NotNeeded:
    """Create the host's container, or reuse it when its spec label matches; a different spec is refused
    (naming the difference) unless --recreate. Starts from the derived image when it is there."""
    if not docker(ctx):
        return NotNeeded("runtime host")
    run = run_spec(ctx, host)
    p = ctx.profile
    mounts = [[m.source, m.create, m.purpose] for m in [*p.mounts_for(hccl_across_hosts(ctx)), *deployment_mounts(ctx)]]
    args = _runtime_args(ctx, "ensure", argv=run.argv[1:], image_index=run.image_index - 1, spec=run.spec,
                         spec_hash=run.spec_hash, recreate=ctx.options.recreate,
                         pull=pull_policy(ctx), mounts=mounts)
    cmd = host_python("container_runtime.py", args, timeout=900 if pull_policy(ctx) == "never" else 3900)
    shown = " ".join("yrpd.args=<the spec as JSON>" if w.startswith("yrpd.args=") else shlex.quote(w) for w in run.argv)
    return on_host(Command(cmd.script, display=f"create or reuse container {name(ctx)} (from the derived image "
                                               f"{derived(ctx)} where present): {shown}", timeout=cmd.timeout))


def ensured(ctx: StepContext, host: HostPlan, **_: object) -> Command | NotNeeded:
    if not docker(ctx):
        return NotNeeded("runtime host")
    want = f"true {run_spec(ctx, host).spec_hash}"
    fmt = "{{.State.Running}} {{index .Config.Labels \"yrpd.spec\"}}"
    return on_host(shell_command(
        f"[ \"$({engine(ctx)} inspect -f {shlex.quote(fmt)} {shlex.quote(name(ctx))} 2>/dev/null)\" = {shlex.quote(want)} ]"))


def remove(ctx: StepContext, host: HostPlan) -> Command | NotNeeded:
    """Remove the host's container of the session (its processes were stopped by the steps before)."""
    if not docker(ctx):
        return NotNeeded("runtime host")
    return on_host(host_python("container_runtime.py", {"action": "remove", "engine": engine(ctx), "name": name(ctx)},
                               timeout=180))


# -- the patch series and the derived image ------------------------------------------------------

@lru_cache(maxsize=1)
def patch_bundle() -> tuple[str, str]:
    """yrpd's patch manager and the shipped series, as one content-addressed bundle for the container."""
    from pathlib import Path

    pkg = Path(__file__).resolve().parent.parent
    files = [(f"yrpd/{n}", pkg / n) for n in ("__init__.py", "errors.py", "patches.py")]
    root = patches_dir()
    files += [(f"patches/{p.relative_to(root).as_posix()}", p) for p in sorted(root.rglob("*"))
              if p.is_file() and (p.suffix == ".patch" or p.name == "manifest.yaml")]
    return bundle_archive(files)


def _patch_paths(ctx: StepContext) -> tuple[str, str]:
    digest = patch_bundle()[0]
    return f"{ctx.spec.env_root}/lib/yrpd-patch-{digest}", f"{ctx.spec.env_root}/state/patched-{digest}.json"


def patch(ctx: StepContext, host: HostPlan) -> Command | NotNeeded:
    """In the container: apply the series for its vllm-ascend tree (already applied: nothing changes),
    reinstall only when it changed, and check python3 imports the patched tree."""
    if not docker(ctx):
        return NotNeeded("runtime host")
    if ctx.profile.source_tree is None:
        return NotNeeded("the container profile names no vllm-ascend tree")
    bundle_dir, marker = _patch_paths(ctx)
    p = ctx.profile
    # the image's own Python: the one whose import of vllm-ascend must come from the patched tree
    run = host_python("container_patch.py", {"bundle": bundle_dir, "tree": p.source_tree, "reinstall": p.reinstall,
                                             "marker": marker}, timeout=1800, python=p.python)
    unpack = f"if [ ! -f {shlex.quote(bundle_dir)}/.complete ]; then\n{unpack_script(bundle_dir, patch_bundle()[1])}\nfi"
    return Command(f"{unpack}\n{run.script}", display=f"unpack yrpd's patch manager and series into {bundle_dir}; "
                                                     f"{run.display}", timeout=run.timeout)


def patched(ctx: StepContext, host: HostPlan, **_: object) -> Command | NotNeeded:
    if not docker(ctx):
        return NotNeeded("runtime host")
    if ctx.profile.source_tree is None:
        return NotNeeded("the container profile names no vllm-ascend tree")
    return shell_command(f"[ -f {shlex.quote(_patch_paths(ctx)[1])} ]")


def commit(ctx: StepContext, host: HostPlan) -> Command | NotNeeded:
    """Commit the patched container (with yrpd's packages installed) as the derived image; later deploys with
    the same inputs start from it and skip the patch and install steps."""
    if not docker(ctx):
        return NotNeeded("runtime host")
    return on_host(host_python("container_runtime.py", _runtime_args(ctx, "commit"), timeout=1860))


def committed(ctx: StepContext, host: HostPlan, **_: object) -> Command | NotNeeded:
    """Done when the container runs the derived image, or the derived image was made from the container's image."""
    if not docker(ctx):
        return NotNeeded("runtime host")
    e, c, d = engine(ctx), shlex.quote(name(ctx)), shlex.quote(derived(ctx))
    fmt = shlex.quote("{{.Id}} {{index .Config.Labels \"yrpd.base-id\"}}")
    return on_host(shell_command(
        f"img=$({e} inspect -f '{{{{.Image}}}}' {c} 2>/dev/null) && [ -n \"$img\" ] && "
        f"have=$({e} image inspect -f {fmt} {d} 2>/dev/null) && case \" $have \" in *\" $img \"*) exit 0;; esac; exit 1"))
