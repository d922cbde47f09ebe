"""What is left on a fake host: the checks every lab test and the soak make after `yrpd down`."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def leftovers(host):
    """Processes and listening TCP ports of the cluster still on the host."""
    procs = [p for p in host.processes()
             if any(k in p for k in ("etcd", "datasystem_worker", "yr.cli", "yr start", "supervise.py"))]
    ports = [p for p in host.exec("ss -ltnH | awk '{print $4}'").stdout.split() if not p.endswith(":22")]  # sshd
    return procs, ports


def session_processes(host) -> list[str]:
    """Command lines of processes inside the fake host that carry a yrpd session marker."""
    out = host.exec("for p in /proc/[0-9]*; do tr '\\0' '\\n' < $p/environ 2>/dev/null | grep -q '^YRPD_SESSION=' "
                    "&& tr '\\0' ' ' < $p/cmdline && echo; done; true").stdout
    return [line for line in out.splitlines() if line.strip()]


def assert_nothing_left(lab) -> None:
    """After `yrpd down`: on every host of the lab, no process of a session and no cluster process or listening port
    (sshd's aside)."""
    for host in lab.hosts:
        assert session_processes(host) == [], host.name
        procs, ports = leftovers(host)
        assert procs == [] and ports == [], (host.name, procs, ports)


def shm_segments() -> set[str]:
    """This machine's vLLM shared-memory segments (psm_*) and multiprocessing semaphores (sem.mp-*)."""
    return {f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith(("psm_", "sem.mp-"))}


def left_behind(before: set[str]) -> set[str]:
    """psm_* segments and sem.mp-* semaphores that appeared since `before` and that no live process maps or holds
    open: what a run left behind (/dev/shm is the machine's: the tests of the other lane have theirs, in use,
    meanwhile)."""
    hostlib = _hostlib()
    held = hostlib.shm_held([pid for pid, *_ in hostlib.proc_table()])
    return {s for s in shm_segments() - before if s not in held}


def remove_left_behind(before: set[str]) -> None:
    """Unlink what `left_behind(before)` names (checked again at the unlink: one mapped meanwhile is kept)."""
    _hostlib().unlink_unheld(sorted(shm_segments() - before))


def _hostlib():
    # the hosts' own helpers (deploy_scripts/hostlib.py), which read /proc as the supervisors do
    sys.path.insert(0, str(Path(__file__).parents[1] / "deploy_scripts"))
    import hostlib

    return hostlib
