"""PD serving inside containers on two fake hosts, each with its own dockerd, from a STAND-IN vllm-ascend image.

The stand-in (scripts/build_standin_image.sh) has vLLM's CPU build in the image's own Python under /usr/local, the
vllm-ascend 0.10.0rc1 tree, an image ENV PYTHONPATH and an entrypoint-only variable, and no network inside. yrpd
brings the data-system client and the openYuanrong wheels from here, runs the cluster, the instances and the proxy
inside the containers; the answers must be those of one plain vLLM instance. What is FAKE: no NPU, no CANN.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import run_yrpd
from yrpd import wheels
from tests.lab import real_model as rm
from lab.hosts import leftovers

from .dockerlab import DockerHosts, docker_unavailable, unavailable

pytestmark = [pytest.mark.lab, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "tests" / "lab" / "profiles" / "standin-cpu.yaml"  # a lab fake: not shipped to users


@pytest.fixture
def standin(fake_lab):
    reason = docker_unavailable()
    if reason:
        unavailable(reason)
    if not (rm.VLLM / "bin" / "vllm").exists():
        unavailable(f"{rm.VLLM} missing: run scripts/test.sh (it installs it)")
    proc = subprocess.run([str(REPO / "scripts" / "build_standin_image.sh")], capture_output=True, text=True,
                          timeout=1800, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        unavailable(f"building the stand-in image failed:\n{proc.stderr[-3000:]}")
    tag, archive = proc.stdout.strip().splitlines()[-2:]
    lab = fake_lab(2, docker=True)
    hosts = DockerHosts(lab)
    try:
        hosts.start(0)
        started = time.monotonic()
        hosts.load_archive(archive)
        print(f"measured: stand-in image loaded on 2 hosts in {time.monotonic() - started:.1f}s")
        yield lab, tag
    finally:
        hosts.close()


def test_pd_in_containers_answers_like_one_instance_and_leaves_nothing(standin, tmp_path, reference_answers):
    lab, image = standin
    # h2's image carries a vllm-ascend release without a patch series (0.24.0rc1 .. 0.30.0rc2 exist): it is left
    # unpatched with a warning, and serves anyway (the instances load the connector by kv_connector_module_path)
    h2 = next(h for h in lab.hosts if h.name == "h2")
    relabel = ("sed -i 's/^Version: .*/Version: 0.24.0rc1/' /vllm-workspace/vllm-ascend/PKG-INFO")
    h2.exec(f"docker run --name relabel --entrypoint bash {image} -c {shlex.quote(relabel)} && "
            f"docker commit relabel {image} >/dev/null && docker rm relabel >/dev/null")
    home = tmp_path / "home"
    # the data system brought by the user (datasystem_wheels): the real 0.8.1 wheel in a directory of theirs, which
    # the hosts' data-system venvs and the image's client are installed from
    brought = tmp_path / "my-datasystem"
    brought.mkdir()
    for wheel in wheels.fetch(wheels.client_set("3.11", "x86_64")):
        (brought / wheel.name).write_bytes(wheel.read_bytes())
    config = tmp_path / "yrpd.yaml"
    config.write_text("hosts:\n  - {address: h1, devices: [0]}\n  - {address: h2, devices: [1]}\n"
                      "device_kind: cpu\nmodel: builtin:smollm2\ndatasystem_memory_mb: 256\ncluster_mode: ds_only\n"
                      f"datasystem_wheels: {brought}\n")
    ssh = lab.cli_ssh_args
    spec = ["--hosts", "h1,h2", "--config", str(config), "--runtime", "docker", "--image", image,
            "--container-profile", str(PROFILE)]
    env = {"YRPD_HOME": str(home)}

    def cli(*args, check=None, timeout=900):
        return run_yrpd(*args, *ssh, env=env, check=check, timeout=timeout)

    plan = cli("plan", *spec, check=0).stdout
    assert "/usr/local/python3.11.7/bin/python3" in plan  # the image's Python runs the instances
    assert f"openyuanrong-datasystem==0.8.1 for cp311 x86_64, also from {brought}" in " ".join(plan.split())
    dtype = json.loads(cli("plan", *spec, "--json", check=0).stdout)["dtype"]["dtype"]
    want = reference_answers.answers(dtype)  # before the deploy: the reference has the cores alone
    try:
        started = time.monotonic()
        deploy = cli("deploy", *spec, check=0, timeout=1800)
        print(f"measured: deploy in containers (cold) {time.monotonic() - started:.1f}s\n{deploy.stderr}")
        warned = [ln for ln in deploy.stderr.splitlines() if "no yrpd patch series for vllm-ascend 0.24.0rc1" in ln]
        assert len(warned) == 1 and "h2" in warned[0] and "kv_connector_module_path" in warned[0], deploy.stderr
        proxy = deploy.stdout.strip().splitlines()[-1]

        got = rm.answers(proxy)
        rm.assert_known_answers(got)
        assert got == want

        report = json.loads(cli("status", "--json", check=0).stdout)
        assert report["healthy"], report["problems"]
        # the data system ran by the dscli launcher (the default): etcd and a worker per container, no yr CLI
        assert sorted((c["host"], c["component"]) for c in report["cluster"]["components"]) == [
            ("h1", "ds_worker"), ("h1", "etcd"), ("h2", "ds_worker")]
        decode = next(i for i in report["instances"] if i["role"] == "decode")
        assert decode["host"] == "h2" and decode["prompt_tokens_loaded"] >= 11 * 128  # across hosts, from the cache
        session = report["session"]
        for host in lab.hosts:
            box = json.loads(host.exec(f"docker inspect yrpd-{session}").stdout)[0]
            assert box["State"]["Running"]
            no_yr = "test ! -e /opt/yrpd/venvs/yr && ! command -v yr && ! python3 -c 'import yr.cli' 2>/dev/null"
            assert host.exec(f"docker exec yrpd-{session} bash -c {shlex.quote(no_yr + ' && echo none')}",
                             check=False).stdout.strip() == "none", host.name
            # the instance runs the image's Python, sees the image's PYTHONPATH and the entrypoint's environment
            name = "prefill-0" if host.name == "h1" else "decode-0"
            state = host.exec(f"docker exec yrpd-{session} cat /tmp/yrpd_sessions/{session}/run/{name}.state.json")
            pid = json.loads(state.stdout)["pid"]  # the instance itself (the pid file names its supervisor)
            environ = host.exec(f"docker exec yrpd-{session} cat /proc/{pid}/environ").stdout.split("\0")
            assert "YRPD_STANDIN_CANN_ENV=sourced" in environ
            path = next(e for e in environ if e.startswith("PYTHONPATH="))
            assert path.endswith(":/usr/local/Ascend/ascend-toolkit/latest/python/site-packages"), path
            # the data system worker gets its own libraries first, then CANN's (libacl_plugin.so needs them)
            first_worker_env = ("for p in /proc/[0-9]*; do case $(readlink $p/exe) in */datasystem_worker) "
                                "tr '\\0' '\\n' < $p/environ; break;; esac; done")
            environ = host.exec(f"docker exec yrpd-{session} bash -c {shlex.quote(first_worker_env)}").stdout.split()
            libs = next(e for e in environ if e.startswith("LD_LIBRARY_PATH=")).split("=", 1)[1].split(":")
            assert libs[0].endswith("/yr/datasystem/lib"), libs
            assert "/usr/local/Ascend/ascend-toolkit/latest/lib64" in libs, libs
        logs = cli("logs", "-n", "20", check=0).stdout
        assert "h1 prefill-0 |" in logs and "h2 decode-0 |" in logs

        # inside a container too, an instance is one process group that dies whole and comes back by itself
        box = f"docker exec yrpd-{session} bash -c "
        state = h2.exec(f"docker exec yrpd-{session} cat /tmp/yrpd_sessions/{session}/run/decode-0.state.json")
        victim = json.loads(state.stdout)["pid"]
        group = (f"for s in /proc/[0-9]*/stat; do read -r l < $s 2>/dev/null || continue; set -- ${{l##*) }}; "
                 f"[ \"$1\" != Z ] && [ \"$3\" = {victim} ] && echo ${{s:6:-5}}; done; true")
        members = h2.exec(box + shlex.quote(group)).stdout.split()
        assert len(members) >= 2, members  # the API server and its EngineCore
        killed = time.monotonic()
        h2.exec(box + shlex.quote(f"kill -9 {victim}"))  # kill is a shell builtin: the image has no procps
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            report = json.loads(cli("status", "--json", check=None).stdout)
            decode = next(i for i in report["instances"] if i["role"] == "decode")
            if report["healthy"] and decode["restarts"] == 1:
                break
            time.sleep(3)
        print(f"measured: decode in a container back after kill -9 in {time.monotonic() - killed:.1f}s")
        assert report["healthy"] and decode["restarts"] == 1, report["problems"]
        assert decode["pid"] != victim and h2.exec(box + shlex.quote(group)).stdout.split() == []  # nothing orphaned
        assert rm.answers(proxy) == got

        down = cli("down", check=0)
        assert "is down" in down.stderr
        for host in lab.hosts:
            assert host.exec("docker ps -aq").stdout.strip() == "", host.name
            procs, ports = leftovers(host)  # the containers' processes were the host's (host networking)
            assert procs == [] and ports == [], (host.name, procs, ports)

        # a second deployment starts from the derived image: nothing to install, patch or convert again
        started = time.monotonic()
        again = cli("deploy", *spec, "--new-session", check=0, timeout=1800)
        print(f"measured: deploy in containers (derived image) {time.monotonic() - started:.1f}s\n{again.stderr}")
        for step in ("install openYuanrong", "install vLLM", "make the built-in model"):
            assert "already done on h1, h2" in again.stderr.split(step, 1)[1].splitlines()[1], step
        assert rm.completion(again.stdout.strip().splitlines()[-1], rm.COMPLETIONS[0]) == got["completion 0"]
        cli("down", check=0)
    finally:
        run_yrpd("down", *ssh, env=env, timeout=300)
