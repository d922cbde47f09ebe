"""Tests of the fake-host lab itself."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import paramiko
import pytest
from fabric import Connection

from lab.fakehosts import HOST_PATH, FakeHostLab, cleanup_stale, ssh_banner

pytestmark = pytest.mark.lab


def connect(lab: FakeHostLab, host) -> Connection:
    """Fabric connection that trusts only the lab's known_hosts."""
    conn = Connection(host.address, user="root", connect_timeout=5,
                      connect_kwargs={"key_filename": str(lab.identity_file),
                                      "look_for_keys": False, "allow_agent": False})
    conn.client.load_host_keys(str(lab.known_hosts))
    conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
    return conn


def run(conn: Connection, cmd: str) -> str:
    return conn.run(cmd, hide=True, in_stream=False).stdout.strip()


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def link_list() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def test_three_hosts_start(fake_lab):
    t0 = time.monotonic()
    lab = fake_lab(3)
    elapsed = time.monotonic() - t0
    assert [h.name for h in lab.hosts] == ["h1", "h2", "h3"]
    assert len({h.address for h in lab.hosts}) == 3
    assert all(h.address.rsplit(".", 1)[0] == str(lab.subnet.network_address).rsplit(".", 1)[0]
               for h in lab.hosts)
    for host in lab.hosts:
        assert alive(host.sshd_pid)
        assert "sshd" in Path(f"/proc/{host.sshd_pid}/cmdline").read_text()
        assert ssh_banner(host.address).startswith(b"SSH-2.0-OpenSSH")
        assert host.exec("cat /proc/1/cmdline").stdout.startswith("sshd")
    for name in (lab.bridge, *(h.veth for h in lab.hosts)):
        assert len(name) <= 15
    assert elapsed < 10, f"3 hosts took {elapsed:.1f}s to start"


def test_hostname_and_python_over_ssh(fake_lab):
    lab = fake_lab(3)
    for host in lab.hosts:
        with connect(lab, host) as conn:
            assert run(conn, "hostname") == host.name
            assert run(conn, "whoami") == "root"
            assert run(conn, "python3 -c 'import sys; print(sys.version_info[:2])'") == "(3, 11)"
            # the binary itself, not pyenv's shim (a bash script: 0.1 s of CPU a call that real hosts don't pay)
            assert run(conn, "command -v python3") == shutil.which("python3", path=HOST_PATH)
            assert run(conn, "bash -lc 'command -v python3'") == shutil.which("python3", path=HOST_PATH)
            assert run(conn, "ip -4 route") == f"{lab.subnet} dev eth0 proto kernel scope link src {host.address}"
    # Host-to-host traffic over the bridge.
    h3 = lab.hosts[2].address
    assert lab.hosts[0].exec(f"bash -c 'echo > /dev/tcp/{h3}/22' && echo ok").stdout.strip() == "ok"


def test_known_hosts_is_checked(fake_lab, tmp_path):
    lab = fake_lab(1)
    host = lab.hosts[0]
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    conn = Connection(host.address, user="root", connect_timeout=5,
                      connect_kwargs={"key_filename": str(lab.identity_file),
                                      "look_for_keys": False, "allow_agent": False})
    conn.client.load_host_keys(str(empty))
    conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        conn.open()


def test_ssh_config_with_openssh_client(fake_lab):
    lab = fake_lab(2)
    for host in lab.hosts:
        out = subprocess.run(["ssh", "-F", str(lab.ssh_config), host.name, "hostname"],
                             capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == host.name


def test_tmp_is_private(fake_lab):
    lab = fake_lab(2)
    h1, h2 = lab.hosts
    marker = f"yrpd-lab-marker-{os.getpid()}-{time.monotonic_ns()}"
    with connect(lab, h1) as conn:
        run(conn, f"echo hi > /tmp/{marker}")
        assert run(conn, f"cat /tmp/{marker}") == "hi"
    with connect(lab, h2) as conn:
        assert run(conn, f"test -e /tmp/{marker} && echo yes || echo no") == "no"
    assert h2.exec(f"test -e /tmp/{marker}", check=False).returncode == 1
    assert not Path("/tmp", marker).exists()
    assert h1.exec(f"cat /tmp/{marker}").stdout == "hi\n"


def test_exec(fake_lab):
    lab = fake_lab(1)
    host = lab.hosts[0]
    result = host.exec("echo out; echo err >&2; exit 3", check=False)
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")
    with pytest.raises(subprocess.CalledProcessError):
        host.exec("false")
    assert host.exec("pwd; hostname").stdout.split() == ["/root", "h1"]
    with pytest.raises(subprocess.TimeoutExpired):
        host.exec("sleep 30", timeout=0.5)
    deadline = time.monotonic() + 5
    while any("sleep 30" in p for p in host.processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any("sleep 30" in p for p in host.processes())


def test_detached_process_is_killed_by_close(fake_lab):
    lab = fake_lab(2)
    h1 = lab.hosts[0]
    with connect(lab, h1) as conn:
        conn.run("setsid nohup sleep 300 >/dev/null 2>&1 </dev/null &", hide=True, in_stream=False)
    deadline = time.monotonic() + 5
    while "sleep 300" not in h1.processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "sleep 300" in h1.processes()
    assert "sleep 300" not in lab.hosts[1].processes()
    pids = h1.pids() + [h.sshd_pid for h in lab.hosts] + [h._proc.pid for h in lab.hosts]
    lab.close()
    assert not [p for p in pids if alive(p)]
    assert h1.processes() == []


def test_stop_sshd(fake_lab):
    lab = fake_lab(3)
    h1, h2, h3 = lab.hosts
    h1.exec("setsid nohup sleep 300 >/dev/null 2>&1 </dev/null &")
    pids = h1.pids() + [h1.sshd_pid]
    h1.stop_sshd()
    h1.stop_sshd()  # idempotent
    assert not [p for p in pids if alive(p)]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((h1.address, 22), timeout=2)
    with pytest.raises(RuntimeError):
        h1.exec("true")
    assert h1.processes() == []
    for host in (h2, h3):
        with connect(lab, host) as conn:
            assert run(conn, "hostname") == host.name


def test_close_leaves_nothing(fake_lab):
    lab = fake_lab(3)
    names = [lab.bridge] + [h.veth for h in lab.hosts]
    netns = [h.netns for h in lab.hosts]
    assert all(n in link_list() for n in names)
    assert all(n in netns_list() for n in netns)
    pids = [h.sshd_pid for h in lab.hosts] + [h._proc.pid for h in lab.hosts]
    t0 = time.monotonic()
    lab.close()
    assert time.monotonic() - t0 < 10
    lab.close()  # idempotent
    assert not any(n in netns_list() for n in netns)
    assert lab.prefix not in netns_list()
    assert lab.prefix not in link_list()
    ps = subprocess.run(["ps", "-eo", "pid=,stat="], capture_output=True, text=True).stdout
    live = {int(pid) for pid, stat in (line.split() for line in ps.splitlines()) if "Z" not in stat}
    assert not live & set(pids)
    route = subprocess.run(["ip", "route", "get", lab.hosts[0].address],
                           capture_output=True, text=True).stdout
    assert lab.bridge not in route
    assert all(ssh_banner(h.address, timeout=0.3) is None for h in lab.hosts)


def test_context_manager(fake_lab, tmp_path):  # fake_lab: skip + stale cleanup
    with FakeHostLab(1, tmp_path / "lab") as lab:
        assert lab.hosts[0].exec("hostname").stdout.strip() == "h1"
    assert lab.prefix not in netns_list() + link_list()


def test_cleanup_stale_removes_crashed_lab_only(fake_lab, tmp_path):
    live_lab = fake_lab(1)
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            sys.path.insert(0, {str(Path(__file__).parents[2] / 'lab')!r})
            import fakehosts
            lab = fakehosts.FakeHostLab(2, Path({str(tmp_path / "crashed")!r})).start()
            pids = [h.sshd_pid for h in lab.hosts] + [h._proc.pid for h in lab.hosts]
            print(lab.prefix, *pids, flush=True)
            time.sleep(600)
        """)],
        stdout=subprocess.PIPE, text=True)
    try:
        prefix, *pids = child.stdout.readline().split()
    finally:
        child.kill()  # SIGKILL: no atexit, the crashed lab's pieces stay behind
        child.wait()
    pids = [int(p) for p in pids]
    assert prefix in netns_list() and prefix in link_list()
    assert all(alive(p) for p in pids)

    removed = cleanup_stale()
    assert f"netns {prefix}h1" in removed and f"link {prefix}br" in removed
    assert prefix not in netns_list() + link_list()
    assert not [p for p in pids if alive(p)]
    # A lab that is still open is left alone.
    assert live_lab.prefix in netns_list()
    assert live_lab.hosts[0].exec("hostname").stdout.strip() == "h1"
