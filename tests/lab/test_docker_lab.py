"""The docker runtime on two fake hosts, each with its own dockerd, FAKE NPUs and a STAND-IN vllm-ascend image.

What is real: sshd per host, dockerd/containerd/runc per host, `docker run` rendered from the guide's container
profile, `docker exec` for every in-container step, yrpd's patch series applied by yrpd's patch manager to the
real vllm-ascend 0.10.0rc1 source tree inside the container, `docker commit` of the derived image, teardown.
What is fake (tests/lab/dockerlab.py): the NPU device nodes (/dev/null's numbers), npu-smi and the other driver
files, and the image (Debian minbase + git + python3 + the sdist tree, tagged with the production name).

Needs root, docker.io and debootstrap (scripts/bootstrap.sh); the stand-in rootfs and the sdist are cached under
/var/cache/yrpd. A missing prerequisite skips, or fails under CI=true.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_yrpd
from tests.doc_commands import as_run_without_changes, commands, detects_npus_on_h1_h2, words

from .dockerlab import (DockerHosts, docker_unavailable, prepare_tree, standin_rootfs, unavailable,
                        vllm_ascend_sdist)

pytestmark = [pytest.mark.lab, pytest.mark.e2e]

PLAYBOOK = Path(__file__).parent / "playbooks" / "docker.yaml"
PROFILE = Path(__file__).resolve().parents[2] / "containers" / "vllm-ascend-v0.10.0rc1-openeuler.yaml"
IMAGE = "quay.io/ascend/vllm-ascend:v0.10.0rc1-openeuler"  # the production name, on a STAND-IN image
FAKE_NPUS = 4
MODEL = "/tmp/models/tiny"
REGISTRATION = 'if "YuanrongConnector" not in KVConnectorFactory._registry:'  # the series' first code line


@pytest.fixture
def docker_hosts(fake_lab, tmp_path):
    reason = docker_unavailable()
    if reason:
        unavailable(reason)
    try:
        rootfs = standin_rootfs()
        sdist = vllm_ascend_sdist("0.10.0rc1")
    except RuntimeError as exc:
        unavailable(str(exc))
    staged = tmp_path / "standin"
    prepare_tree(sdist, staged)
    lab = fake_lab(2, fake_npus=FAKE_NPUS, overlays=("/usr", "/etc"), docker=True)
    hosts = DockerHosts(lab)
    try:
        hosts.start(FAKE_NPUS)
        hosts.rootfs, hosts.staged = rootfs, staged
        yield hosts
    finally:
        hosts.close()


class Cli:
    def __init__(self, lab, home: Path, profile: Path):
        self.env = {"YRPD_HOME": str(home)}
        self.ssh = lab.cli_ssh_args
        self.spec = ["--hosts", ",".join(h.name for h in lab.hosts), "--runtime", "docker", "--image", IMAGE,
                     "--container-profile", str(profile), "--ptp", "2", "--dtp", "2", "--model", MODEL]

    def deploy(self, *extra, check=None):
        return run_yrpd("deploy", *self.spec, "--playbook", PLAYBOOK, *self.ssh, *extra, env=self.env, check=check)

    def __call__(self, *args, check=None):
        return run_yrpd(*args, *self.ssh, env=self.env, check=check)


def journal(home: Path) -> list[dict]:
    return [json.loads(line) for line in (home / "sessions" / "latest" / "journal.jsonl").read_text().splitlines()]


def containers(host) -> list[dict]:
    out = host.exec("docker ps -a --format '{{json .}}'").stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def inspect(host, name: str) -> dict:
    return json.loads(host.exec(f"docker inspect {name}").stdout)[0]


def outcomes(entries: list[dict], run: str) -> dict[str, str]:
    return {e["host"]: e["outcome"] for e in entries if e["run"] == run}


def test_docker_runtime_container_patch_derived_image_and_teardown(docker_hosts, tmp_path):
    lab = docker_hosts.lab
    h1, h2 = lab.hosts
    for host in lab.hosts:
        host.exec(f"mkdir -p {MODEL} && echo '{{}}' > {MODEL}/config.json")
    profile = tmp_path / "profile.yaml"
    # a copy the test edits later (a changed container spec); this test's stand-in image has only Debian's python3
    # (no vLLM: this test serves nothing), where the real image's Python is /usr/local/python3.11.13
    profile.write_text(PROFILE.read_text().replace("python: /usr/local/python3.11.13/bin/python3", "python: python3"))
    home = tmp_path / "home"
    cli = Cli(lab, home, profile)

    # 0. the README's plan and deploy (as --dry-run) for hosts h1,h2: the NPUs are detected over SSH (FAKE ones)
    documented = commands(detects_npus_on_h1_h2)
    assert {words(c)[0] for c in documented} == {"plan", "deploy"}, documented
    for command in documented:
        planned = cli(*as_run_without_changes(command), check=0).stdout
        placement = planned.split("Who may reach each port")[0]  # the placement table, not the ports table
        table = [line.split("│")[1:5] for line in placement.splitlines() if line.count("│") > 5 and "-0 " in line]
        assert [[c.strip() for c in row] for row in table] == [
            ["h1", "prefill-0", "prefill", "0-3"], ["h2", "decode-0", "decode", "0-3"]], planned[:3000]
        assert "ASCEND_RT_VISIBLE_DEVICES=0,1,2,3" in planned, planned[-3000:]
    assert not (home / "sessions").exists()

    # 1. preflight names each host and the missing piece: no image anywhere yet. h2 lacks hccn.conf, which this
    #    deployment does not need: no instance spans hosts, so HCCL never crosses them (KV goes through the cache)
    h2.exec("mv /etc/hccn.conf /etc/hccn.conf.away")
    failed = cli.deploy()
    assert failed.returncode == 1, failed.stderr
    assert "failed on 2 of 2 host(s)" in failed.stderr
    assert f"h1: image {IMAGE} is not on this host and --pull is never" in failed.stderr
    assert f"h2: image {IMAGE} is not on this host" in failed.stderr and "hccn" not in failed.stderr
    assert containers(h1) == [] and containers(h2) == []

    h2.exec("mv /etc/hccn.conf.away /etc/hccn.conf")
    docker_hosts.load_image(IMAGE, docker_hosts.rootfs, docker_hosts.staged)

    # 2. deploy: one container per host with the planned (fake) NPUs, the series applied inside, derived image
    first = cli.deploy(check=0)
    assert "resuming session" in first.stderr
    session = (home / "sessions" / "latest").resolve().name
    name = f"yrpd-{session}"
    entries = journal(home)
    for run in ("container.ensure", "vllm_env.ship_code", "container.patch", "container.commit", "processes.start"):
        assert outcomes(entries, run) == {"h1": "done", "h2": "done"}, run
    derived = None
    for host in lab.hosts:
        [box] = containers(host)
        assert box["Names"] == name and box["State"] == "running"
        info = inspect(host, name)
        assert info["Config"]["Image"] == IMAGE  # the first container starts from the base image
        assert info["Config"]["Labels"]["yrpd.session"] == session
        assert info["HostConfig"]["Privileged"] and info["HostConfig"]["NetworkMode"] == "host"
        assert info["HostConfig"]["ShmSize"] == 64 * 2**30
        planned = ["/dev/davinci0", "/dev/davinci1", "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"]
        assert [d["PathOnHost"] for d in info["HostConfig"]["Devices"]] == planned  # FAKE nodes, 2 of 4 planned
        binds = info["HostConfig"]["Binds"]
        assert not any("hccn" in b for b in binds) and f"{MODEL}:{MODEL}:ro" in binds
        for node in planned:
            assert host.exec(f"docker exec {name} test -c {node}", check=False).returncode == 0, node
        assert "FAKE910" in host.exec(f"docker exec {name} npu-smi info").stdout  # the FAKE npu-smi, mounted
        patched = host.exec(f"docker exec {name} cat {'/vllm-workspace/vllm-ascend'}/vllm_ascend/distributed/__init__.py").stdout
        assert REGISTRATION in patched
        record = json.loads(host.exec(f"docker exec {name} cat /vllm-workspace/vllm-ascend/.yrpd-patches.json").stdout)
        assert record["series"] == "vllm-ascend/0.10.0rc1"
        images = host.exec("docker images --format '{{.Repository}}:{{.Tag}}'").stdout.split()
        [tag] = [i for i in images if i.startswith(IMAGE + "-yrpd-")]
        assert derived in (None, tag)
        derived = tag
        assert "while true; do echo" in host.exec(f"docker top {name}").stdout  # the heartbeat runs in the container
    # the heartbeat runs in the container; its log is on the host through the session mount
    assert "beat from h1" in h1.exec(f"cat /tmp/yrpd_sessions/{session}/logs/heartbeat.log").stdout
    status = json.loads(cli("status", "--json").stdout)  # status asks inside the containers (docker exec)
    assert sorted((p["host"], p["name"], p["alive"]) for p in status["processes"]) == [
        ("h1", "heartbeat", True), ("h2", "heartbeat", True)]
    logs = cli("logs", "heartbeat", "-n", "2", check=0).stdout.splitlines()
    assert logs and all(line.startswith(("h1 heartbeat | beat from h1", "h2 heartbeat | beat from h2")) for line in logs)

    # 3. re-deploy: the same container and image, no patch or install work at all
    ids = {h.name: inspect(h, name)["Id"] for h in lab.hosts}
    second = cli.deploy(check=0)
    new = journal(home)[len(entries):]
    assert new and all(e["outcome"] == "skipped" for e in new), new
    assert {h.name: inspect(h, name)["Id"] for h in lab.hosts} == ids
    assert second.stderr.count("already done on h1, h2") == 8

    # 4. a changed container spec is refused, naming the difference; --recreate replaces the container,
    #    which now starts from the derived image: patch, install and commit are skipped
    profile.write_text(profile.read_text().replace("shm_size: 64g", "shm_size: 32g"))
    refused = cli.deploy()
    assert refused.returncode == 1
    assert f"container {name} exists with another spec" in refused.stderr
    assert "only in the existing container: --shm-size 64g" in refused.stderr
    assert "only in this deploy: --shm-size 32g" in refused.stderr and "--recreate" in refused.stderr
    assert {h.name: inspect(h, name)["Id"] for h in lab.hosts} == ids  # untouched
    before = len(journal(home))
    cli.deploy("--recreate", check=0)
    recreated = journal(home)[before:]
    assert outcomes(recreated, "container.ensure") == {"h1": "done", "h2": "done"}
    for run in ("vllm_env.ship_code", "container.patch", "container.commit"):
        assert outcomes(recreated, run) == {"h1": "skipped", "h2": "skipped"}, run
    for host in lab.hosts:
        info = inspect(host, name)
        assert info["Id"] != ids[host.name] and info["Config"]["Image"] == derived
        assert info["HostConfig"]["ShmSize"] == 32 * 2**30

    # 5. down stops the service and removes the containers; the derived image stays for later deploys
    cli("down", check=0)
    for host in lab.hosts:
        assert containers(host) == []
        assert derived in host.exec("docker images --format '{{.Repository}}:{{.Tag}}'").stdout.split()
    cli("down", check=0)  # idempotent: no container left is fine

    # 6. a new session with the same inputs starts from the derived image with zero patch/install work
    third = cli.deploy(check=0)
    assert "resuming" not in third.stderr
    fresh = journal(home)
    for run in ("vllm_env.ship_code", "container.patch", "container.commit"):
        assert outcomes(fresh, run) == {"h1": "skipped", "h2": "skipped"}, run
    new_name = f"yrpd-{(home / 'sessions' / 'latest').resolve().name}"
    assert new_name != name
    for host in lab.hosts:
        assert inspect(host, new_name)["Config"]["Image"] == derived
    cli("down", check=0)
    assert containers(h1) == [] and containers(h2) == []
