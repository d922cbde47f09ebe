"""yrpd deploy/status/logs/down against fake hosts (network namespaces, each with its own real sshd).

The "service" is a detached heartbeat logger started by tests/lab/playbooks/heartbeat.yaml, which runs
the real deploy steps first (preflight, session directories).
"""

import json
from pathlib import Path

import pytest

from lab.hosts import session_processes
from tests.conftest import run_yrpd

pytestmark = pytest.mark.lab

PLAYBOOK = Path(__file__).parent / "playbooks" / "heartbeat.yaml"
MODEL = "/tmp/models/tiny"


def put_model(*hosts):
    """A stand-in model directory on each host: preflight only checks that it is there with a config.json."""
    for host in hosts:
        host.exec(f"mkdir -p {MODEL} && echo '{{}}' > {MODEL}/config.json")


class Cli:
    """The yrpd CLI pointed at one lab and a private YRPD_HOME."""

    def __init__(self, lab, home: Path, known_hosts: Path | None = None):
        self.lab = lab
        self.env = {"YRPD_HOME": str(home)}
        self.ssh = ["--ssh-config", str(lab.ssh_config), "-i", str(lab.identity_file),
                    "--known-hosts", str(known_hosts or lab.known_hosts)]

    @property
    def hosts(self) -> str:
        return ",".join(h.name for h in self.lab.hosts)

    def deploy(self, *extra, check=None):
        return run_yrpd("deploy", "--hosts", self.hosts, "--playbook", PLAYBOOK, "--model", MODEL, *self.ssh, *extra,
                        env=self.env, check=check)

    def __call__(self, *args, check=None):
        return run_yrpd(*args, *self.ssh, env=self.env, check=check)


def journal(home: Path) -> list[dict]:
    latest = home / "sessions" / "latest"
    return [json.loads(line) for line in (latest / "journal.jsonl").read_text().splitlines()]


def test_deploy_status_logs_down_on_three_hosts(fake_lab, tmp_path):
    lab = fake_lab(3)
    put_model(*lab.hosts)
    home = tmp_path / "home"
    cli = Cli(lab, home)

    first = cli.deploy(check=0)
    assert "done on h1, h2, h3" in first.stderr
    entries = journal(home)
    steps = {e["run"] for e in entries}
    assert {"preflight.check_hosts", "host_session.create", "shell.run", "processes.start"} <= steps
    for step in steps:
        assert sorted(e["host"] for e in entries if e["run"] == step) == ["h1", "h2", "h3"]
        assert all(e["outcome"] == "done" for e in entries if e["run"] == step)

    # the one-second step ran on all hosts at once: every host started before any finished
    session_id = (home / "sessions" / "latest").resolve().name
    spans = []
    for host in lab.hosts:
        d = f"/tmp/yrpd_sessions/{session_id}"
        spans.append([float(host.exec(f"cat {d}/parallel.{w}").stdout) for w in ("start", "end")])
    assert max(s for s, _ in spans) < min(e for _, e in spans)

    pids_before = {h.name: h.exec(f"cat /tmp/yrpd_sessions/{session_id}/run/heartbeat.pid").stdout.strip() for h in lab.hosts}

    # a second deploy skips every completed step and restarts nothing
    second = cli.deploy(check=0)
    assert f"resuming session {session_id}" in second.stderr
    assert second.stderr.count("already done on h1, h2, h3") == 4
    new_entries = journal(home)[len(entries):]
    assert new_entries and all(e["outcome"] == "skipped" for e in new_entries)
    pids_after = {h.name: h.exec(f"cat /tmp/yrpd_sessions/{session_id}/run/heartbeat.pid").stdout.strip() for h in lab.hosts}
    assert pids_after == pids_before

    status = cli("status", "--json", check=0)
    report = json.loads(status.stdout)
    assert report["healthy"] is True
    assert [h["name"] for h in report["hosts"]] == ["h1", "h2", "h3"]
    assert all(h["reachable"] and h["facts"]["hostname"] == h["name"] for h in report["hosts"])
    assert sorted((p["host"], p["name"], p["alive"]) for p in report["processes"]) == [
        ("h1", "heartbeat", True), ("h2", "heartbeat", True), ("h3", "heartbeat", True)]
    assert {i["name"] for i in report["instances"]} == {"prefill-0", "decode-0"}
    table = cli("status", check=0)
    assert "healthy" in table.stdout and "h3" in table.stdout

    logs = cli("logs", "-n", "5", check=0)
    for host in lab.hosts:
        lines = [line for line in logs.stdout.splitlines() if line.startswith(f"{host.name} heartbeat | ")]
        assert 1 <= len(lines) <= 5
        assert all(f"beat from {host.name}" in line for line in lines)
    only_h2 = cli("logs", "heartbeat", "--host", "h2", "-n", "2", check=0)
    assert only_h2.stdout and all(line.startswith("h2 heartbeat | ") for line in only_h2.stdout.splitlines())

    assert all(session_processes(h) for h in lab.hosts)
    down = cli("down", check=0)
    assert "is down" in down.stderr
    for host in lab.hosts:
        assert session_processes(host) == []
        assert not any("beat from" in p for p in host.processes())

    after = cli("status", "--json")
    assert after.returncode == 1
    report = json.loads(after.stdout)
    assert report["phase"] == "down" and not report["healthy"]
    assert all(not p["alive"] for p in report["processes"])
    cli("down", check=0)  # idempotent


def test_unreachable_host_is_reported_per_host(fake_lab, tmp_path):
    lab = fake_lab(3)
    put_model(*lab.hosts)
    home = tmp_path / "home"
    cli = Cli(lab, home)
    cli.deploy(check=0)
    lab.hosts[1].stop_sshd()

    status = cli("status", "--json")
    assert status.returncode == 1
    report = json.loads(status.stdout)
    by = {h["name"]: h for h in report["hosts"]}
    assert not by["h2"]["reachable"] and "refused" in by["h2"]["error"]
    assert by["h1"]["reachable"] and by["h3"]["reachable"]
    assert {p["host"] for p in report["processes"]} == {"h1", "h3"}

    down = cli("down")
    assert down.returncode == 1
    assert "failed on 1 of 3 host(s)" in down.stderr
    assert "h2: ssh to " in down.stderr and "succeeded on: h1, h3" in down.stderr
    for host in (lab.hosts[0], lab.hosts[2]):
        assert session_processes(host) == []

    # a deploy that meets the dead host fails on it, names it, and still reports the others
    again = cli.deploy("--new-session", "--devices", "0")
    assert again.returncode == 1
    assert "h2: ssh to " in again.stderr and "refused" in again.stderr
    assert "succeeded on: h1, h3" in again.stderr
    assert "resume" in again.stderr
    entries = journal(home)
    assert {(e["host"], e["outcome"]) for e in entries} >= {("h1", "done"), ("h3", "done"), ("h2", "unreachable")}
    cli("down", "--purge")


def test_unknown_host_key_is_refused_unless_accepted(fake_lab, tmp_path):
    lab = fake_lab(1)
    put_model(*lab.hosts)
    home = tmp_path / "home"
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    cli = Cli(lab, home, known_hosts=empty)

    refused = cli.deploy("--devices", "0-1")
    assert refused.returncode == 1
    assert "host key of" in refused.stderr and "not in" in refused.stderr and "--accept-new-host-keys" in refused.stderr
    assert session_processes(lab.hosts[0]) == []

    accepted = cli.deploy("--devices", "0-1", "--accept-new-host-keys", check=0)
    assert "done on h1" in accepted.stderr
    assert lab.hosts[0].address in empty.read_text()
    # the key is now known: plain commands work without the flag
    cli("status", check=0)
    cli("down", "--purge", check=0)
    assert lab.hosts[0].exec("ls /tmp/yrpd_sessions").stdout.strip() == ""


def test_preflight_failure_names_the_host_and_deploy_resumes_after_the_fix(fake_lab, tmp_path):
    lab = fake_lab(2)
    put_model(lab.hosts[0])  # h2 lacks the model directory
    home = tmp_path / "home"
    cli = Cli(lab, home)
    failed = cli.deploy()
    assert failed.returncode == 1, failed.stderr
    assert "failed on 1 of 2 host(s)" in failed.stderr
    assert f"h2: exit 1" in failed.stderr and f"model directory {MODEL} does not exist on this host" in failed.stderr
    assert "succeeded on: h1" in failed.stderr
    assert all(session_processes(h) == [] for h in lab.hosts)

    put_model(lab.hosts[1])
    fixed = cli.deploy(check=0)
    assert "resuming session" in fixed.stderr
    assert "already done on h1" in fixed.stderr  # h1 passed preflight before: skipped
    assert json.loads(cli("status", "--json", check=0).stdout)["healthy"]
    cli("down", check=0)
