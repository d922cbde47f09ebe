"""Golden tests for yrpd.cluster.yrconfig (config.toml for `yr start` and the yr command lines).

Regenerate the goldens after an intended change with:
    YRPD_UPDATE_GOLDEN=1 python -m pytest tests/unit/test_yrconfig.py
and review the diff: the semantic tests below must still pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from tests.prereq import missing
from tests.unit import golden_files

from yrpd.cluster.yrconfig import (
    YR_CLI_SHIM,
    YrNode,
    YrPorts,
    components,
    listen_ports,
    render_config,
    start_command,
    stop_command,
    validate,
)

YR_CLUSTER = Path(__file__).parents[2] / "deploy_scripts" / "yr_cluster.py"
MASTER_IP, AGENT_IP = "10.0.0.1", "10.0.0.2"
DEPLOY = "/var/lib/yrpd/yr-session"


def node(mode: str, is_master: bool) -> YrNode:
    return YrNode(
        host_ip=MASTER_IP if is_master else AGENT_IP,
        is_master=is_master,
        master_ip=MASTER_IP,
        deploy_path=DEPLOY,
        mode=mode,
    )


CASES = [(mode, role) for mode in ("ds_only", "full") for role in ("master", "agent")]


def check_golden(name: str, text: str) -> None:
    golden_files.check_golden("yrconfig", name, text)


@pytest.mark.parametrize("mode,role", CASES)
def test_config_golden(mode, role):
    check_golden(f"{mode}_{role}.toml", render_config(node(mode, role == "master")))


def test_commands_golden():
    lines = []
    for role in ("master", "agent"):
        n = node("ds_only", role == "master")
        lines += [
            f"# {role}",
            start_command(n).shell(),
            stop_command(n).shell(),
            stop_command(n, force=True).shell(),
        ]
    check_golden("commands.txt", "\n".join(lines) + "\n")


@pytest.mark.parametrize("mode,role", CASES)
def test_config_semantics(mode, role):
    n = node(mode, role == "master")
    cfg = tomllib.loads(render_config(n))
    values = cfg["values"]
    assert values["host_ip"] == n.host_ip
    assert values["deploy_path"] == DEPLOY
    # every address yr needs is pinned as a plain int (no check_port() templates left)
    assert values["etcd"]["address"] == [{"ip": MASTER_IP, "port": 32379, "peer_port": 32380}]
    assert values["ds_master"] == {"ip": MASTER_IP, "port": 12123}
    assert values["ds_worker"] == {"ip": n.host_ip, "port": 31501}
    assert values["function_master"] == {"ip": MASTER_IP, "global_scheduler_port": 22770}
    assert values["function_proxy"]["ip"] == values["function_agent"]["ip"] == n.host_ip

    table = cfg["mode"][role]
    assert set(cfg["mode"]) == {role}
    assert table["ds_worker"] is True
    assert table.get("etcd", False) is (role == "master")
    assert table.get("ds_master", False) is (role == "master")
    for fs in ("function_proxy", "function_agent") + (("function_master",) if role == "master" else ()):
        assert table[fs] is (mode == "full")
    assert not any(table[c] for c in ("frontend", "dashboard", "collector", "meta_service", "function_scheduler"))

    assert cfg["ds_worker"]["args"]["memory_reclamation_time_second"] == 5
    ds_sections = [s for s in ("ds_master", "ds_worker") if s in cfg and "bin_path" in cfg[s]]
    if mode == "ds_only":
        assert ds_sections == (["ds_master", "ds_worker"] if role == "master" else ["ds_worker"])
        ds_pkg = "/opt/yrpd/venvs/ds/lib/python3.11/site-packages/yr/datasystem"
        for s in ds_sections:
            assert cfg[s]["bin_path"] == f"{ds_pkg}/datasystem_worker"
            assert cfg[s]["env"]["LD_LIBRARY_PATH"] == f"{ds_pkg}/lib"  # never the yr package's libs
        assert "ld_library_path" not in values
    else:
        assert ds_sections == []  # full mode keeps the yr package's own datasystem
        assert values["ld_library_path"] == n.yr_pkg_dir
    assert "spill_directory" not in cfg["ds_worker"]["args"]  # no disk tier unless asked for


def test_a_disk_tier_reaches_the_worker_in_bytes_under_the_session_or_where_asked():
    n = replace(node("ds_only", True), spill_mb=512)
    args = tomllib.loads(render_config(n))["ds_worker"]["args"]
    assert args["spill_directory"] == f"{DEPLOY}/ds-spill" and args["spill_size_limit"] == 512 * 1024 * 1024
    n = replace(n, spill_dir="/ssd/kv")
    assert tomllib.loads(render_config(n))["ds_worker"]["args"]["spill_directory"] == "/ssd/kv"


def test_start_commands():
    m, a = node("ds_only", True), node("ds_only", False)
    for n in (m, a):
        cmd = start_command(n)
        assert cmd.env == {"LD_LIBRARY_PATH": "/opt/yrpd/venvs/yr/lib/python3.11/site-packages/yr",
                           "YRPD_CHILD_LD_LIBRARY_PATH": n.ds_lib_dir, "YRPD_HOST_IP": n.host_ip}
        assert cmd.argv[:3] == ("/opt/yrpd/venvs/yr/bin/python", "-c", YR_CLI_SHIM)
        assert cmd.argv[3:6] == ("-c", f"{DEPLOY}/config.toml", "start")
        assert "--master_address" not in cmd.argv  # agents join through their config
    assert start_command(m).argv[-1] == "--master"
    assert "--master" not in start_command(a).argv
    assert start_command(a, "/etc/x.toml").argv[4] == "/etc/x.toml"
    assert stop_command(m).argv == ("/opt/yrpd/venvs/yr/bin/yr", "stop", "-f", f"{DEPLOY}/session.json")
    assert stop_command(m, force=True).argv[2] == "--force"


def _fake_yr_cli(tmp_path):
    pkg = tmp_path / "yr" / "cli"
    pkg.mkdir(parents=True)
    (tmp_path / "yr" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("def get_ip(dst=('8.8.8.8', 80)):\n    raise OSError(101, 'Network is unreachable')\n")
    (pkg / "main.py").write_text(
        "import os, subprocess, sys\n"
        "from yr.cli import config\n"
        "def main():\n"
        "    child = subprocess.run([sys.executable, '-c', 'import os; print(os.environ.get(\"LD_LIBRARY_PATH\"))'],\n"
        "                           capture_output=True, text=True).stdout.strip()\n"
        "    print(sys.argv[0], sys.argv[1:], child, config.get_ip())\n"
    )


def _run_shim(tmp_path, **env):
    _fake_yr_cli(tmp_path)
    env = {**{k: v for k, v in os.environ.items() if "LD_LIBRARY_PATH" not in k},
           "PYTHONPATH": str(tmp_path), "YRPD_HOST_IP": "10.9.8.7", **env}
    return subprocess.run(
        [sys.executable, "-c", YR_CLI_SHIM, "-c", "cfg.toml", "start", "--master"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()


def test_shim_hides_the_yr_library_path_from_children(tmp_path):
    """The start shim runs yr's main() with the yr package's LD_LIBRARY_PATH gone from os.environ (children
    inherit os.environ), and answers yr's outward address probe with our host_ip (no default route needed)."""
    out = _run_shim(tmp_path, LD_LIBRARY_PATH="/yr/pkg")
    assert out == "yr ['-c', 'cfg.toml', 'start', '--master'] None 10.9.8.7"


def test_data_system_processes_get_their_libraries_then_the_hosts(tmp_path):
    """Audit item 9: on NPU hosts CANN's set_env.sh puts libascendcl & co. on LD_LIBRARY_PATH and the data
    system worker's libacl_plugin.so needs them: the children see the data system's lib dir, then the host's
    path (yr_cluster.py moves it aside), never the yr package's."""
    n = node("ds_only", True)
    out = _run_shim(tmp_path, **{**start_command(n).env, "YRPD_HOST_IP": "10.9.8.7",
                                 "YRPD_INHERITED_LD_LIBRARY_PATH": "/usr/local/Ascend/ascend-toolkit/latest/lib64"})
    assert out.split()[-2] == f"{n.ds_lib_dir}:/usr/local/Ascend/ascend-toolkit/latest/lib64"
    assert n.yr_pkg_dir + ":" not in out


def test_cluster_driver_moves_the_host_library_path_aside(tmp_path):
    # the script's own directory on the path, as when it is run by its path (it imports deploy_scripts/hostlib.py)
    probe = ("import json, runpy, sys; sys.path.insert(0, %r); sys.argv[1:] = [json.dumps({'deploy': '/d', 'logs': '/l', "
             "'env': {'LD_LIBRARY_PATH': '/yr/pkg'}})]; e = runpy.run_path(%r, run_name='probe')['env'](); "
             "print(e['LD_LIBRARY_PATH'], e['YRPD_INHERITED_LD_LIBRARY_PATH'])")
    out = subprocess.run([sys.executable, "-c", probe % (str(YR_CLUSTER.parent), str(YR_CLUSTER))],
                         capture_output=True, text=True,
                         env={**os.environ, "LD_LIBRARY_PATH": "/cann/lib64"}, check=True).stdout.split()
    assert out == ["/yr/pkg", "/cann/lib64"]


def test_listen_ports_and_components():
    assert listen_ports(node("ds_only", True)) == {
        "etcd_client": 32379, "etcd_peer": 32380, "ds_master": 12123, "ds_worker": 31501,
    }
    assert listen_ports(node("ds_only", False)) == {"ds_worker": 31501}
    assert set(listen_ports(node("full", False))) == {
        "ds_worker", "function_proxy", "function_proxy_grpc", "function_proxy_exec_grpc", "function_agent",
    }
    assert len(listen_ports(node("full", True))) == 9
    assert components(node("ds_only", False))["function_proxy"] is False


def test_agent_with_its_own_ports_points_at_master_ports():
    """Two nodes on one host (tests): the agent listens on its own ports, joins the master's."""
    master_ports = YrPorts(etcd_client=24379, etcd_peer=24380, ds_master=24123, ds_worker=24501)
    a = YrNode(host_ip="127.0.0.1", is_master=False, master_ip="127.0.0.1", deploy_path="/tmp/a",
               ports=YrPorts(ds_worker=24502), master_ports=master_ports)
    cfg = tomllib.loads(render_config(a))
    assert cfg["values"]["etcd"]["address"][0]["port"] == 24379
    assert cfg["values"]["ds_master"]["port"] == 24123
    assert cfg["values"]["ds_worker"] == {"ip": "127.0.0.1", "port": 24502}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"mode": "fast"}, "mode must be"),
        ({"host_ip": "0.0.0.0"}, "routable"),
        ({"host_ip": "node1"}, "IP address"),
        ({"master_ip": "10.0.0.9"}, "master_ip"),
        ({"deploy_path": "relative/dir"}, "absolute"),
        ({"ports": YrPorts(ds_worker=12123)}, "share a port"),
        ({"ports": YrPorts(etcd_client=70000)}, "out of range"),
        ({"shared_memory_mb": 0}, "shared_memory_mb"),
    ],
)
def test_validate_rejects(change, message):
    with pytest.raises(ValueError, match=message):
        validate(replace(node("ds_only", True), **change))


def test_agent_port_clash_only_counts_its_own_components():
    # an agent runs no ds_master: reusing that port number for its ds_worker is fine
    validate(replace(node("ds_only", False), ports=YrPorts(ds_worker=12123)))


YR = Path("/opt/yrpd/venvs/yr")

# Resolve several config files the way `yr -c FILE config dump` does, in one process (~1.5 s).
DUMP = """
import json, sys
from pathlib import Path
import yr.cli
from yr.cli.config import ConfigResolver
cli_dir = Path(yr.cli.__file__).parent
print(json.dumps([ConfigResolver(Path(f), cli_dir).rendered_config for f in sys.argv[1:]]))
"""


@pytest.fixture(scope="module")
def yr_dumps(tmp_path_factory):
    if not (YR / "bin" / "yr").exists():
        missing(f"no yr venv at {YR} (deploy_scripts/install_openyuanrong.sh)")
    tmp = tmp_path_factory.mktemp("yrdump")
    files, nodes = [], []
    for mode, role in CASES:
        n = replace(node(mode, role == "master"), deploy_path=str(tmp / f"{mode}-{role}"))
        f = tmp / f"{mode}-{role}.toml"
        f.write_text(render_config(n))
        files.append(str(f))
        nodes.append(n)
    env = {**os.environ, **start_command(nodes[0]).env}
    proc = subprocess.run([str(YR / "bin" / "python"), "-c", DUMP, *files],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(zip(CASES, zip(nodes, json.loads(proc.stdout))))


@pytest.mark.parametrize("mode,role", CASES)
def test_real_yr_resolves_it(yr_dumps, mode, role):
    """The installed yr CLI merges our file with values.toml / config.toml.jinja the way we expect."""
    n, dumped = yr_dumps[(mode, role)]
    on = {k for k, v in dumped["mode"][role].items() if v}
    assert on == {k for k, v in components(n).items() if v}
    worker = dumped["ds_worker"]["args"]
    assert worker["worker_address"] == f"{n.host_ip}:31501"
    assert worker["master_address"] == f"{MASTER_IP}:12123"
    assert worker["etcd_address"] == f"{MASTER_IP}:32379"
    assert worker["memory_reclamation_time_second"] == 5
    assert worker["add_node_wait_time_s"] == 0  # a late worker joins the ring at once (yrconfig.worker_tuning)
    assert worker["shared_memory_size_mb"] == 1024
    assert worker["log_dir"] == f"{n.deploy_path}/logs/data_system/worker"
    if mode == "ds_only":
        assert dumped["ds_worker"]["bin_path"] == n.ds_worker_bin
        assert dumped["ds_worker"]["env"]["LD_LIBRARY_PATH"] == n.ds_lib_dir
    else:
        assert dumped["ds_worker"]["bin_path"] == f"{n.yr_pkg_dir}/datasystem/datasystem_worker"
        assert dumped["function_proxy"]["args"]["address"] == f"{n.host_ip}:22772"
        assert dumped["function_proxy"]["args"]["global_scheduler_address"] == f"{MASTER_IP}:22770"
        assert dumped["function_agent"]["args"]["agent_address"] == f"{n.host_ip}:58866"
        assert dumped["function_agent"]["args"]["runtime_ld_library_path"] == n.yr_pkg_dir
    if role == "master":
        assert dumped["etcd"]["args"]["listen-client-urls"] == f"http://{MASTER_IP}:32379"
        assert dumped["etcd"]["args"]["listen-peer-urls"] == f"http://{MASTER_IP}:32380"
        assert dumped["ds_master"]["args"]["master_address"] == f"{MASTER_IP}:12123"
        if mode == "ds_only":
            assert dumped["ds_master"]["bin_path"] == n.ds_worker_bin


def test_with_a_key_directory_the_master_and_the_workers_require_curve():
    import tomllib

    from yrpd.cluster.yrconfig import YrNode, render_config

    node = YrNode(host_ip="10.0.0.1", is_master=True, master_ip="10.0.0.1", deploy_path="/s/yr",
                  curve_key_dir="/s/secrets/curve", etcd_tls_dir="/s/secrets/etcd")
    values = tomllib.loads(render_config(node))["values"]
    assert values["ds"]["curve"] == {"enable": True, "base_path": "/s/secrets/curve"}
    assert values["etcd"]["auth_type"] == "TLS" and values["etcd"]["auth"] == {"base_path": "/s/secrets/etcd"}
    assert values["etcd"]["address"][0]["ip"] == "10.0.0.1"
    plain = YrNode(host_ip="10.0.0.1", is_master=True, master_ip="10.0.0.1", deploy_path="/s/yr")
    assert "ds" not in tomllib.loads(render_config(plain))["values"]
    assert "auth_type" not in tomllib.loads(render_config(plain))["values"]["etcd"]


def test_cluster_status_reads_the_components_from_session_json(tmp_path):
    """What `yr health -f` would print, read from the session.json yr's daemon keeps: a live pid is RUNNING with its
    restart count, a dead one STOPPED and not alive, a component missing from the file is a problem by name."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "session.json").write_text(json.dumps({"session_id": "s", "components": {
        "etcd": {"pid": os.getpid(), "restart_count": 2}, "ds_worker": {"pid": gone.pid, "restart_count": 0}}}))
    args = {"action": "wait", "deploy": str(tmp_path), "logs": str(tmp_path), "timeout": 0, "host_ip": "127.0.0.1",
            "expect": ["etcd", "ds_worker", "ds_master"], "ports": {}}
    out = subprocess.run([sys.executable, str(YR_CLUSTER), json.dumps(args)], capture_output=True, text=True)
    snap = json.loads(out.stdout)
    assert snap["components"]["etcd"] == {"state": "RUNNING", "pid": os.getpid(), "restarts": 2, "alive": True}
    assert snap["components"]["ds_worker"]["state"] == "STOPPED" and not snap["components"]["ds_worker"]["alive"]
    assert out.returncode == 1
    assert f"ds_worker: stopped (pid {gone.pid}, exited)" in out.stderr
    assert "ds_master: missing from session.json" in out.stderr


def test_cluster_status_without_session_json_names_the_file_once_for_every_component(tmp_path):
    """`yr start` said its components were healthy but left no session.json where we read it: the wait names the
    file, once for all of them, instead of calling each component missing from a file that is not there."""
    args = {"action": "wait", "deploy": str(tmp_path), "logs": str(tmp_path), "timeout": 0, "host_ip": "127.0.0.1",
            "expect": ["etcd", "ds_master", "ds_worker"], "ports": {}}
    out = subprocess.run([sys.executable, str(YR_CLUSTER), json.dumps(args)], capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stderr.splitlines()[0] == f"etcd/ds_master/ds_worker: no {tmp_path}/session.json"


def test_the_driver_takes_the_args_of_the_mode_the_host_picked_at_configure(tmp_path):
    """cluster_mode auto: the status query carries both modes' args, the host's mode file picks one."""
    full, ds_only = tmp_path / "full", tmp_path / "ds_only"
    for d in (full, ds_only):
        d.mkdir()
    (full / "session.json").write_text(json.dumps({"components": {"etcd": {"pid": os.getpid()}}}))
    mode_file = tmp_path / "mode"
    by_mode = {m: {"action": "status", "deploy": str(d), "logs": str(d), "host_ip": "127.0.0.1", "ports": {}}
               for m, d in (("full", full), ("ds_only", ds_only))}

    def status():
        args = {"mode_file": str(mode_file), "by_mode": by_mode}
        return subprocess.run([sys.executable, str(YR_CLUSTER), json.dumps(args)], capture_output=True, text=True)

    assert json.loads(status().stdout)["present"] is False  # no mode file yet: ds_only
    mode_file.write_text("full\n")
    assert json.loads(status().stdout)["components"]["etcd"]["alive"]
    mode_file.write_text("fancy\n")
    odd = status()
    assert odd.returncode == 2 and "names mode 'fancy'; this deployment has ds_only, full" in odd.stderr


# A stand-in for `yr start` (not yr: its hang cannot be triggered at will): it double-forks like yr's
# SystemLauncher._daemonize, the daemon writes session.json naming itself as ds_worker, and the middle process then
# hangs instead of exiting, which leaves the parent waiting for it, as yr's parent does (os.waitpid).
STUCK_YR_START = r"""
import json, os, sys, time
deploy, parent_hangs = sys.argv[1], sys.argv[2] == "1"
pid = os.fork()
if pid:
    os.waitpid(pid, 0)  # yr's parent waits for the middle process before reading the session
    while parent_hangs:
        time.sleep(1)
    print("parent: middle process gone, session read", flush=True)
    sys.exit(0)
os.setsid()
if os.fork():
    time.sleep(3600)  # the middle process: where yr's sys.exit hangs
    os._exit(0)
with open(os.path.join(deploy, "session.json"), "w") as fh:
    json.dump({"components": {"ds_worker": {"pid": os.getpid(), "restart_count": 0}}}, fh)
time.sleep(3600)  # the daemon
"""


def run_start(tmp_path, parent_hangs: bool, timeout: int) -> tuple[subprocess.CompletedProcess, dict]:
    fake = tmp_path / "yr_start.py"
    fake.write_text(STUCK_YR_START)
    args = {"action": "start", "deploy": str(tmp_path), "logs": str(tmp_path / "logs"), "session": "s",
            "timeout": timeout, "host_ip": "127.0.0.1", "expect": ["ds_worker"], "ports": {},
            "start": [sys.executable, str(fake), str(tmp_path), "1" if parent_hangs else "0"], "force_stop": ["true"]}
    out = subprocess.run([sys.executable, str(YR_CLUSTER), json.dumps(args)], capture_output=True, text=True, timeout=120)
    daemon = json.loads((tmp_path / "session.json").read_text())["components"]["ds_worker"]["pid"]
    return out, {"daemon": daemon, "log": (tmp_path / "logs" / "yr-start.log").read_text()}


def test_a_yr_start_stuck_after_the_cluster_came_up_is_freed_and_the_start_succeeds(tmp_path):
    out, got = run_start(tmp_path, parent_hangs=False, timeout=60)
    try:
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["components"]["ds_worker"]["alive"]
        assert "killing its stuck fork" in got["log"] and "parent: middle process gone" in got["log"]
        os.kill(got["daemon"], 0)  # the daemon lives on: only the stuck middle process was killed
        assert left_besides(tmp_path, got["daemon"]) == [], "a process of the stand-in was left"
    finally:
        os.kill(got["daemon"], 9)


def test_a_yr_start_that_never_returns_is_killed_at_the_timeout_with_one_clear_line(tmp_path):
    out, got = run_start(tmp_path, parent_hangs=True, timeout=15)
    try:
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert out.stderr.splitlines()[0] == ("openYuanrong did not come up on this host: yr start: did not return "
                                              "within 15 s (killed)")
        assert left_besides(tmp_path, got["daemon"]) == [], "the stuck `yr start` or its fork was left"
    finally:
        os.kill(got["daemon"], 9)


def left_besides(tmp_path, daemon: int) -> list[int]:
    """Processes of the stand-in (its paths on their command line) still running, the daemon left out."""
    def cmdline(pid: str) -> bytes:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                return fh.read()
        except OSError:
            return b""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != daemon
            and str(tmp_path).encode() in cmdline(p)]
