"""Fake hosts on one machine, reachable over real SSH, for yrpd's tests.

Each fake host is

* a network namespace ``<prefix>h<i>`` whose ``eth0`` is one end of a veth pair;
  the other end (``<prefix>v<i>``) is a port of the lab bridge ``<prefix>br``.
  The bridge holds ``.1`` of a private /24 that overlaps no address or route of
  the machine; hosts get ``.11``, ``.12``, ...  No default route, no forwarding:
  the root namespace and the hosts talk over the bridge only.
* inside it, ``unshare --mount --uts --pid --fork --kill-child --mount-proc
  --propagation private`` running a short setup script that sets the hostname,
  mounts a fresh tmpfs on ``/run``, binds private ``/root`` and ``/etc/ssh``
  (and the private ``/tmp`` last, because the earlier steps read from the lab's
  work directory, which usually lives under ``/tmp``), then execs
  ``sshd -D -e -f /etc/ssh/sshd_config``.  sshd is PID 1 of the host's pid
  namespace: it reaps orphans, and killing it kills every process of the host.

PATH and python3 inside hosts: the private ``/root`` would hide pyenv
(``/root/.pyenv``), so the real ``/root/.pyenv`` is bind-mounted read-only into
each host's ``/root``.  sshd has ``PermitUserEnvironment PATH`` and each host's
``/root/.ssh/environment`` sets ``PATH=HOST_PATH`` (pyenv's global version's bin
directory, then its shims), which works for every command run over SSH whatever
the shell.  Debian's
``/etc/profile`` resets PATH for root in login shells, so ``/root/.profile``
exports it again.  ``command -v python3`` over SSH gives
``/root/.pyenv/versions/<global>/bin/python3`` (pyenv's global 3.11, not its shim).  ``FakeHost.exec`` uses
the same PATH.

Housekeeping: every lab holds an exclusive flock on
``/run/yrpd-lab/<prefix>.lock`` for its lifetime.  ``cleanup_stale()`` removes
namespaces and links named ``yl...`` whose lock is not held (their lab crashed
or was killed), so parallel labs of other pytest processes are left alone.
Open labs are also closed by an atexit hook.

Options for container tests (all off by default):

* ``fake_npus=N``: a private ``/dev`` (tmpfs with the usual nodes, devpts, shm)
  holding FAKE Ascend device nodes ``davinci0..N-1``, ``davinci_manager``,
  ``devmm_svm`` and ``hisi_hdc``.  They are character devices with /dev/null's
  numbers (1:3): they exist, docker can pass them to containers, and reading
  them gives nothing.  No NPU stands behind them.
* ``overlays=("/usr", "/etc")``: a private writable overlay on each path (upper
  dir under the host's directory), so a test can put fake driver files such as
  ``/usr/local/bin/npu-smi`` into a host without touching the machine.
* ``private_shm=True``: a fresh tmpfs on ``/dev/shm``, as separate machines have (``fake_npus`` brings one
  too).  vLLM tells the ranks of one node from those of others by whether they open each other's shared memory:
  on a ``/dev/shm`` the hosts share, two hosts' ranks of one TP group take each other for one node and wait on
  sockets in each other's private ``/tmp``.
* ``docker=True``: a private ``/var/lib/docker`` and the cgroup hierarchies
  mounted again under ``/sys/fs/cgroup`` (``ip netns exec`` mounts a fresh sysfs
  whose ``/sys/fs/cgroup`` is empty), so a dockerd can run inside the host with
  its defaults (socket, pid file and exec root land in the private ``/run``).
  Starting dockerd is the test's business (tests/lab/dockerlab.py).  The bridge is subject to br_netfilter
(``bridge-nf-call-iptables=1`` here): host-to-host traffic would be dropped if
something set the iptables FORWARD policy to DROP (dockerd in the root
namespace does).
"""

from __future__ import annotations

import atexit
import fcntl
import ipaddress
import json
import os
import random
import re
import shlex
import signal
import socket
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

PREFIX_ROOT = "yl"
LOCK_DIR = Path("/run/yrpd-lab")
SSHD = "/usr/sbin/sshd"
PYENV_ROOT = Path("/root/.pyenv")


def _pyenv_python_dir() -> str:
    """The bin directory of pyenv's global Python, or "" without pyenv. A host's python3 is a binary on PATH; pyenv's
    shim is a bash script that costs about 0.1 s of CPU a call, which every host-side script would pay here only."""
    try:
        prefix = subprocess.run([str(PYENV_ROOT / "bin" / "pyenv"), "prefix"], capture_output=True, text=True,
                                timeout=10, env={**os.environ, "PYENV_ROOT": str(PYENV_ROOT)}).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{prefix}/bin:" if prefix and Path(prefix, "bin", "python3").exists() else ""


HOST_PATH = (f"{_pyenv_python_dir()}/root/.pyenv/shims:/root/.pyenv/bin:"
             "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
HOST_ENV = {
    "PATH": HOST_PATH,
    "HOME": "/root",
    "USER": "root",
    "LOGNAME": "root",
    "SHELL": "/bin/bash",
    "LANG": "C.UTF-8",
}
# Candidate lab subnets: 10.200.0.0/24 .. 10.254.255.0/24.
_SUBNET_SECOND_OCTETS = range(200, 255)
_MAX_HOSTS = 200  # .11 .. .210; with a 10-char prefix names stay within IFNAMSIZ (15)
_START_TIMEOUT = 15.0
_DELAY_QUEUE = 7  # the netfilter queue a degraded host's delayed packets wait in (one per netns)

_LAB_SUFFIX = re.compile(r"h\d+|v\d+|br")  # names are <prefix><suffix>

_live_labs: set["FakeHostLab"] = set()
_live_lock = threading.Lock()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], text=True, capture_output=True, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _ns_key(path: str) -> tuple[int, int] | None:
    """Identity of a namespace file (``/proc/PID/ns/KIND`` or ``/run/netns/NAME``)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _pids_in_ns(kind: str, key: tuple[int, int] | None) -> list[int]:
    """Root-namespace PIDs of all live processes in the given namespace."""
    if key is None:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _ns_key(f"/proc/{entry}/ns/{kind}") == key:
            pids.append(int(entry))
    return pids


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _kill_and_wait(pids: list[int], timeout: float = 10.0) -> list[int]:
    """SIGKILL pids and wait until they are dead (or zombies); returns survivors."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    remaining = [p for p in pids if _alive(p)]
    while remaining and time.monotonic() < deadline:
        time.sleep(0.02)
        remaining = [p for p in remaining if _alive(p)]
    return remaining


def _children(ppids: set[int]) -> dict[int, int]:
    """Map parent PID -> one child PID, for the given parents."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid in ppids:
            found[ppid] = int(entry)
    return found


def _link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def _wait_links_gone(names: list[str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_link_exists(n) for n in names) and time.monotonic() < deadline:
        time.sleep(0.02)


def _netns_names() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _link_names() -> list[str]:
    out = _ip("-j", "link", "show", check=False).stdout or "[]"
    return [link["ifname"] for link in json.loads(out)]


def _destroy_netns(name: str) -> None:
    """Kill every process in the named netns, then delete it."""
    survivors = _kill_and_wait(_pids_in_ns("net", _ns_key(f"/run/netns/{name}")))
    if survivors:
        raise RuntimeError(f"processes {survivors} in netns {name} survive SIGKILL")
    _ip("netns", "del", name, check=False)


def _lock_is_held(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def cleanup_stale(prefix_root: str = PREFIX_ROOT) -> list[str]:
    """Remove namespaces and links of crashed labs; returns what was removed.

    An object named ``<prefix_root>...`` is stale unless it belongs to a lab
    whose lock file is still locked.  Objects are listed before the locks are
    read: a lab takes its lock before creating anything, so a lab starting
    concurrently is never mistaken for a stale one.
    """
    netns = [n for n in _netns_names() if n.startswith(prefix_root)]
    links = [n for n in _link_names() if n.startswith(prefix_root)]
    live = []
    stale_locks = []
    if LOCK_DIR.is_dir():
        for lock in LOCK_DIR.glob(f"{prefix_root}*.lock"):
            if _lock_is_held(lock):
                live.append(lock.name[:-len(".lock")])
            else:
                stale_locks.append(lock)

    def stale(name: str) -> bool:
        return not any(name.startswith(p) and _LAB_SUFFIX.fullmatch(name[len(p):])
                       for p in live)

    removed = []
    for name in filter(stale, netns):
        _destroy_netns(name)
        removed.append(f"netns {name}")
    # Deleting a veth removes its peer; deleting the bridge detaches its ports.
    stale_links = [n for n in links if stale(n)]
    for name in stale_links:
        if _link_exists(name):
            _ip("link", "del", name, check=False)
            removed.append(f"link {name}")
    _wait_links_gone(stale_links)
    for lock in stale_locks:
        # Only unlink when we can lock it: a lab may have just created it.
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            lock.unlink(missing_ok=True)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
    return removed


def _keygen(path: Path, comment: str) -> subprocess.Popen:
    for p in (path, path.with_name(path.name + ".pub")):
        p.unlink(missing_ok=True)
    return subprocess.Popen(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


class FakeHost:
    """One fake host.  Created by FakeHostLab; do not instantiate directly."""

    def __init__(self, name: str, address: str, netns: str, veth: str, dir: Path,
                 fake_npus: int = 0, overlays: tuple[str, ...] = (), docker: bool = False,
                 private_shm: bool = False):
        self.name = name
        self.fake_npus = fake_npus
        self.overlays = overlays
        self.docker = docker
        self.private_shm = private_shm
        self.address = address
        self.netns = netns
        self.veth = veth
        self.dir = dir
        self.sshd_log = dir / "sshd.log"
        self.sshd_pid = 0
        self._proc: subprocess.Popen | None = None  # the `ip netns exec unshare ...` process
        self._pidfd: int | None = None
        self._pidns: tuple[int, int] | None = None

    def __repr__(self) -> str:
        return f"FakeHost({self.name!r}, {self.address!r}, sshd_pid={self.sshd_pid})"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and self.sshd_pid > 0

    def exec(self, cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run ``bash -c cmd`` inside the host (all its namespaces), cwd /root."""
        if not self.running:
            raise RuntimeError(f"fake host {self.name} is not running")
        args = ["nsenter", "-t", str(self.sshd_pid), "-a", "--wd=/root", "bash", "-c", cmd]
        # Own session so that a timeout can kill nsenter's child, which runs in
        # the host's pid namespace but stays in this process group.
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=HOST_ENV,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(args, timeout, out, err) from None
        result = subprocess.CompletedProcess(args, proc.returncode, out, err)
        if check:
            result.check_returncode()
        return result

    def pids(self) -> list[int]:
        """Root-namespace PIDs of the host's processes, except its sshd (PID 1)."""
        if not self.running:
            return []
        return [p for p in _pids_in_ns("pid", self._pidns) if p != self.sshd_pid]

    def processes(self) -> list[str]:
        """Command lines of the host's processes, except its sshd (PID 1)."""
        lines = []
        for pid in self.pids():
            try:
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if raw:
                lines.append(raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace"))
        return lines

    def stop_sshd(self) -> None:
        """Kill the host's sshd and with it every process of the host; idempotent."""
        self._signal_sshd()
        if self._proc is not None:
            try:
                # unshare exits once its child (the pid namespace's init) is
                # reaped, and the kernel reaps init only after all the other
                # processes of the namespace have died.
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()  # SIGKILL; unshare ignores SIGTERM
                self._proc.wait(timeout=10)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _signal_sshd(self) -> None:
        if self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif self._proc is not None and self._proc.poll() is None:
            # sshd never seen: kill unshare, --kill-child takes its child down.
            self._proc.kill()

    def _launch(self) -> None:
        d = shlex.quote(str(self.dir))
        setup = [
            "set -e",
            f"hostname {shlex.quote(self.name)}",
            "mount -t tmpfs -o mode=0755 tmpfs /run",
            "mkdir -m 0755 /run/sshd",
        ]
        if PYENV_ROOT.is_dir():
            setup.append(f"mount --bind -o ro {PYENV_ROOT} {d}/root/.pyenv")
        setup += self._container_setup()
        setup += [
            f"mount --rbind {d}/root /root",
            f"mount --bind {d}/etc_ssh /etc/ssh",
            f"mount --bind {d}/tmp /tmp",
            f"exec {SSHD} -D -e -f /etc/ssh/sshd_config",
        ]
        with open(self.sshd_log, "ab") as logf:
            self._proc = subprocess.Popen(
                ["ip", "netns", "exec", self.netns,
                 "unshare", "--mount", "--uts", "--pid", "--fork", "--kill-child",
                 "--mount-proc", "--propagation", "private",
                 "bash", "-c", "\n".join(setup)],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                start_new_session=True, env=HOST_ENV)

    def _container_setup(self) -> list[str]:
        """Setup lines for the container-test options (see the module docstring); none by default."""
        d = shlex.quote(str(self.dir))
        lines = []
        for i, path in enumerate(self.overlays):
            upper, work = f"{d}/overlay/{i}/upper", f"{d}/overlay/{i}/work"
            lines += [f"mkdir -p {upper} {work}",
                      f"mount -t overlay overlay -o lowerdir={shlex.quote(path)},upperdir={upper},workdir={work} "
                      f"{shlex.quote(path)}"]
        if self.fake_npus:
            lines += _private_dev_lines(f"{d}/devfs", self.fake_npus)
        elif self.private_shm:
            lines += ["mount -t tmpfs -o mode=1777 shm /dev/shm"]
        if self.docker:
            # /var has an overlay (FakeHostLab adds it), so the mount point can be made without touching the
            # machine; the data root itself is a plain directory: overlay2 cannot sit on an overlay
            lines += ["mkdir -p /var/lib/docker", f"mount --bind {d}/var_lib_docker /var/lib/docker",
                      "mount -t tmpfs -o mode=0755 cgroup /sys/fs/cgroup"]
            for mountpoint, fstype, options in _cgroup_mounts():
                lines += [f"mkdir -p {mountpoint}", f"mount -t {fstype} -o {options} {fstype} {mountpoint}"]
        return lines

    def _attach(self, pid: int) -> None:
        self._pidfd = os.pidfd_open(pid)
        self._pidns = _ns_key(f"/proc/{pid}/ns/pid")
        self.sshd_pid = pid


class FakeHostLab:
    """n fake hosts h1..hn on a private bridge; use as a context manager."""

    def __init__(self, n: int, workdir: Path, prefix: str | None = None, *, fake_npus: int = 0,
                 overlays: tuple[str, ...] = (), docker: bool = False, private_shm: bool = False):
        """prefix: names of the lab's namespaces and links; default: "yl" + 5 random
        characters.  Only "yl..." prefixes are covered by cleanup_stale()'s default.
        fake_npus, overlays, docker, private_shm: see the module docstring."""
        for path in overlays:
            if not path.startswith("/") or path in ("/", "/tmp", "/run", "/dev", "/proc", "/sys"):
                raise ValueError(f"overlays: {path!r} cannot have an overlay")
        if docker and "/var" not in overlays:
            overlays = (*overlays, "/var")
        self.fake_npus = fake_npus
        self.overlays = tuple(overlays)
        self.docker = docker
        self.private_shm = private_shm
        if not 1 <= n <= _MAX_HOSTS:
            raise ValueError(f"n must be in 1..{_MAX_HOSTS}")
        if prefix is not None and not re.fullmatch(r"[a-z][a-z0-9]{0,9}", prefix):
            raise ValueError("prefix: 1-10 chars of [a-z0-9], starting with a letter")
        self.n = n
        self.workdir = Path(workdir).resolve()
        self.prefix = prefix
        self.bridge = ""
        self.subnet: ipaddress.IPv4Network | None = None
        self.hosts: list[FakeHost] = []
        self.identity_file = self.workdir / "id_ed25519"
        self.known_hosts = self.workdir / "known_hosts"
        self.ssh_config = self.workdir / "ssh_config"
        self._lock_fd: int | None = None
        self._lock_path: Path | None = None
        self._state_lock = threading.Lock()
        self._started = False
        self._closed = False
        self._delayers: dict[str, subprocess.Popen] = {}  # host name -> its netdelay.py

    def __enter__(self) -> "FakeHostLab":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, name: str) -> FakeHost:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)

    @property
    def cli_ssh_args(self) -> list[str]:
        """The yrpd CLI flags that reach this lab's hosts: its ssh_config, key and known_hosts."""
        return ["--ssh-config", str(self.ssh_config), "-i", str(self.identity_file),
                "--known-hosts", str(self.known_hosts)]

    # -- start -------------------------------------------------------------

    def start(self) -> "FakeHostLab":
        with self._state_lock:
            if self._closed:
                raise RuntimeError("lab already closed")
            if self._started:
                return self
            self._started = True
        with _live_lock:
            _live_labs.add(self)
        try:
            self._take_lock()
            self.workdir.mkdir(parents=True, exist_ok=True)
            self.bridge = f"{self.prefix}br"
            self._create_bridge()
            for i in range(1, self.n + 1):
                host_dir = self.workdir / f"h{i}"
                self.hosts.append(FakeHost(
                    f"h{i}", str(self.subnet.network_address + 10 + i),
                    f"{self.prefix}h{i}", f"{self.prefix}v{i}", host_dir,
                    fake_npus=self.fake_npus, overlays=self.overlays, docker=self.docker,
                    private_shm=self.private_shm))
            self._write_keys_and_configs()
            for host in self.hosts:
                self._create_host_network(host)
            for host in self.hosts:
                host._launch()
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def _take_lock(self) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        for _ in range(100):
            prefix = self.prefix or PREFIX_ROOT + "".join(
                random.choices(string.ascii_lowercase + string.digits, k=5))
            path = LOCK_DIR / f"{prefix}.lock"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                if self.prefix:
                    raise RuntimeError(f"lab prefix {prefix} in use ({path} exists)")
                continue
            fcntl.flock(fd, fcntl.LOCK_EX)
            # cleanup_stale may have unlinked the file between open and flock.
            if _ns_key(str(path)) != (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
                os.close(fd)
                continue
            os.write(fd, f"{os.getpid()}\n".encode())
            self.prefix, self._lock_fd, self._lock_path = prefix, fd, path
            return
        raise RuntimeError("could not allocate a lab prefix")

    def _create_bridge(self) -> None:
        # One allocator at a time across processes, so two labs never pick the same /24.
        with open(LOCK_DIR / "subnet-alloc.lock", "w") as alloc:
            fcntl.flock(alloc, fcntl.LOCK_EX)
            self.subnet = self._pick_subnet()
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.subnet.network_address + 1}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")

    @staticmethod
    def _pick_subnet() -> ipaddress.IPv4Network:
        used = []
        for link in json.loads(_ip("-j", "-4", "addr", "show").stdout or "[]"):
            for a in link.get("addr_info", []):
                used.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
        for route in json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
            dst = route.get("dst", "default")
            if dst != "default":
                used.append(ipaddress.ip_network(dst, strict=False))
        candidates = [ipaddress.ip_network(f"10.{a}.{b}.0/24")
                      for a in _SUBNET_SECOND_OCTETS for b in range(256)]
        random.shuffle(candidates)
        for net in candidates:
            if not any(net.overlaps(u) for u in used):
                return net
        raise RuntimeError("no free private /24 for the lab bridge")

    def _write_keys_and_configs(self) -> None:
        jobs = [_keygen(self.identity_file, f"yrpd-lab-{self.prefix}")]
        for host in self.hosts:
            for sub in ("root/.ssh", "root/.pyenv", "etc_ssh", "tmp") + (("var_lib_docker",) if self.docker else ()):
                (host.dir / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(host.dir / "root", 0o700)
            os.chmod(host.dir / "root/.ssh", 0o700)
            os.chmod(host.dir / "tmp", 0o1777)
            jobs.append(_keygen(host.dir / "etc_ssh/ssh_host_ed25519_key", host.name))
        for job in jobs:
            _, err = job.communicate()
            if job.returncode:
                raise RuntimeError(f"ssh-keygen failed: {err.strip()}")

        lab_pub = self.identity_file.with_name(self.identity_file.name + ".pub").read_text()
        known, config = [], []
        for host in self.hosts:
            ssh_dir = host.dir / "root/.ssh"
            _write(ssh_dir / "authorized_keys", lab_pub, 0o600)
            _write(ssh_dir / "environment", f"PATH={HOST_PATH}\n", 0o600)
            _write(host.dir / "root/.profile", f"export PATH={HOST_PATH}\n", 0o644)
            _write(host.dir / "etc_ssh/sshd_config", _sshd_config(host.address), 0o644)
            if Path("/etc/ssh/ssh_config").exists():
                _write(host.dir / "etc_ssh/ssh_config",
                       Path("/etc/ssh/ssh_config").read_text(), 0o644)
            host_pub = (host.dir / "etc_ssh/ssh_host_ed25519_key.pub").read_text().split()
            known.append(f"{host.address} {host_pub[0]} {host_pub[1]}\n")
            config.append(
                f"Host {host.name}\n"
                f"    HostName {host.address}\n"
                f"    Port 22\n"
                f"    User root\n"
                f"    IdentityFile {self.identity_file}\n"
                f"    IdentitiesOnly yes\n"
                f"    UserKnownHostsFile {self.known_hosts}\n"
                f"    GlobalKnownHostsFile /dev/null\n"
                f"    StrictHostKeyChecking yes\n"
                f"    PasswordAuthentication no\n"
                f"    BatchMode yes\n"
                f"    ConnectTimeout 5\n"
                f"    LogLevel ERROR\n\n")
        _write(self.known_hosts, "".join(known), 0o644)
        _write(self.ssh_config, "".join(config), 0o644)

    def _create_host_network(self, host: FakeHost) -> None:
        _ip("netns", "add", host.netns)
        _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        _ip("link", "set", host.veth, "master", self.bridge, "up")
        _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")

    def restart(self, name: str) -> FakeHost:
        """Tear one host down (every process of it dies, as on a power loss; its disk, /tmp included, stays) and
        bring it up again with a fresh sshd."""
        host = self[name]
        host.stop_sshd()
        host.sshd_pid, host._pidns = 0, None
        host._launch()
        self._wait_ready([host])
        return host

    def cut(self, name: str) -> None:
        """Take the host off the network as a pulled cable would: its end of the bridge goes down, so packets to and
        from it vanish (nothing is refused or reset), while every process of it runs on."""
        _ip("link", "set", self[name].veth, "down")

    def mend(self, name: str) -> None:
        _ip("link", "set", self[name].veth, "up")

    def degrade(self, name: str, delay_ms: int, loss_pct: float) -> dict:
        """A slow, lossy link for the host: random loss of its packets both ways (iptables' statistic match in its
        netns), and `delay_ms` on the packets it receives: netem on its veth where the kernel has sch_netem, else
        lab/netdelay.py holding them in a netfilter queue in its netns (this machine's kernel lacks
        sch_netem). Returns what was applied: {"loss_pct", "delay_ms", "delay_by": "netem" or "nfqueue"}."""
        host = self[name]
        for chain in ("INPUT", "OUTPUT"):
            subprocess.run(["ip", "netns", "exec", host.netns, "iptables", "-A", chain, "-m", "statistic", "--mode",
                            "random", "--probability", str(loss_pct / 100), "-j", "DROP"], check=True,
                           capture_output=True)
        applied = {"loss_pct": loss_pct, "delay_ms": delay_ms}
        netem = subprocess.run(["tc", "qdisc", "replace", "dev", host.veth, "root", "netem", "delay", f"{delay_ms}ms"],
                               capture_output=True, text=True)
        if netem.returncode == 0:
            return {**applied, "delay_by": "netem"}
        delayer = subprocess.Popen(["ip", "netns", "exec", host.netns, sys.executable,
                                    str(Path(__file__).with_name("netdelay.py")), "--queue", str(_DELAY_QUEUE),
                                    "--delay-ms", str(delay_ms)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if delayer.stdout.readline().strip() != "ready":
            delayer.kill()
            raise RuntimeError(f"link delay for {name}: tc netem failed ({netem.stderr.strip()}) and "
                               f"lab/netdelay.py did not start: {delayer.communicate()[1].strip()[-500:]}")
        self._delayers[name] = delayer
        # after the loss rules, so a dropped packet is not held first
        subprocess.run(["ip", "netns", "exec", host.netns, "iptables", "-A", "INPUT", "-i", "eth0", "-j", "NFQUEUE",
                        "--queue-num", str(_DELAY_QUEUE), "--queue-bypass"], check=True, capture_output=True)
        return {**applied, "delay_by": "nfqueue"}

    def restore(self, name: str) -> dict:
        """Undo degrade(); returns what the delayer reports ({"packets", "late_ms"}), {} where netem delayed."""
        host = self[name]
        for chain in ("INPUT", "OUTPUT"):
            subprocess.run(["ip", "netns", "exec", host.netns, "iptables", "-F", chain], capture_output=True)
        subprocess.run(["tc", "qdisc", "del", "dev", host.veth, "root"], capture_output=True)
        delayer = self._delayers.pop(name, None)
        if delayer is None:
            return {}
        delayer.terminate()
        out, err = delayer.communicate(timeout=10)
        if delayer.returncode:
            raise RuntimeError(f"lab/netdelay.py for {name} failed: {err.strip()[-500:]}")
        return json.loads(out.strip().splitlines()[-1])

    def _wait_ready(self, hosts: list[FakeHost] | None = None) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        pending = list(self.hosts if hosts is None else hosts)
        while pending:
            unattached = {h._proc.pid: h for h in pending if not h.sshd_pid}
            if unattached:
                for ppid, child in _children(set(unattached)).items():
                    unattached[ppid]._attach(child)
            for host in list(pending):
                if host._proc.poll() is not None:
                    log = host.sshd_log.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"fake host {host.name} exited during start:\n{log}")
                if host.sshd_pid and ssh_banner(host.address):
                    pending.remove(host)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"fake hosts not ready: {[h.name for h in pending]}")
            if pending:
                time.sleep(0.02)

    # -- close -------------------------------------------------------------

    def close(self) -> None:
        """Tear everything down; idempotent, ignores pieces that are already gone."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        errors = []
        try:
            for delayer in self._delayers.values():
                delayer.kill()
                delayer.wait()
            for host in self.hosts:
                host._signal_sshd()
            for host in self.hosts:
                try:
                    host.stop_sshd()
                except Exception as exc:
                    errors.append(exc)
            for host in self.hosts:
                if os.path.exists(f"/run/netns/{host.netns}"):
                    try:
                        _destroy_netns(host.netns)
                    except Exception as exc:
                        errors.append(exc)
            links = [h.veth for h in self.hosts] + ([self.bridge] if self.bridge else [])
            for name in links:
                if _link_exists(name):
                    _ip("link", "del", name, check=False)
            _wait_links_gone(links)
        finally:
            if self._lock_fd is not None:
                self._lock_path.unlink(missing_ok=True)
                os.close(self._lock_fd)
                self._lock_fd = None
            with _live_lock:
                _live_labs.discard(self)
        if errors:
            # Whatever is left is now unlocked, so cleanup_stale() will retry it.
            raise errors[0]


FAKE_NPU_EXTRA_NODES = ("davinci_manager", "devmm_svm", "hisi_hdc")


def _private_dev_lines(stage: str, fake_npus: int) -> list[str]:
    """Shell lines that replace /dev with a tmpfs holding the usual nodes plus FAKE Ascend nodes.

    The nodes are made on a tmpfs at `stage` and the tmpfs is then moved onto /dev.  Every fake
    Ascend node is a character device 1:3, the numbers of /dev/null."""
    nodes = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}
    fakes = [f"davinci{i}" for i in range(fake_npus)] + list(FAKE_NPU_EXTRA_NODES)
    lines = [f"mkdir -p {stage}", f"mount -t tmpfs -o mode=0755,size=16m devfs {stage}"]
    for name, (major, minor) in nodes.items():
        lines.append(f"mknod -m 0666 {stage}/{name} c {major} {minor}")
    lines += [f"mknod -m 0660 {stage}/{name} c 1 3" for name in fakes]
    lines += [f"mkdir -m 0755 {stage}/pts {stage}/mqueue", f"mkdir -m 1777 {stage}/shm",
              f"ln -s /proc/self/fd {stage}/fd", f"ln -s /proc/self/fd/0 {stage}/stdin",
              f"ln -s /proc/self/fd/1 {stage}/stdout", f"ln -s /proc/self/fd/2 {stage}/stderr",
              f"ln -s pts/ptmx {stage}/ptmx",
              f"mount --move {stage} /dev",
              "mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts /dev/pts",
              "mount -t tmpfs -o mode=1777 shm /dev/shm",
              "mount -t mqueue mqueue /dev/mqueue"]
    return lines


def _cgroup_mounts() -> list[tuple[str, str, str]]:
    """(mount point, fstype, options) of this machine's cgroup hierarchies below /sys/fs/cgroup."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        mountpoint, fstype, super_options = fields[4], fields[sep + 1], fields[sep + 3]
        if fstype in ("cgroup", "cgroup2") and mountpoint.startswith("/sys/fs/cgroup/"):
            options = ",".join(o for o in super_options.split(",") if o not in ("rw", "ro")) or "defaults"
            found.append((mountpoint, fstype, options))
    return found


def _write(path: Path, text: str, mode: int) -> None:
    path.write_text(text)
    os.chmod(path, mode)


def _sshd_config(address: str) -> str:
    return f"""\
ListenAddress {address}:22
HostKey /etc/ssh/ssh_host_ed25519_key
PidFile none
PermitRootLogin prohibit-password
PubkeyAuthentication yes
AuthorizedKeysFile .ssh/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitUserEnvironment PATH
PrintMotd no
PrintLastLog no
UseDNS no
MaxStartups 100
MaxSessions 100
Subsystem sftp internal-sftp
"""


def ssh_banner(address: str, port: int = 22, timeout: float = 0.5) -> bytes | None:
    """The SSH server's greeting, or None.  A bare TCP connect proves nothing here:
    the uplink of these machines accepts connections to any unrouted address."""
    try:
        with socket.create_connection((address, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            banner = sock.recv(256)
    except OSError:
        return None
    return banner if banner.startswith(b"SSH-") else None


@atexit.register
def _close_live_labs() -> None:
    with _live_lock:
        labs = list(_live_labs)
    for lab in labs:
        try:
            lab.close()
        except Exception:
            pass
