"""yrpd/ascend_store.py and its use in serving: `kv_connector: ascend-store` as `yrpd plan` renders it."""

import json
from pathlib import Path

import pytest

from tests.unit.golden_files import check_golden
from yrpd.errors import SpecError
from yrpd.placement import HostInventory, make_plan
from yrpd.serving import instance_launches
from yrpd.spec import DeviceKind, build_spec
from yrpd.steps import StepContext
from yrpd.steps.vllm_env import paths as host_paths


def launches(**over):
    spec = build_spec({}, {"hosts": "h1,h2", "model": "/models/Qwen2.5-7B", "device_kind": "npu", "devices": "0-7",
                           "kv_connector": "ascend-store", **over})
    plan = make_plan(spec, {h: HostInventory(DeviceKind.npu, tuple(range(8)), f"10.0.0.{i + 1}")
                            for i, h in enumerate(("h1", "h2"))})
    paths = host_paths(StepContext(spec, plan))
    return spec, plan, {i.name: instance_launches(spec, plan, i, paths)[0] for i in plan.instances}


def transfer_config(launch) -> dict:
    return json.loads(launch.argv[launch.argv.index("--kv-transfer-config") + 1])


def test_pd_on_the_current_release_is_upstreams_recipe_on_each_hosts_worker():
    spec, _, by_name = launches(ptp=4, dtp=4)
    assert spec.image == "quay.io/ascend/vllm-ascend:v0.23.0"  # NPU hosts: the release image, runtime docker
    configs = {name: transfer_config(launch) for name, launch in by_name.items()}
    check_golden("ascend_store", "pd-v0.23.0.json", json.dumps(configs, indent=2, sort_keys=True) + "\n")
    for name, host in (("prefill-0", "10.0.0.1"), ("decode-0", "10.0.0.2")):
        env = by_name[name].env
        # its own host's worker; remote H2D off (its pre-registration call is not in the data system yrpd installs)
        assert env["DS_WORKER_ADDR"] == f"{host}:31501" and env["DS_ENABLE_REMOTE_H2D"] == "0"
        assert env["PYTHONHASHSEED"] == "0"  # the pool's keys are vLLM block hashes: alike on every instance
    # the roles of upstream's recipe
    assert [c["kv_role"] for c in configs["prefill-0"]["kv_connector_extra_config"]["connectors"]] == ["kv_producer"] * 2
    assert [c["kv_role"] for c in configs["decode-0"]["kv_connector_extra_config"]["connectors"]] == ["kv_consumer"] * 2


def test_instances_sharing_a_host_get_their_own_lookup_socket_and_handshake_ports():
    _, plan, by_name = launches(prefill=2, decode=2, ptp=2, dtp=2, hosts="h1")
    seen_lookup, seen_ports = set(), set()
    for name, launch in by_name.items():
        mooncake, pool = transfer_config(launch)["kv_connector_extra_config"]["connectors"]
        lookup = pool["kv_connector_extra_config"]["lookup_rpc_port"]
        assert lookup not in seen_lookup, name
        seen_lookup.add(lookup)
        first = int(mooncake["kv_port"])
        block = set(range(first, first + 2))  # kv_port + dp_rank * tp + tp_rank, tp 2 dp 1
        assert not block & seen_ports, name
        seen_ports |= block
    assert len(seen_lookup) == len(plan.instances) == 4


def test_a_single_instance_with_the_pool_gets_the_pool_alone():
    _, _, by_name = launches(disaggregated=False, single_kv_store=True, prefill=1)
    (launch,) = by_name.values()
    config = transfer_config(launch)
    assert config["kv_connector"] == "AscendStoreConnector" and config["kv_role"] == "kv_both"
    assert config["kv_connector_extra_config"]["backend"] == "yuanrong"


@pytest.mark.parametrize("over,said", [
    ({"image": "quay.io/ascend/vllm-ascend:v0.30.0rc2"}, "needs openyuanrong-datasystem >= 0.9.1rc5"),
    ({"image": "quay.io/ascend/vllm-ascend:v0.10.0rc1-openeuler"}, "has no AscendStoreConnector with a yuanrong backend"),
    ({"runtime": "host"}, "ascend-store is vllm-ascend's own connector: it runs in the vllm-ascend image"),
    ({"ptp": 8, "pdp": 4}, "needs 32 Mooncake handshake ports"),
])
def test_what_ascend_store_cannot_serve_is_refused_naming_why(over, said):
    with pytest.raises(SpecError) as refused:
        launches(**over)
    assert str(refused.value).startswith("kv_connector: ") and said in str(refused.value)
    # keyed control: the same spec without the offending setting plans
    launches()


def test_the_bench_peer_runs_pd_through_ascend_store_where_it_can_and_is_refused_elsewhere():
    from yrpd.bench.run import variant
    from yrpd.spec import DeviceKind as Kind

    npu = build_spec({}, {"hosts": "h1,h2", "model": "/models/m", "device_kind": "npu", "devices": "0-7"})
    peer = variant(npu, "peer-ascend-store", Kind.npu)
    assert peer.kv_connector.value == "ascend-store" and peer.disaggregated and peer.image.endswith(":v0.23.0")
    assert variant(npu, "pd", Kind.npu).kv_connector.value == "yuanrong"  # control: the yrpd target beside it
    cpu = build_spec({}, {"hosts": "localhost", "device_kind": "cpu", "runtime": "host"})  # as a session stores it
    with pytest.raises(SpecError) as refused:
        variant(cpu, "peer-ascend-store", Kind.cpu)
    assert "it runs in the vllm-ascend image" in str(refused.value)


# -- a data system the user brings (datasystem_wheels)

#: what vllm-ascend 0.27.1rc1 and later call on HeteroClient beyond 0.8.1's client
NEWER_CALLS = ("batch_is_exist", "mget_h2d_from_multi_buffers", "mset_d2h_from_multi_buffers")
RELEASES_READING_JSON = ("0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc1", "0.30.0rc2")


def fake_wheel(directory, version: str, methods: tuple[str, ...], tag: str = "cp312-cp312-manylinux_2_34_aarch64"):
    """A FAKE openyuanrong-datasystem wheel: the two files yrpd reads (METADATA, HeteroClient's module), standing in for
    a release newer than the package index's, which this machine cannot have. tests/lab/test_brought_datasystem.py
    reads the real 0.8.1 wheel the same way."""
    import zipfile

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"openyuanrong_datasystem-{version}-{tag}.whl"
    body = "".join(f"    def {m}(self, *args):\n        pass\n\n" for m in ("init", "exist", *methods))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"openyuanrong_datasystem-{version}.dist-info/METADATA", f"Name: openyuanrong-datasystem\n"
                   f"Version: {version}\n")
        z.writestr("yr/datasystem/hetero_client.py", f"class HeteroClient:\n{body}")
        z.writestr("yr/datasystem/cli/start.py", "parser.add_argument('--coordinator_address')\n")
    return path


def profile_for(tmp_path, release: str) -> str:
    """A copy of the shipped v0.30.0rc2 profile naming `release` (a user's image of that release)."""
    shipped = Path(__file__).resolve().parents[2] / "containers" / "vllm-ascend-v0.30.0rc2.yaml"
    text = shipped.read_text().replace('vllm_ascend: "0.30.0rc2"', f'vllm_ascend: "{release}"')
    text = text.replace("name: vllm-ascend-v0.30.0rc2", f"name: my-vllm-ascend-{release}")
    path = tmp_path / f"{release}.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("release", RELEASES_READING_JSON)
def test_a_brought_data_system_with_the_calls_serves_the_releases_that_read_yr_config_path(tmp_path, release):
    from yrpd.steps import instances

    fake_wheel(tmp_path / "ds", "0.9.2", NEWER_CALLS)
    spec, plan, by_name = launches(ptp=4, dtp=4, image=f"quay.io/ascend/vllm-ascend:v{release}",
                                   container_profile=profile_for(tmp_path, release),
                                   datasystem_wheels=str(tmp_path / "ds"))
    assert spec.datasystem_version == "0.9.2"
    written = {}
    for name, host in (("prefill-0", "10.0.0.1"), ("decode-0", "10.0.0.2")):
        env = by_name[name].env
        assert "DS_WORKER_ADDR" not in env and env["PYTHONHASHSEED"] == "0"
        [(path, text)] = by_name[name].files
        assert env["YR_CONFIG_PATH"] == path and path.endswith(f"/run/{name}.yr-config.json")
        written[name] = json.loads(text)
        assert written[name]["worker_addr"] == f"{host}:31501"
        # the instances' start step writes it before the instance starts, as `yrpd plan` shows
        host_plan = next(h for h in plan.hosts if h.reach_ip == host)
        start = instances.start(StepContext(spec, plan), host_plan)
        assert start.script.index(path) < start.script.index("supervise.py") and f"write {path}: " in start.display
    check_golden("ascend_store", f"yr-config-v{release}.json", json.dumps(written, indent=2, sort_keys=True) + "\n")




@pytest.mark.parametrize("methods,lacking", [(NEWER_CALLS[:2], NEWER_CALLS[2]), ((), ", ".join(NEWER_CALLS))])
def test_a_brought_data_system_without_a_call_the_release_makes_is_refused_naming_the_call(tmp_path, methods,
                                                                                             lacking):
    fake_wheel(tmp_path / "ds", "0.9.0", methods)
    over = dict(ptp=4, dtp=4, image="quay.io/ascend/vllm-ascend:v0.30.0rc2")
    with pytest.raises(SpecError) as refused:
        launches(**over, datasystem_wheels=str(tmp_path / "ds"))
    line = str(refused.value)
    assert line.startswith("kv_connector: ascend-store: vllm-ascend 0.30.0rc2's yuanrong backend calls HeteroClient."
                           f"{lacking}, which the openyuanrong-datasystem 0.9.0 brought in {tmp_path / 'ds'} lacks")
    # keyed control: the same spec with a wheel that has every call plans
    fake_wheel(tmp_path / "ok", "0.9.2", NEWER_CALLS)
    launches(**over, datasystem_wheels=str(tmp_path / "ok"))


@pytest.mark.parametrize("what,said", [
    ("missing", "datasystem_wheels: {d} is not a directory"),
    ("empty", "datasystem_wheels: {d} holds no openyuanrong_datasystem-*.whl"),
    ("two-versions", "datasystem_wheels: {d} holds openyuanrong-datasystem 0.9.1, 0.9.2"),
    ("not-a-wheel", "is not an openyuanrong-datasystem wheel"),
    ("runtime-host", "datasystem_wheels: brought wheels are installed inside the containers (runtime docker)"),
    ("with-wheels", "datasystem_wheels: is brought to hosts that have nothing, and wheels says they have their own"),
])
def test_brought_wheels_that_cannot_serve_are_one_line_naming_the_field(tmp_path, what, said):
    d = tmp_path / "ds"
    over = {"datasystem_wheels": str(d)}
    if what != "missing":
        fake_wheel(d, "0.9.2", NEWER_CALLS)
    if what == "empty":
        next(d.glob("*.whl")).unlink()
    elif what == "two-versions":
        fake_wheel(d, "0.9.1", NEWER_CALLS, tag="cp311-cp311-manylinux_2_34_x86_64")
    elif what == "not-a-wheel":
        next(d.glob("*.whl")).write_bytes(b"PK\x05\x06" + b"\0" * 18)  # an empty zip
    spec = {"hosts": "h1,h2", "model": "/models/m", "device_kind": "npu", "devices": "0-7", **over}
    if what == "runtime-host":
        spec.update(device_kind="cpu", runtime="host")
    elif what == "with-wheels":
        spec["wheels"] = "/srv/wheels"
    with pytest.raises(SpecError) as refused:
        build_spec({}, spec)
    assert said.format(d=d) in str(refused.value), str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_brought_data_system_is_what_every_host_installs_from_its_wheels(tmp_path):
    from yrpd.steps import brought, cluster, vllm_env

    fake_wheel(tmp_path / "ds", "0.9.2", NEWER_CALLS)
    spec, plan, _ = launches(ptp=4, dtp=4, image="quay.io/ascend/vllm-ascend:v0.30.0rc2",
                             datasystem_wheels=str(tmp_path / "ds"))
    ctx = StepContext(spec, plan)
    for host in plan.hosts:
        sets = brought.needed(ctx, host)
        for which in (brought.CLUSTER, brought.CLIENT):
            assert sets[which].requirements == ("openyuanrong-datasystem==0.9.2",)
            assert sets[which].find_links == (str(tmp_path / "ds"),)  # pip finds it there, not on the index
        assert "DS_VERSION=0.9.2" in cluster.install(ctx, host).script
        assert "openyuanrong-datasystem==0.9.2" in vllm_env.install(ctx, host).script
    # control: without it, the package index's pin, and the sets key apart (no stale cache is reused)
    plain, plan2, _ = launches(ptp=4, dtp=4)
    host = plan2.hosts[0]
    index_set = brought.needed(StepContext(plain, plan2), host)[brought.CLIENT]
    assert index_set.requirements == ("openyuanrong-datasystem==0.8.1",) and index_set.find_links == ()
    assert index_set.key != brought.needed(ctx, plan.hosts[0])[brought.CLIENT].key
    # the index's build of that version must not win: the brought package alone comes from the directory alone
    assert not brought.needed(ctx, plan.hosts[0])[brought.CLIENT].index and index_set.index
    # a rebuilt wheel of the same version is another set and another derived image
    from yrpd.steps import container
    before = (brought.needed(ctx, plan.hosts[0])[brought.CLIENT].key, container.derived(ctx))
    import os, time
    wheel = next((tmp_path / "ds").glob("*.whl"))
    os.utime(wheel, ns=(time.time_ns(), time.time_ns() + 10**9))
    after = (brought.needed(ctx, plan.hosts[0])[brought.CLIENT].key, container.derived(ctx))
    assert before[0] != after[0] and before[1] != after[1]
    assert container.derived_inputs(ctx)["datasystem"] == "0.9.2"


def test_a_relative_datasystem_wheels_is_kept_absolute(tmp_path, monkeypatch):
    fake_wheel(tmp_path / "ds", "0.9.2", NEWER_CALLS)
    monkeypatch.chdir(tmp_path)
    spec, _, _ = launches(datasystem_wheels="ds")
    assert spec.datasystem_wheels == str(tmp_path / "ds")  # what the session stores: later commands run elsewhere
