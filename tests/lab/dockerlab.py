"""A dockerd inside each fake host, FAKE Ascend driver files, and a stand-in for the vllm-ascend image.

Everything here is a stand-in, named as such:

* FAKE NPUs: the lab's private /dev holds ``davinci0..N-1``, ``davinci_manager``, ``devmm_svm`` and ``hisi_hdc``
  as character devices 1:3 (/dev/null's numbers); see lab/fakehosts.py.
* FAKE driver files (``install_fake_ascend_driver``): an ``npu-smi`` shell script printing an ``npu-smi info``
  table of the fake NPUs, a ``version.info``, empty ``dcmi`` and ``lib64`` directories, an ``hccn_tool`` script,
  ``/etc/ascend_install.info`` and an ``/etc/hccn.conf`` with one address per NPU; written through the host's
  private overlays on /usr and /etc, never onto the machine.
* The STAND-IN IMAGE (``load_standin_image``): Debian minbase with git and python3 (scripts/build_standin_rootfs.sh,
  cached under /var/cache/yrpd/standin), plus the real vllm-ascend sdist tree (scripts/fetch_vllm_ascend_sources.sh)
  as a git repository at the guide's path /vllm-workspace/vllm-ascend and a .pth file that makes python3 import
  it, as the real image's editable install does. Tagged with the production image name; no vLLM, no CANN.

One dockerd per host, started over ``nsenter`` (not SSH) with everything private: the socket, pid file and exec
root in the host's own /run, the data root in its own /var/lib/docker (a directory of the lab), cgroups below
``/yrpd-lab/<netns>``, no bridge network and no iptables (containers use host networking). Never in the root
namespace. ``DockerHosts.close()`` stops the daemons, closes the lab and removes the data roots and cgroups.
Where the machine's capability bounding set lacks capabilities (this VM drops CAP_SYS_RESOURCE), privileged
containers cannot start; the daemons then run containers through ``RUNC_WRAPPER``, a lab-only wrapper around runc
that removes exactly those capabilities from the OCI spec.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import threading
import time
from pathlib import Path

from lab.fakehosts import FakeHost, FakeHostLab

REPO = Path(__file__).resolve().parents[2]
STANDIN_BUILD = REPO / "scripts" / "build_standin_rootfs.sh"
FETCH_SOURCES = REPO / "scripts" / "fetch_vllm_ascend_sources.sh"
SOURCES = Path(os.environ.get("YRPD_VLLM_ASCEND_SRC", "/var/cache/yrpd/vllm-ascend-src"))
CGROUP_ROOT = "yrpd-lab"
TREE = "/vllm-workspace/vllm-ascend"

FAKE_NPU_SMI = r"""#!/bin/bash
# FAKE npu-smi for yrpd's lab tests: prints an `npu-smi info` table of the fake NPUs (no NPU exists here)
[ "$1" = info ] || { echo "fake npu-smi: only 'info' is faked" >&2; exit 2; }
echo "+------------------------------------------------------------------------------------------------+"
echo "| npu-smi FAKE-24.1.0 (yrpd lab)   Version: FAKE-24.1.0                                          |"
echo "+---------------------------+---------------+----------------------------------------------------+"
echo "| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|"
echo "| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |"
echo "+===========================+===============+====================================================+"
for i in $(seq 0 $((FAKE_NPUS - 1))); do
  printf '| %-5s FAKE910              | OK            | 0.0         0                 0    / 0             |\n' "$i"
  printf '| 0                         | 0000:00:0%s.0  | 0           0    / 0          0    / 65536         |\n' "$i"
  echo "+===========================+===============+====================================================+"
done
"""


# Privileged containers get every capability the kernel knows; runc fails ("unable to apply caps") where the
# machine's own bounding set lacks some (this VM drops CAP_SYS_RESOURCE). On such a machine the lab's dockerds
# use this wrapper around runc as their runtime: it removes the capabilities the bounding set lacks from the
# OCI spec (container create, and exec process specs) and runs the real runc. Nothing else changes.
RUNC_WRAPPER = "/usr/local/sbin/yrpd-lab-runc"
RUNC_WRAPPER_SCRIPT = r"""#!/bin/bash
# yrpd lab only (tests/lab/dockerlab.py): drop capabilities this machine cannot grant, then run runc
strip() { sed -i -E 'DROPS' "$1"; }
args=("$@"); cmd=""
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    create|run|exec) [ -z "$cmd" ] && cmd="${args[i]}" ;;
    --bundle|-b) bundle="${args[i+1]}" ;;
    --process|-p) process="${args[i+1]}" ;;
  esac
done
if [ "$cmd" = create ] || [ "$cmd" = run ]; then [ -f "${bundle:-.}/config.json" ] && strip "${bundle:-.}/config.json"; fi
if [ "$cmd" = exec ] && [ -n "$process" ] && [ -f "$process" ]; then strip "$process"; fi
exec runc "$@"
"""

CAP_NAMES = ["CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
             "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER",
             "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
             "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
             "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF",
             "CHECKPOINT_RESTORE"]


def missing_capabilities() -> list[str]:
    """Capabilities the kernel knows that this process's bounding set lacks (privileged containers want all)."""
    bounding = next(int(line.split()[1], 16) for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("CapBnd:"))
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    return [f"CAP_{CAP_NAMES[i]}" for i in range(min(last + 1, len(CAP_NAMES))) if not bounding >> i & 1]


def unavailable(reason: str):
    """A missing prerequisite of a docker lab test (tests/prereq.py)."""
    from tests.prereq import missing

    missing(reason)


def install_fake_ascend_driver(host: FakeHost, npus: int) -> None:
    """FAKE driver files at the paths the container profiles mount (through the host's /usr and /etc overlays)."""
    smi = FAKE_NPU_SMI.replace("$((FAKE_NPUS - 1))", str(npus - 1))
    addresses = "".join(f"address_{i}=192.168.100.{10 + i}\nnetmask_{i}=255.255.255.0\n" for i in range(npus))
    script = "\n".join([
        "set -e",
        "mkdir -p /usr/local/dcmi /usr/local/Ascend/driver/lib64 /usr/local/bin",
        "echo 'FAKE dcmi for yrpd lab tests' > /usr/local/dcmi/FAKE",
        "echo 'FAKE driver libraries for yrpd lab tests' > /usr/local/Ascend/driver/lib64/FAKE",
        "printf 'Version=FAKE-24.1.0\\nascendhal_version=FAKE\\n' > /usr/local/Ascend/driver/version.info",
        f"cat > /usr/local/bin/npu-smi <<'EOF'\n{smi}EOF",
        "printf '#!/bin/sh\\necho FAKE hccn_tool: no NPU network here >&2\\nexit 1\\n' > /usr/bin/hccn_tool",
        "chmod 755 /usr/local/bin/npu-smi /usr/bin/hccn_tool",
        "echo 'Driver_Install_Path_Param=/usr/local/Ascend  # FAKE' > /etc/ascend_install.info",
        f"printf %s {shlex.quote(addresses)} > /etc/hccn.conf",
    ])
    host.exec(script)


def start_dockerd(host: FakeHost, timeout: float = 60) -> None:
    cgroup = f"/{CGROUP_ROOT}/{host.netns}"
    args = ["dockerd", "--host", "unix:///run/docker.sock", "--pidfile", "/run/docker.pid",
            "--exec-root", "/run/docker", "--data-root", "/var/lib/docker", "--storage-driver", "overlay2",
            "--bridge", "none", "--iptables=false", "--ip6tables=false", "--cgroup-parent", cgroup,
            "--log-level", "warn"]
    lacking = missing_capabilities()
    if lacking:
        drops = ";".join(f's/,"{c}"//g;s/"{c}",?//g' for c in lacking)
        script = RUNC_WRAPPER_SCRIPT.replace("DROPS", drops)
        host.exec(f"mkdir -p {os.path.dirname(RUNC_WRAPPER)} && cat > {RUNC_WRAPPER} <<'EOF'\n{script}EOF\n"
                  f"chmod 755 {RUNC_WRAPPER}")
        args += ["--add-runtime", f"yrpd-lab-runc={RUNC_WRAPPER}", "--default-runtime", "yrpd-lab-runc"]
    host.exec(f"setsid {' '.join(args)} >> /run/dockerd.log 2>&1 < /dev/null &")
    deadline = time.monotonic() + timeout
    while host.exec("docker version >/dev/null 2>&1", check=False).returncode != 0:
        if time.monotonic() > deadline:
            log = host.exec("tail -n 30 /run/dockerd.log", check=False).stdout
            raise RuntimeError(f"dockerd on {host.name} not up after {timeout:.0f}s:\n{log}")
        time.sleep(0.2)


def stop_dockerd(host: FakeHost, timeout: float = 30) -> None:
    if not host.running:
        return
    host.exec("pid=$(cat /run/docker.pid 2>/dev/null) && kill $pid; "
              f"for i in $(seq {int(timeout * 5)}); do [ -e /run/docker.pid ] && kill -0 $pid 2>/dev/null || exit 0; "
              "sleep 0.2; done; kill -9 $pid", check=False, timeout=timeout + 10)


def standin_rootfs() -> Path:
    """The cached Debian minbase + git + python3 rootfs tar; built on first use (about 2 minutes)."""
    proc = subprocess.run([str(STANDIN_BUILD)], capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"building the stand-in rootfs failed:\n{proc.stderr[-3000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def vllm_ascend_sdist(version: str) -> Path:
    """The real vllm-ascend source distribution (cached; downloaded by the fetch script on first use)."""
    if not (SOURCES / version / "PKG-INFO").is_file():
        proc = subprocess.run([str(FETCH_SOURCES), str(SOURCES), version], capture_output=True, text=True,
                              timeout=1800, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise RuntimeError(f"fetching vllm-ascend {version} failed:\n{(proc.stderr or proc.stdout)[-2000:]}")
    return SOURCES / version


def prepare_tree(sdist: Path, dest: Path) -> Path:
    """The sdist as a git repository, as the guide's image has its clone (the patch manager uses git apply)."""
    tree = dest / "vllm-workspace" / "vllm-ascend"
    shutil.copytree(sdist, tree, symlinks=True)
    git = ["git", "-C", str(tree), "-c", "user.name=yrpd lab", "-c", "user.email=lab@yrpd.invalid"]
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    subprocess.run([*git, "add", "-A", "-f"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", f"vllm-ascend {sdist.name} sdist (stand-in for the image's clone)"],
                   check=True)
    (dest / "yrpd-standin-vllm-ascend.pth").write_text(TREE + "\n")
    return tree


def load_standin_image(host: FakeHost, rootfs: Path, staged: Path, image: str) -> None:
    """Import the rootfs, add the tree and the .pth, tag the result with the production image name."""
    host_tmp = host.dir / "tmp" / "standin"
    shutil.copytree(staged, host_tmp, symlinks=True)
    base = "yrpd-lab/standin-base:" + rootfs.stem.rsplit("-", 1)[-1]
    script = "\n".join([
        "set -e",
        f"docker image inspect {base} >/dev/null 2>&1 || docker import --change "
        f"'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' {shlex.quote(str(rootfs))} {base} >/dev/null",
        f"cid=$(docker create {base} true)",
        "docker cp /tmp/standin/vllm-workspace $cid:/",
        "docker cp /tmp/standin/yrpd-standin-vllm-ascend.pth $cid:/usr/lib/python3/dist-packages/",
        f"docker commit --change 'LABEL yrpd.lab.standin=\"FAKE vllm-ascend image: Debian minbase, git, python3 and "
        f"the vllm-ascend sdist; no vLLM, no CANN\"' $cid {shlex.quote(image)} >/dev/null",
        "docker rm $cid >/dev/null",
        "rm -rf /tmp/standin",
    ])
    host.exec(script, timeout=600)


def _rmdir_tree(path: Path) -> None:
    if not path.is_dir():
        return
    for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if child.is_dir():
            try:
                child.rmdir()
            except OSError:
                pass
    try:
        path.rmdir()
    except OSError:
        pass


def remove_cgroups(netns: str) -> None:
    """The (empty) cgroups the host's dockerd left below /yrpd-lab/<netns> in every hierarchy."""
    root = Path("/sys/fs/cgroup")
    for hierarchy in root.iterdir() if root.is_dir() else ():
        _rmdir_tree(hierarchy / CGROUP_ROOT / netns)
        try:
            (hierarchy / CGROUP_ROOT).rmdir()
        except OSError:
            pass


class DockerHosts:
    """A started FakeHostLab whose hosts each run a dockerd; close() undoes everything, also after failures."""

    def __init__(self, lab: FakeHostLab):
        self.lab = lab
        self.started: list[FakeHost] = []

    @property
    def hosts(self) -> list[FakeHost]:
        return self.lab.hosts

    def start(self, npus: int) -> "DockerHosts":
        for host in self.lab.hosts:
            self.started.append(host)
            start_dockerd(host)
            if npus:
                install_fake_ascend_driver(host, npus)
        return self

    def _on_every_host(self, action) -> None:
        """Run action(host) on every host at once; the first failure is raised after all have finished."""
        errors: list[BaseException] = []

        def one(host: FakeHost) -> None:
            try:
                action(host)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(h,)) for h in self.lab.hosts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def load_image(self, image: str, rootfs: Path, staged: Path) -> None:
        self._on_every_host(lambda host: load_standin_image(host, rootfs, staged, image))

    def load_archive(self, archive: str) -> None:
        """`docker load` an image archive on every host at once (they see this machine's files)."""
        self._on_every_host(lambda host: host.exec(f"docker load -q -i {shlex.quote(archive)}", timeout=900))

    def close(self) -> None:
        errors = []
        for host in self.started:
            try:
                stop_dockerd(host)
            except Exception as exc:
                errors.append(exc)
        try:
            self.lab.close()
        except Exception as exc:
            errors.append(exc)
        for host in self.lab.hosts:
            shutil.rmtree(host.dir / "var_lib_docker", ignore_errors=True)
            remove_cgroups(host.netns)
        if errors:
            raise errors[0]


def docker_unavailable() -> str | None:
    missing = [t for t in ("dockerd", "docker", "git") if shutil.which(t) is None]
    if not STANDIN_BUILD.is_file():
        missing.append(str(STANDIN_BUILD))
    if missing:
        return f"docker lab needs {', '.join(missing)} (scripts/bootstrap.sh installs docker.io and debootstrap)"
    return None
