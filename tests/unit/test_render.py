"""yrpd/render.py: what `yrpd status`, `yrpd plan` and the deploy/down progress lines show, as text a user reads.

Status reports are judged by yrpd.status.judge from the scripted answers of tests/unit/sessions.py; rich renders them
into a recording console, and the assertions read the text (and, where only colour tells, its styles)."""

from __future__ import annotations

import io
import json
import re

from rich.console import Console

from yrpd.exposure import exposure
from yrpd.hostgroup import GroupResult, HostResult
from yrpd.playbook import StepOutcome, StepSpec
from yrpd.render import outcome_line, plan_commands, plan_table, rates_table, status_tables, status_verdict, \
    warning_lines
from yrpd.session import SessionPhase
from yrpd.status import StatusReport, judge
from yrpd.steps import NotNeeded

from tests.unit.sessions import answer, recorded


def shown(*renderables, styles: bool = False) -> str:
    console = Console(record=True, width=200, file=io.StringIO(), color_system="standard" if styles else None)
    for item in renderables:
        console.print(item)
    return console.export_text(styles=styles)


def rows(text: str, *first: str) -> list[list[str]]:
    """The table rows (cells, stripped) whose leading cells are `first`."""
    found = []
    for line in text.splitlines():
        if line.startswith("│"):
            cells = [c.strip() for c in line.strip("│").split("│")]
            if cells[:len(first)] == list(first):
                found.append(cells)
    return found


def row(text: str, *first: str) -> list[str]:
    matches = rows(text, *first)
    assert len(matches) == 1, (first, text)
    return matches[0]


def report(tmp_path, phase: SessionPhase = SessionPhase.deployed, unreachable: dict[str, str] | None = None,
           failing: dict[str, str] | None = None, edit: dict | None = None, **faults) -> StatusReport:
    """judge() on h1's and h2's answers: `faults` per host as sessions.answer takes them; `unreachable` host ->
    its SSH error; `failing` host -> the stderr of a status query that exited 1; `edit` host -> a function that
    changes its parsed answer in place."""
    deployment = recorded(tmp_path, phase)
    results = {}
    for host in ("h1", "h2"):
        if host in (unreachable or {}):
            results[host] = HostResult(host, "status", None, error=unreachable[host])
        elif host in (failing or {}):
            results[host] = HostResult(host, "status", 1, stderr=failing[host])
        else:
            data = json.loads(answer(host, **faults.get(host, {})))
            (edit or {}).get(host, lambda a: None)(data)
            results[host] = HostResult(host, "status", 0, stdout=json.dumps(data))
    return judge(deployment, results, with_cluster=True)


# -- status -------------------------------------------------------------------------------------------

def test_a_healthy_deployment_shows_every_table_and_says_healthy(tmp_path):
    r = report(tmp_path)
    text = shown(*status_tables(r))
    assert f"Hosts (session {r.session}, deployed)" in text
    for title in ("Processes", "openYuanrong cluster (ds_only mode, master h1 (10.0.0.1), etcd", "Instances", "Proxy"):
        assert title in text
    assert row(text, "h1", "master")[2:] == ["yes", "0.50 0.40 0.30", "12.0", "present", "2/2 running"]
    assert row(text, "h2", "worker")[-1] == "1/1 running"
    decode = row(text, "decode-0")
    assert decode[1:3] == ["decode", "h2"] and decode[6] == "healthy" and decode[7] == "0"  # restarts
    assert decode[9:] == ["6 (0)", "2", "2", "256"]  # sent by the proxy (for its prefix), KV loaded / saved, hits
    assert row(text, "prefill-0")[9] == "7 (3)"
    proxy = row(text, "http://10.0.0.1:8000")
    assert proxy[1] == "h1" and proxy[3] == "healthy" and proxy[5] == "2/2"
    assert shown(status_verdict(r)).strip() == "healthy"


def test_failed_saves_are_shown_next_to_the_saved_blocks(tmp_path):
    def failed(data):
        data["serving"]["instances"][0]["connector"]["counters"]["save_failed_blocks"] = 48

    r = report(tmp_path, edit={"h1": failed})
    text = shown(*status_tables(r))
    assert row(text, "prefill-0")[11] == "2 (48 failed)"
    assert row(text, "decode-0")[11] == "2"  # nothing failed: the count alone


def test_an_instance_whose_ranks_span_hosts_shows_them_all(tmp_path):
    r = report(tmp_path)
    decode = next(i for i in r.instances if i.name == "decode-0")
    decode.hosts = ["h2", "h3"]
    assert row(shown(*status_tables(r)), "decode-0")[2] == "h2+h3"
    assert r.to_json()["instances"][1]["hosts"] == ["h2", "h3"]


def test_a_dead_instance_is_shown_dead_and_the_verdict_lists_it(tmp_path):
    r = report(tmp_path, h1={"dead": ("prefill-0",)})
    text = shown(*status_tables(r))
    assert row(text, "h1", "prefill-0")[3] == "dead"  # Processes
    assert row(text, "h1", "proxy")[3] == "running"
    assert row(text, "prefill-0")[6] == "dead"  # Instances: health
    assert row(text, "h1", "master")[-1] == "1/2 running"
    assert shown(status_verdict(r)).strip() == "unhealthy: prefill-0 on h1 is not running"


def test_an_unreachable_host_shows_its_error_and_nothing_made_up(tmp_path):
    error = "ssh to h2 failed: [Errno 113] No route to host"
    r = report(tmp_path, unreachable={"h2": error})
    text = shown(*status_tables(r))
    host = row(text, "h2", "worker")
    assert host[2] == f"no: {error}"
    assert host[3:] == ["-", "-", "-", "-"]  # no load, memory, session dir or processes claimed for it
    assert rows(text, "h2", "decode-0") == []  # no process row invented
    assert row(text, "decode-0")[5] == "-"  # no pid
    assert "h2 unreachable" in shown(status_verdict(r))


def test_an_error_with_brackets_is_shown_as_written_not_as_markup(tmp_path):
    error = "ssh to h2 failed: [bold]key[/bold] rejected"
    text = shown(*status_tables(report(tmp_path, unreachable={"h2": error})))
    assert f"no: {error}" in text


def test_a_failed_status_query_is_named_in_the_verdict(tmp_path):
    r = report(tmp_path, failing={"h2": "python3 not found (PATH /usr/bin); install python3 (3.8+)"})
    assert row(shown(*status_tables(r)), "h2", "worker")[-1] == "-"
    assert shown(status_verdict(r)).strip() == ("unhealthy: h2: status query failed (python3 not found (PATH "
                                                "/usr/bin); install python3 (3.8+))")  # with the host's reason


def test_supervised_processes_show_restarting_failed_and_their_restarts(tmp_path):
    r = report(tmp_path, h1={"restarting": ("prefill-0",), "process_restarts": 1}, h2={"failed": ("decode-0",)})
    text = shown(*status_tables(r))
    assert row(text, "h1", "prefill-0")[3:5] == ["restarting", "2"]  # Processes: state, restarts
    assert row(text, "h2", "decode-0")[3:5] == ["failed", "3"]
    assert row(text, "h1", "proxy")[3:5] == ["running", "1"]
    assert row(text, "prefill-0")[6:8] == ["restarting", "2"]  # Instances: health, restarts
    assert row(text, "decode-0")[6:8] == ["failed", "3"]
    # the failed one's log ends under the tables; the restarting one is on its way back and shows none
    tail = text.split("decode-0 on h2 (failed), last lines of its log:", 1)[1].splitlines()
    assert [line.strip() for line in tail[1:3]] == ["Traceback (most recent call last):",
                                                   "OSError: decode-0: no model at /models/x"]
    assert "prefill-0 on h1 (restarting)" not in text


def test_the_kv_cache_table_shows_each_workers_memory_disk_and_hits(tmp_path):
    text = shown(*status_tables(report(tmp_path)))
    assert row(text, "h1", "200 / 256") == ["h1", "200 / 256", "300 / 1,024", "42", "7/3/1", "2"]
    assert row(text, "h2", "10 / 256")[2] == "0 / 1,024"


def test_the_kv_cache_table_shows_the_proxys_index_of_each_worker_beside_its_own_counters(tmp_path):
    """Where the proxy follows the data system's events, each worker's row says how many blocks the proxy takes it to
    hold (those it infers spilled in brackets), keyed by the address its instances' URLs name; a blind one is said."""
    def followed(answer):
        answer["serving"]["proxy"]["status"]["kv_store_index"] = {"sight": "blind", "blocks": 1300, "workers": {
            "10.0.0.1": {"sight": "seeing", "blocks": 1200, "gaps": 0, "restarts": 0, "memory_blocks": 900,
                         "on_disk": 300},
            "10.0.0.2": {"sight": "blind", "blocks": 100, "gaps": 1, "restarts": 0, "why": "sequence gap",
                         "memory_blocks": 900, "on_disk": 0}}}

    text = shown(*status_tables(report(tmp_path, edit={"h1": followed})))
    assert row(text, "h1", "200 / 256")[6] == "1,200 (300)"
    assert row(text, "h2", "10 / 256")[6] == "blind, 100 (0)"

    def unheard(answer):  # h2's worker has published nothing yet: its zero is not a count
        followed(answer)
        answer["serving"]["proxy"]["status"]["kv_store_index"]["workers"]["10.0.0.2"] = {
            "sight": "never", "blocks": 0, "gaps": 0, "restarts": 0}

    assert row(shown(*status_tables(report(tmp_path, edit={"h1": unheard}))), "h2", "10 / 256")[6] == "no events yet"
    # the control: a proxy that does not follow the data system adds no column
    plain = shown(*status_tables(report(tmp_path)))
    assert "proxy's index" not in plain and len(row(plain, "h1", "200 / 256")) == 6


def test_a_process_whose_supervisor_was_killed_is_running_but_flagged(tmp_path):
    def orphan(answer):
        proc = next(p for p in answer["processes"]["processes"] if p["name"] == "decode-0")
        proc.update(state="unsupervised", supervisor=None)

    r = report(tmp_path, edit={"h2": orphan})
    assert row(shown(*status_tables(r)), "h2", "decode-0")[3] == "unsupervised"
    assert next(i for i in r.instances if i.name == "decode-0").healthy  # it serves
    assert r.problems == ["decode-0 on h2 runs without its supervisor (killed?): nothing restarts it if it dies; "
                          "`yrpd deploy` puts it under a new one (restarting it)"]


def test_cluster_components_show_their_restarts(tmp_path):
    text = shown(*status_tables(report(tmp_path, h2={"restarts": 3})))
    assert row(text, "h2", "ds_worker")[3:] == ["running", "3", "ds_worker up"]
    assert row(text, "h1", "ds_worker")[3:5] == ["running", "0"]
    components = [r[1] for r in rows(text, "h1") if r[1] in ("etcd", "ds_master", "ds_worker")]
    assert components == ["etcd", "ds_master", "ds_worker"]  # in the cluster table, in start order


def test_an_exited_cluster_component_is_shown_exited_in_red(tmp_path):
    r = report(tmp_path, edit={"h2": lambda a: a["cluster"]["components"]["ds_worker"].update(alive=False)})
    text = shown(*status_tables(r))
    assert row(text, "h2", "ds_worker")[3] == "exited"  # though yr still says RUNNING
    styled = shown(*status_tables(r), styles=True)
    h2_line = next(line for line in styled.splitlines() if re.search(r"h2\S*\s*│\s*\S*ds_worker", line))
    assert "\x1b[31mexited" in h2_line
    h1_line = next(line for line in styled.splitlines() if re.search(r"h1\S*\s*│\s*\S*ds_worker", line))
    assert "\x1b[32mrunning" in h1_line
    assert shown(status_verdict(r)).strip() == "unhealthy: ds_worker on h2 exited"


def test_the_proxy_row_counts_the_instances_it_sees_up(tmp_path):
    r = report(tmp_path, h1={"proxy_ok": False})
    proxy = row(shown(*status_tables(r)), "http://10.0.0.1:8000")
    assert proxy[3] == "unhealthy" and proxy[4] == "1" and proxy[5] == "1/2"
    assert shown(status_verdict(r)).strip() == "unhealthy: proxy at http://10.0.0.1:8000 is not healthy"


def test_the_verdict_lists_every_problem_once(tmp_path):
    r = report(tmp_path, unreachable={"h2": "ssh to h2 failed: timed out"},
               h1={"dead": ("prefill-0",), "proxy_ok": False})
    verdict = shown(status_verdict(r)).strip()
    assert verdict.startswith("unhealthy: ")
    assert verdict.removeprefix("unhealthy: ").split("; ") == [
        "prefill-0 on h1 is not running", "h2 unreachable", "proxy at http://10.0.0.1:8000 is not healthy"]


def test_a_failed_session_shows_its_phase_and_how_to_resume(tmp_path):
    r = report(tmp_path, SessionPhase.failed)
    assert f"Hosts (session {r.session}, failed)" in shown(*status_tables(r))
    assert shown(status_verdict(r)).strip() == "unhealthy: session is failed (run yrpd deploy to resume)"


# -- deploy and down progress lines -----------------------------------------------------------------------

STEP = StepSpec(name="create the session directory on every host", run="host_session.create")


def ok(host: str, stderr: str = "") -> HostResult:
    return HostResult(host, "cmd", 0, stderr=stderr, duration=0.2)


def outcome(ran=(), skipped=(), results=(), not_needed=None, seconds=1.25) -> StepOutcome:
    return StepOutcome(STEP, list(ran), list(skipped), GroupResult({r.host: r for r in results}), seconds,
                       dict(not_needed or {}))


def test_outcome_line_says_where_the_step_ran_was_already_done_or_was_not_needed():
    assert outcome_line(outcome(ran=["h1", "h2"], results=[ok("h1"), ok("h2")])) == "done on h1, h2 (1.2s)"
    line = outcome_line(outcome(ran=["h1"], skipped=["h2", "h3"], results=[ok("h1")], seconds=0.04))
    assert line == "done on h1; already done on h2, h3 (0.0s)"
    line = outcome_line(outcome(not_needed={"h2": "runtime host", "h1": "runtime host", "h3": "no instance here"}))
    assert line == "not needed on h3: no instance here; not needed on h1, h2: runtime host (1.2s)"
    assert outcome_line(outcome(seconds=0)) == "nothing to do (0.0s)"


def test_outcome_line_names_failed_hosts_in_red_and_unreachable_ones_too():
    failed = HostResult("h2", "cmd", 1, stderr="mkdir: Permission denied")
    down = HostResult("h3", "cmd", None, error="ssh to h3 failed")
    line = outcome_line(outcome(ran=["h1", "h2"], results=[ok("h1"), failed, down]))
    assert line == "done on h1; [red]failed on h2, h3[/red] (1.2s)"
    assert shown(line).strip() == "done on h1; failed on h2, h3 (1.2s)"


def test_warning_lines_come_only_from_hosts_where_the_step_succeeded():
    h1 = ok("h1", stderr="Collecting vllm\nwarning: vllm-ascend 0.24.0rc1 has no series; using 0.24.0\n"
                         "  warning: low disk: 3 GB free\nno warning: here\n")
    h2 = HostResult("h2", "cmd", 1, stderr="warning: this host failed anyway\n")
    lines = warning_lines(outcome(ran=["h1", "h2"], skipped=["h3"], results=[h1, h2]))
    assert lines == ["h1: warning: vllm-ascend 0.24.0rc1 has no series; using 0.24.0", "h1: warning: low disk: 3 GB free"]
    assert warning_lines(outcome(ran=["h1"], results=[ok("h1")])) == []


# -- plan -------------------------------------------------------------------------------------------------

def test_plan_table_shows_placement_hosts_and_how_the_dtype_was_chosen(tmp_path):
    deployment = recorded(tmp_path)
    text = shown(*plan_table(deployment.context(), exposure(deployment.spec, deployment.plan), []))
    assert "1 prefill x (dp 1, tp 1), 1 decode x (dp 1, tp 1); proxy on h1:8000" in text
    assert "dtype: float32 - set with --dtype" in text
    assert row(text, "h1", "prefill-0")[2:] == ["prefill", "0", "8100", "-", "61000-61015"]  # no DP rpc on one host
    assert row(text, "h2", "decode-0")[2] == "decode"
    assert row(text, "h1", "h1")[2:6] == ["master", "cpu", "0-3", "0"]  # CPU cores the host has, and those in use
    assert row(text, "h2", "h2")[2:] == ["worker", "cpu", "0-3", "0",
                                       "datasystem 31501, exporter 32700, kv_relay 32710, kv_relay_replay 32711"]
    assert "proxy 8000, etcd 32379" in row(text, "h1", "h1")[-1]


def test_plan_commands_show_each_hosts_command_or_why_it_has_none():
    from yrpd.hostgroup import Command
    from yrpd.playbook import PlannedStep

    steps = [PlannedStep(STEP, {"h1": Command("mkdir -p /tmp/x\nln -sfn a b"), "h2": NotNeeded("runtime host")}),
             PlannedStep(StepSpec(name="nothing", run="host_session.create"), {})]
    text = shown(*plan_commands(steps))
    assert "[1] create the session directory on every host" in text
    assert "    $ mkdir -p /tmp/x\n    $ ln -sfn a b" in text
    assert "  h2: not needed: runtime host" in text
    assert "[2] nothing\n    (nothing to do on any host)" in text


def test_the_verdict_names_a_change_under_way_the_drained_hosts_and_the_planners_last_decision(tmp_path):
    r = report(tmp_path)
    assert shown(status_verdict(r)).strip() == "healthy"  # the control: nothing of it recorded
    r.change, r.drained = "decode: 1 -> 2 instances", ["h2"]
    r.planner = {"action": "add", "role": "prefill", "reason": "TTFT p90 900 ms (target 500): one more prefill "
                 "instance", "at": "2026-11-26T12:00:00"}
    lines = shown(status_verdict(r)).strip().splitlines()
    assert lines[1:] == ["changing: decode: 1 -> 2 instances",
                         "drained (maintenance, no instances; `yrpd undrain HOST`): h2",
                         "planner (2026-11-26T12:00:00): add prefill: TTFT p90 900 ms (target 500): one more "
                         "prefill instance"]
    assert r.to_json()["drained"] == ["h2"] and r.to_json()["planner"]["action"] == "add"


def test_watch_shows_per_second_rates_between_two_looks_and_a_dash_where_a_counter_went_back(tmp_path):
    before, now = report(tmp_path / "a"), report(tmp_path / "b")
    for r, sent, loaded in ((before, 10, 1000), (now, 30, 5000)):
        for inst in r.instances:
            inst.routed = {"requests": sent, "errors": 0}
            inst.probe = {**inst.probe, "prompt_tokens_loaded": float(loaded)}
    restarted = now.instances[1]
    restarted.probe = {**restarted.probe, "prompt_tokens_loaded": 10.0}  # its counters began again
    text = shown(rates_table(before, now, 4.0))
    assert "Rates over the last 4.0 s" in text
    first = row(text, before.instances[0].name)
    assert first[1] == "5.0" and first[4] == "1000.0" and first[5] == "0.0"  # 20 requests, 4000 tokens in 4 s
    assert row(text, restarted.name)[4] == "-"
    assert row(shown(rates_table(before, now, 0)), restarted.name)[1] == "-"  # no time between them: no rate
