"""The user's spec (yrpd.spec): the flags of `yrpd deploy` and `yrpd plan` over the config file, and what a change of
each field does to a running deployment (the refusals of bad input are tests/unit/test_bad_input.py's)."""

from __future__ import annotations

import json

import click
import pytest

from yrpd.cli.deploy import deploy
from yrpd.cli.options import spec_options
from yrpd.cli.plan import plan as plan_command
from yrpd.errors import SpecError
from yrpd.live import describe_change
from yrpd.placement import make_plan, stale
from yrpd.spec import ChangeKind, DeploySpec, build_spec, joined_hosts, spec_diff, spec_from_flags

from tests.unit.test_placement import eight_each, three_hosts  # three hosts of 8 NPUs: the specs a change compares


def test_each_changed_field_is_sorted_into_what_rolls_scales_takes_effect_or_needs_recreate():
    old = three_hosts()
    new = three_hosts(engine_args=["--max-num-seqs", "8"], decode=2, startup_timeout_s=1200, datasystem_memory_mb=4096)
    kinds = {c.field: c.kind for c in spec_diff(old, new)}
    assert kinds == {"engine_args": ChangeKind.roll, "decode": ChangeKind.scale,
                     "startup_timeout_s": ChangeKind.free,
                     "datasystem_memory_mb": ChangeKind.recreate}
    assert spec_diff(old, three_hosts()) == []  # the control: the same spec changes nothing


def test_hosts_added_after_the_others_join_and_any_other_change_of_the_hosts_needs_recreate():
    old = three_hosts(hosts="h1,h2")
    [joined] = spec_diff(old, three_hosts(hosts="h1,h2,h3"))
    assert (joined.kind, joined.line()) == (ChangeKind.join, "hosts: ['h1', 'h2'] -> ['h1', 'h2', 'h3'] (join)")
    assert joined_hosts(old, three_hosts(hosts="h1,h2,h3,h4")) == ["h3", "h4"]
    # the master (the first host) would change, a host would go, or a running host's settings would change
    for other in ("h3,h1,h2", "h1", "h1,h3", "h2,h1,h3"):
        assert [c.kind for c in spec_diff(old, three_hosts(hosts=other))] == [ChangeKind.recreate], other
    moved = build_spec({"hosts": [{"address": "h1"}, {"address": "h2", "ip": "10.9.9.9"}, {"address": "h3"}]},
                       {"model": "/models/m", "device_kind": "npu", "ptp": 4, "dtp": 4})
    assert joined_hosts(old, moved) == [] and spec_diff(old, moved)[0].kind is ChangeKind.recreate
    same_names = build_spec({"hosts": [{"address": "h1"}, {"address": "h2", "ip": "10.9.9.9"}]},
                            {"model": "/models/m", "device_kind": "npu", "ptp": 4, "dtp": 4})
    assert spec_diff(old, same_names)[0].line() == \
        "hosts: [{'address': 'h2'}] -> [{'address': 'h2', 'ip': '10.9.9.9'}] (recreate)"  # what differs, named
    lines = describe_change(spec_diff(old, three_hosts(hosts="h1,h2,h3")), make_plan(old, eight_each(hosts=("h1", "h2"))),
                             three_hosts(hosts="h1,h2,h3"), 0)
    assert lines[1] == "join h3: its data system worker joins the cluster, nothing that runs restarts"


def test_a_roles_own_engine_args_roll_that_roles_instances_alone():
    plan = make_plan(three_hosts(), eight_each())
    assert [i.name for i in stale(plan, three_hosts(decode_engine_args=["--max-num-seqs", "64"]))] == ["decode-0"]
    assert [i.name for i in stale(plan, three_hosts(prefill_engine_args=["--max-num-seqs", "4"]))] == ["prefill-0"]
    # a session recorded before the role fields existed does not roll for them while they stay empty: the digest is
    # the one of the six fields it was made of then
    from yrpd.spec import _digest
    before = _digest({k: getattr(three_hosts(), k) for k in ("model", "served_model_name", "dtype", "prefix_reuse",
                                                       "engine_args", "connector")})
    assert three_hosts().instance_config("decode") == three_hosts().instance_config("prefill") == before
    assert [c.kind.value for c in spec_diff(three_hosts(), three_hosts(decode_engine_args=["--max-num-seqs", "64"]))] == ["roll"]


# -- flags over the config file ---------------------------------------------------------------------------------

CONFIG = {"hosts": ["h1", "h2"], "model": "/models/m", "device_kind": "npu", "decode": 1, "ddp": 1,
          "env": {"A": "0", "B": "2"}, "ports": {"proxy": 8000}, "ssh": {"identity": "config.key"}}


@pytest.mark.parametrize("argv, read, given, configured", [
    (["--decode", "2"], lambda s: s.decode, 2, 1),
    (["--ddp", "2"], lambda s: s.decode_data_parallel_size, 2, 1),
    (["--decode-data-parallel-size", "2"], lambda s: s.decode_data_parallel_size, 2, 1),
    (["--env", "A=1"], lambda s: s.env, {"A": "1", "B": "2"}, {"A": "0", "B": "2"}),
    (["--proxy-port", "9001"], lambda s: s.ports.proxy, 9001, 8000),
    (["-i", "flag.key"], lambda s: s.ssh.identity, "flag.key", "config.key"),
    (["--hosts", "h3,h4"], lambda s: [h.name for h in s.hosts], ["h3", "h4"], ["h1", "h2"]),
    (["--served-model-name", "x"], lambda s: s.served_model_name, "x", None),
])
def test_a_flag_of_deploy_and_plan_sets_the_field_it_names_over_the_config_file(tmp_path, monkeypatch, argv, read,
                                                                                given, configured):
    monkeypatch.chdir(tmp_path)  # the identity files the spec checks exist
    (tmp_path / "config.key").write_text("")
    (tmp_path / "flag.key").write_text("")
    config = tmp_path / "yrpd.yaml"
    config.write_text(json.dumps(CONFIG))  # YAML reads JSON
    for command in (deploy, plan_command):
        flags = command.make_context(command.name, ["--config", str(config), *argv]).params
        assert read(spec_from_flags(flags)) == given, (command.name, argv)
        # the control: without the flag, the config file's value
        alone = command.make_context(command.name, ["--config", str(config)]).params
        assert read(spec_from_flags(alone)) == configured, command.name


BASE = ("--hosts", "h1,h2", "--model", "/models/m", "--device-kind", "npu")
#: every flag of `spec_options` but --config (above): what it is given, and where the spec keeps it
EACH_FLAG = {
    "hosts": (["--hosts", "h3,h4"], lambda s: [h.name for h in s.hosts]),
    "master": (["--master", "h2"], lambda s: s.master),
    "devices": (["--devices", "0-3"], lambda s: s.devices),
    "device_kind": (["--device-kind", "gpu"], lambda s: s.device_kind),
    "runtime": (["--runtime", "host"], lambda s: s.runtime),
    "image": (["--image", "registry.example/vllm-ascend:v9", "--container-profile", "vllm-ascend-v0.23.0"],
              lambda s: s.image),
    "container_profile": (["--container-profile", "vllm-ascend-v0.23.0"], lambda s: s.container_profile),
    "prefill": (["--prefill", "2"], lambda s: s.prefill),
    "decode": (["--decode", "2"], lambda s: s.decode),
    "ptp": (["--ptp", "2", "--dtp", "2"], lambda s: s.prefill_tensor_parallel_size),
    "dtp": (["--ptp", "2", "--dtp", "2"], lambda s: s.decode_tensor_parallel_size),
    "pdp": (["--pdp", "2"], lambda s: s.prefill_data_parallel_size),
    "ddp": (["--ddp", "2"], lambda s: s.decode_data_parallel_size),
    "ppp": (["--ppp", "2", "--dpp", "2"], lambda s: s.prefill_pipeline_parallel_size),
    "dpp": (["--ppp", "2", "--dpp", "2"], lambda s: s.decode_pipeline_parallel_size),
    "multi_node_backend": (["--multi-node-backend", "mp"], lambda s: s.multi_node_backend),
    "model": (["--model", "/models/other"], lambda s: s.model),
    "served_model_name": (["--served-model-name", "x"], lambda s: s.served_model_name),
    "dtype": (["--dtype", "float16"], lambda s: s.dtype),
    "proxy_port": (["--proxy-port", "9001"], lambda s: s.ports.proxy),
    "routing": (["--routing", "load"], lambda s: s.routing),
    "kv_connector": (["--kv-connector", "nixl"], lambda s: s.kv_connector),
    "cluster_launcher": (["--cluster-launcher", "yr", "--runtime", "host"], lambda s: s.cluster_launcher),
    "env_pairs": (["--env", "A=1"], lambda s: s.env),
    "env_path": (["--env-path", "/opt/prepared"], lambda s: s.env_path),
    "ssh_config": (["--ssh-config", "ssh.conf"], lambda s: s.ssh.config_file),
    "identity": (["-i", "flag.key"], lambda s: s.ssh.identity),
    "known_hosts": (["--known-hosts", "known"], lambda s: s.ssh.known_hosts),
    "accept_new_host_keys": (["--accept-new-host-keys"], lambda s: s.ssh.accept_new_host_keys),
}


@pytest.mark.parametrize("name", sorted(EACH_FLAG))
def test_each_spec_flag_changes_the_field_it_sets(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)  # no ./yrpd.yaml, and the files the spec checks exist
    (tmp_path / "flag.key").write_text("")
    (tmp_path / "ssh.conf").write_text("")
    argv, read = EACH_FLAG[name]
    for command in (deploy, plan_command):
        given = spec_from_flags(command.make_context(command.name, [*BASE, *argv]).params)
        # the control: the same command without the flag
        alone = spec_from_flags(command.make_context(command.name, list(BASE)).params)
        assert read(given) != read(alone), (command.name, argv)


def test_every_spec_flag_has_its_check_and_no_other_option_shares_a_fields_name():
    spec_flags = {p.name for p in click.command()(spec_options(lambda **_: 0)).params}
    assert spec_flags - {"config_file"} == set(EACH_FLAG)  # a new flag gets a row above
    fields = set(DeploySpec.model_fields)
    for command in (deploy, plan_command):
        others = {p.name for p in command.params} - spec_flags
        assert others and not others & fields, command.name  # a command's own option never lands in the spec


def test_an_env_flag_that_is_not_key_value_is_refused_naming_the_flag():
    with pytest.raises(SpecError, match=r"^--env: 'A' is not KEY=VALUE; write --env NAME=value$"):
        spec_from_flags(deploy.make_context("deploy", ["--hosts", "h1", "--env", "A"]).params)
    assert spec_from_flags(deploy.make_context("deploy", ["--hosts", "h1", "--env", "A=", "--model", "/m"]).params
                           ).env == {"A": ""}  # the control: an empty value is a value
