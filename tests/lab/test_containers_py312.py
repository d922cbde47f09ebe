"""The data system in containers whose Python is 3.12, as in today's vllm-ascend images (v0.23.0 on), for which the
`yr` CLI has no wheel: on two fake hosts with a dockerd each, from the 3.12 STAND-IN image
(scripts/build_standin_py312_image.sh: CPython 3.12 at /usr/local/python3.12.13, no vLLM), yrpd brings the cp312
wheels from here, makes the data system's venv from the image's Python inside each container and runs etcd and the
workers by the dscli launcher, with the deployment's CURVE keys and etcd's client certificates as on hosts. The
deploy playbook is cut to the cluster's steps (the image serves nothing). What is FAKE: no NPU, no CANN, no vLLM in
the image."""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_yrpd
from lab.cluster import MODEL, put_model
from lab.hosts import leftovers
from tests.lab.test_cluster_lab import ds_check, etcdctl, worker_restarted

from .dockerlab import DockerHosts, docker_unavailable, unavailable

pytestmark = [pytest.mark.lab, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
PYTHON = "/usr/local/python3.12.13/bin/python3"
CLUSTER_STEPS = ("preflight.check_hosts", "container.preflight", "host_session.create", "container.ensure",
                 "credentials.ship", "cluster.install", "cluster.configure", "cluster.start_master",
                 "cluster.start_agent", "cluster.wait_healthy", "cluster.check_kv")


@pytest.fixture
def standin312(fake_lab):
    reason = docker_unavailable()
    if reason:
        unavailable(reason)
    proc = subprocess.run([str(REPO / "scripts" / "build_standin_py312_image.sh")], capture_output=True, text=True,
                          timeout=1800, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        unavailable(f"building the 3.12 stand-in image failed:\n{proc.stderr[-3000:]}")
    tag, archive = proc.stdout.strip().splitlines()[-2:]
    lab = fake_lab(2, docker=True)
    hosts = DockerHosts(lab)
    try:
        hosts.start(0)
        hosts.load_archive(archive)
        yield lab, tag
    finally:
        hosts.close()


def test_the_data_system_runs_from_the_images_python_312_without_the_yr_cli(standin312, tmp_path):
    lab, image = standin312
    put_model(*lab.hosts)
    profile = tmp_path / "py312.yaml"
    profile.write_text(yaml.safe_dump({
        "schema": "yrpd.container-profile/1", "name": "standin-py312", "image": image, "shm_size": "4g",
        "python": PYTHON, "python_version": "3.12", "env_scripts": ["/usr/local/Ascend/ascend-toolkit/set_env.sh"]}))
    book = yaml.safe_load((REPO / "playbooks" / "deploy.yaml").read_text())
    book["steps"] = [s for s in book["steps"] if s["run"] in CLUSTER_STEPS]
    playbook = tmp_path / "cluster.yaml"
    playbook.write_text(yaml.safe_dump(book))
    config = tmp_path / "yrpd.yaml"
    config.write_text("device_kind: cpu\ndatasystem_memory_mb: 256\n")
    spec = ["--hosts", "h1,h2", "--config", str(config), "--runtime", "docker", "--image", image,
            "--container-profile", str(profile), "--model", MODEL]
    env = {"YRPD_HOME": str(tmp_path / "home")}

    def cli(*args, check=None):
        return run_yrpd(*args, *lab.cli_ssh_args, env=env, check=check, timeout=900)

    plan = cli("plan", *spec, check=0).stdout
    assert f"the venv /opt/yrpd/venvs/ds made from {PYTHON} (Python 3.12)" in plan
    assert "openyuanrong-datasystem==0.8.1 for cp312" in plan and "/yr/bin" not in plan
    try:
        started = time.monotonic()
        cli("deploy", *spec, "--playbook", str(playbook), check=0)
        print(f"measured: the data system in 3.12 containers up on 2 hosts in {time.monotonic() - started:.1f}s")
        report = json.loads(cli("status", "--json", check=0).stdout)
        assert report["cluster"]["healthy"], report["problems"]
        rows = {(c["host"], c["component"]): c for c in report["cluster"]["components"]}
        assert sorted(rows) == [("h1", "ds_worker"), ("h1", "etcd"), ("h2", "ds_worker")]
        box = f"yrpd-{report['session']}"
        for host in lab.hosts:
            inside = ("/opt/yrpd/venvs/ds/bin/python -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])' && "
                      "ls -d /opt/yrpd/venvs/ds/lib/python3.12/site-packages/yr/datasystem/datasystem_worker && "
                      "test ! -e /opt/yrpd/venvs/yr && ! command -v yr && echo no-yr")
            out = host.exec(f"docker exec {box} bash -c {shlex.quote(inside)}").stdout.split()
            assert out[0] == "3.12" and out[-1] == "no-yr", (host.name, out)

        # from outside the deployment the data system refuses a client without the deployment's CURVE keys and serves
        # one with them; etcd refuses plain HTTP and a TLS client without a certificate of the deployment's CA
        secrets = tmp_path / "home" / "sessions" / report["session"] / "secrets"
        h1, h2 = (f"{h.address}:31501" for h in lab.hosts)
        assert not ds_check("--write", h1, "--read", h2, "--timeout-ms", "3000", "--attempts", "1")["ok"]
        assert ds_check("--write", h1, "--read", h2, "--env-file", str(secrets / "datasystem.env"))["ok"]
        tls = secrets / "etcd"
        etcd = f"https://{lab.hosts[0].address}:32379"
        assert etcdctl(etcd.replace("https", "http")).returncode != 0
        assert etcdctl(etcd, "--cacert", str(tls / "ca.crt")).returncode != 0
        listed = etcdctl(etcd, "--cacert", str(tls / "ca.crt"), "--cert", str(tls / "client.crt"), "--key",
                         str(tls / "client.key"))
        assert listed.returncode == 0 and "/datasystem/" in listed.stdout, listed.stderr[-500:]

        # a killed worker is restarted by its supervisor inside the container
        victim = rows[("h2", "ds_worker")]["pid"]
        lab.hosts[1].exec(f"docker exec {box} bash -c {shlex.quote(f'kill -9 {victim}')}")
        report, worker = worker_restarted(lambda: json.loads(cli("status", "--json").stdout), "h2", 60)
        assert report["healthy"] and worker["restarts"] >= 1 and worker["pid"] != victim, report["problems"]

        cli("down", check=0)
        for host in lab.hosts:
            assert host.exec("docker ps -aq").stdout.strip() == "", host.name
            assert leftovers(host) == ([], []), host.name
    finally:
        run_yrpd("down", *lab.cli_ssh_args, env=env, timeout=300)
