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
