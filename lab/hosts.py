"""What is left on a fake host: the checks every lab test and the soak make after `yrpd down`."""

from __future__ import annotations


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
