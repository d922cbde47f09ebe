"""What yrpd would launch on the hosts: vllm serve and proxy command lines from the plan (pure, no host)."""

import json
import shlex
from pathlib import Path

import pytest

from yrpd.errors import SpecError
from yrpd.layout import HostPaths, HostSessionLayout
from yrpd.placement import HostInventory, make_plan
from yrpd.serving import instance_launches, launches_on_host, proxy_launch, sample_request
from yrpd.spec import DeviceKind, build_spec
from yrpd.steps.vllm_env import bundle, bundle_file, unpack_script

PATHS = HostPaths(env_root="/opt/yrpd/venvs", session=HostSessionLayout("/tmp/yrpd_sessions", "S"), bundle_dir="/opt/yrpd/venvs/lib/yrpd-x")


def INVENTORY_OF(plan):
    return {h.name: HostInventory(h.kind, h.devices, h.ip) for h in plan.hosts}


def deployment(kind=DeviceKind.npu, devices=8, hosts=("h1", "h2"), **over):
    spec = build_spec({}, {"hosts": ",".join(hosts), "model": "/models/qwen", "device_kind": kind.value, **over})
    inventory = {h: HostInventory(kind, tuple(range(devices)), f"10.0.0.{i + 1}") for i, h in enumerate(hosts)}
    return spec, make_plan(spec, inventory)


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_guide_layout_npu_instances_get_their_devices_ports_and_connector_roles():
    spec, plan = deployment(ptp=4, dtp=4)
    prefill = launches_on_host(spec, plan, "h1", PATHS)
    decode = launches_on_host(spec, plan, "h2", PATHS)
    assert [l.name for l in prefill] == ["prefill-0"] and [l.name for l in decode] == ["decode-0"]
    p, d = prefill[0], decode[0]
    assert p.env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3" and d.env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3"
    assert p.env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and p.env["HCCL_IF_BASE_PORT"] == "61000"
    assert flag(p.argv, "--tensor-parallel-size") == "4" and flag(p.argv, "--port") == "8100"
    assert flag(p.argv, "--host") == "10.0.0.1" and flag(d.argv, "--host") == "10.0.0.2"
    kv_p, kv_d = json.loads(flag(p.argv, "--kv-transfer-config")), json.loads(flag(d.argv, "--kv-transfer-config"))
    assert (kv_p["kv_role"], kv_d["kv_role"]) == ("kv_both", "kv_consumer")  # prefix reuse on by default
    # each instance talks to the data system worker of its own host
    assert kv_p["kv_connector_extra_config"]["ds_address"] == "10.0.0.1:31501"
    assert kv_d["kv_connector_extra_config"]["ds_address"] == "10.0.0.2:31501"
    assert kv_p["kv_connector_module_path"] == "yrpd.connector" and kv_p["kv_load_failure_policy"] == "recompute"
    # decode waits for prefill's puts: neither writer is lowered in priority
    assert "writer_nice" not in kv_p["kv_connector_extra_config"] and "writer_nice" not in kv_d["kv_connector_extra_config"]
    assert p.health_url == "http://10.0.0.1:8100/health"
    assert "--enforce-eager" not in p.argv  # CPU-only default


def test_prefix_reuse_off_makes_prefill_a_pure_producer_and_connector_overrides_apply():
    spec, plan = deployment(ptp=4, dtp=4, prefix_reuse=False, connector={"ttl_seconds": 30})
    kv = json.loads(flag(instance_launches(spec, plan, plan.instances[0], PATHS)[0].argv, "--kv-transfer-config"))
    assert kv["kv_role"] == "kv_producer" and kv["kv_connector_extra_config"]["ttl_seconds"] == 30


def test_cpu_instances_bind_cores_per_tp_rank_and_user_engine_args_come_last():
    spec, plan = deployment(DeviceKind.cpu, devices=4, hosts=("h1",), ptp=2, dtp=2,
                            engine_args=["--max-model-len", "2048"])
    p, d = launches_on_host(spec, plan, "h1", PATHS)
    assert p.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and d.env["VLLM_CPU_OMP_THREADS_BIND"] == "2|3"
    assert "--enforce-eager" in p.argv
    # argparse keeps the last occurrence: the user's value wins over yrpd's CPU default of 4096
    assert [p.argv[i + 1] for i, a in enumerate(p.argv) if a == "--max-model-len"][-1] == "2048"
    assert p.env["PYTHONPATH"] == PATHS.bundle_dir and p.env["HF_HUB_OFFLINE"] == "1"


def test_a_roles_own_engine_args_reach_that_roles_instances_after_the_common_ones():
    spec, plan = deployment(DeviceKind.cpu, devices=4, hosts=("h1",), ptp=2, dtp=2,
                            engine_args=["--max-num-seqs", "8"], decode_engine_args=["--max-num-seqs", "64"])
    p, d = launches_on_host(spec, plan, "h1", PATHS)
    assert [p.argv[i + 1] for i, a in enumerate(p.argv) if a == "--max-num-seqs"] == ["8"]
    assert [d.argv[i + 1] for i, a in enumerate(d.argv) if a == "--max-num-seqs"] == ["8", "64"]  # the last wins


def test_an_instances_data_system_client_logs_under_the_session_not_in_home():
    spec, plan = deployment(DeviceKind.cpu, devices=4, hosts=("h1",), ptp=2, dtp=2)
    p, d = launches_on_host(spec, plan, "h1", PATHS)
    assert p.env["DATASYSTEM_CLIENT_LOG_DIR"] == "/tmp/yrpd_sessions/S/logs/ds-client/prefill-0"
    assert d.env["DATASYSTEM_CLIENT_LOG_DIR"] == "/tmp/yrpd_sessions/S/logs/ds-client/decode-0"
    # control: a plain instance (the bench's `single` baseline) has no data-system client
    plain, plan = deployment(DeviceKind.cpu, devices=4, hosts=("h1",), disaggregated=False)
    [single] = launches_on_host(plain, plan, "h1", PATHS)
    assert "DATASYSTEM_CLIENT_LOG_DIR" not in single.env


def test_data_parallel_ranks_on_two_hosts_run_a_headless_engine_on_the_second():
    spec, plan = deployment(ptp=4, pdp=2, dtp=4, prefill=1, decode=1, devices=4, hosts=("h1", "h2", "h3"))
    prefill = plan.instances[0]
    assert [r.host for r in prefill.ranks] == ["h1", "h2"]  # each 4-device host fits one TP-4 rank
    head, other = instance_launches(spec, plan, prefill, PATHS)
    assert flag(head.argv, "--data-parallel-size") == "2" and "--headless" not in head.argv
    assert "--headless" in other.argv and flag(other.argv, "--data-parallel-start-rank") == "1"
    assert flag(other.argv, "--data-parallel-address") == flag(head.argv, "--data-parallel-address")
    assert other.health_url is None
    # each host's ranks keep their KV with their own host's data system worker
    assert [json.loads(flag(launch.argv, "--kv-transfer-config"))["kv_connector_extra_config"]["ds_address"]
            for launch in (head, other)] == ["10.0.0.1:31501", "10.0.0.2:31501"]


def test_proxy_lists_every_instance_and_never_shows_the_key(monkeypatch):
    monkeypatch.setenv("MY_KEY", "s3cret")
    spec, plan = deployment(ptp=4, dtp=4, prefill=2, decode=2, devices=8, api_key_env="MY_KEY")
    launch = proxy_launch(spec, plan, PATHS)
    assert launch.host == "h1" and launch.argv[:3] == [PATHS.python, "-m", "yrpd.proxy"]
    assert [a for i, a in enumerate(launch.argv) if launch.argv[i - 1] == "--prefill"] == \
        [f"http://10.0.0.{1 if i.host == 'h1' else 2}:{i.port}" for i in plan.instances if i.role == "prefill"]
    assert flag(launch.argv, "--api-key-env") == "YRPD_API_KEY" and "s3cret" not in launch.command
    assert "$MY_KEY" in sample_request(spec, plan) and "s3cret" not in sample_request(spec, plan)
    assert shlex.split(sample_request(spec, plan))[2] == "http://10.0.0.1:8000/v1/completions"
    # the proxy routes cache-aware unless the spec says load; bench's pd-load target forces load
    assert flag(launch.argv, "--routing") == "prefix" and flag(launch.argv, "--routing-bound") == "2"
    from yrpd.bench.run import variant

    by_load = build_spec({}, {"hosts": "h1,h2", "model": "/models/qwen", "device_kind": "npu", "ptp": 4, "dtp": 4,
                               "prefill": 2, "decode": 2, "routing": "load"})
    assert flag(proxy_launch(by_load, plan, PATHS).argv, "--routing") == "load"
    load = variant(spec, "pd-load", DeviceKind.npu)
    assert flag(proxy_launch(load, make_plan(load, INVENTORY_OF(plan)), PATHS).argv, "--routing") == "load"


def test_host_bundle_carries_only_host_side_code_and_travels_as_an_upload_not_inside_the_command():
    import base64
    import io
    import tarfile

    digest, encoded = bundle()
    names = tarfile.open(fileobj=io.BytesIO(base64.b64decode(encoded))).getnames()
    assert "yrpd/connector/connector.py" in names and "yrpd/proxy/app.py" in names
    assert "yrpd/demo/tiny_model.py" in names and "yrpd/proxy/kvindex.py" in names
    # nothing that needs yrpd's own dependencies (fabric, pydantic, click) on the hosts
    assert not any(n.startswith(("yrpd/cli", "yrpd/steps")) or n in ("yrpd/spec.py", "yrpd/hostgroup.py")
                   for n in names)
    assert bundle() == (digest, encoded)  # reproducible: same code, same hash
    # the step uploads the file named by that hash into the session directory and unpacks it from there: its
    # script stays small however large the code grows
    from yrpd.steps import StepContext
    from yrpd.steps.vllm_env import bundle_file, ship_code

    spec, plan = deployment(DeviceKind.cpu, devices=2, hosts=("h1",))
    ctx = StepContext(spec=spec, plan=plan, session_id="S")
    command = ship_code(ctx, plan.hosts[0])
    [(local, remote)] = command.uploads
    assert local == str(bundle_file()) and Path(local).read_bytes() == base64.b64decode(encoded)
    assert remote.startswith(ctx.host_session_dir) and remote.endswith(f"yrpd-{digest}.tgz")
    assert len(command.script) < 2000 and remote in command.script


def test_every_hosts_copy_step_gets_the_bundle_when_they_run_at_once_in_one_deploy(yrpd_home, monkeypatch):
    """A deploy's hosts run the copy step in parallel threads of one process: the first deploy on a machine (no
    bundle there yet) must give every host the bundle, not an internal error for all but one."""
    import base64
    import threading
    from concurrent.futures import ThreadPoolExecutor

    digest, encoded = bundle()
    for attempt in range(20):  # each attempt starts without the file, as a first deploy does
        monkeypatch.setenv("YRPD_HOME", str(yrpd_home / f"home{attempt}"))
        start = threading.Barrier(8)

        def copy() -> Path:
            start.wait()
            return bundle_file()

        with ThreadPoolExecutor(8) as pool:
            paths = [f.result() for f in [pool.submit(copy) for _ in range(8)]]
        assert len(set(paths)) == 1 and paths[0].read_bytes() == base64.b64decode(encoded)
        assert [p.name for p in paths[0].parent.iterdir()] == [f"yrpd-{digest}.tgz"]  # no part file left behind


def test_hosts_sharing_env_root_unpack_the_bundle_at_once_and_all_succeed(tmp_path):
    """Fake hosts (and NFS-mounted /opt) share env_root: parallel copies of one bundle must not collide."""
    import subprocess

    target = tmp_path / "lib" / "yrpd-x"
    script = unpack_script(str(target), archive=str(bundle_file()))

    def run_many(n: int) -> list[int]:
        procs = [subprocess.Popen(["bash", "-c", script], stderr=subprocess.PIPE) for _ in range(n)]
        return [p.wait() for p in procs]

    assert run_many(6) == [0] * 6
    assert (target / ".complete").is_file() and (target / "yrpd" / "proxy" / "app.py").is_file()
    assert not list(tmp_path.glob("lib/*.tmp.*")) and not list(target.glob("*.tmp.*"))
    # a half copy left by an older yrpd (no .complete) is replaced
    (target / ".complete").unlink()
    (target / "yrpd" / "proxy" / "app.py").unlink()
    assert run_many(1) == [0] and (target / "yrpd" / "proxy" / "app.py").is_file() and (target / ".complete").is_file()
    # a copy that fails half way (here: a corrupt bundle; on a host: a full disk) fails the step and marks nothing
    broken = tmp_path / "lib" / "yrpd-y"
    corrupt = tmp_path / "corrupt.tgz"
    corrupt.write_bytes(b"!corrupt!")
    failed = subprocess.run(["bash", "-c", unpack_script(str(broken), archive=str(corrupt)) + "\necho went on"],
                            capture_output=True, text=True)
    assert failed.returncode != 0 and "went on" not in failed.stdout and not broken.exists()


def test_bench_single_targets_one_plain_instance_and_one_that_keeps_its_kv_in_the_data_system():
    from yrpd.bench.run import variant

    spec, plan = deployment(DeviceKind.cpu, devices=2, hosts=("h1",))
    for target, role in (("single", None), ("single-yr", "kv_both")):
        want = variant(spec, target, DeviceKind.cpu)
        want_plan = make_plan(want, {"h1": HostInventory(DeviceKind.cpu, (0, 1), "10.0.0.1")})
        [launch] = launches_on_host(want, want_plan, "h1", PATHS)
        assert launch.env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"  # both cores the PD pair used
        if role is None:
            assert "--kv-transfer-config" not in launch.argv
        else:
            kv = json.loads(flag(launch.argv, "--kv-transfer-config"))
            assert kv["kv_role"] == role and kv["kv_connector_extra_config"]["ds_address"] == "10.0.0.1:31501"
            assert kv["kv_connector_extra_config"]["writer_nice"] == 10  # nothing waits for its puts
        assert proxy_launch(want, want_plan, PATHS) is None
    # with save_sync the engine's step waits for the puts: the writer is not lowered; save_sync read as the
    # connector reads it (a config file's "false" is false, the keyed control of "true")
    for save_sync, lowered in ((True, False), ("true", False), ("false", True)):
        want = variant(spec.model_copy(update={"connector": {"save_sync": save_sync}}), "single-yr", DeviceKind.cpu)
        want_plan = make_plan(want, {"h1": HostInventory(DeviceKind.cpu, (0, 1), "10.0.0.1")})
        [launch] = launches_on_host(want, want_plan, "h1", PATHS)
        extra = json.loads(flag(launch.argv, "--kv-transfer-config"))["kv_connector_extra_config"]
        assert ("writer_nice" in extra) is lowered, save_sync
    # a session stored before the spec checked these keys still launches (and status reads it): an unknown key
    # passes to the connector, which warns of it, as before
    want = variant(spec, "single-yr", DeviceKind.cpu).model_copy(update={"connector": {"ttl_secnds": 5}})
    want_plan = make_plan(want, {"h1": HostInventory(DeviceKind.cpu, (0, 1), "10.0.0.1")})
    [launch] = launches_on_host(want, want_plan, "h1", PATHS)
    assert json.loads(flag(launch.argv, "--kv-transfer-config"))["kv_connector_extra_config"]["ttl_secnds"] == 5
    # the user's own value wins
    want = variant(spec.model_copy(update={"connector": {"writer_nice": 0}}), "single-yr", DeviceKind.cpu)
    want_plan = make_plan(want, {"h1": HostInventory(DeviceKind.cpu, (0, 1), "10.0.0.1")})
    [launch] = launches_on_host(want, want_plan, "h1", PATHS)
    assert json.loads(flag(launch.argv, "--kv-transfer-config"))["kv_connector_extra_config"]["writer_nice"] == 0


def test_bench_example_peer_hands_kv_over_through_one_files_directory_and_down_removes_it():
    from yrpd.bench.run import variant
    from yrpd.steps import StepContext
    from yrpd.steps.instances import stop

    spec, _ = deployment(DeviceKind.cpu, devices=2, hosts=("h1",))
    want = variant(spec, "peer-example-pd", DeviceKind.cpu)
    plan = make_plan(want, {"h1": HostInventory(DeviceKind.cpu, (0, 1), "10.0.0.1")})
    kvs = [json.loads(flag(launch.argv, "--kv-transfer-config")) for launch in launches_on_host(want, plan, "h1", PATHS)]
    assert [kv["kv_connector"] for kv in kvs] == ["ExampleConnector", "ExampleConnector"]
    # prefill writes, decode reads: the same directory, inside the session (not vLLM's default /tmp)
    assert {kv["kv_connector_extra_config"]["shared_storage_path"] for kv in kvs} == {"/tmp/yrpd_sessions/S/kv-files"}
    assert proxy_launch(want, plan, PATHS) is not None
    ctx = StepContext(spec=want, plan=plan, session_id="S")
    assert stop(ctx, plan.hosts[0]).script.rstrip().endswith("rm -rf /tmp/yrpd_sessions/S/kv-files")
    # the other targets are yrpd's connector again, and their teardown has nothing of the kind to remove
    back = variant(want, "pd", DeviceKind.cpu)
    back_plan = make_plan(back, {"h1": HostInventory(DeviceKind.cpu, (0, 1), "10.0.0.1")})
    assert "kv-files" not in stop(StepContext(spec=back, plan=back_plan, session_id="S"), back_plan.hosts[0]).script
    assert json.loads(flag(launches_on_host(back, back_plan, "h1", PATHS)[0].argv, "--kv-transfer-config"))[
        "kv_connector"] == "YuanrongConnector"


def test_bench_lmcache_peer_runs_its_server_first_and_vllm_from_the_venv_that_has_lmcache():
    from yrpd.bench.run import variant
    from yrpd.placement import ports_on_host

    spec, _ = deployment(DeviceKind.cpu, devices=2, hosts=("h1",), datasystem_memory_mb=512)
    want = variant(spec, "peer-lmcache", DeviceKind.cpu)
    plan = make_plan(want, {"h1": HostInventory(DeviceKind.cpu, (0, 1), "10.0.0.1")})
    server, instance = launches_on_host(want, plan, "h1", PATHS)
    assert server.name == "lmcache-server" and server.argv[:2] == ["/opt/yrpd/venvs/lmcache/bin/lmcache", "server"]
    assert flag(server.argv, "--port") == "32600" and flag(server.argv, "--l1-size-gb") == "0.5"
    assert flag(server.argv, "--supported-transfer-mode") == "auto"
    assert server.health_url == "http://127.0.0.1:32601/healthcheck" and server.env["LMCACHE_TRACK_USAGE"] == "false"
    assert instance.argv[:3] == ["/opt/yrpd/venvs/lmcache/bin/python", "-m", "vllm.entrypoints.cli.main"]
    kv = json.loads(flag(instance.argv, "--kv-transfer-config"))
    assert kv["kv_connector"] == "LMCacheMPConnector" and kv["kv_connector_extra_config"]["lmcache.mp.port"] == 32600
    assert flag(instance.argv, "--gpu-memory-utilization") == "0.3"
    # both ports are the deployment's: preflight checks them free, down checks them closed
    assert {(32600, "lmcache"), (32601, "lmcache_http")} <= set(ports_on_host(plan, "h1"))
    assert proxy_launch(want, plan, PATHS) is None


def test_bench_nixl_peer_pulls_from_prefill_over_each_instances_own_side_channel_from_the_nixl_venv():
    from yrpd.bench.run import variant
    from yrpd.spec import build_spec

    spec, _ = deployment(DeviceKind.cpu, devices=2, hosts=("h1",))
    want = variant(spec, "peer-nixl-pd", DeviceKind.cpu)
    plan = make_plan(want, {"h1": HostInventory(DeviceKind.cpu, (0, 1), "10.0.0.1")})
    prefill, decode = launches_on_host(want, plan, "h1", PATHS)
    for launch, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
        assert launch.argv[:3] == ["/opt/yrpd/venvs/nixl/bin/python", "-m", "vllm.entrypoints.cli.main"]
        assert json.loads(flag(launch.argv, "--kv-transfer-config")) == {
            "kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
        assert launch.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.1"
    # two instances on one host: two side channels, in each one's own block of hand-over ports
    ports = {int(launch.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) for launch in (prefill, decode)}
    assert ports == {want.ports.mooncake_base, want.ports.mooncake_base + 16}
    assert proxy_launch(want, plan, PATHS) is not None
    # a hand-over needs two sides: refused on a plain instance (control: the PD spec above is taken)
    with pytest.raises(SpecError) as e:
        build_spec({}, {"hosts": "h1", "device_kind": "cpu", "model": "/m", "kv_connector": "nixl",
                        "disaggregated": False})
    assert e.value.field == "kv_connector" and "needs a PD deployment" in e.value.problem


def test_bench_kv_pool_size_reaches_every_target_and_a_single_instance_gets_the_pd_pools_together():
    from yrpd.bench.run import variant

    spec, _ = deployment(DeviceKind.cpu, devices=2, hosts=("h1",))
    sizes = {t: flag(variant(spec, t, DeviceKind.cpu, kv_cache_mb=128).engine_args, "--kv-cache-memory-bytes")
             for t in ("pd", "pd-noreuse", "single", "single-yr")}
    assert sizes == {"pd": str(128 << 20), "pd-noreuse": str(128 << 20), "single": str(256 << 20),
                     "single-yr": str(256 << 20)}
    assert "--no-enable-prefix-caching" in variant(spec, "pd-noreuse", DeviceKind.cpu, kv_cache_mb=128).engine_args
    # single-roomy keeps vLLM's own pool beside them (the store's floor), and is otherwise the plain instance
    roomy = variant(spec, "single-roomy", DeviceKind.cpu, kv_cache_mb=128)
    assert "--kv-cache-memory-bytes" not in roomy.engine_args
    assert roomy == variant(spec, "single", DeviceKind.cpu)
    # and a pool the deployment's own engine_args cut is not kept either
    cut = spec.model_copy(update={"engine_args": ["--kv-cache-memory-bytes", "1000", "--max-model-len", "2048"]})
    assert variant(cut, "single-roomy", DeviceKind.cpu, kv_cache_mb=128).engine_args == ["--max-model-len", "2048"]
    assert "--kv-cache-memory-bytes" in variant(cut, "single", DeviceKind.cpu).engine_args  # the control
    # the data system's tiers are the same for every target of one run (eviction and spill runs)
    for target in ("pd", "pd-noreuse", "single", "single-yr", "peer-example-pd"):
        sized = variant(spec, target, DeviceKind.cpu, datasystem_mb=96, datasystem_spill_mb=512)
        assert (sized.datasystem_memory_mb, sized.datasystem_spill_mb) == (96, 512)
    assert variant(spec, "pd", DeviceKind.cpu).datasystem_memory_mb == spec.datasystem_memory_mb


def test_the_proxy_reads_its_membership_from_the_session_file_that_lists_every_instance_of_the_plan():
    """What the controller writes is what the proxy takes (yrpd.proxy.app.parse_members): each instance's URL,
    role and model group; a draining one marked; the proxy started with the file's path, so a restart reads the membership as it is
    now, not as it was at deploy."""
    from yrpd.proxy.app import parse_members
    from yrpd.serving import instance_url, proxy_members

    spec, plan = deployment(prefill=2, decode=2, ptp=2, dtp=2)
    argv = proxy_launch(spec, plan, PATHS).argv
    assert flag(argv, "--instances-file") == "/tmp/yrpd_sessions/S/run/proxy-members.json"
    taken = parse_members(proxy_members(plan, draining=frozenset({"decode-1"})))
    assert taken == [(instance_url(plan, i), i.role, i.name == "decode-1", spec.model_group) for i in plan.instances]
    assert sorted(r for _, r, _, _ in taken) == ["decode", "decode", "prefill", "prefill"]


def test_metrics_targets_list_the_proxy_and_every_instance_for_a_prometheus_file_sd(tmp_path, yrpd_home):
    """`yrpd metrics targets --out FILE`: the proxy, each host's exporter and each vLLM server's host:port with their
    labels, read from the session alone (nothing is contacted: the hosts h1, h2 do not exist here)."""
    from tests.conftest import run_yrpd
    from tests.unit.sessions import recorded

    deployment = recorded(yrpd_home)  # stored where the CLI looks: $YRPD_HOME/sessions
    out = tmp_path / "targets.json"
    proc = run_yrpd("metrics", "targets", "--out", out, env={"YRPD_HOME": str(yrpd_home)}, check=0)
    assert proc.stdout == ""
    groups = json.loads(out.read_text())
    sid = deployment.session.id
    assert groups[0] == {"targets": ["10.0.0.1:8000"], "labels": {"yrpd_session": sid, "job": "yrpd_proxy",
                                                                  "host": "h1"}}
    assert groups[1:3] == [{"targets": [f"10.0.0.{n}:32700"], "labels": {"yrpd_session": sid, "job": "yrpd_host",
                                                                        "host": f"h{n}"}} for n in (1, 2)]
    rows = [(g["labels"]["job"], g["labels"]["yrpd_instance"], g["labels"]["role"], g["targets"]) for g in groups[3:]]
    assert rows == [("yrpd_vllm", i.name, i.role, [f"{'10.0.0.1' if i.host == 'h1' else '10.0.0.2'}:{i.port}"])
                    for i in deployment.plan.instances]
    again = run_yrpd("metrics", "targets", env={"YRPD_HOME": str(yrpd_home)}, check=0)
    assert json.loads(again.stdout) == groups  # stdout without --out


# -- an instance whose TP x PP group spans hosts


def spanning(backend: str, **over):
    """One prefill and one decode instance of TP 16 on four 8-NPU hosts, the NIC enp189s0f0 on each."""
    return deployment(hosts=("h1", "h2", "h3", "h4"), **{"ptp": 16, "dtp": 16, "nic": "enp189s0f0",
                                                         "multi_node_backend": backend, **over})


def describe(launches) -> str:
    """One block per process: where, its environment, its argv one word a line, its gang."""
    out = []
    for launch in launches:
        out.append(f"# {launch.name} on {launch.host}" + (f" (health {launch.health_url})" if launch.health_url else ""))
        out += [f"{k}={v}" for k, v in sorted(launch.env.items())]
        out += ["  " + word for word in launch.argv]
        out.append(f"gang: {json.dumps(launch.gang, sort_keys=True)}")
    return "\n".join(out) + "\n"


def test_tp_16_on_two_8_npu_hosts_over_ray_golden():
    """vLLM's recipe: a Ray head on the instance's first host, a Ray worker on the second, `vllm serve` with the Ray
    executor on the first; every process told the NIC, its own HCCL block and its host's address."""
    from tests.unit.golden_files import check_golden
    from yrpd.exposure import exposure
    from yrpd.placement import ports_on_host

    spec, plan = spanning("ray")
    ports = [f"{r.host} {r.port}: {r.what} (listens on {r.listens_on}; for {r.callers})" for r in exposure(spec, plan)
             if r.what.startswith(("prefill-0", "decode-0"))]
    preflight = [f"{h.name} checks free: {ports_on_host(plan, h.name, spec)}" for h in plan.hosts]
    check_golden("multinode", "tp16-two-8npu-hosts-ray.txt",
                 "".join(describe(instance_launches(spec, plan, inst, PATHS)) for inst in plan.instances)
                 + "# ports (yrpd plan's exposure table)\n" + "\n".join(ports) + "\n" + "\n".join(preflight) + "\n")
    head, serve, worker = instance_launches(spec, plan, plan.instances[0], PATHS)
    assert (head.name, serve.name, worker.name) == ("prefill-0-ray", "prefill-0", "prefill-0-ray-h2")
    assert "--head" in head.argv and "--address=10.0.0.1:64200" in worker.argv
    assert flag(serve.argv, "--distributed-executor-backend") == "ray" and serve.env["RAY_ADDRESS"] == "10.0.0.1:64200"
    assert flag(serve.argv, "--tensor-parallel-size") == "16" and serve.health_url == "http://10.0.0.1:8100/health"
    # the Ray head leads: the API server and the worker node follow it
    assert head.gang == {"role": "leader", "members": [["prefill-0", "10.0.0.1:8300"],
                                                       ["prefill-0-ray-h2", "10.0.0.2:8300"]]}
    assert serve.gang["role"] == worker.gang["role"] == "follower"
    assert worker.env["VLLM_HOST_IP"] == "10.0.0.2" and worker.env["HCCL_SOCKET_IFNAME"] == "enp189s0f0"
    assert worker.env["PYTHONPATH"] == PATHS.bundle_dir  # the connector runs in the Ray workers the raylet starts


def test_the_same_instance_on_vllms_own_launcher_runs_one_serve_per_host():
    spec, plan = spanning("mp")
    head, node = instance_launches(spec, plan, plan.instances[1], PATHS)
    assert (head.name, head.host, node.name, node.host) == ("decode-0", "h3", "decode-0-h4", "h4")
    for launch, rank in ((head, "0"), (node, "1")):
        assert (flag(launch.argv, "--nnodes"), flag(launch.argv, "--node-rank")) == ("2", rank)
        assert (flag(launch.argv, "--master-addr"), flag(launch.argv, "--master-port")) == ("10.0.0.3", "8300")
    assert "--headless" in node.argv and "--headless" not in head.argv and "--port" not in node.argv
    assert head.gang == {"role": "leader", "members": [["decode-0-h4", "10.0.0.4:8300"]]}
    assert node.gang == {"role": "follower", "listen": "10.0.0.4:8300", "leader": "decode-0 on h3"}
    assert node.env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and node.env["GLOO_SOCKET_IFNAME"] == "enp189s0f0"


def test_an_instance_on_one_host_has_no_gang_nor_nic_settings():
    # the control of the two above: TP 8 fits one host
    spec, plan = spanning("mp", ptp=8, dtp=8)
    (launch,) = instance_launches(spec, plan, plan.instances[0], PATHS)
    assert launch.gang is None and "GLOO_SOCKET_IFNAME" not in launch.env and "--nnodes" not in launch.argv


def test_pipeline_stages_are_passed_and_take_their_devices():
    spec, plan = deployment(hosts=("h1", "h2"), ptp=2, dtp=2, ppp=2, dpp=2)
    (prefill,) = instance_launches(spec, plan, plan.instances[0], PATHS)
    assert flag(prefill.argv, "--pipeline-parallel-size") == "2"
    assert prefill.env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3"  # four ranks: tp 2 x pp 2


def test_a_host_without_the_ray_cli_fails_its_start_in_one_line_naming_it(tmp_path):
    import subprocess

    from yrpd.steps import StepContext
    from yrpd.steps.instances import start
    from yrpd.steps.vllm_env import paths

    spec, plan = spanning("ray")
    ctx = StepContext(spec, plan)
    ray = paths(ctx).ray  # the vllm-ascend image's, which this machine has not: its start stops at the check
    run = subprocess.run(["bash", "-c", start(ctx, plan.hosts[1]).script], capture_output=True, text=True,
                         cwd=tmp_path, timeout=30, check=False)
    assert run.returncode == 1 and run.stderr.strip().splitlines() == [
        (f"prefill-0-ray-h2 run on Ray (multi_node_backend ray) and there is no {ray} here: the vllm-ascend images "
         "ship Ray beside vLLM; install it there, or set multi_node_backend: mp")], run.stderr
    # the control: an instance on vLLM's launcher asks for no Ray
    spec, plan = spanning("mp")
    assert "command -v" not in start(StepContext(spec, plan), plan.hosts[1]).script.split("\n", 1)[0]


def test_cpu_instances_behind_a_prefix_routing_proxy_publish_kv_events_on_unix_sockets_unless_routed_otherwise():
    from yrpd.bench.run import variant

    spec, plan = deployment(DeviceKind.cpu, devices=2, hosts=("h1",))
    p, d = launches_on_host(spec, plan, "h1", PATHS)
    config = json.loads(flag(p.argv, "--kv-events-config"))
    assert config["endpoint"] == f"ipc://{PATHS.session.run_dir}/kv-events-prefill-0.sock"
    assert config["replay_endpoint"] == f"ipc://{PATHS.session.run_dir}/kv-replay-prefill-0.sock"
    assert "--kv-events-config" in d.argv and "--no-kv-events" not in proxy_launch(spec, plan, PATHS).argv
    # the bench's routing baselines: the estimate alone (no events published, none followed), and round robin
    for target, routing in (("pd-estimate", "prefix"), ("pd-rr", "round-robin"), ("pd-load", "load")):
        other = variant(spec, target, DeviceKind.cpu)
        other_plan = make_plan(other, INVENTORY_OF(plan))
        assert not any("--kv-events-config" in l.argv for l in launches_on_host(other, other_plan, "h1", PATHS))
        proxy = proxy_launch(other, other_plan, PATHS).argv
        assert flag(proxy, "--routing") == routing and ("--no-kv-events" in proxy) == (target == "pd-estimate")
        assert "--kv-exact" not in proxy
    # the oracle: the same events, and the proxy catches up on them before every leg (the control: pd does not)
    oracle = variant(spec, "pd-oracle", DeviceKind.cpu)
    oracle_plan = make_plan(oracle, INVENTORY_OF(plan))
    assert all("--kv-events-config" in l.argv for l in launches_on_host(oracle, oracle_plan, "h1", PATHS))
    assert "--kv-exact" in proxy_launch(oracle, oracle_plan, PATHS).argv
    assert "--kv-exact" not in proxy_launch(variant(spec, "pd", DeviceKind.cpu), plan, PATHS).argv
    # the instances' hash seed reaches the proxy where they have one (ascend-store's PYTHONHASHSEED=0)
    seeded = build_spec({}, {"hosts": "h1", "model": "/models/qwen", "device_kind": "cpu", "env": {"PYTHONHASHSEED": "7"}})
    seeded_plan = make_plan(seeded, INVENTORY_OF(plan))
    assert flag(proxy_launch(seeded, seeded_plan, PATHS).argv, "--kv-hash-seed") == "7"
    assert "--kv-hash-seed" not in proxy_launch(spec, plan, PATHS).argv  # the control: none set, none passed


def test_where_the_proxy_follows_the_caches_events_every_cpu_hosts_data_system_worker_publishes_its_own():
    from yrpd.bench.run import variant
    from yrpd.cluster.dsconfig import worker_args
    from yrpd.steps import StepContext
    from yrpd.steps.cluster import node

    def published(spec, plan):
        ctx = StepContext(spec=spec, plan=plan, session_id="S")
        return [worker_args(node(ctx, h, "ds_only")).get("kv_events_config") for h in plan.hosts]

    spec, plan = deployment(DeviceKind.cpu, devices=2)
    ctx = StepContext(spec=spec, plan=plan, session_id="S")
    for h, config in zip(plan.hosts, published(spec, plan)):
        # a unix socket in the session's run directory, named as an instance's would be: the relay carries it too
        assert json.loads(config) == {"bind_endpoint": f"ipc://{ctx.layout.run_dir}/kv-events-datasystem.sock",
                                      "backend_id": h.reach_ip}
    # the controls: the estimate alone, load routing, the store's events off (pd-nostore), another connector, NPU
    # hosts: no worker publishes
    for target in ("pd-estimate", "pd-load", "pd-nostore", "peer-nixl-pd"):
        other = variant(spec, target, DeviceKind.cpu)
        assert published(other, make_plan(other, INVENTORY_OF(plan))) == [None, None], target
    assert published(*deployment(DeviceKind.npu, ptp=4, dtp=4)) == [None, None]
    # the yr launcher's config carries the same JSON in [ds_worker.args], as a TOML string
    import tomllib

    from yrpd.cluster.yrconfig import render_config
    yr_spec, yr_plan = deployment(DeviceKind.cpu, devices=2, cluster_launcher="yr")
    yr_ctx = StepContext(spec=yr_spec, plan=yr_plan, session_id="S")
    for h in yr_plan.hosts:
        args = tomllib.loads(render_config(node(yr_ctx, h, "ds_only")))["ds_worker"]["args"]
        assert json.loads(args["kv_events_config"]) == {
            "bind_endpoint": f"ipc://{yr_ctx.layout.run_dir}/kv-events-datasystem.sock", "backend_id": h.reach_ip}


def test_a_host_other_than_the_proxys_runs_a_relay_of_its_instances_kv_events_and_the_proxy_knows_its_port():
    from yrpd.bench.run import variant
    from yrpd.serving import KV_RELAY_NAME

    spec, plan = deployment(DeviceKind.cpu, devices=2)  # prefill-0 and the proxy on h1, decode-0 on h2
    on_h2 = launches_on_host(spec, plan, "h2", PATHS)
    relay = on_h2[0]
    assert [l.name for l in on_h2] == [KV_RELAY_NAME, "decode-0"]  # before the instance it relays
    assert relay.argv[relay.argv.index("-m") + 1] == "yrpd.proxy.kvrelay"
    assert flag(relay.argv, "--run-dir") == PATHS.session.run_dir and flag(relay.argv, "--listen") == "10.0.0.2"
    assert flag(relay.argv, "--port") == str(spec.ports.kv_relay) and relay.health_url is None
    assert relay.env_file == PATHS.session.env_file("kv-relay") and "PYTHONPATH" in relay.env
    assert plan.hosts[1].ports["kv_relay"] == spec.ports.kv_relay  # checked free at preflight, closed at down
    assert flag(proxy_launch(spec, plan, PATHS).argv, "--kv-relay-port") == str(spec.ports.kv_relay)
    # the proxy's own host needs none: it subscribes to the unix sockets there
    assert KV_RELAY_NAME not in [l.name for l in launches_on_host(spec, plan, "h1", PATHS)]
    assert "kv_relay" not in plan.hosts[0].ports
    # the controls: nothing published (the estimate alone, load routing, NPU hosts), no relay and no port
    cases = [(v, make_plan(v, INVENTORY_OF(plan))) for v in (variant(spec, t, DeviceKind.cpu)
                                                            for t in ("pd-estimate", "pd-load"))]
    cases.append(deployment(DeviceKind.npu, ptp=4, dtp=4))
    for other, other_plan in cases:
        assert KV_RELAY_NAME not in [l.name for l in launches_on_host(other, other_plan, "h2", PATHS)]
        assert all("kv_relay" not in h.ports for h in other_plan.hosts)
    # the proxy is told where relays listen whenever it follows events, so a scale onto a new host needs no restart
    # of it; not where it follows none
    assert [("--kv-relay-port" in proxy_launch(o, p, PATHS).argv) for o, p in cases] == [False, False, True]


def test_the_proxy_knows_the_workers_memory_where_a_disk_tier_is_behind_it():
    """Prefix routing infers what the data system holds on disk from each worker's memory (kvindex.Store): told where
    a disk tier exists and the workers' events are followed; not where all a worker holds is in memory."""
    spec, plan = deployment(DeviceKind.cpu, devices=2, datasystem_spill_mb=512, datasystem_memory_mb=2048)
    assert flag(proxy_launch(spec, plan, PATHS).argv, "--store-memory-mb") == "2048"
    # the controls: no disk tier; the workers' events not followed
    for over in ({}, {"datasystem_spill_mb": 512, "routing_store_events": False}):
        other, other_plan = deployment(DeviceKind.cpu, devices=2, **over)
        assert "--store-memory-mb" not in proxy_launch(other, other_plan, PATHS).argv
