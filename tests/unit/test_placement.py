"""Placement (yrpd.placement): which host and devices each instance gets, its ports, the dtype all of them compute in,
and what a running plan lacks against a changed spec."""

import json

import pytest

from yrpd.layout import HostPaths, HostSessionLayout
from yrpd.errors import SpecError
from yrpd.live import describe_change
from yrpd.placement import (HostInventory, choose_dtype, default_max_unavailable, make_plan, ports_on_host, stale,
                            with_counts)
from yrpd.serving import instance_launches
from yrpd.spec import DeviceKind, Dtype, build_spec, format_device_list, parse_device_list, spec_diff


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


# -- a running plan against a changed spec (what a rolling change, a scale and a drain place) -----------------

def three_hosts(**over):
    base = {"hosts": "h1,h2,h3", "model": "/models/m", "device_kind": "npu", "ptp": 4, "dtp": 4}
    return build_spec({}, {**base, **over})


def eight_each(n=8, hosts=("h1", "h2", "h3")):
    return {h: HostInventory(DeviceKind.npu, tuple(range(n)), ip=f"10.0.0.{i + 1}") for i, h in enumerate(hosts)}


def test_an_instance_is_stale_once_its_settings_differ_and_a_model_change_changes_its_group():
    plan = make_plan(three_hosts(), eight_each())
    assert stale(plan, three_hosts()) == []
    flag = three_hosts(engine_args=["--max-num-seqs", "8"])
    assert [i.name for i in stale(plan, flag)] == ["prefill-0", "decode-0"]  # prefill first
    assert flag.model_group == three_hosts().model_group  # the same model: old and new instances may pair
    other = three_hosts(model="/models/other")
    assert other.model_group != three_hosts().model_group and other.model_group.startswith("other#")


def test_a_new_instance_takes_the_lowest_free_index_and_kept_ones_keep_their_settings():
    running = make_plan(three_hosts(decode=2), eight_each())
    flag = three_hosts(decode=2, engine_args=["--max-num-seqs", "8"])
    # decode-0 replaced: a third decode instance started beside the two, then decode-0 retired
    grown = make_plan(with_counts(flag, running, decode=1), eight_each(), keep=running.instances)
    assert [i.name for i in grown.instances] == ["prefill-0", "decode-0", "decode-1", "decode-2"]
    assert [i.config == flag.instance_config(i.role) for i in grown.instances] == [False, False, False, True]
    rest = [i for i in grown.instances if i.name != "decode-0"]
    after = make_plan(flag, eight_each(), keep=rest)
    assert [i.name for i in after.instances] == ["prefill-0", "decode-1", "decode-2"]
    assert [(i.host, i.devices, i.port) for i in after.instances] == \
        [(i.host, i.devices, i.port) for i in rest]  # nothing moved
    # scaling out again fills the gap
    again = make_plan(with_counts(flag, after, decode=1), eight_each(), keep=after.instances)
    assert [i.name for i in again.instances] == ["prefill-0", "decode-0", "decode-1", "decode-2"]


def test_a_drained_host_keeps_what_runs_there_but_takes_nothing_new():
    inv = {h: HostInventory(DeviceKind.npu, tuple(range(n))) for h, n in (("h1", 4), ("h2", 8), ("h3", 4))}
    running = make_plan(three_hosts(), inv)
    assert [(i.name, i.host) for i in running.instances] == [("prefill-0", "h2"), ("decode-0", "h1")]
    kept = make_plan(three_hosts(), inv, keep=running.instances, cordoned=["h2"])
    assert kept.instances == running.instances  # the plan still names what runs there
    grow = with_counts(three_hosts(), running, decode=1)
    assert make_plan(grow, inv, keep=running.instances).instance("decode-1").host == "h2"  # the control
    assert make_plan(grow, inv, keep=running.instances, cordoned=["h2"]).instance("decode-1").host == "h3"
    with pytest.raises(SpecError, match=r"\(h2, h3 drained: `yrpd undrain` brings it back\)"):
        make_plan(grow, inv, keep=running.instances, cordoned=["h2", "h3"])


def test_max_unavailable_defaults_to_zero_only_where_one_more_instance_of_each_replaced_role_fits():
    flag = three_hosts(engine_args=["--max-num-seqs", "8"])
    roomy = make_plan(three_hosts(), eight_each())  # 3 hosts of 8 NPUs, 8 used: a spare prefill and decode fit
    assert default_max_unavailable(flag, eight_each(), roomy) == 0
    tight = make_plan(three_hosts(hosts="h1,h2"), eight_each(4, hosts=("h1", "h2")))  # 2 hosts of 4 NPUs, all used
    assert default_max_unavailable(three_hosts(hosts="h1,h2", engine_args=["--x"]),
                                   eight_each(4, hosts=("h1", "h2")), tight) == 1
    lines = describe_change(spec_diff(three_hosts(), flag), roomy, flag, 0)
    assert lines == ["engine_args: [] -> ['--max-num-seqs', '8'] (roll)",
                     "replace prefill-0, decode-0 one by one (start each new instance, then drain and stop the old one)"]


# -- the dtype: chosen once for all instances (KV crosses between them), on CPU hosts from what their CPUs
# compute fastest, shown by `yrpd plan` with the reason, overridden by --dtype ---------------------------------

PATHS = HostPaths(env_root="/opt/yrpd/venvs", session=HostSessionLayout("/tmp/yrpd_sessions", "S"), bundle_dir="/b")


def plan_for(bf16: dict, kind=DeviceKind.cpu, **over):
    spec = build_spec({}, {"hosts": ",".join(bf16), "model": "/models/m", "device_kind": kind.value, **over})
    inventory = {h: HostInventory(kind, (0, 1), f"10.0.0.{i + 1}", has) for i, (h, has) in enumerate(bf16.items())}
    return spec, make_plan(spec, inventory)


def dtype_flags(spec, plan):
    found = set()
    for inst in plan.instances:
        argv = instance_launches(spec, plan, inst, PATHS)[0].argv
        found.add(argv[argv.index("--dtype") + 1] if "--dtype" in argv else None)
    return found


def test_cpu_without_bf16_instructions_computes_in_float32_everywhere():
    spec, plan = plan_for({"h1": True, "h2": False})
    assert plan.dtype.dtype == "float32" and "h2" in plan.dtype.reason and "4.8x" in plan.dtype.reason
    assert dtype_flags(spec, plan) == {"float32"}  # prefill and decode agree on the KV dtype


def test_cpus_with_bf16_instructions_compute_in_bfloat16():
    spec, plan = plan_for({"h1": True, "h2": True})
    assert plan.dtype.dtype == "bfloat16" and dtype_flags(spec, plan) == {"bfloat16"}


def test_undetected_cpu_features_fall_back_to_float32():
    choice = choose_dtype(Dtype.auto, DeviceKind.cpu, {"h1": None})
    assert choice.dtype == "float32" and "not detected" in choice.reason


def test_dtype_flag_wins_and_accelerators_keep_the_models_dtype():
    spec, plan = plan_for({"h1": False}, dtype="bfloat16")
    assert plan.dtype.dtype == "bfloat16" and dtype_flags(spec, plan) == {"bfloat16"}
    spec, plan = plan_for({"h1": None, "h2": None}, kind=DeviceKind.npu)
    assert plan.dtype.dtype is None and dtype_flags(spec, plan) == {None}  # vLLM's auto: the model's own
    assert json.loads(json.dumps(plan.to_dict()))["dtype"] == {"dtype": None, "reason": plan.dtype.reason}


def test_dtype_cannot_be_set_behind_the_plans_back():
    with pytest.raises(SpecError, match="engine_args: --dtype is set by yrpd"):
        build_spec({"engine_args": ["--dtype", "float16"]}, {"hosts": "localhost"})


def test_plan_shows_the_chosen_dtype_and_why(yrpd, yrpd_home, tmp_path):
    """`yrpd plan --hosts localhost` reads this machine's CPU flags (the only probe it makes) and says."""
    flags = open("/proc/cpuinfo").read()
    has_bf16 = "avx512_bf16" in flags and "amx_bf16" not in flags  # AMX: vLLM's bf16 kernels failed there
    shown = yrpd("plan", "--hosts", "localhost", "--model", "builtin:tiny-qwen2", check=0).stdout.splitlines()[1]
    assert shown.startswith(f"dtype: {'bfloat16' if has_bf16 else 'float32'} - auto: "), shown
    assert shown.endswith("--dtype overrides")
    embedded = yrpd("plan", "--hosts", "localhost", check=0).stdout.splitlines()[1]
    assert embedded.startswith("dtype: float32 - auto: the model is served in float32 on every CPU"), embedded
    forced = yrpd("plan", "--hosts", "localhost", "--dtype", "bfloat16", check=0).stdout.splitlines()[1]
    assert forced == "dtype: bfloat16 - set with --dtype"


def test_the_embedded_model_is_served_in_float32_on_every_cpu_unless_told():
    """SmolLM2 in bfloat16 on an Intel CPU with AMX answered "What is the capital of France?" wrong (measured)."""
    spec, plan = plan_for({"h1": True, "h2": True}, model="builtin:smollm2")
    assert plan.dtype.dtype == "float32" and "4-bit GGUF" in plan.dtype.reason and dtype_flags(spec, plan) == {"float32"}
    spec, plan = plan_for({"h1": True, "h2": True}, model="builtin:smollm2", dtype="bfloat16")
    assert plan.dtype.dtype == "bfloat16"
    spec, plan = plan_for({"h1": True, "h2": True}, model="builtin:tiny-qwen2")
    assert plan.dtype.dtype == "bfloat16"  # random weights: nothing to answer right, the CPU's fastest
