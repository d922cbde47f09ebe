import json

import pytest

from yrpd.errors import SpecError
from yrpd.placement import HostInventory, make_plan, ports_on_host
from yrpd.spec import DeviceKind, build_spec, format_device_list, parse_device_list


def spec(**over):
    base = {"hosts": "h1,h2", "model": "/models/m", "device_kind": "npu"}
    return build_spec({}, {**base, **over})


def inventory(n_per_host, kind=DeviceKind.npu, hosts=("h1", "h2")):
    counts = n_per_host if isinstance(n_per_host, (list, tuple)) else [n_per_host] * len(hosts)
    return {h: HostInventory(kind, tuple(range(c))) for h, c in zip(hosts, counts)}


def rows(plan):
    return [(i.name, [(r.host, list(r.devices)) for r in i.ranks], i.port) for i in plan.instances]


def test_guide_layout_prefill_on_h1_decode_on_h2():
    plan = make_plan(spec(ptp=4, dtp=4), inventory(8))
    assert rows(plan) == [("prefill-0", [("h1", [0, 1, 2, 3])], 8100), ("decode-0", [("h2", [0, 1, 2, 3])], 8100)]
    assert plan.proxy_host == "h1"


def test_same_result_with_four_devices_per_host():
    plan = make_plan(spec(ptp=4, dtp=4), inventory(4))
    assert rows(plan) == [("prefill-0", [("h1", [0, 1, 2, 3])], 8100), ("decode-0", [("h2", [0, 1, 2, 3])], 8100)]


def test_instances_sharing_a_host_get_distinct_ports_and_devices():
    plan = make_plan(spec(hosts="h1", prefill=2, decode=2, ptp=2, dtp=2), inventory(8, hosts=("h1",)))
    assert [list(i.devices) for i in plan.instances] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    ports = [p for p, _ in ports_on_host(plan, "h1")]
    assert len(ports) == len(set(ports))
    hccl = [i.hccl_port for i in plan.instances]
    assert all(b - a >= 16 for a, b in zip(hccl, hccl[1:]))


def test_dp_ranks_stay_on_one_host_while_it_has_room_then_span_hosts():
    plan = make_plan(spec(pdp=2, ptp=4, ddp=2, dtp=4), inventory(8))
    prefill, decode = plan.instances
    assert [(r.host, r.devices) for r in prefill.ranks] == [("h1", (0, 1, 2, 3)), ("h1", (4, 5, 6, 7))]
    assert [(r.host, r.devices) for r in decode.ranks] == [("h2", (0, 1, 2, 3)), ("h2", (4, 5, 6, 7))]
    # nixl: decode's TP may differ from prefill's (the yuanrong connector refuses that, test_bad_input.py)
    plan = make_plan(spec(pdp=2, ptp=4, device_kind="cpu", kv_connector="nixl"), inventory([5, 4], kind=DeviceKind.cpu))
    prefill, decode = plan.instances
    assert [r.host for r in prefill.ranks] == ["h1", "h2"]
    assert prefill.host == "h1"


def test_a_group_no_host_holds_spans_whole_hosts_or_equal_shares_of_them():
    with pytest.raises(SpecError) as err:
        make_plan(spec(ptp=4, dtp=4, prefill=1, decode=1), inventory([6, 2]))
    # 4 neither divides 6 nor is a multiple of it: two devices of h1 would be stranded
    assert "ptp" in str(err.value) and "neither divides the 6 NPUs of h1" in str(err.value)
    # prefill takes h1 0-1; decode's 4 fit no host then: two ranks on each of h1 and h2, h1 (first) its head
    plan = make_plan(spec(ptp=2, dtp=4, kv_connector="nixl"), inventory([4, 2]))
    prefill, decode = plan.instances
    assert not prefill.split and [(r.host, r.devices) for r in prefill.ranks] == [("h1", (0, 1))]
    assert decode.split and decode.host == "h1"
    assert [(r.host, r.devices) for r in decode.ranks] == [("h1", (2, 3)), ("h2", (0, 1))]


def test_tp_16_on_8_npu_hosts_takes_two_whole_hosts_per_instance():
    hosts = ("h1", "h2", "h3", "h4")
    plan = make_plan(spec(hosts=",".join(hosts), ptp=16, dtp=16), inventory(8, hosts=hosts))
    assert rows(plan) == [("prefill-0", [("h1", list(range(8))), ("h2", list(range(8)))], 8100),
                          ("decode-0", [("h3", list(range(8))), ("h4", list(range(8)))], 8100)]
    assert all(i.split and i.dp == 1 for i in plan.instances)
    # pipeline stages count as ranks: tp 8 x pp 2 is the same 16 NPUs
    staged = make_plan(spec(hosts=",".join(hosts), ptp=8, dtp=8, ppp=2, dpp=2), inventory(8, hosts=hosts))
    assert rows(staged) == rows(plan) and [i.pp for i in staged.instances] == [2, 2]
    # the control: TP 8 fits one host, nothing spans
    assert not any(i.split for i in make_plan(spec(hosts=",".join(hosts), ptp=8, dtp=8),
                                              inventory(8, hosts=hosts)).instances)


def test_ray_on_cpu_and_ascend_store_are_refused_for_an_instance_spanning_hosts_only():
    hosts = ("h1", "h2", "h3")
    cpu = inventory([1, 1, 2], kind=DeviceKind.cpu, hosts=hosts)
    with pytest.raises(SpecError) as err:
        make_plan(spec(hosts=",".join(hosts), ptp=2, dtp=2, device_kind="cpu", multi_node_backend="ray"), cpu)
    assert str(err.value).startswith("multi_node_backend: ray cannot run decode-0 across h1, h2"), err.value
    # the controls: the same on vLLM's launcher, and Ray where nothing spans
    assert make_plan(spec(hosts=",".join(hosts), ptp=2, dtp=2, device_kind="cpu", multi_node_backend="mp"), cpu)
    assert make_plan(spec(hosts=",".join(hosts), device_kind="cpu", multi_node_backend="ray"), cpu)
    npu = {"runtime": "docker", "image": "quay.io/ascend/vllm-ascend:v0.23.0", "kv_connector": "ascend-store"}
    with pytest.raises(SpecError) as err:
        make_plan(spec(ptp=16, dtp=16, hosts="h1,h2,h3,h4", **npu), inventory(8, hosts=("h1", "h2", "h3", "h4")))
    assert str(err.value).startswith("kv_connector: ascend-store counts prefill-0's Mooncake hand-over ports"), err.value
    assert make_plan(spec(ptp=8, dtp=8, hosts="h1,h2,h3,h4", **npu), inventory(8, hosts=("h1", "h2", "h3", "h4")))


def test_pipeline_stages_on_cpu_hosts_are_refused_where_vllms_cpu_build_fails_them():
    with pytest.raises(SpecError) as err:
        make_plan(spec(ptp=1, dtp=1, ppp=2, dpp=2, device_kind="cpu"), inventory(4, kind=DeviceKind.cpu))
    assert str(err.value).startswith("prefill_pipeline_parallel_size (--ppp): vLLM's CPU build fails at its first "
                                     "request with 2 pipeline stages"), err.value
    # the control: the same stages on NPU hosts plan
    assert make_plan(spec(ptp=1, dtp=1, ppp=2, dpp=2), inventory(4)).instances[0].pp == 2


def test_cpu_cores_fill_a_host_first_and_span_only_what_no_host_holds():
    # the lab's shape: h3 has two cores and takes prefill's TP 2 whole; decode's TP 2 then spans h1 and h2
    hosts = ("h1", "h2", "h3")
    plan = make_plan(spec(hosts=",".join(hosts), ptp=2, dtp=2, device_kind="cpu"),
                     inventory([1, 1, 2], kind=DeviceKind.cpu, hosts=hosts))
    prefill, decode = plan.instances
    assert [(r.host, r.devices) for r in prefill.ranks] == [("h3", (0, 1))] and not prefill.split
    assert [(r.host, r.devices) for r in decode.ranks] == [("h1", (0,)), ("h2", (0,))] and decode.split
    assert plan.to_dict()["instances"][1]["pp"] == 1


def test_too_few_devices_names_the_numbers():
    with pytest.raises(SpecError) as err:
        make_plan(spec(ptp=4, dtp=4), inventory([4, 2]))
    # 2 is not divisible by 4 comes first for NPUs; use cpu cores to reach the count check
    with pytest.raises(SpecError) as err:
        make_plan(spec(ptp=4, dtp=4, device_kind="cpu"), inventory([4, 2], kind=DeviceKind.cpu))
    assert str(err.value) == (
        "devices: prefill needs 1 x 4 CPU cores and decode 1 x 4 CPU cores = 8; hosts h1,h2 offer 4 + 2 = 6; "
        "add hosts or devices, or lower --prefill/--decode/--ptp/--dtp/--pdp/--ddp/--ppp/--dpp"
    )


def test_fragmentation_is_explained():
    with pytest.raises(SpecError) as err:
        make_plan(spec(ptp=3, dtp=3, device_kind="cpu"), inventory([4, 2], kind=DeviceKind.cpu))
    # 3 cores split over 2 hosts in equal shares is impossible, and no host has 3 left
    assert str(err.value).startswith("devices: decode-0 needs 3 CPU cores for its TP x PP group and no hosts have room "
                                     "for equal shares of it (free: h1 1, h2 2)"), err.value


def test_plan_is_deterministic_and_json_serialisable():
    a = make_plan(spec(prefill=2, decode=3), inventory(4))
    b = make_plan(spec(prefill=2, decode=3), inventory(4))
    assert json.dumps(a.to_dict(), sort_keys=True) == json.dumps(b.to_dict(), sort_keys=True)
    data = a.to_dict()
    assert {"name", "role", "host", "devices", "port"} <= set(data["instances"][0])


def test_localhost_cpu_default_uses_one_core_each():
    s = build_spec({}, {"hosts": "localhost"})
    assert s.is_embedded_default
    plan = make_plan(s, {"localhost": HostInventory(DeviceKind.cpu, (0, 1))})
    assert [(i.name, list(i.devices)) for i in plan.instances] == [("prefill-0", [0]), ("decode-0", [1])]


def test_master_and_ports_on_master_only():
    plan = make_plan(spec(master="h2"), inventory(2))
    by = {h.name: h for h in plan.hosts}
    assert by["h2"].is_master and "proxy" in by["h2"].ports and "proxy" not in by["h1"].ports
    assert plan.proxy_host == "h2"


@pytest.mark.parametrize("text,ids", [("0-3", [0, 1, 2, 3]), ("0,2,4", [0, 2, 4]), ("0-1,6-7", [0, 1, 6, 7]), ("5", [5])])
def test_device_lists_round_trip(text, ids):
    assert parse_device_list(text, "devices") == ids
    assert parse_device_list(format_device_list(ids), "devices") == ids


def test_per_host_devices_from_config_survive_hosts_flag():
    config = {"hosts": [{"address": "h1", "devices": "0-3"}, {"address": "h2", "devices": "4-7"}], "model": "/m"}
    s = build_spec(config, {"hosts": "h2,h1"})
    assert [h.name for h in s.hosts] == ["h2", "h1"]
    assert s.host("h2").devices == [4, 5, 6, 7]
    assert s.host("h1").devices == [0, 1, 2, 3]


def test_host_address_forms():
    s = build_spec({}, {"hosts": "root@10.1.2.3:2222,h2", "model": "/m"})
    first = s.hosts[0]
    assert (first.user, first.hostname, first.port, first.name) == ("root", "10.1.2.3", 2222, "10.1.2.3:2222")
    assert not first.is_local


# -- changing a running deployment: what runs stays where it is


def test_scaling_out_and_in_keeps_every_running_instance_on_its_devices_and_ports():
    now = make_plan(spec(hosts="h1,h2,h3", ptp=4, dtp=4), inventory(8, hosts=("h1", "h2", "h3")))
    out = make_plan(spec(hosts="h1,h2,h3", ptp=4, dtp=4, decode=2), inventory(8, hosts=("h1", "h2", "h3")), keep=now.instances)
    assert rows(out)[:2] == rows(now)
    added = out.instances[2]
    assert added.name == "decode-1"
    taken = {(r.host, d) for i in now.instances for r in i.ranks for d in r.devices}
    assert not taken & {(r.host, d) for r in added.ranks for d in r.devices}
    assert (added.host, added.port) not in {(i.host, i.port) for i in now.instances}
    back = make_plan(spec(hosts="h1,h2,h3", ptp=4, dtp=4), inventory(8, hosts=("h1", "h2", "h3")), keep=out.instances)
    assert rows(back) == rows(now)


def test_a_new_prefill_instance_does_not_move_the_decode_instance_a_fresh_plan_would_move():
    hosts = ("h1", "h2")
    now = make_plan(spec(ptp=4, dtp=4), inventory(8, hosts=hosts))
    fresh = make_plan(spec(ptp=4, dtp=4, prefill=2), inventory(8, hosts=hosts))
    kept = make_plan(spec(ptp=4, dtp=4, prefill=2), inventory(8, hosts=hosts), keep=now.instances)
    # the control: planned from nothing, decode-0 would go elsewhere (prefill-1 takes its place)
    assert rows(fresh)[-1] != rows(now)[-1]
    assert [r for r in rows(kept) if r[0] in ("prefill-0", "decode-0")] == rows(now)
    devices = [(r.host, d) for i in kept.instances for r in i.ranks for d in r.devices]
    assert len(devices) == len(set(devices))  # nothing placed twice
    ports = [(i.host, i.port) for i in kept.instances]
    assert len(ports) == len(set(ports))


def test_an_instance_whose_tp_changed_is_placed_again_and_one_on_a_device_gone_too():
    hosts = ("h1", "h2")
    now = make_plan(spec(ptp=2, dtp=2), inventory(8, hosts=hosts))
    wider = make_plan(spec(ptp=2, dtp=4, kv_connector="nixl"), inventory(8, hosts=hosts), keep=now.instances)
    assert rows(wider)[0] == rows(now)[0] and len(wider.instances[1].devices) == 4
    shrunk = {"h1": HostInventory(DeviceKind.npu, (4, 5, 6, 7)), "h2": HostInventory(DeviceKind.npu, tuple(range(8)))}
    moved = make_plan(spec(ptp=2, dtp=2), shrunk, keep=now.instances)
    assert all(d in (4, 5, 6, 7) for r in moved.instances[0].ranks if r.host == "h1" for d in r.devices)


def test_a_stored_plan_read_back_keeps_a_placement_a_plan_from_nothing_would_not_make():
    from yrpd.placement import instances_from_dicts

    hosts = ("h1", "h2")
    now = make_plan(spec(ptp=4, dtp=4), inventory(8, hosts=hosts))
    scaled = make_plan(spec(ptp=4, dtp=4, prefill=2), inventory(8, hosts=hosts), keep=now.instances)
    stored = json.loads(json.dumps(scaled.to_dict()))["instances"]
    again = make_plan(spec(ptp=4, dtp=4, prefill=2), inventory(8, hosts=hosts), keep=instances_from_dicts(stored))
    assert rows(again) == rows(scaled)
    assert rows(make_plan(spec(ptp=4, dtp=4, prefill=2), inventory(8, hosts=hosts))) != rows(scaled)  # the control
