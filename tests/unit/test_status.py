"""yrpd/status.py: one query per host, judged into a StatusReport (scripted hosts: no sshd, no root)."""

from __future__ import annotations

import json
import subprocess
import time

from yrpd import api
from yrpd.render import status_verdict
from yrpd.session import SessionPhase

from yrpd.testing import ScriptedHosts

from tests.unit.sessions import answer, recorded, scripted


def test_a_healthy_deployment_reports_every_part(tmp_path):
    deployment = recorded(tmp_path)
    with scripted() as hosts:
        report = api.status(deployment)
    assert report.healthy and report.problems == [] and report.warnings == []
    assert report.phase is SessionPhase.deployed
    assert [(h.name, h.role, h.healthy, h.session_pids) for h in report.hosts] == \
        [("h1", "master", True, 2), ("h2", "worker", True, 1)]
    decode = next(i for i in report.instances if i.role == "decode")
    assert (decode.host, decode.state, decode.healthy, decode.probe["prompt_tokens_loaded"]) == ("h2", "running", True, 256)
    assert report.proxy.healthy and report.proxy.in_flight == 1 and report.proxy.instances_up["http://10.0.0.2:8100"]
    assert decode.routed == {"requests": 6, "in_flight": 0, "errors": None, "prefix_routed": 0}
    prefill = next(i for i in report.instances if i.role == "prefill")
    assert prefill.routed["ms_per_chunk"] == 28.4  # prefix routing's measured time, where the proxy has one
    assert report.proxy.routing["load_ms_per_chunk"] == 6.5  # and that of a load from the data system
    assert report.cluster.healthy and report.cluster.mode == "ds_only" and report.cluster.master == "h1 (10.0.0.1)"
    assert {c.component for c in report.cluster.components} == {"etcd", "ds_master", "ds_worker"}
    # one round trip per host, and the cluster asked because the journal says it was started
    assert len(hosts.calls) == 2 and all(hosts.ran(h, "yr_cluster") for h in ("h1", "h2"))


def test_json_is_the_report_with_probe_fields_on_the_instance(tmp_path):
    with scripted():
        data = api.status(recorded(tmp_path)).to_json()
    assert data["phase"] == "deployed" and data["healthy"] is True
    decode = next(i for i in data["instances"] if i["name"] == "decode-0")
    assert decode["prompt_tokens_loaded"] == 256 and decode["connector"]["loaded_blocks"] == 2
    assert "probe" not in decode and "error" not in decode
    assert "error" not in data["hosts"][0] and data["hosts"][0]["facts"]["hostname"] == "h1"
    json.dumps(data)  # serialisable as is


def test_handed_over_kv_that_decode_computed_again_is_a_warning_naming_the_fix_not_a_problem(tmp_path):
    deployment = recorded(tmp_path)
    with scripted(h2={"missed": 12}):
        report = api.status(deployment)
    assert report.healthy and report.problems == []
    [warning] = report.warnings
    assert warning.startswith("decode-0 computed 12 KV block(s) again that prefill had handed over")
    assert f"datasystem_memory_mb, {deployment.spec.datasystem_memory_mb} MB a host now" in warning
    assert "datasystem_spill_mb" in warning  # no disk tier yet: the other fix
    assert status_verdict(report).splitlines()[1] == f"[yellow]warning[/yellow]: {warning}"
    assert report.to_json()["warnings"] == [warning]


def prefill_counters(**counters) -> ScriptedHosts:
    """The hosts of `scripted()`, prefill-0's connector (on h1) reporting these counters as well."""
    hosts = ScriptedHosts()
    for host in ("h1", "h2"):
        data = json.loads(answer(host))
        for inst in data["serving"]["instances"]:
            if inst["name"] == "prefill-0":
                inst["connector"]["counters"].update(counters)
        hosts.on("serving_status", stdout=json.dumps(data), host=host)
    return hosts


def test_failed_saves_of_prefill_are_a_warning_naming_the_data_systems_full_memory_when_that_is_why(tmp_path):
    """The data system's worker on h1 took prefill's blocks and evicted them at once (its memory full of entries it
    may not evict), or refused them: the connector counts them failed, with that reason, and status says so."""
    deployment = recorded(tmp_path)
    with prefill_counters(save_failed_blocks=48, save_failed_memory_full_blocks=48):
        report = api.status(deployment)
    assert report.healthy and report.problems == []  # it serves, computing those prompts again
    [warning] = report.warnings
    assert warning.startswith("prefill-0 failed to save 48 KV block(s) to the data system, 48 of them because the "
                              "data system on h1 had no room for them (200 of 256 MB of memory in use now: ")
    assert "its memory is full of entries it may not evict" in warning
    assert "decode computes those prompts again" in warning
    assert f"datasystem_memory_mb, {deployment.spec.datasystem_memory_mb} MB a host now" in warning
    assert "datasystem_spill_mb" in warning  # no disk tier yet: the other fix
    assert status_verdict(report).splitlines()[1] == f"[yellow]warning[/yellow]: {warning}"
    prefill = next(i for i in report.instances if i.name == "prefill-0")
    assert prefill.connector["save_failed_blocks"] == 48  # in `yrpd status --json` as well
    # failed for another reason (the data system out of reach, a refusal that is not for memory): the log says why
    with prefill_counters(save_failed_blocks=3, save_failed_memory_full_blocks=0):
        [warning] = api.status(deployment).warnings
    assert warning == ("prefill-0 failed to save 3 KV block(s) to the data system (it was out of reach or refused "
                       "them; `yrpd logs prefill-0` says why): decode computes those prompts again")
    # the control: the same counters with nothing failed
    with prefill_counters(save_failed_blocks=0, save_failed_memory_full_blocks=0):
        assert api.status(deployment).warnings == []


def test_a_disk_tier_whose_filesystem_is_full_is_a_warning_naming_the_host_and_the_fix(tmp_path):
    deployment = recorded(tmp_path)
    # h1's worker may spill 724 MB more (1 GiB limit, 300 MB used) but its filesystem has 1 MiB left; h2's has room
    with scripted(h1={"disk_free": 1 << 20}, h2={"disk_free": 50 << 30}):
        report = api.status(deployment)
    assert report.healthy and report.problems == []
    [warning] = report.warnings
    assert warning.startswith("ds_worker on h1: the disk tier's filesystem") and "1024 KiB free" in warning
    assert "724 MB more" in warning and "lower datasystem_spill_mb" in warning
    with scripted(h1={"disk_free": 2 << 30}, h2={"disk_free": 50 << 30}):  # control: room on both
        assert api.status(deployment).warnings == []


def test_a_dead_instance_an_unanswering_one_and_an_unreachable_host_are_each_one_problem(tmp_path):
    deployment = recorded(tmp_path)
    with scripted(h1={"dead": ("prefill-0",), "proxy_ok": False}) as hosts:
        hosts.unreachable("h2")
        report = api.status(deployment)
    assert not report.healthy
    assert "prefill-0 on h1 is not running" in report.problems
    assert "h2 unreachable" in report.problems
    assert any(p.startswith("proxy at ") and "not healthy" in p for p in report.problems)
    prefill = next(i for i in report.instances if i.name == "prefill-0")
    assert prefill.state == "dead" and not prefill.healthy
    decode = next(i for i in report.instances if i.name == "decode-0")
    assert decode.state == "not deployed"  # nothing known about h2
    assert report.hosts[1].error and not report.hosts[1].reachable


def test_pd_degraded_is_a_problem_saying_since_when_and_who_answers_and_the_proxy_row_says_so(tmp_path):
    deployment = recorded(tmp_path)
    since = time.time() - 42
    degraded = {"since": since, "missing": ["decode"],
                "message": "no decode instance is up: prefill instances answer whole requests (generating the answer)"}
    with scripted(h1={"degraded": degraded}, h2={"dead": ("decode-0",)}):
        report = api.status(deployment)
    [line] = [p for p in report.problems if p.startswith("serving degraded")]
    assert f"since {time.strftime('%H:%M:%S', time.localtime(since))} (4" in line
    assert line.endswith("no decode instance is up: prefill instances answer whole requests (generating the answer)")
    shown = render_text(report)
    assert "degraded: no decode" in shown and "carried over" in shown
    # the control: the same hosts with PD serving say nothing of it
    with scripted(h2={"dead": ("decode-0",)}):
        assert not any(p.startswith("serving degraded") for p in api.status(deployment).problems)


def render_text(report) -> str:
    import io

    from rich.console import Console

    from yrpd.render import status_tables
    console = Console(width=250, record=True, file=io.StringIO())
    for table in status_tables(report):
        console.print(table)
    return console.export_text()


def test_a_cluster_component_that_was_restarted_and_is_back_is_healthy_with_its_restarts_shown(tmp_path):
    """openYuanrong's daemon restarts what dies: a restart count is information, not illness."""
    with scripted(h2={"restarts": 3}):
        report = api.status(recorded(tmp_path))
    assert report.healthy and report.cluster.healthy
    assert next(c for c in report.cluster.components if c.host == "h2").restarts == 3


def test_a_supervised_instance_being_restarted_and_one_given_up_are_reported_as_such(tmp_path):
    with scripted(h1={"restarting": ("prefill-0",)}, h2={"failed": ("decode-0",)}):
        report = api.status(recorded(tmp_path))
    states = {i.name: (i.state, i.restarts, i.healthy) for i in report.instances}
    assert states == {"prefill-0": ("restarting", 1, False), "decode-0": ("failed", 3, False)}
    assert "prefill-0 on h1 is restarting (restart 1; killed by signal 9)" in report.problems
    failed = next(p for p in report.problems if p.startswith("decode-0"))
    assert "failed: exited with status 1 after 3 restarts" in failed and "`yrpd logs decode-0`" in failed
    assert "its log ends: OSError: decode-0: no model at /models/x" in failed


def test_restarts_of_a_running_instance_are_shown_not_counted_as_a_problem(tmp_path):
    with scripted(h1={"process_restarts": 2}):
        report = api.status(recorded(tmp_path))
    assert report.healthy
    assert next(i for i in report.instances if i.name == "prefill-0").restarts == 2
    assert report.proxy.restarts == 2


def test_an_instance_a_change_left_half_way_shows_its_state_and_a_failed_start_is_a_problem(tmp_path):
    deployment = recorded(tmp_path)
    deployment.session.set_state(instances={"decode-0": "draining"})
    with scripted():
        report = api.status(deployment)
    assert report.healthy and {i.name: i.life for i in report.instances} == {"prefill-0": "serving",
                                                                             "decode-0": "draining"}
    assert "(draining)" in status_table_text(report) and "(serving)" not in status_table_text(report)
    deployment.session.set_state(instances={"decode-0": "failed"})
    with scripted():
        report = api.status(deployment)
    assert report.problems == ["decode-0's start failed in a change that stopped half-way; run the same command "
                               "again to go on with the change"]
    assert report.to_json()["instances"][1]["life"] == "failed"


def status_table_text(report) -> str:
    from rich.console import Console

    from yrpd.render import status_tables

    console = Console(width=300, record=True)
    for table in status_tables(report):
        console.print(table)
    return console.export_text()


def test_an_instance_that_does_not_answer(tmp_path):
    with scripted(h2={"unhealthy": ("decode-0",)}):
        report = api.status(recorded(tmp_path))
    assert report.problems == ["decode-0 on h2 does not answer /health (connection refused)"]


def test_an_instance_whose_connector_cannot_reach_the_data_system_is_a_problem_until_it_reconnects(tmp_path):
    """Its /health answers, but every prompt is computed: status is not healthy while the connector says so (a
    worker that came back serves hand-overs only once the connector has reconnected)."""
    with scripted(h2={"ds_unreached": ("decode-0",)}):
        report = api.status(recorded(tmp_path / "a"))
    assert not report.healthy
    assert report.problems == ["decode-0's KV connector on h2 cannot reach the data system (it computes every "
                               "prompt meanwhile; `yrpd logs decode-0` says why)"]
    with scripted():  # control: the same deployment with the connector connected
        assert api.status(recorded(tmp_path / "b")).healthy


def test_a_failed_session_says_how_to_resume_and_a_down_one_expects_nothing(tmp_path):
    with scripted():
        failed = api.status(recorded(tmp_path / "a", SessionPhase.failed))
    assert failed.problems[0] == "session is failed (run yrpd deploy to resume)"
    with scripted(h1={"dead": ("prefill-0", "proxy")}, h2={"dead": ("decode-0",)}):
        down = api.status(recorded(tmp_path / "b", SessionPhase.down))
    assert down.problems == ["session is down"]  # dead processes are what down means


def test_without_a_started_cluster_it_is_not_asked(tmp_path):
    with scripted(h1={"cluster": False}, h2={"cluster": False}) as hosts:
        report = api.status(recorded(tmp_path, cluster_started=False))
    assert report.cluster is None and report.healthy
    assert not hosts.ran("h1", "yr_cluster")


def test_query_parts_run_in_one_interpreter_each_as_its_own_main_and_a_failed_part_is_named(monkeypatch):
    """The host side of the status query (python3 here): each part's last JSON line, keyed; a failing part fails it."""
    import yrpd.steps
    from yrpd.steps import ScriptCall, host_python_parts

    sources = {
        "a.py": "import json, sys\nprint('starting')\nprint(json.dumps({'a': json.loads(sys.argv[1])['n']}))\n",
        # a part's module-level names never leak into the next part
        "b.py": "assert 'json' not in globals()\nif __name__ == '__main__':\n    print('{\"b\": 2}')\n",
        "exits.py": "print('{\"e\": 3}')\nimport sys\nprint('it broke', file=sys.stderr)\nsys.exit(4)\n",
        "raises.py": "raise RuntimeError('no such thing')\n",
    }
    monkeypatch.setattr(yrpd.steps, "deploy_script", sources.__getitem__)

    def run(**parts: str) -> subprocess.CompletedProcess:
        cmd = host_python_parts({k: ScriptCall(v, {"n": 1}, timeout=1) for k, v in parts.items()})
        assert cmd.timeout == len(parts)
        return subprocess.run(["bash", "-c", cmd.script], capture_output=True, text=True)

    ok = run(processes="a.py", serving="b.py")
    assert ok.returncode == 0 and json.loads(ok.stdout) == {"processes": {"a": 1}, "serving": {"b": 2}}
    failed = run(processes="a.py", serving="exits.py", cluster="raises.py")
    assert failed.returncode == 1 and json.loads(failed.stdout) == {"processes": {"a": 1}, "serving": None,
                                                                    "cluster": None}
    assert "it broke" in failed.stderr and "RuntimeError: no such thing" in failed.stderr
    assert 'File "deploy_scripts/raises.py", line 1' in failed.stderr  # the part's own traceback
    assert failed.stderr.strip().endswith("status query: the serving, cluster part failed")


def test_an_instance_whose_cache_the_proxy_cannot_see_is_named_with_why_and_the_deployment_stays_healthy(tmp_path):
    deployment = recorded(tmp_path)
    blind = {"sight": "blind", "blocks": 12, "why": "the instance is down", "gaps": 1}
    with scripted(h1={"kv_index": blind}) as hosts:
        report = api.status(deployment)
    prefill = next(i for i in report.instances if i.role == "prefill")
    assert prefill.routed["kv_index"] == blind and report.healthy
    assert any(w.startswith("prefill-0: the proxy cannot see its prefix cache exactly (the instance is down)")
               for w in report.warnings), report.warnings
    # the control: seen, nothing said
    with scripted(h1={"kv_index": {**blind, "sight": "seeing"}}) as hosts:
        report = api.status(deployment)
    assert not any("prefix cache" in w for w in report.warnings), report.warnings


def test_dead_in_names_instances_whose_process_neither_runs_nor_is_restarted_and_trusts_no_silence():
    """What the reconciler of a live change starts again (yrpd.status.dead_instances), from the hosts' answers."""
    from yrpd.hostgroup import CONTAINER_DOWN, HostResult
    from yrpd.status import dead_in

    from tests.unit.sessions import processes_answer

    def said(host, names, **faults):
        return HostResult(host, "q", 0, json.dumps({"processes": processes_answer(host, names, **faults)}))

    launches = {"prefill-0": [("h1", "prefill-0")], "decode-0": [("h2", "decode-0")],
                "decode-1": [("h2", "decode-1"), ("h1", "decode-1-dp1")]}  # decode-1's DP ranks span h2 and h1
    every = {"h1": ["prefill-0", "decode-1-dp1"], "h2": ["decode-0", "decode-1"]}
    calm = {h: said(h, n) for h, n in every.items()}
    assert dead_in(launches, calm) == frozenset()  # the control: all running
    # being restarted by its supervisor is not dead; given up (failed) and gone (dead) are
    assert dead_in(launches, {**calm, "h2": said("h2", every["h2"], restarting=("decode-0",))}) == frozenset()
    assert dead_in(launches, {**calm, "h2": said("h2", every["h2"], failed=("decode-0",))}) == {"decode-0"}
    assert dead_in(launches, {**calm, "h1": said("h1", every["h1"], dead=("decode-1-dp1",))}) == {"decode-1"}
    # a host rebuilt: its processes are not even listed
    assert dead_in(launches, {**calm, "h2": said("h2", [])}) == {"decode-0", "decode-1"}
    # its container gone: nothing of the session runs there
    gone = HostResult("h1", "q", CONTAINER_DOWN, "", "container yrpd-x is not running on h1 (deploy creates it: run "
                      "the same yrpd deploy again)")
    assert dead_in(launches, {**calm, "h1": gone}) == {"prefill-0", "decode-1"}
    # a host that does not answer, or whose query failed, says nothing
    assert dead_in(launches, {**calm, "h2": HostResult("h2", "q", None, error="ssh to h2 failed")}) == frozenset()
    assert dead_in(launches, {**calm, "h2": HostResult("h2", "q", 1, "", "status query: the processes part failed")}) \
        == frozenset()


def connector_of(kv_stats: str, names: tuple[str, ...], session_dir: str) -> dict:
    """Each instance's connector part of deploy_scripts/serving_status.py's answer, run as yrpd runs it on a host
    (`kv_stats`: the stats files' template, `{name}` the instance)."""
    from yrpd.assets import asset_dir

    args = {"dir": session_dir, "proxy": None, "kv_stats": kv_stats,
            "instances": [{"name": n, "url": "http://127.0.0.1:9"} for n in names]}
    out = json.loads(subprocess.run(["python3", str(asset_dir("deploy_scripts") / "serving_status.py"),
                                     json.dumps(args)], capture_output=True, text=True, check=True, timeout=60).stdout)
    return {i["name"]: i["connector"] for i in out["instances"]}


def test_the_host_probe_sums_each_instances_connector_counters_and_its_time_by_kind_over_its_stats_files(tmp_path):
    """deploy_scripts/serving_status.py as yrpd runs it on a host: the scheduler's and the worker's stats files of
    one instance add up, counters and the milliseconds each kind of work took (what `yrpd bench` reports of a
    store's own cost); an instance with no stats file has none."""
    for side, saved, stage in (("scheduler", 0, None), ("worker", 40, 12.5)):
        doc = {"schema": "yrpd.connector.stats/1", "side": side, "ds_healthy": True,
               "counters": {"saved_blocks": saved, "save_skipped_recent_blocks": 7 if side == "scheduler" else 0},
               "latency_ms": {"lookup": {"count": 3, "total": 4.25 if side == "scheduler" else 0.0}}}
        if stage is not None:
            doc["latency_ms"]["stage"] = {"count": 9, "total": stage}
        (tmp_path / f"p0-{side}.json").write_text(json.dumps(doc))
    by_name = connector_of(str(tmp_path / "{name}-*.json"), ("p0", "p1"), str(tmp_path))
    assert by_name["p0"]["counters"] == {"saved_blocks": 40, "save_skipped_recent_blocks": 7, "lookup_ms": 4.25,
                                         "stage_ms": 12.5}
    assert by_name["p0"]["files"] == 2 and by_name["p1"] == {"counters": {}, "ds_healthy": None, "files": 0}


def test_the_host_probe_counts_every_dp_engine_and_the_stats_files_named_before_dp(tmp_path):
    """An instance of two DP engines on the host writes a stats file per engine (yrpd.layout's names): status sums
    both; a session deployed before the engine was in the name keeps its connectors' files, which still count while
    their writer runs. A file whose writer is gone (an engine dropped by a smaller dp, an old name beside the new)
    counts for nothing."""
    import os
    from pathlib import Path

    from yrpd.layout import HostSessionLayout

    gone = subprocess.Popen(["true"])
    gone.wait()
    layout = HostSessionLayout(str(tmp_path), "s")
    run = Path(layout.run_dir)
    run.mkdir(parents=True)
    for dp, saved, pid in ((0, 3, os.getpid()), (1, 4, os.getpid()), (2, 100, gone.pid)):
        Path(layout.kv_stats("d0").format(side="worker", dp=dp, rank=0)).write_text(json.dumps(
            {"pid": pid, "side": "worker", "dp": dp, "counters": {"saved_blocks": saved}}))
    (run / "kv-d1-worker-rank0.json").write_text(json.dumps(
        {"pid": os.getpid(), "side": "worker", "counters": {"saved_blocks": 5}}))
    by_name = connector_of(layout.for_scripts()["kv_stats"], ("d0", "d1", "d2"), layout.dir)
    assert (by_name["d0"]["counters"], by_name["d0"]["files"]) == ({"saved_blocks": 7}, 2)
    assert (by_name["d1"]["counters"], by_name["d1"]["files"]) == ({"saved_blocks": 5}, 1)
    assert by_name["d2"]["files"] == 0  # the control: an instance with no file of its own counts none of theirs
