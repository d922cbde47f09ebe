"""The names the hosts write and the controller reads are the same on both sides: deploy_scripts/hostlib.py (run
without yrpd) and yrpd/tags.py."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from yrpd.assets import deploy_script
from yrpd.tags import ComponentState, ProcessState

SCRIPTS = Path(__file__).resolve().parents[2] / "deploy_scripts"


def hostlib():
    spec = importlib.util.spec_from_file_location("hostlib", SCRIPTS / "hostlib.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_process_states_are_spelled_alike_on_hosts_and_controller():
    assert hostlib().STATES == tuple(ProcessState)


def test_the_component_states_are_spelled_alike_on_hosts_and_controller():
    assert hostlib().COMPONENT_STATES == tuple(ComponentState)


def test_a_process_record_has_the_keys_the_controller_takes_and_a_record_short_of_one_is_refused_on_the_host():
    from dataclasses import fields

    from yrpd.status import ProcessStatus

    lib = hostlib()
    assert lib.PROCESS_KEYS == tuple(f.name for f in fields(ProcessStatus) if f.name != "host")
    full = dict.fromkeys(lib.PROCESS_KEYS)
    assert list(lib.shaped(lib.PROCESS_KEYS, **full)) == list(lib.PROCESS_KEYS)  # control: the full record passes
    with pytest.raises(KeyError, match=r"missing \['reason'\], unexpected \['why'\]"):
        lib.shaped(lib.PROCESS_KEYS, **{k if k != "reason" else "why": v for k, v in full.items()})


def test_the_status_reply_of_a_live_supervised_process_is_taken_whole_by_the_controller(tmp_path):
    """session_processes.py run for real on a process of a made-up session: its record becomes a ProcessStatus."""
    import json
    import os
    import subprocess
    import sys
    import time

    from yrpd.status import ProcessStatus

    env = {**os.environ, "YRPD_SESSION": "tagtest", "YRPD_PROCESS": "sleeper"}
    sleeper = subprocess.Popen(["sleep", "30"], env=env, start_new_session=True)
    try:
        (tmp_path / "sleeper.pid").write_text(str(sleeper.pid))
        (tmp_path / "sleeper.json").write_text(json.dumps({"pid": sleeper.pid, "state": "running", "restarts": 2,
                                                           "supervisor": sleeper.pid}))
        args = json.dumps({"dir": str(tmp_path), "id": "tagtest", "action": "status",
                           "pidfile": f"{tmp_path}/{{name}}.pid", "state": f"{tmp_path}/{{name}}.json",
                           "log": f"{tmp_path}/{{name}}.log"})
        time.sleep(0.1)
        run = subprocess.run([sys.executable, "-", args], input=deploy_script("session_processes.py"),
                             capture_output=True, text=True, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-500:]
        [record] = json.loads(run.stdout.splitlines()[-1])["processes"]
        proc = ProcessStatus(host="here", **record)
        assert proc.alive and proc.pid == sleeper.pid and proc.restarts == 2 and proc.state == ProcessState.running
    finally:
        sleeper.kill()
        sleeper.wait()


def compared_state_literals(source: str, states: tuple) -> list[str]:
    """State names a script compares against as string literals (where it should take hostlib's names)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for part in [node.left, *node.comparators]:
                items = part.elts if isinstance(part, (ast.Tuple, ast.List, ast.Set)) else [part]
                found += [i.value for i in items if isinstance(i, ast.Constant) and i.value in states]
    return found


def test_no_host_script_compares_against_a_state_name_it_spells_itself():
    states = hostlib().STATES + hostlib().COMPONENT_STATES
    spelled = {p.name: compared_state_literals(p.read_text(), states) for p in SCRIPTS.glob("*.py")
               if p.name != "hostlib.py"}
    assert {name: found for name, found in spelled.items() if found} == {}
    assert compared_state_literals('if s in ("backoff", "failed"):\n    pass\n', states) == ["backoff", "failed"]


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
    # no import: the same code, its module docstring travelling as its first line (its --help still has it) and its
    # comment lines left out
    sent, source = deploy_script("ds_kv_check.py"), (SCRIPTS / "ds_kv_check.py").read_text()
    assert ast.get_docstring(ast.parse(sent)).startswith(ast.get_docstring(ast.parse(source)).splitlines()[0])
    assert [ast.dump(n) for n in ast.parse(sent).body[1:]] == [ast.dump(n) for n in ast.parse(source).body[1:]]
    assert len(sent) < len(source) and sent.startswith("#!")
