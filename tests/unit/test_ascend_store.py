"""yrpd/ascend_store.py and its use in serving: `kv_connector: ascend-store` as `yrpd plan` renders it."""

import json

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
