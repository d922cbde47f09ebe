"""Runs tests/connector/scripts/inproc_checks.py in the vLLM venv: the connector against the real vLLM API (and the
classes of vLLM 0.10.0's sdist, which the v0.10 images run) with a fake data system (no server processes; about
30 s, mostly importing vLLM)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.connector.harness import REPO, SCRIPTS

pytestmark = pytest.mark.e2e


def test_connector_in_process_checks(vllm_venv, tiny_model, vllm_010_src, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    # TMPDIR: vLLM binds its engine's IPC sockets there and leaves them when its process ends (4 in /tmp a run)
    env.update({"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "YRPD_VLLM_010_SRC": str(vllm_010_src), "TMPDIR": str(tmp_path)})
    proc = subprocess.run([str(vllm_venv / "bin/python"), str(SCRIPTS / "inproc_checks.py"),
                           str(tiny_model)], capture_output=True, text=True, timeout=900, env=env, cwd=str(REPO),
                          stdin=subprocess.DEVNULL)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1])
    assert not result["failed"], "\n\n".join(f"{k}:\n{v}" for k, v in result["failed"].items())
    assert len(result["passed"]) >= 10
