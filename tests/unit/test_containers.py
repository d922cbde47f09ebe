"""Container profiles and the rendered `docker run` (golden files), the docker exec wrapping of the host layer,
the container steps under both runtimes, and the host scripts' pure parts.

Regenerate the goldens after an intended change with:
    YRPD_UPDATE_GOLDEN=1 python -m pytest tests/unit/test_containers.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit import golden_files

from yrpd.containers import (Mount, container_run, derived_image, load_profile, profile_for_image, profile_names,
                             render_docker_run, spec_hash, split_image)
from yrpd.errors import SpecError
from yrpd.hostgroup import Command, ContainerRunner, Host, HostGroup, HostResult, container_exec, on_host
from yrpd.steps import RunOptions

REPO = Path(__file__).resolve().parents[2]
GUIDE = "vllm-ascend-v0.10.0rc1-openeuler"
GUIDE_IMAGE = "quay.io/ascend/vllm-ascend:v0.10.0rc1-openeuler"
SESSION = "20260101-120000-abcdef"
DEPLOYMENT_MOUNTS = [Mount(source="/tmp/yrpd_sessions", create=True), Mount(source="/data/models/Qwen2.5-7B", read_only=True)]


def check_golden(name: str, text: str) -> None:
    golden_files.check_golden("containers", name, text)


def as_lines(argv: list[str]) -> str:
    """One option (with its value) per line, shell-quoted: how a person reads a long docker run."""
    lines, current = [], []
    for word in argv:
        if word.startswith("-") and current and not (len(current) == 1 and current[0] in ("docker", "run")):
            lines.append(current)
            current = []
        current.append(word)
    lines.append(current)
    return " \\\n    ".join(shlex.join(words) for words in lines) + "\n"


def guide_run(npus=range(8), multi_host=True, mounts=DEPLOYMENT_MOUNTS, **kwargs):
    return container_run(load_profile(GUIDE), name=f"yrpd-{SESSION}", npus=list(npus), mounts=mounts,
                         multi_host=multi_host, session_id=SESSION, **kwargs)


def pairs(argv: list[str]) -> list[tuple[str, str]]:
    return list(zip(argv, argv[1:]))


# -- the guide's 8-NPU host ----------------------------------------------------------------------

def test_guide_8npu_host_golden():
    check_golden("guide-8npu-host.txt", as_lines(guide_run().argv))


def test_guide_8npu_host_has_every_flag_of_the_guide():
    run = guide_run()
    argv = run.argv
    assert argv[:5] == ["docker", "run", "-d", "--pull", "never"]  # never an implicit pull
    assert argv[run.image_index] == GUIDE_IMAGE and argv[run.image_index + 1:] == ["infinity"]
    assert "--privileged" in argv and "--net=host" in argv
    assert ("--shm-size", "64g") in pairs(argv)
    devices = [b for a, b in pairs(argv) if a == "--device"]
    assert devices == [f"/dev/davinci{i}" for i in range(8)] + ["/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"]
    mounts = [b for a, b in pairs(argv) if a == "-v"]
    for path in ("/usr/local/dcmi", "/usr/local/bin/npu-smi", "/usr/local/Ascend/driver/lib64",
                 "/usr/local/Ascend/driver/version.info", "/usr/bin/hccn_tool", "/etc/ascend_install.info",
                 "/etc/hccn.conf"):
        assert f"{path}:{path}" in mounts, path
    assert "/data/models/Qwen2.5-7B:/data/models/Qwen2.5-7B:ro" in mounts
    assert "/tmp/yrpd_sessions:/tmp/yrpd_sessions" in mounts
    env = [b for a, b in pairs(argv) if a == "-e"]
    assert {"VLLM_USE_V1=1", "VLLM_WORKER_MULTIPROC_METHOD=spawn", "HCCL_OP_EXPANSION_MODE=AIV"} <= set(env)
    labels = dict(b.split("=", 1) for a, b in pairs(argv) if a == "--label")
    assert labels["yrpd.spec"] == run.spec_hash and labels["yrpd.session"] == SESSION
    assert json.loads(labels["yrpd.args"]) == run.spec
    assert ("--name", f"yrpd-{SESSION}") in pairs(argv) and "--init" in argv


def test_npu_subset_and_single_host():
    run = guide_run(npus=[4, 5, 6, 7], multi_host=False)
    check_golden("subset-4npu-single-host.txt", as_lines(run.argv))
    devices = [b for a, b in pairs(run.argv) if a == "--device"]
    assert devices == ["/dev/davinci4", "/dev/davinci5", "/dev/davinci6", "/dev/davinci7",
                       "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"]
    mounts = " ".join(b for a, b in pairs(run.argv) if a == "-v")
    assert "hccn" not in mounts  # HCCL between hosts only


def test_current_profile_renders():
    profile = load_profile("vllm-ascend-v0.23.0")
    argv = render_docker_run(profile, name="yrpd-x", npus=[0, 1], multi_host=True)
    assert profile.image in argv and "VLLM_USE_V1=1" not in argv
    assert "/usr/local/Ascend/driver/tools/hccn_tool:/usr/local/Ascend/driver/tools/hccn_tool" in argv


def test_spec_hash_covers_the_container_not_its_labels_or_derived_image():
    base = guide_run()
    assert guide_run(run_image=GUIDE_IMAGE + "-yrpd-0123456789ab").spec_hash == base.spec_hash
    assert guide_run().spec_hash == base.spec_hash == spec_hash(base.spec)
    derived = guide_run(run_image="repo/derived:tag")
    assert derived.argv[derived.image_index] == "repo/derived:tag"
    assert guide_run(npus=range(4)).spec_hash != base.spec_hash
    assert guide_run(image="registry.local/ascend/vllm-ascend:mine").spec_hash != base.spec_hash


def test_mount_twice_is_refused():
    with pytest.raises(ValueError, match="/root/.cache is mounted twice"):
        guide_run(mounts=[Mount(source="/root/.cache")])


# -- profiles: shipped ones, lookup, validation ------------------------------------------------------

def test_shipped_profiles_load_and_match_their_images():
    names = profile_names()
    assert GUIDE in names and "vllm-ascend-v0.23.0" in names
    for name in names:
        profile = load_profile(name)
        assert profile.name == name
        assert profile_for_image(profile.image).name == name
    assert profile_for_image("example.org/other:1") is None


BAD_PROFILES = [
    ("unknown key", {"shm": "1g"}, "shm: is not a known setting"),
    ("bad size", {"shm_size": "64x"}, "shm_size: '64x' is not a size like 64g"),
    ("no image", {"image": None}, "image:"),
    ("bad image", {"image": "Quay.io/UPPER:tag"}, "is not an image reference"),
    ("device outside dev", {"devices": ["/tmp/davinci0"]}, "'/tmp/davinci0' is not a device node under /dev/"),
    ("npu device without id", {"npu_device": "/dev/davinci"}, "npu_device:"),
    ("relative mount", {"mounts": [{"source": "usr/local/dcmi"}]}, "mounts.0.source:"),
    ("mount twice", {"mounts": [{"source": "/a"}, {"source": "/b", "target": "/a"}]}, "/a is mounted twice"),
    ("unknown when", {"mounts": [{"source": "/a", "when": "sometimes"}]}, "mounts.0.when:"),
    ("bridge network", {"network": "bridge"}, "network:"),
    ("bad env name", {"env": {"1X": "y"}}, "'1X' is not an environment variable name"),
    ("wrong schema", {"schema": "yrpd.container-profile/9"}, "schema: must be yrpd.container-profile/1"),
]


@pytest.mark.parametrize("what,change,expected", BAD_PROFILES, ids=[c[0] for c in BAD_PROFILES])
def test_profile_validation_errors_are_one_clear_line(tmp_path, what, change, expected):
    import yaml

    data = yaml.safe_load((REPO / "containers" / f"{GUIDE}.yaml").read_text())
    for key, value in change.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as info:
        load_profile(str(path))
    message = str(info.value)
    assert "\n" not in message and message.startswith("container_profile: ")
    assert str(path) in message and expected in message


def test_profile_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("schema: [unclosed\n")
    with pytest.raises(SpecError, match="is not valid YAML at line"):
        load_profile(str(bad))
    with pytest.raises(SpecError, match="does not exist"):
        load_profile(str(tmp_path / "missing.yaml"))
    with pytest.raises(SpecError, match="'nope' is not a shipped profile; use one of"):
        load_profile("nope")


# -- derived images --------------------------------------------------------------------------------

def test_derived_image_tag():
    tag = derived_image(GUIDE_IMAGE, {"patches": "x"})
    assert tag.startswith(GUIDE_IMAGE + "-yrpd-") and len(tag.rsplit("-", 1)[1]) == 12
    assert derived_image(GUIDE_IMAGE, {"patches": "x"}) == tag
    assert derived_image(GUIDE_IMAGE, {"patches": "y"}) != tag
    assert split_image("registry:5000/a/b") == ("registry:5000/a/b", "latest")
    assert split_image("registry:5000/a/b:v1") == ("registry:5000/a/b", "v1")
    assert split_image("a/b@sha256:" + "0" * 64) == ("a/b", "sha256-000000000000")


# -- the host layer: docker exec -------------------------------------------------------------------

def test_container_exec_applies_the_timeout_inside_the_container():
    cmd = container_exec(Command("echo 'hi'; exit 3", timeout=50), "yrpd-s", engine="podman")
    assert cmd.on_host and cmd.timeout > 50
    lines = cmd.script.splitlines()
    assert lines[0].startswith("if [ \"$(podman inspect -f '{{.State.Running}}' yrpd-s 2>/dev/null)\" != true ]")
    assert "exit 125" in lines[0]
    assert lines[1] == "exec podman exec yrpd-s timeout -k 10 50 bash -c " + shlex.quote("echo 'hi'; exit 3")
    teardown = container_exec(Command("true"), "yrpd-s", absent_ok=True)
    assert "nothing to do in it\"; exit 0" in teardown.script.splitlines()[0]


class Recorder:
    def __init__(self):
        self.commands: list[Command] = []

    def run(self, command, on_line=None):
        self.commands.append(command)
        return HostResult("h1", str(command), 0)

    def close(self):
        pass


def test_container_runner_wraps_all_but_on_host_commands():
    inner = Recorder()
    runner = ContainerRunner(inner, "yrpd-s")
    result = runner.run(Command("echo in", display="shown"))
    runner.run(on_host(Command("echo host")))
    wrapped, plain = inner.commands
    assert "docker exec yrpd-s timeout" in wrapped.script and result.command == "shown"
    assert plain.script == "echo host" and plain.on_host


def test_host_group_in_containers_reports_a_missing_container_per_host():
    group = HostGroup([Host("local", "localhost", local=True)])
    boxed = group.in_containers({"local": "yrpd-surely-absent-container"})
    result = boxed.run(Command("echo hi"))["local"]
    assert result.exit_code == 125 and "container yrpd-surely-absent-container is not running on" in result.stderr
    assert boxed.subset(["local"]).containers == {"local": "yrpd-surely-absent-container"}
    assert group.in_containers({"local": "yrpd-x"}, absent_ok=True).run(Command("false"))["local"].ok
    assert boxed.run(on_host(Command("echo hi")))["local"].stdout == "hi\n"
    assert group.run(Command("echo plain"))["local"].stdout == "plain\n"  # the group itself is unchanged


# -- steps under both runtimes -----------------------------------------------------------------------

def _ctx(runtime: str, hosts="h1,h2", kind="npu", **over):
    from yrpd.deployment import inventory_from_json
    from yrpd.placement import make_plan
    from yrpd.spec import build_spec
    from yrpd.steps import StepContext

    overrides = {"hosts": hosts, "devices": "0-7", "device_kind": kind, "model": "/data/models/m", "ptp": 4, "dtp": 4,
                 "runtime": runtime, "image": GUIDE_IMAGE if runtime == "docker" else None, **over}
    spec = build_spec({}, overrides)
    inventory = inventory_from_json({h: {"kind": kind, "devices": list(range(8)), "ip": f"10.0.0.{i + 1}"}
                                     for i, h in enumerate(hosts.split(","))})
    return StepContext(spec=spec, plan=make_plan(spec, inventory), session_id=SESSION)


def test_container_steps_are_noops_under_runtime_host():
    from yrpd.steps import NotNeeded, container

    ctx = _ctx("host")
    host = ctx.plan.hosts[0]
    for step in (container.ensure, container.patch, container.commit, container.remove):
        assert step(ctx, host) == NotNeeded("runtime host")
    for check in (container.ensured, container.patched, container.committed):
        # nothing to check: the step is skipped without a round trip, and deploy says why
        assert check(ctx, host) == NotNeeded("runtime host")
    # the NPU preflight still runs on NPU hosts, without container checks
    args = json.loads(shlex.split(container.preflight(ctx, host).display)[-1])
    assert args["container"] is None and args["npu"]["devices"] == [0, 1, 2, 3]
    cpu = _ctx("host", hosts="localhost", kind="cpu")
    assert container.preflight(cpu, cpu.plan.hosts[0]) == NotNeeded("runtime host, no NPUs")
    assert container.preflight_passed(cpu, cpu.plan.hosts[0]) == NotNeeded("runtime host, no NPUs")


def test_container_steps_under_runtime_docker():
    from yrpd.steps import container

    ctx = _ctx("docker")
    h1, h2 = ctx.plan.hosts
    ensure = container.ensure(ctx, h1)
    assert ensure.on_host and f"docker run -d --pull never --name yrpd-{SESSION}" in ensure.display
    assert "--device /dev/davinci3" in ensure.display and "--device /dev/davinci4" not in ensure.display
    assert f"-v /data/models/m:/data/models/m:ro" in ensure.display
    assert container.commit(ctx, h1).on_host and container.remove(ctx, h1).on_host
    assert not container.patch(ctx, h1).on_host  # runs inside the container
    pre = json.loads(shlex.split(container.preflight(ctx, h2).display)[-1])
    assert pre["container"]["pull"] == "never"
    # prefill on h1, decode on h2, each on one host: KV goes through the data system, HCCL never crosses hosts,
    # so neither /etc/hccn.conf nor hccn_tool is demanded or mounted
    assert pre["npu"]["hccn_conf"] is None and "hccn" not in ensure.display
    assert "/usr/bin/hccn_tool" not in [m[0] for m in pre["container"]["mounts"]]
    assert "/root/.cache" not in [m[0] for m in pre["container"]["mounts"]]  # created when missing
    ctx.options = RunOptions(pull="missing")
    assert json.loads(shlex.split(container.preflight(ctx, h2).display)[-1])["container"]["pull"] == "missing"
    assert container.derived(ctx).startswith(GUIDE_IMAGE + "-yrpd-")


def test_vllms_cache_outlives_the_container_unless_the_env_path_is_mounted_whole():
    from yrpd.steps import container, vllm_env

    ctx = _ctx("docker")
    cache = vllm_env.paths(ctx).vllm_cache  # what the instances get as VLLM_CACHE_ROOT
    ensure = container.ensure(ctx, ctx.plan.hosts[0]).display
    assert f"-v {cache}:{cache} " in ensure, ensure
    pre = json.loads(shlex.split(container.preflight(ctx, ctx.plan.hosts[1]).display)[-1])
    assert cache not in [m[0] for m in pre["container"]["mounts"]]  # not demanded: made where it is missing
    # the control: with env_path the whole environment root is the host's, its cache with it, mounted once
    mounted = container.ensure(_ctx("docker", env_path="/data/yrpd"), ctx.plan.hosts[0]).display
    assert "-v /data/yrpd:/data/yrpd " in mounted and "/cache/vllm" not in mounted


def test_hccn_is_demanded_only_where_an_instance_spans_hosts():
    from yrpd.steps import container

    # prefill-0's two DP ranks of 8 NPUs each sit on h1 and h2: its collectives cross hosts
    ctx = _ctx("docker", hosts="h1,h2,h3", ptp=8, pdp=2, dtp=8)
    assert [i.hosts for i in ctx.plan.instances] == [("h1", "h2"), ("h3",)]
    for host in ctx.plan.hosts:
        pre = json.loads(shlex.split(container.preflight(ctx, host).display)[-1])
        assert pre["npu"]["hccn_conf"] == "/etc/hccn.conf", host.name
        assert "/usr/bin/hccn_tool" in [m[0] for m in pre["container"]["mounts"]]
        assert "-v /etc/hccn.conf:/etc/hccn.conf" in container.ensure(ctx, host).display


def test_playbooks_name_the_container_steps():
    from yrpd.assets import playbook_path
    from yrpd.playbook import load_playbook

    deploy = [s.run for s in load_playbook(playbook_path("deploy")).steps]
    assert deploy.index("container.preflight") < deploy.index("container.ensure") < deploy.index("cluster.install")
    assert deploy.index("vllm_env.ship_code") < deploy.index("container.patch") < deploy.index("container.commit")
    assert deploy.index("container.commit") < deploy.index("instances.start")
    teardown = [s.run for s in load_playbook(playbook_path("teardown")).steps]
    assert teardown.index("processes.stop_all") < teardown.index("container.remove")


# -- host scripts ----------------------------------------------------------------------------------

def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), REPO / "deploy_scripts" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_spec_difference_names_the_changed_options():
    runtime = _load_script("container_runtime.py")
    old = guide_run().spec
    new = container_run(load_profile(GUIDE).model_copy(update={"shm_size": "32g"}), name=f"yrpd-{SESSION}",
                        npus=list(range(8)), mounts=DEPLOYMENT_MOUNTS, multi_host=True).spec
    assert runtime.describe_diff(old, new) == ("only in the existing container: --shm-size 64g; "
                                               "only in this deploy: --shm-size 32g")
    assert "no yrpd spec" in runtime.describe_diff([], new)
    assert runtime.describe_diff(old, old) == "the same arguments in another order"


FAKE_NPU_SMI = """#!/bin/sh
cat <<'EOF'
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.4        36                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3392 / 65536         |
| 1     910B3               | Alarm         | 93.4        36                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          3392 / 65536         |
EOF
"""


def test_ascend_preflight_names_each_missing_piece(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "npu-smi"
    smi.write_text(FAKE_NPU_SMI)  # a FAKE npu-smi listing NPUs 0 and 1
    smi.chmod(0o755)
    conf = tmp_path / "hccn.conf"
    conf.write_text("address_0=192.168.1.1\naddress_1=192.168.1.2\n")
    args = {"npu": {"devices": [0, 1, 2], "npu_device": "/dev/null", "nodes": ["/dev/zero", str(tmp_path / "hisi_hdc")],
                    "npu_smi": str(smi), "version_file": str(tmp_path / "version.info"), "hccn_conf": str(conf)},
            "container": None}
    proc = subprocess.run([sys.executable, str(REPO / "deploy_scripts" / "ascend_preflight.py"), json.dumps(args)],
                          capture_output=True, text=True, env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert proc.returncode == 1
    problems = proc.stderr.strip().splitlines()
    host = os.uname().nodename
    assert all(p.startswith(f"{host}: ") for p in problems)
    text = "\n".join(problems)
    assert f"device node {tmp_path / 'hisi_hdc'} is missing" in text
    assert "`npu-smi info` does not list NPU 2 (it lists 0,1)" in text
    assert "NPU 1 health is Alarm" in text
    assert f"driver version file {tmp_path / 'version.info'} is not readable" in text
    assert f"{conf} has no address_N line for NPU 2" in text
    assert len(problems) == 5
    facts = json.loads(proc.stdout)["facts"]
    assert facts["npu_smi"]["0"] == {"name": "910B3", "health": "OK"}


def test_a_vllm_ascend_release_without_a_series_is_left_unpatched_with_a_warning(tmp_path):
    """vllm-ascend 0.24.0rc1 .. 0.30.0rc2 have no series, and need none: kv_connector_module_path loads the connector.
    The in-container patch step warns, records the tree as unpatched (so the step counts as done) and exits 0."""
    import base64
    import io
    import subprocess
    import sys
    import tarfile

    from yrpd.steps import container

    bundle = tmp_path / "bundle"
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(container.patch_bundle()[1]))) as tar:
        tar.extractall(bundle)
    tree = tmp_path / "vllm-ascend"
    (tree / "vllm_ascend").mkdir(parents=True)
    (tree / "vllm_ascend" / "__init__.py").write_text("")
    (tree / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: vllm_ascend\nVersion: 0.24.0rc1\n")
    marker = tmp_path / "state" / "patched.json"
    args = {"bundle": str(bundle), "tree": str(tree), "reinstall": None, "marker": str(marker)}
    proc = subprocess.run([sys.executable, str(REPO / "deploy_scripts" / "container_patch.py"), json.dumps(args)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("warning: no yrpd patch series for vllm-ascend 0.24.0rc1") and "kv_connector_module_path" in line
    assert json.loads(marker.read_text()) == {"series": None, "version": "0.24.0rc1", "changed": False}
    assert (tree / "vllm_ascend" / "__init__.py").read_text() == ""  # nothing touched


def test_wheels_and_prepared_environments_are_mounted_where_the_installs_run():
    from yrpd.steps import container

    ctx = _ctx("docker", wheels="/srv/wheels", env_path="/opt/prepared")
    ensure = container.ensure(ctx, ctx.plan.hosts[0]).display
    assert "-v /srv/wheels:/srv/wheels:ro" in ensure and "-v /opt/prepared:/opt/prepared " in ensure
    # without them, nothing of the kind is mounted
    assert "/srv/wheels" not in container.ensure(_ctx("docker"), ctx.plan.hosts[0]).display


def test_only_real_vllm_ascend_images_are_offered_by_name_and_the_lab_fake_loads_by_path():
    from yrpd.containers import load_profile, profile_names

    names = profile_names()
    assert names and all(load_profile(n).image.startswith("quay.io/ascend/vllm-ascend:") for n in names), names
    assert "standin-cpu" not in names
    lab = Path(__file__).parents[1] / "lab" / "profiles" / "standin-cpu.yaml"
    assert load_profile(str(lab)).image.startswith("yrpd-lab/")  # the tests still reach it, by its path
