"""Detached processes on a host, run for real through the local runner: the environment they start with."""

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from yrpd.hostgroup import Command, Host, HostGroup
from yrpd.placement import HostInventory, make_plan
from yrpd.spec import DeviceKind, build_spec
from yrpd.steps import StepContext
from yrpd.steps.processes import start_script


@pytest.fixture
def ctx():
    root = tempfile.mkdtemp(prefix="yp-", dir="/tmp")  # short: the spec bounds the session root's length
    spec = build_spec({}, {"hosts": "localhost", "device_kind": "cpu", "model": "/m", "remote_session_root": root})
    plan = make_plan(spec, {"localhost": HostInventory(DeviceKind.cpu, (0, 1), "127.0.0.1", False)})
    yield StepContext(spec=spec, plan=plan, session_id="s1")
    shutil.rmtree(root, ignore_errors=True)


def started_env(ctx, preamble: str, env: dict) -> dict:
    """Start a process that prints its environment, with `preamble` run first in the same shell; its environment."""
    dump = "import os, json, time; print(json.dumps(dict(os.environ)), flush=True); time.sleep(60)"
    script = start_script(ctx, "envdump", f"exec python3 -c '{dump}'", env)
    with HostGroup([Host("localhost", "localhost", local=True)]) as group:
        result = group.run(Command(f"{preamble}\n{script}"))["localhost"]
    assert result.ok, result.stderr
    run = Path(ctx.host_session_dir)
    pid = int((run / "run" / "envdump.pid").read_text())
    try:
        log = run / "logs" / "envdump.log"

        def dumped():  # the supervisor may write its own lines first (stopping a previous run's command)
            return [line for line in log.read_text().splitlines() if line.startswith("{") and line.endswith("}")]

        deadline = time.monotonic() + 10
        while not dumped() and time.monotonic() < deadline:
            time.sleep(0.05)
        return json.loads(dumped()[-1])
    finally:
        os.kill(pid, signal.SIGKILL)
        (run / "logs" / "envdump.log").unlink()


def test_pythonpath_is_extended_not_replaced(ctx):
    """A container image's PYTHONPATH (CANN's te/tbe packages) stays behind yrpd's code bundle."""
    env = started_env(ctx, "export PYTHONPATH=/usr/local/Ascend/python/site-packages", {"PYTHONPATH": "/b/yrpd-x"})
    assert env["PYTHONPATH"] == "/b/yrpd-x:/usr/local/Ascend/python/site-packages"
    assert env["YRPD_SESSION"] == "s1"
    env = started_env(ctx, "unset PYTHONPATH", {"PYTHONPATH": "/b/yrpd-x"})
    assert env["PYTHONPATH"] == "/b/yrpd-x"  # nothing to keep: no dangling ':'


def test_the_controllers_python_environment_does_not_reach_a_local_host(ctx, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/where/yrpd/itself/runs")
    monkeypatch.setenv("VIRTUAL_ENV", "/controller/.venv")
    env = started_env(ctx, "true", {"PYTHONPATH": "/b/yrpd-x"})
    assert env["PYTHONPATH"] == "/b/yrpd-x" and "VIRTUAL_ENV" not in env
    assert os.environ["PYTHONPATH"] == "/where/yrpd/itself/runs"  # the controller itself is untouched


# -- what one command may weigh

#: Linux refuses an exec whose single argument is longer than this (MAX_ARG_STRLEN): `bash -c SCRIPT` over SSH, or
#: `docker exec ... bash -c SCRIPT` inside the container, fails with "Argument list too long" before anything runs
ONE_ARGUMENT = 131072
#: what a step may use of it here: the rest is room for a real deployment's longer names, paths and spec
HEADROOM = 7 / 8


#: the longest session root the spec takes (DeploySpec's check: vLLM's socket paths below it must fit)
LONGEST_ROOT = "/" + "r" * 42
BUSY = {  # four instances on each host, under yr (NPU) or under dscli with etcd (CPU, the lab's and demo's)
    "npu": {"hosts": "h1,h2", "devices": "0-7", "device_kind": "npu", "model": "/data/models/m", "prefill": 4,
            "decode": 4, "ptp": 2, "dtp": 2},
    "cpu-dscli": {"hosts": "h1,h2", "devices": "0-7", "device_kind": "cpu", "model": "builtin:tiny-qwen2",
                  "prefill": 4, "decode": 4, "cluster_mode": "ds_only"},
}


@pytest.mark.parametrize("case,runtime", [("npu", "host"), ("npu", "docker"), ("cpu-dscli", "host")])
@pytest.mark.parametrize("playbook", ["deploy", "teardown"])
def test_every_step_of_a_busy_host_fits_in_one_exec_argument(case, runtime, playbook):
    """Four instances and the whole data system on a host, each under its supervisor: what the host's shell is given
    for any step (its check in the same round trip, inside the container under runtime docker, under `timeout`) is
    under the kernel's limit for one argument, with room to spare."""
    from yrpd.assets import playbook_path
    from yrpd.containers import container_name, container_profile
    from yrpd.deployment import inventory_from_json
    from yrpd.hostgroup import as_run_in, env_preamble, wrap_timeout
    from yrpd.playbook import load_playbook, round_trips, step_enabled, step_hosts

    spec = build_spec({}, {**BUSY[case], "runtime": runtime, "remote_session_root": LONGEST_ROOT,
                           "image": "quay.io/ascend/vllm-ascend:v0.10.0rc1-openeuler" if runtime == "docker" else None})
    kind = BUSY[case]["device_kind"]
    inventory = inventory_from_json({h: {"kind": kind, "devices": list(range(8)), "ip": f"10.0.0.{i + 1}"}
                                     for i, h in enumerate(("h1", "h2"))})
    ctx = StepContext(spec=spec, plan=make_plan(spec, inventory), session_id="20261126-000000-abcdef")
    if runtime == "docker":
        preamble = env_preamble(container_profile(spec).env_scripts)
        inside = lambda c: as_run_in(c, container_name(ctx.session_id), preamble=preamble)  # noqa: E731
    else:
        inside = lambda c: c  # noqa: E731
    sizes = {}
    for step in load_playbook(playbook_path(playbook)).steps:
        if step_enabled(step, ctx):
            trips = round_trips(step, ctx, step_hosts(step, ctx))
            for host, cmd in {**trips.sent, **trips.separate}.items():
                sent = inside(cmd)
                sizes[(step.name, host)] = max(sizes.get((step.name, host), 0),
                                               len(wrap_timeout(sent.script, sent.timeout).encode()))
    assert sizes, "no step had a command"
    biggest = max(sizes, key=sizes.get)
    assert sizes[biggest] < ONE_ARGUMENT * HEADROOM, (biggest, sizes[biggest])


def test_preflight_takes_a_port_held_by_the_sessions_own_process_and_refuses_one_held_by_anyone_else(tmp_path):
    """`yrpd scale` runs the deploy playbook again on a live session, whose services hold their ports: those are
    not conflicts; a port held by a process of another session still is (the control)."""
    import socket
    import subprocess
    import sys

    from yrpd.assets import deploy_script

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = f"import socket,time; s=socket.socket(); s.bind(('127.0.0.1',{port})); s.listen(); time.sleep(60)"
    held = subprocess.Popen([sys.executable, "-c", server], env={**os.environ, "YRPD_SESSION": "mine"})
    try:
        for _ in range(100):
            if subprocess.run(["ss", "-ltn", f"sport = :{port}"], capture_output=True, text=True).stdout.count("\n") > 1:
                break
            time.sleep(0.05)

        def problems(session: str) -> list[str]:
            args = {"session_root": str(tmp_path), "session": session, "min_free_disk_gb": 0,
                    "ports": [[port, "decode-0"]], "device_kind": "cpu", "devices": [], "model": None}
            run = subprocess.run([sys.executable, "-", json.dumps(args)], input=deploy_script("preflight.py"),
                                 capture_output=True, text=True)
            return [line for line in run.stdout.splitlines() + run.stderr.splitlines() if f"port {port}" in line]

        assert problems("mine") == []
        assert problems("theirs") and "already in use by pid" in problems("theirs")[0]
    finally:
        held.kill()
        held.wait()


# -- a pid file whose number now belongs to another process of the session


def test_a_pid_file_whose_number_went_to_another_process_of_the_session_does_not_count_as_running(ctx):
    """A host that lost every process keeps its pid files; its new pid namespace hands the old numbers out again,
    often to the same session's other processes. The exporter's pid file naming the data system worker's supervisor
    must not pass its `already running` check, nor make status report it alive; the worker itself stays running."""
    from yrpd.steps import host_python_parts
    from yrpd.steps.processes import running, status_call

    host = ctx.plan.hosts[0]
    sleeper = "exec python3 -c 'import time; time.sleep(60)'"
    run = Path(ctx.host_session_dir) / "run"
    with HostGroup([Host("localhost", "localhost", local=True)]) as group:
        def do(cmd: Command):
            return group.run(cmd)["localhost"]

        def alive() -> dict[str, bool]:
            result = do(host_python_parts({"p": status_call(ctx, host)}))
            assert result.ok, result.stderr
            return {p["name"]: p["alive"] for p in json.loads(result.stdout)["p"]["processes"]}

        assert do(Command(start_script(ctx, "ds_worker", sleeper))).ok
        worker = int((run / "ds_worker.pid").read_text())
        try:
            assert do(running(ctx, host, "ds_worker")).ok  # control: the worker's own pid file counts
            (run / "exporter.pid").write_text(f"{worker}\n")  # the number the exporter's supervisor had before
            (run / "exporter.state.json").write_text(json.dumps({"pid": worker, "state": "running", "restarts": 0}))
            assert not do(running(ctx, host, "exporter")).ok
            assert alive() == {"ds_worker": True, "exporter": False}
            started = do(Command(start_script(ctx, "exporter", sleeper)))
            assert started.ok and "exporter started" in started.stdout, started.stdout
            assert int((run / "exporter.pid").read_text()) != worker and do(running(ctx, host, "exporter")).ok
        finally:
            for name in ("ds_worker", "exporter"):
                try:
                    os.killpg(int((run / f"{name}.pid").read_text()), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
