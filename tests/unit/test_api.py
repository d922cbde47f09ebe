"""yrpd/api.py: deploy, resume, refuse, tear down and read logs as the library does it, against scripted hosts h1 and h2
(yrpd.testing.ScriptedHosts: no sshd, no root, no processes). Deploys run a two-step playbook of real deploy steps
(the host session directory, the preflight); the hosts remember what those steps did, so checks skip as on real
hosts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from yrpd import api
from yrpd.api import ContainerActions, check_container_actions
from yrpd.errors import SessionError, SpecError
from yrpd.hostgroup import Command
from yrpd.playbook import PlaybookFailed, StepFailed
from yrpd.render import outcome_line
from yrpd.session import Session, SessionPhase, SessionStore
from yrpd.spec import DeploySpec, Runtime, build_spec
from yrpd.testing import ScriptedHosts

from tests.unit.sessions import recorded

CREATE = "create the session directory on every host"
PREFLIGHT = "check the hosts are ready"
PLAYBOOK = f"""\
name: tiny
description: two real deploy steps, cheap to script
steps:
  - name: {CREATE}
    hosts: all
    run: host_session.create
    check: host_session.exists
  - name: {PREFLIGHT}
    hosts: all
    run: preflight.check_hosts
    check: preflight.passed_before
"""
SID = re.compile(r"\d{8}-\d{6}-[0-9a-f]{6}")


@pytest.fixture
def playbook(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(PLAYBOOK)
    return path


@pytest.fixture(autouse=True)
def home(yrpd_home: Path) -> Path:
    """Every test gets a private $YRPD_HOME (tests/conftest.py)."""
    return yrpd_home


def spec_for(tmp_path: Path, session_root: str | None = "sessions", **flags) -> DeploySpec:
    """Two CPU hosts whose devices, dtype and addresses are given, so no host is probed before the playbook."""
    config = {"hosts": [{"address": "h1", "ip": "10.0.0.1"}, {"address": "h2", "ip": "10.0.0.2"}]}
    given = {"device_kind": "cpu", "devices": "0-3", "model": "/models/m", "dtype": "float32", **flags}
    if session_root:
        given["session_root"] = str(tmp_path / session_root)
    return build_spec(config, given)


class FakeHosts(ScriptedHosts):
    """h1 and h2 for the tiny playbook: a session directory exists on a host once created there, and the preflight
    passes (and is then remembered for that session, as its marker file does) unless the host is in `failing`."""

    def __init__(self, failing: set[str] | None = None):
        super().__init__()
        self.failing = set(failing or ())
        self.made: set[tuple[str, str]] = set()  # (host, session id)
        self.passed: set[tuple[str, str]] = set()
        self.on(r"deploy_scripts/preflight\.py", answer=self._preflight)
        self.on(r"ln -sfn", answer=self._create)
        self.on(r"^test -d", answer=lambda host, cmd: ("", "", 0 if (host, sid(cmd)) in self.made else 1))
        self.on(r"^grep -qx", answer=lambda host, cmd: ("", "", 0 if (host, sid(cmd)) in self.passed else 1))

    def _create(self, host: str, cmd: Command):
        self.made.add((host, sid(cmd)))
        return "", "", 0

    def _preflight(self, host: str, cmd: Command):
        if host in self.failing:
            return "", "preflight: port 8100 (prefill-0) is in use by pid 4242 (python3)", 1
        self.passed.add((host, sid(cmd)))
        return "", "warning: 3.1 GB free under /tmp/yrpd_sessions", 0


def sid(cmd: Command) -> str:
    return SID.search(cmd.script).group()


class Recorder:
    """A Progress that keeps what it was told."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def message(self, text: str) -> None:
        self.events.append(("message", text))

    def step_started(self, number, total, step) -> None:
        self.events.append(("started", number, total, step.name))

    def step_finished(self, step, outcome) -> None:
        self.events.append(("finished", step.name, outcome_line(outcome).rsplit(" (", 1)[0]))


# -- deploy ------------------------------------------------------------------------------------------------

def test_deploy_records_the_session_and_reports_each_step_in_order(tmp_path, playbook, home):
    spec, progress = spec_for(tmp_path), Recorder()
    with FakeHosts() as hosts:
        done = api.deploy(spec, playbook_file=playbook, progress=progress)
    session = done.session
    assert session.path.parent == tmp_path / "sessions" and SessionStore(tmp_path / "sessions").latest() == session
    assert not home.exists()  # the spec's session_root, not $YRPD_HOME
    assert not done.resumed and done.endpoint is None  # this playbook starts no proxy
    assert session.phase is SessionPhase.deployed and session.state["playbook"] == str(playbook)
    # the session holds the spec as deployed: runtime auto resolved (CPU hosts: host)
    assert spec.runtime is Runtime.auto
    assert DeploySpec.model_validate(session.spec_data) == spec.model_copy(update={"runtime": Runtime.host})
    assert session.plan_data["inventory"]["h2"] == {"kind": "cpu", "devices": [0, 1, 2, 3], "ip": "10.0.0.2",
                                                    "cpu_bf16": None, "arch": None, "nic": None}
    assert progress.events == [
        ("message", f"session {session.id} ({session.path})"),
        ("started", 1, 2, CREATE), ("finished", CREATE, "done on h1, h2"),
        ("started", 2, 2, PREFLIGHT), ("finished", PREFLIGHT, "done on h1, h2"),
    ]
    assert [o.step.name for o in done.outcomes] == [CREATE, PREFLIGHT]
    assert [(e["step"], e["host"], e["outcome"]) for e in session.journal_entries()] == [
        (CREATE, "h1", "done"), (CREATE, "h2", "done"), (PREFLIGHT, "h1", "done"), (PREFLIGHT, "h2", "done")]
    # the hosts' session directory is named after the local session
    assert f"/tmp/yrpd_sessions/{session.id}/logs" in hosts.ran("h2", r"ln -sfn")[0].script
    # nothing ran before the playbook: devices, dtype and addresses were all given
    assert not any("# deploy_scripts/inventory.py\n" in cmd.script for _, cmd in hosts.calls)


def test_without_a_session_root_the_session_is_under_yrpd_home_and_opened_from_there(tmp_path, playbook, home):
    with FakeHosts():
        done = api.deploy(spec_for(tmp_path, session_root=None), playbook_file=playbook)
    assert done.session.path.parent == home / "sessions"
    opened = api.open_deployment()
    assert opened.session == done.session and opened.spec == done.deployment.spec
    assert opened.plan.to_dict() == done.deployment.plan.to_dict()
    # the hosts may be reached differently now: ssh settings given here apply, the rest is as deployed
    later = api.open_deployment(done.session.id, {"connect_timeout": 3.0, "identity": None})
    assert later.spec.ssh.connect_timeout == 3.0 and later.spec.model_copy(update={"ssh": opened.spec.ssh}) == opened.spec
    with pytest.raises(SessionError, match="no session 20200101-000000-abcdef"):
        api.open_deployment("20200101-000000-abcdef")


def test_a_failing_step_says_how_to_resume_and_the_same_deploy_resumes_it(tmp_path, playbook):
    spec = spec_for(tmp_path)
    hosts = FakeHosts(failing={"h2"})
    with hosts, pytest.raises(StepFailed) as exc:
        api.deploy(spec, playbook_file=playbook)
    session = SessionStore(tmp_path / "sessions").latest()
    message = str(exc.value)
    assert message.startswith(f"step '{PREFLIGHT}' failed on 1 of 2 host(s):")
    assert "h2: exit 1" in message and "port 8100 (prefill-0) is in use by pid 4242" in message
    assert "succeeded on: h1" in message
    assert message.endswith(f"run the same `yrpd deploy` again to resume session {session.id} (finished steps are "
                            "skipped), or `yrpd down` to remove what was started")
    assert exc.value.step.name == PREFLIGHT and set(exc.value.failed) == {"h2"}
    assert session.phase is SessionPhase.failed and session.state["failed_step"] == PREFLIGHT

    hosts.failing.clear()  # the user freed the port
    progress = Recorder()
    with hosts:
        done = api.deploy(spec, playbook_file=playbook, progress=progress)
    assert done.resumed and done.session == session
    assert progress.events[0] == ("message", f"resuming session {session.id}: finished steps are skipped")
    assert progress.events[1:] == [
        ("started", 1, 2, CREATE), ("finished", CREATE, "already done on h1, h2"),
        ("started", 2, 2, PREFLIGHT), ("finished", PREFLIGHT, "done on h2; already done on h1"),
    ]
    assert len(hosts.ran("h1", r"ln -sfn")) == 1 and len(hosts.ran("h1", r"preflight\.py")) == 1  # not again
    assert session.phase is SessionPhase.deployed and session.state["failed_step"] is None
    assert len(SessionStore(tmp_path / "sessions").all()) == 1


def test_an_unreachable_host_fails_the_step_without_trying_it_there(tmp_path, playbook):
    with FakeHosts() as hosts, pytest.raises(StepFailed) as exc:
        hosts.unreachable("h2")
        api.deploy(spec_for(tmp_path), playbook_file=playbook)
    assert "step 'create the session directory on every host' failed on 1 of 2 host(s)" in str(exc.value)
    assert "h2: ssh to h2 failed: scripted down" in str(exc.value)
    assert hosts.ran("h2", r"^test -d") and not hosts.ran("h2", r"ln -sfn")  # the check found it unreachable
    assert hosts.ran("h1", r"ln -sfn")  # the other host did the step
    assert not hosts.ran("h1", r"preflight\.py")  # the playbook stopped at the failed step
    assert SessionStore(tmp_path / "sessions").latest().phase is SessionPhase.failed


def test_a_change_that_cannot_roll_is_refused_naming_it_and_recreate_tears_the_session_down_first(tmp_path, playbook):
    store = SessionStore(tmp_path / "sessions")
    with FakeHosts() as hosts:
        first = api.deploy(spec_for(tmp_path), playbook_file=playbook).session
        calls = len(hosts.calls)
        other = spec_for(tmp_path, decode=2, datasystem_memory_mb=2048)
        with pytest.raises(SpecError) as exc:
            api.deploy(other, playbook_file=playbook)
        assert str(exc.value) == (
            f"deploy: session {first.id} is running and datasystem_memory_mb cannot change under it (only instance "
            "settings roll, instance counts scale and hosts added after the others join); pass --recreate to tear it down and deploy anew (requests fail "
            "meanwhile), or undo that change")
        assert len(hosts.calls) == calls and store.all() == [first]  # refused before any host or session
        control = api.deploy(spec_for(tmp_path), playbook_file=playbook)  # the same spec: resumed, no refusal
        assert control.resumed and control.session == first

        second = api.deploy(other, playbook_file=playbook, new_session=True)
        assert not second.resumed and second.session != first
        assert first.phase is SessionPhase.deployed  # --new-session leaves it as it was
        assert Session(second.session.path).spec_data["decode"] == 2

        for rule in (r"deploy_scripts/session_processes\.py", r"deploy_scripts/yr_cluster\.py", r"^rm -rf "):
            hosts.on(rule)
        third = api.deploy(spec_for(tmp_path, datasystem_memory_mb=4096), playbook_file=playbook,
                           actions=ContainerActions(recreate=True))
    assert Session(second.session.path).phase is SessionPhase.down  # torn down first
    assert not third.resumed and third.session not in (first, second.session)
    assert Session(third.session.path).spec_data["datasystem_memory_mb"] == 4096


def test_only_ssh_settings_changed_resumes_and_a_down_session_is_not_resumed(tmp_path, playbook):
    with FakeHosts():
        first = api.deploy(spec_for(tmp_path), playbook_file=playbook).session
        again = api.deploy(spec_for(tmp_path, ssh={"connect_timeout": 3}), playbook_file=playbook)
        assert again.resumed and again.session == first
        first.set_state(SessionPhase.down)
        fresh = api.deploy(spec_for(tmp_path, decode=2), playbook_file=playbook)  # nothing runs: no refusal
    assert not fresh.resumed and fresh.session != first


def test_pull_is_refused_outside_runtime_docker_before_any_host_is_touched(tmp_path, playbook):
    spec = spec_for(tmp_path)
    for pull in ("missing", "always"):
        with pytest.raises(SpecError, match=r"^--pull: only applies to runtime docker"):
            check_container_actions(spec, ContainerActions(pull=pull))
    assert check_container_actions(spec, None) == ContainerActions()
    assert check_container_actions(spec, ContainerActions(pull="never")) == ContainerActions()
    # --recreate means something on every runtime (a changed spec that cannot roll is deployed anew)
    assert check_container_actions(spec, ContainerActions(recreate=True)) == ContainerActions(recreate=True)

    docker = spec_for(tmp_path, runtime="docker", image="quay.io/ascend/vllm-ascend:v0.10.0rc1-openeuler")
    wanted = ContainerActions(recreate=True, pull="always")
    assert check_container_actions(docker, wanted) is wanted

    with ScriptedHosts() as hosts, pytest.raises(SpecError, match="--pull"):
        api.deploy(spec, playbook_file=playbook, actions=ContainerActions(pull="missing"))
    assert hosts.calls == [] and not (tmp_path / "sessions").exists()


def test_a_playbook_that_cannot_be_read_is_refused_before_any_host_or_session(tmp_path, playbook):
    spec = spec_for(tmp_path)
    with ScriptedHosts() as hosts, pytest.raises(SpecError, match=r"^--playbook: .*missing\.yaml does not exist"):
        api.deploy(spec, playbook_file=tmp_path / "missing.yaml")
    assert hosts.calls == [] and not (tmp_path / "sessions").exists()
    # the control: the readable one deploys (its steps answered as done)
    with ScriptedHosts(default_exit=0):
        assert api.deploy(spec, playbook_file=playbook).session.phase is SessionPhase.deployed


# -- down --------------------------------------------------------------------------------------------------

def teardown_hosts(**failing: str) -> ScriptedHosts:
    """The teardown's host scripts answer: every stop succeeds, except on the hosts given (host -> stderr)."""
    hosts = ScriptedHosts()
    for host, stderr in failing.items():
        hosts.on(r"deploy_scripts/session_processes\.py", host=host, stderr=stderr, exit_code=1)
    hosts.on(r"deploy_scripts/session_processes\.py")
    hosts.on(r"deploy_scripts/yr_cluster\.py")
    hosts.on(r"^rm -rf ")
    return hosts


def test_down_runs_the_teardown_and_marks_the_session_down(tmp_path):
    deployment = recorded(tmp_path)
    progress = Recorder()
    with teardown_hosts() as hosts:
        done = api.down(deployment, progress=progress)
    assert done.hosts == ["h1", "h2"] and not done.was_down and done.session == deployment.session
    state = Session(deployment.session.path).state
    assert state["phase"] == "down" and state["purged"] is False
    finished = [e[1:] for e in progress.events if e[0] == "finished"]
    assert finished[0] == ("stop the proxy (no new requests reach the instances)", "done on h1")
    assert ("remove the container of the session on every host (runtime docker)",
            "not needed on h1, h2: runtime host") in finished
    assert not any(name.startswith("remove the session directory") for name, _ in finished)  # only with purge
    # openYuanrong stops on the workers before the master: agents would spin without their master
    cluster = [(name, i) for i, (name, cmd) in enumerate(hosts.calls) if "# deploy_scripts/yr_cluster.py\n" in cmd.script]
    assert [name for name, _ in cluster] == ["h2", "h1"]
    for host in ("h1", "h2"):  # logs are kept; the deployment's secrets are not
        assert [c.script for c in hosts.ran(host, r"^rm -rf")] == [
            f"rm -rf /tmp/yrpd_sessions/{deployment.session.id}/secrets"]

    with teardown_hosts() as hosts:
        again = api.down(deployment, purge=True)
    assert again.was_down
    for host in ("h1", "h2"):
        assert any(f"rm -rf /tmp/yrpd_sessions/{deployment.session.id};" in c.script for c in hosts.ran(host, r"^rm -rf"))
    assert Session(deployment.session.path).state["purged"] is True


@pytest.mark.parametrize("fault", ["fails", "unreachable"])
def test_a_host_that_fails_teardown_leaves_the_session_down_failed_and_says_to_retry(tmp_path, fault):
    deployment = recorded(tmp_path)
    hosts = teardown_hosts(**({"h2": "decode-0 (pid 4242) is still running after SIGKILL"} if fault == "fails" else {}))
    if fault == "unreachable":
        hosts.unreachable("h2")
    with hosts, pytest.raises(PlaybookFailed) as exc:
        api.down(deployment)
    message = str(exc.value)
    assert "failed on 1 of 2 host(s)" in message and "succeeded on: h1" in message
    assert ("decode-0 (pid 4242) is still running" if fault == "fails" else "ssh to h2 failed") in message
    assert message.endswith("fix the cause (or bring the host back) and run `yrpd down` again")
    assert deployment.session.phase is SessionPhase.down_failed
    # the other host carried on to the end; the failed one was left out of the later steps
    assert hosts.ran("h1", r"yr_cluster\.py") and not hosts.ran("h2", r"yr_cluster\.py")
    assert len(hosts.ran("h1", r"session_processes\.py")) == 4  # proxy, instances, the cluster, every process

    with teardown_hosts():
        retried = api.down(deployment)
    assert not retried.was_down and deployment.session.phase is SessionPhase.down


# -- logs --------------------------------------------------------------------------------------------------

TAILS = {
    "h1": "==> ./prefill-0.log <==\nINFO starting\n\nINFO ready\n\n==> ./proxy.log <==\nproxy listening on :8000\n",
    "h2": "==> ./decode-0.log <==\nINFO ready\n\n==> ./ds-client/worker.log <==\nconnected\n",
}


def logs_hosts() -> ScriptedHosts:
    hosts = ScriptedHosts()
    for host, out in TAILS.items():
        hosts.on(r"exec tail -v", host=host, stdout=out)
    return hosts


def test_logs_are_split_per_host_and_log_name(tmp_path):
    deployment = recorded(tmp_path)
    lines: list[tuple[str, str, str]] = []
    with logs_hosts() as hosts:
        results = api.logs(deployment, lambda *line: lines.append(line))
    assert results.ok and sorted(results) == ["h1", "h2"]
    assert [line[1:] for line in lines if line[0] == "h1"] == [
        ("prefill-0", "INFO starting"), ("prefill-0", ""), ("prefill-0", "INFO ready"),  # a blank line in a log kept
        ("proxy", "proxy listening on :8000")]  # tail's blank line before a header dropped
    assert [line[1:] for line in lines if line[0] == "h2"] == [("decode-0", "INFO ready"), ("ds-client/worker", "connected")]
    script = hosts.ran("h1", r"exec tail -v")[0].script
    assert f"cd /tmp/yrpd_sessions/{deployment.session.id}/logs " in script and "-n 20" in script


def test_logs_of_one_host_and_one_name(tmp_path):
    deployment = recorded(tmp_path)
    lines = []
    with logs_hosts() as hosts:
        api.logs(deployment, lambda *line: lines.append(line), name="decode-0", lines=5, hosts=["h2"])
    assert {line[0] for line in lines} == {"h2"} and not hosts.ran("h1", ".")
    script = hosts.ran("h2", r"exec tail -v")[0].script
    assert "-name decode-0.log" in script and "-n 5" in script


def test_logs_refuse_a_host_that_is_not_in_the_session(tmp_path):
    deployment = recorded(tmp_path)
    with ScriptedHosts() as hosts, pytest.raises(SpecError) as exc:
        api.logs(deployment, lambda *line: None, hosts=["h2", "h3"])
    assert str(exc.value) == f"--host: 'h3' is not a host of session {deployment.session.id} (h1, h2); pick one of them"
    assert hosts.calls == []


def test_a_host_without_logs_fails_alone(tmp_path):
    deployment = recorded(tmp_path)
    lines = []
    with ScriptedHosts() as hosts:
        hosts.on(r"exec tail -v", host="h1", stdout=TAILS["h1"])
        hosts.on(r"exec tail -v", host="h2", stderr="no logs directory /tmp/yrpd_sessions/x/logs on this host",
                 exit_code=3)
        results = api.logs(deployment, lambda *line: lines.append(line))
    assert results["h1"].ok and not results["h2"].ok and "no logs directory" in results["h2"].tail(3)
    assert len(lines) == 4 and {line[0] for line in lines} == {"h1"}


def test_the_secrets_travel_as_private_files_and_no_command_carries_them(tmp_path, monkeypatch):
    monkeypatch.setenv("YRPD_TEST_PROXY_KEY", "client-key-123")
    path = tmp_path / "secrets.yaml"
    path.write_text(PLAYBOOK.replace("preflight.check_hosts", "credentials.ship").replace(
        "    check: preflight.passed_before\n", ""))
    spec = spec_for(tmp_path, api_key_env="YRPD_TEST_PROXY_KEY")
    with FakeHosts() as hosts:
        hosts.on(r"^chmod -R go-rwx")
        done = api.deploy(spec, playbook_file=path)
    local = done.session.path / "secrets"
    token = (local / "instance.token").read_text().strip()
    remote = f"/tmp/yrpd_sessions/{done.session.id}/secrets"
    shipped = {h: c for h, c in hosts.calls if c.uploads}
    curve = {(f"{local}/curve/{name}", f"{remote}/curve/{name}") for name in
             ("worker.key", "worker.key_secret", "worker_authorized_clients/worker.key",
              "worker_authorized_clients/client.key")}
    etcd = lambda *names: {(f"{local}/etcd/{n}", f"{remote}/etcd/{n}") for n in names}  # noqa: E731
    # prefill and the proxy run on h1, decode on h2; the data system's keys go to every host, etcd's server pair
    # only to the master; the KV-event relay's keys to h2, whose decode instance's events it relays to the proxy
    assert set(shipped["h1"].uploads) == curve | {(f"{local}/{n}.env", f"{remote}/{n}.env") for n in (
        "instance", "proxy", "datasystem")} | etcd("ca.crt", "server.crt", "server.key", "client.crt", "client.key")
    assert set(shipped["h2"].uploads) == curve | {(f"{local}/{n}.env", f"{remote}/{n}.env") for n in (
        "instance", "datasystem", "kv-relay")} | etcd("ca.crt", "client.crt", "client.key")
    relay, proxy = ((local / f"{n}.env").read_text() for n in ("kv-relay", "proxy"))
    relay_secret = (local / "kv-relay" / "relay.key_secret").read_text().strip()
    proxy_secret = (local / "kv-relay" / "proxy.key_secret").read_text().strip()
    # each holds its own secret and the other's public key, never the other's secret
    assert relay_secret in relay and proxy_secret not in relay and proxy_secret in proxy and relay_secret not in proxy
    assert (local / "kv-relay" / "proxy.key").read_text().strip() in relay
    assert shipped["h1"].fresh_uploads and f"chmod -R go-rwx {remote} && chmod 700 {remote}" in shipped["h1"].script
    assert "client-key-123" in (local / "proxy.env").read_text()
    secret_values = [token, "client-key-123", (local / "curve" / "worker.key_secret").read_text(),
                     (local / "curve" / "client.key_secret").read_text(), relay_secret, proxy_secret,
                     (local / "etcd" / "server.key").read_text().splitlines()[1]]
    for _, command in hosts.calls:
        for value in secret_values:
            assert value not in command.script + str(command)
    journal = (done.session.path / "journal.jsonl").read_text()
    assert not any(value in journal for value in secret_values)


def test_a_session_stored_before_the_launcher_existed_is_torn_down_as_the_yr_cli_ran_it(tmp_path):
    """Sessions deployed by an older yrpd ran the yr CLI: their stored spec has no cluster_launcher, and status and
    down must drive yr's stop for them, not the dscli launcher's supervisors (control: a session stored now)."""
    from yrpd.spec import ClusterLauncher, stored_spec

    now = spec_for(tmp_path).model_dump(mode="json")
    assert stored_spec(now).launcher is ClusterLauncher.dscli
    before = {k: v for k, v in now.items() if k != "cluster_launcher"}
    assert stored_spec(before).launcher is ClusterLauncher.yr


def test_a_deployed_session_whose_stored_spec_cannot_be_read_is_reported_not_deployed_over(tmp_path, playbook):
    store = SessionStore(tmp_path / "sessions")
    with FakeHosts() as hosts:
        first = api.deploy(spec_for(tmp_path), playbook_file=playbook).session
        assert api.deploy(spec_for(tmp_path), playbook_file=playbook).resumed  # control: readable, so resumed
        (first.path / "spec.json").write_text('{"hosts": 5}')
        calls = len(hosts.calls)
        with pytest.raises(SpecError) as exc:
            api.deploy(spec_for(tmp_path), playbook_file=playbook)
        assert f"session {first.id} is still deployed but its stored spec cannot be read" in str(exc.value)
        assert f"yrpd down --session {first.id}" in str(exc.value)
        assert len(hosts.calls) == calls and store.all() == [first]  # refused before any host or session
