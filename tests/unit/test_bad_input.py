"""Bad input: exit 2, one line on stderr naming the field, before any host is touched.

Every host in these tests resolves (through the ssh_config written below) to 127.0.0.1 port 9, where
nothing listens: had yrpd tried to connect, it would report an ssh error and exit 1 instead of 2.
"""

import pytest

SSH_CONFIG = """\
Host h1 h2 h3
    HostName 127.0.0.1
    Port 9
"""

GOOD = ["--hosts", "h1,h2", "--devices", "0-7", "--device-kind", "npu", "--model", "/models/m"]


def without(args, *flags):
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        out.append(a)
    return out


CASES = [
    # (id, args, config file text or None, text the error line must contain)
    ("unknown-device-kind", GOOD[:-4] + ["--device-kind", "tpu", "--model", "/m"], None, "--device-kind"),
    ("unknown-runtime", GOOD + ["--runtime", "podman"], None, "--runtime"),
    ("unknown-flag", GOOD + ["--frobnicate", "1"], None, "--frobnicate"),
    ("ptp-not-a-number", GOOD + ["--ptp", "four"], None, "--ptp"),
    ("ptp-zero", GOOD + ["--ptp", "0"], None, "ptp"),
    ("long-ptp-zero", GOOD + ["--prefill-tensor-parallel-size", "0"], None,
     "prefill_tensor_parallel_size: Input should be greater than or equal to 1 (got 0); give --ptp"),
    ("ptp-under-both-names", GOOD, "ptp: 2\nprefill_tensor_parallel_size: 2\n",
     "prefill_tensor_parallel_size: given twice, as prefill_tensor_parallel_size and as ptp"),
    ("decode-negative", GOOD + ["--decode", "-1"], None, "decode"),
    ("tp-not-dividing", without(GOOD, "--devices") + ["--devices", "0-5", "--ptp", "4", "--dtp", "4"], None,
     "prefill_tensor_parallel_size (--ptp): 4 neither divides the 6 NPUs of h1 nor is a multiple of them"),
    # a group bigger than a host fills whole hosts (the control: --ptp 16 --dtp 16 plans, test_placement.py)
    ("split-not-whole-hosts", GOOD + ["--ptp", "12", "--dtp", "12"], None,
     "12 neither divides the 8 NPUs of h1 nor is a multiple of them; use one of 1, 2, 4, 8, or a multiple of 8"),
    ("split-with-dp", without(GOOD, "--hosts", "--devices") + ["--hosts", "h1,h2,h3,h4,h5,h6", "--devices", "0-3",
                                                                "--ptp", "8", "--dtp", "8", "--pdp", "2"], None,
     "spans hosts only in an instance of one DP rank"),
    # the connector keys KV per TP rank and PP stage (the control: equal sizes plan, as every other case here)
    ("tp-shapes-differ", GOOD + ["--ptp", "2", "--dtp", "4"], None,
     ("decode_tensor_parallel_size: the yuanrong connector keys KV by TP rank and PP stage: decode (tp 4, pp 1) "
      "would find none of prefill's (tp 2, pp 1) blocks")),
    ("pp-shapes-differ", GOOD + ["--ppp", "2"], None, "decode_pipeline_parallel_size: the yuanrong connector"),
    ("tp-not-dividing-heads", without(GOOD, "--model", "--devices", "--device-kind") +
     ["--model", "builtin:smollm2", "--device-kind", "cpu", "--devices", "0-3", "--ptp", "2", "--dtp", "2"], None,
     ("prefill_tensor_parallel_size: builtin:smollm2 has 9 attention heads, which 2 does not divide; use --ptp 1 or "
      "3 or 9")),
    ("pp-over-layers", without(GOOD, "--model") + ["--model", "builtin:tiny-qwen2", "--ppp", "4", "--dpp", "4"], None,
     "prefill_pipeline_parallel_size: builtin:tiny-qwen2 has 2 layers, fewer than 4 stages; use --ppp 2 or less"),
    ("too-few-devices", without(GOOD, "--devices") + ["--devices", "0-3", "--ptp", "4", "--dtp", "4", "--decode", "2"], None,
     "prefill needs 1 x 4 NPUs and decode 2 x 4 NPUs = 12; hosts h1,h2 offer 4 + 4 = 8"),
    ("duplicate-hosts", ["--hosts", "h1,h2,h1"] + GOOD[2:], None, "hosts[2]: h1 is listed twice"),
    ("empty-host", ["--hosts", "h1,,h2"] + GOOD[2:], None, "hosts[1]"),
    ("bad-host-port", ["--hosts", "h1:99999,h2"] + GOOD[2:], None, "port '99999' is not in 1-65535"),
    ("bad-host-name", ["--hosts", "h1,h_2!"] + GOOD[2:], None, "is not a valid host name"),
    ("master-not-a-host", GOOD + ["--master", "h9"], None, "master: 'h9' is not one of the hosts"),
    ("proxy-port-zero", GOOD + ["--proxy-port", "0"], None, "ports.proxy"),
    ("proxy-port-too-big", GOOD + ["--proxy-port", "70000"], None, "ports"),
    ("proxy-collides-datasystem", GOOD + ["--proxy-port", "31501"], None, "proxy (31501) collides with datasystem (31501)"),
    ("proxy-inside-instance-range", GOOD + ["--proxy-port", "8150"], None, "collides with instance_base (8100-8199)"),
    ("instance-range-past-65535", GOOD, "ports:\n  instance_base: 65500\n", "ports.instance_base: range 65500-65599 runs past 65535"),
    ("kv-overlaps-instances", GOOD, "ports:\n  kv_base: 8150\n", "collides with kv_base"),
    ("kv-relay-on-exporter", GOOD, "ports:\n  kv_relay: 32699\n", "exporter (32700) collides with kv_relay (32699-32700)"),
    ("kv-relay-at-the-top", GOOD, "ports:\n  kv_relay: 65535\n", "kv_relay: 65535 leaves no port after it"),
    ("missing-model", without(GOOD, "--model"), None, "model: no model path given"),
    ("relative-model", without(GOOD, "--model") + ["--model", "models/m"], None, "model: 'models/m' is not an absolute path"),
    ("missing-config-file", GOOD + ["--config", "/nonexistent/yrpd.yaml"], None, "--config: /nonexistent/yrpd.yaml does not exist"),
    ("malformed-yaml", GOOD, "hosts: [h1, h2\nptp: 4\n", "is not valid YAML"),
    ("yaml-not-mapping", GOOD, "- h1\n- h2\n", "must hold a mapping"),
    ("unknown-config-key", GOOD, "prefil: 2\n", "prefil: is not a known setting"),
    ("devices-backwards", without(GOOD, "--devices") + ["--devices", "3-0"], None, "devices: range '3-0' runs backwards"),
    ("devices-duplicate", without(GOOD, "--devices") + ["--devices", "0,1,1"], None, "device 1 is listed twice"),
    ("devices-garbage", without(GOOD, "--devices") + ["--devices", "a-b"], None, "devices"),
    ("docker-without-image", GOOD + ["--runtime", "docker"], None, "image: runtime docker needs an image"),
    ("docker-bad-image", GOOD + ["--runtime", "docker", "--image", "Not An Image"], None,
     "image: 'Not An Image' is not an image reference"),
    ("docker-image-without-profile", GOOD + ["--runtime", "docker", "--image", "example.org/my/vllm:1"], None,
     "container_profile: no shipped profile is made for image example.org/my/vllm:1"),
    ("docker-unknown-profile", GOOD + ["--runtime", "docker", "--image", "example.org/my/vllm:1",
                                       "--container-profile", "nope"], None, "container_profile: 'nope' is not a shipped profile"),
    ("docker-missing-profile-file", GOOD + ["--runtime", "docker", "--image", "example.org/my/vllm:1",
                                            "--container-profile", "/nonexistent/p.yaml"], None,
     "container_profile: /nonexistent/p.yaml does not exist"),
    ("profile-without-docker", GOOD + ["--runtime", "host", "--container-profile", "vllm-ascend-v0.23.0"], None,
     "container_profile: is only used with runtime docker"),
    ("unknown-container-engine", GOOD, "container_engine: lxc\n", "container_engine"),
    ("bad-env", GOOD + ["--env", "NOEQUALS"], None, "--env"),
    ("bad-env-name", GOOD + ["--env", "1X=2"], None, "env.1X"),
    ("missing-identity", GOOD + ["-i", "/nonexistent/key"], None, "identity file /nonexistent/key does not exist"),
    ("missing-ssh-config", GOOD + ["--ssh-config", "/nonexistent/cfg"], None, "ssh.config_file"),
    ("too-many-instances", without(GOOD, "--devices") + ["--devices", "0-7", "--prefill", "65"], None, "prefill"),
    ("session-root-too-long", GOOD, "remote_session_root: /var/lib/a-very-long-directory-name/for-sessions\n",
     "remote_session_root: is too long"),
    ("engine-args-owns-port", GOOD, "engine_args: ['--port', '9000']\n", "engine_args: --port is set by yrpd"),
    ("dscli-with-full-mode", GOOD, "cluster_launcher: dscli\ncluster_mode: full\n",
     "cluster_launcher: dscli starts the data system alone"),
    ("decode-engine-args-owns-port", GOOD, "decode_engine_args: ['--port=9000']\n",
     "decode_engine_args: --port is set by yrpd"),
    # (the control: the same field in a PD spec plans, tests/unit/test_serving.py)
    ("role-engine-args-without-pd", GOOD, "disaggregated: false\nprefill_engine_args: ['--max-num-seqs', '4']\n",
     "prefill_engine_args: set for one PD role's instances, but disaggregated: false runs one plain instance"),
    ("proxy-host-not-ip", GOOD, "proxy_host: everywhere\n", "proxy_host: 'everywhere' is not an IP address"),
    ("api-key-env-unset", GOOD, "api_key_env: YRPD_TEST_SURELY_UNSET_KEY\n", "api_key_env: $YRPD_TEST_SURELY_UNSET_KEY is not set"),
    ("startup-timeout-too-small", GOOD, "startup_timeout_s: 1\n", "startup_timeout_s"),
    ("unknown-dtype", GOOD + ["--dtype", "fp8"], None, "--dtype"),
    ("engine-args-owns-dtype", GOOD, "engine_args: ['--dtype', 'float16']\n", "engine_args: --dtype is set by yrpd"),
    ("unknown-builtin-model", GOOD[:-2] + ["--model", "builtin:gpt5"], None, "builtin:smollm2"),
    ("example-connector-two-hosts", GOOD, "kv_connector: example\n",
     "kv_connector: example shares KV through files, which only one host can see"),
    ("lmcache-with-pd", GOOD, "kv_connector: lmcache\n",
     "kv_connector: lmcache is a prefix store for plain instances here, not a PD handoff"),
    ("unknown-kv-connector", GOOD, "kv_connector: mooncake\n", "kv_connector"),
    # the connector's own keys, checked as it reads them (the control: test_spec_accepts_the_connectors_own_keys)
    ("connector-misspelt-key", GOOD, "connector: {ttl_secnds: 5}\n",
     "connector: unknown key 'ttl_secnds' (did you mean 'ttl_seconds'?); docs/dev/connector.md lists the keys"),
    ("connector-value-out-of-range", GOOD, "connector: {writer_nice: 25}\n", "connector: writer_nice must be 0-19"),
    ("connector-not-a-boolean", GOOD, "connector: {save_sync: maybe}\n",
     "connector: save_sync: expected a boolean, got 'maybe'"),
    ("mixed-kinds", ["--hosts", "h1,h2", "--devices", "0-3", "--model", "/m"],
     "hosts:\n  - {address: h1, device_kind: npu}\n  - {address: h2, device_kind: cpu}\n", "hosts mix device kinds"),
]


@pytest.mark.parametrize("case_id,args,config,expected", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("command", ["plan", "deploy"])
def test_bad_input_exits_2_with_one_line(tmp_path, yrpd, yrpd_home, command, case_id, args, config, expected):
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(SSH_CONFIG)
    full = [command, *args]
    if "--ssh-config" not in args:
        full += ["--ssh-config", str(ssh_config)]
    if config is not None:
        cfg = tmp_path / "yrpd.yaml"
        cfg.write_text(config)
        if "--config" not in args:
            full += ["--config", str(cfg)]
    proc = yrpd(*full)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    # nothing was started: no session was created
    assert not (yrpd_home / "sessions").exists() or not any((yrpd_home / "sessions").iterdir())


def test_cases_are_distinct():
    assert len({c[0] for c in CASES}) == len(CASES) >= 20


DEPLOY_ONLY = [
    ("pull-without-docker", GOOD + ["--runtime", "host", "--pull", "missing"], "--pull: only applies to runtime docker"),
    ("pull-unknown-policy", GOOD + ["--runtime", "docker", "--image", "quay.io/ascend/vllm-ascend:v0.10.0rc1-openeuler",
                                    "--pull", "sometimes"], "--pull"),
]


@pytest.mark.parametrize("case_id,args,expected", DEPLOY_ONLY, ids=[c[0] for c in DEPLOY_ONLY])
def test_bad_deploy_options_exit_2_with_one_line(tmp_path, yrpd, yrpd_home, case_id, args, expected):
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(SSH_CONFIG)
    proc = yrpd("deploy", *args, "--ssh-config", str(ssh_config))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr
    assert not (yrpd_home / "sessions").exists() or not any((yrpd_home / "sessions").iterdir())


def test_bench_target_that_cannot_run_on_the_deployment_is_refused_before_anything_is_torn_down(yrpd, yrpd_home):
    from tests.unit.sessions import recorded

    deployment = recorded(yrpd_home)  # two hosts: vLLM's file-based connector cannot hand KV across them
    proc = yrpd("bench", "run", "--targets", "pd,peer-example-pd")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--targets: peer-example-pd cannot run on session" in lines[0], proc.stderr
    assert "only one host" in lines[0] and "leave it out of --targets" in lines[0]
    assert not (deployment.session.path / "bench").exists()


@pytest.mark.parametrize("way", ["short-flags", "long-flags", "short-config", "long-config"])
def test_the_parallel_sizes_have_readable_names_and_keep_their_short_ones(tmp_path, yrpd, way):
    """--ptp/--dtp/--pdp/--ddp/--ppp/--dpp and their long names (flags and config keys) plan the same; a plan with none of them
    (the control) differs."""
    import json

    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(SSH_CONFIG)
    short = {"ptp": "2", "dtp": "2", "pdp": "2", "ddp": "1", "ppp": "2", "dpp": "2"}
    long = {"ptp": "prefill-tensor-parallel-size", "dtp": "decode-tensor-parallel-size",
            "pdp": "prefill-data-parallel-size", "ddp": "decode-data-parallel-size",
            "ppp": "prefill-pipeline-parallel-size", "dpp": "decode-pipeline-parallel-size"}
    base = ["plan", "--json", "--runtime", "host", "--ssh-config", str(ssh_config), *GOOD]

    def plan(*extra):
        proc = yrpd(*base, *extra)
        assert proc.returncode == 0, proc.stderr
        return [(i["name"], i["host"], i["devices"]) for i in json.loads(proc.stdout)["instances"]]

    if way.endswith("flags"):
        args = [a for k, v in short.items() for a in ((f"--{k}" if way == "short-flags" else f"--{long[k]}"), v)]
    else:
        cfg = tmp_path / "yrpd.yaml"
        cfg.write_text("".join(f"{k if way == 'short-config' else long[k].replace('-', '_')}: {v}\n"
                               for k, v in short.items()))
        args = ["--config", str(cfg)]
    wanted = plan("--ptp", "2", "--dtp", "2", "--pdp", "2", "--ddp", "1", "--ppp", "2", "--dpp", "2")
    # prefill: two DP ranks of tp 2 x pp 2 on h1, decode's one on h2
    assert wanted == [("prefill-0", "h1", list(range(8))), ("decode-0", "h2", [0, 1, 2, 3])], wanted
    assert plan(*args) == wanted
    assert plan() != wanted


def test_spec_accepts_the_connectors_own_keys_as_a_config_file_writes_them(tmp_path, yrpd):
    """The keyed control of the connector cases above: known keys with values in range plan."""
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(SSH_CONFIG)
    cfg = tmp_path / "yrpd.yaml"
    cfg.write_text("connector: {ttl_seconds: 5, writer_nice: 19, save_sync: 'false', resave_after_s: 2}\n")
    proc = yrpd("plan", *GOOD, "--config", str(cfg), "--ssh-config", str(ssh_config))
    assert proc.returncode == 0, proc.stderr
