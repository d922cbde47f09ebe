"""The names the hosts write and the controller reads are the same on both sides: deploy_scripts/hostlib.py (run
without yrpd) and yrpd/tags.py."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from yrpd.assets import deploy_script
from yrpd.tags import ProcessState

SCRIPTS = Path(__file__).resolve().parents[2] / "deploy_scripts"


def hostlib():
    spec = importlib.util.spec_from_file_location("hostlib", SCRIPTS / "hostlib.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_process_states_are_spelled_alike_on_hosts_and_controller():
    assert hostlib().STATES == tuple(ProcessState)


def test_no_host_script_reads_proc_but_hostlib():
    readers = sorted(p.name for p in SCRIPTS.glob("*.py") if p.name != "hostlib.py" and '"/proc' in p.read_text())
    assert readers == []


def test_a_shipped_script_carries_hostlib_in_place_of_its_import_and_runs_alone(tmp_path):
    """What travels to a host is one piece: the import (continuation lines too) replaced by hostlib's text."""
    import subprocess
    import sys

    text = deploy_script("session_processes.py")
    assert not [n for n in ast.parse(text).body if isinstance(n, ast.ImportFrom) and n.module == "hostlib"]
    assert text.count("def proc_stat(") == 1 and "proc_cmdline, proc_environ" not in text
    compile(text, "session_processes.py", "exec")
    args = ('{"dir": "%s", "id": "none", "action": "status", "pidfile": "%s/{name}.pid", "state": "%s/{name}.json", '
            '"log": "%s/{name}.log"}' % ((tmp_path,) * 4))
    run = subprocess.run([sys.executable, "-", args], input=text, capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0 and '"processes": []' in run.stdout, run.stderr[-500:]
    assert deploy_script("ds_kv_check.py") == (SCRIPTS / "ds_kv_check.py").read_text()  # no import: unchanged
