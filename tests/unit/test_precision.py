"""The dtype a deployment computes in: chosen once for all instances (KV crosses between them), on CPU hosts from
what their CPUs compute fastest, shown by `yrpd plan` with the reason, overridden by --dtype."""

import json

import pytest

from yrpd.layout import HostPaths, HostSessionLayout
from yrpd.errors import SpecError
from yrpd.placement import HostInventory, make_plan
from yrpd.precision import choose
from yrpd.serving import instance_launches
from yrpd.spec import DeviceKind, Dtype, build_spec

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
    choice = choose(Dtype.auto, DeviceKind.cpu, {"h1": None})
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
