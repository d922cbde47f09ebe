"""yrpd/provenance.py: what every saved result says about where it came from."""

from __future__ import annotations

import hashlib
import os
import subprocess

from yrpd import provenance


def test_a_record_names_the_commit_the_versions_the_cpu_the_commands_and_the_inputs_checksum(tmp_path):
    data = tmp_path / "set.jsonl"
    data.write_text('{"prompt": "a"}\n')
    rec = provenance.record(["yrpd bench run --dataset set.jsonl"], {"dataset": data})
    assert set(provenance.FIELDS) <= set(rec)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(provenance.__file__)).stdout.strip()
    assert head and rec["commit"] == head[:12] and isinstance(rec["dirty"], bool)
    assert rec["inputs"]["dataset"]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert rec["cores"] == os.cpu_count() and rec["cpu"] and rec["commands"] == ["yrpd bench run --dataset set.jsonl"]
    flags = open("/proc/cpuinfo").read().split()
    assert rec["cpu_flags"] == [f for f in provenance.CPU_FLAGS if f in flags]
    assert provenance.missing({"provenance": rec}) == []


def test_a_result_without_provenance_or_without_its_commands_is_named_incomplete():
    complete = {f: "x" for f in provenance.FIELDS}
    assert provenance.missing({"provenance": complete}) == []  # control
    assert provenance.missing({"targets": {}}) == list(provenance.FIELDS)
    assert provenance.missing({"provenance": {**complete, "commands": []}}) == ["commands"]
    assert provenance.missing({"provenance": {k: v for k, v in complete.items() if k != "commit"}}) == ["commit"]


def test_a_checkout_with_changes_is_recorded_dirty_and_one_outside_git_has_no_commit(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "f").write_text("1")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    commit, dirty = provenance.git_state(repo)
    assert commit and dirty is False
    (repo / "f").write_text("2")
    assert provenance.git_state(repo) == (commit, True)
    outside = tmp_path / "plain"
    outside.mkdir()
    assert provenance.git_state(outside) == (None, None)


def test_a_run_names_the_code_it_began_with_and_is_dirty_when_the_checkout_moved_meanwhile():
    now = provenance.git_state()
    same = provenance.record(["x"], code=now)
    assert (same["commit"], same["dirty"]) == now  # the control: nothing moved
    began = ("0123456789ab", False)  # another commit, clean, when the run began
    moved = provenance.record(["x"], code=began)
    assert moved["commit"] == "0123456789ab" and moved["dirty"] is True
