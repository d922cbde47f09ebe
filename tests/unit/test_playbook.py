"""The playbook runner's skip rule, on the local host: a step is skipped on a host whose check says it is done,
and without any command at all where the check says the step is not needed there (with the reason it gives)."""

from pathlib import Path

import pytest

from yrpd.hostgroup import Command, Host, HostGroup
from yrpd.playbook import Playbook, PlaybookRunner, StepFailed, StepStarted
from yrpd.steps import NotNeeded

CHECKED: list[str] = []


def touch(ctx, host, path: str, **_):
    return Command(f"touch {path}")


def exists_or_nothing(ctx, host, path: str, nothing: bool = False, **_):
    if nothing:
        return NotNeeded("runtime host")
    CHECKED.append(path)
    return Command(f"test -f {path}")


def _run(steps: list[dict]):
    from yrpd.deployment import inventory_from_json
    from yrpd.placement import make_plan
    from yrpd.spec import build_spec
    from yrpd.steps import StepContext

    spec = build_spec({}, {"hosts": "localhost", "device_kind": "cpu"})
    plan = make_plan(spec, inventory_from_json({"localhost": {"kind": "cpu", "devices": [0, 1], "ip": "127.0.0.1"}}))
    ctx = StepContext(spec=spec, plan=plan, session_id="s")
    playbook = Playbook.model_validate({"name": "t", "steps": steps})
    return PlaybookRunner(HostGroup([Host("localhost", "localhost", local=True)]), ctx).run(playbook)


def test_nothing_to_check_skips_without_a_command_and_a_failed_check_runs_the_step(tmp_path: Path):
    CHECKED.clear()
    here = __name__
    skipped, made = tmp_path / "skipped", tmp_path / "made"
    outcomes = _run([
        {"name": "nothing to check", "run": f"{here}.touch", "check": f"{here}.exists_or_nothing",
         "with": {"path": str(skipped), "nothing": True}},
        {"name": "checked, not done", "run": f"{here}.touch", "check": f"{here}.exists_or_nothing",
         "with": {"path": str(made)}},
    ])
    assert outcomes[0].not_needed == {"localhost": "runtime host"} and outcomes[0].skipped == []
    assert not outcomes[0].results and not skipped.exists()
    assert outcomes[1].skipped == [] and outcomes[1].results["localhost"].ok and made.exists()
    assert CHECKED == [str(made)]  # the first step's check produced no command to run


def slow_check(ctx, host, path: str, **_):
    return Command(f"sleep 30; test -f {path}", timeout=1)


def test_a_done_step_is_skipped_in_the_same_round_trip_and_a_hung_check_counts_as_not_done(tmp_path: Path):
    """Check and step go to the host as one command: a passing check reports the step done there without running
    it (its output dropped); a check that hangs is cut at its own timeout and the step runs."""
    here = __name__
    done, hung = tmp_path / "done", tmp_path / "hung"
    done.write_text("")
    outcomes = _run([
        {"name": "done before", "run": f"{here}.touch", "check": f"{here}.exists_or_nothing",
         "with": {"path": str(done)}},
        {"name": "check hangs", "run": f"{here}.touch", "check": f"{here}.slow_check", "with": {"path": str(hung)}},
    ])
    assert outcomes[0].skipped == ["localhost"] and outcomes[0].ran == [] and not outcomes[0].results
    assert outcomes[1].skipped == [] and outcomes[1].ran == ["localhost"] and hung.exists()
    assert outcomes[1].results["localhost"].command == f"touch {hung}"  # reports name the step, not the wrapper


def stamp(ctx, host, dir: str, step: str, slow_on: str = "", until: str = "", fail_on: str = "", **_):
    # the slow host waits for the other's stamp (at most 60 s), not a fixed time a loaded CI machine can outlast;
    # -s: the file exists, empty, before that python prints its time
    wait = f"for _ in $(seq 600); do [ -s {dir}/{until} ] && break; sleep 0.1; done; " if host.name == slow_on else ""
    fail = "exit 3; " if host.name == fail_on else ""
    return Command(f"{wait}{fail}python3 -c 'import time; print(time.time())' > {dir}/{step}-{host.name}")


def _run_two_hosts(steps: list[dict], names: tuple[str, ...] = ("h1", "h2")):
    from yrpd.deployment import inventory_from_json
    from yrpd.placement import make_plan
    from yrpd.spec import build_spec
    from yrpd.steps import StepContext

    spec = build_spec({}, {"hosts": ",".join(names), "device_kind": "cpu", "model": "builtin:tiny-qwen2"})
    plan = make_plan(spec, inventory_from_json({h: {"kind": "cpu", "devices": [0, 1], "ip": f"127.0.0.{i + 1}"}
                                                for i, h in enumerate(names)}))
    events: list[tuple[str, str]] = []
    runner = PlaybookRunner(HostGroup([Host(h, "localhost", local=True) for h in names]),
                            StepContext(spec=spec, plan=plan, session_id="s"),
                            report=lambda event: events.append(
                                ("start" if isinstance(event, StepStarted) else "end", event.step.name)))
    return runner, Playbook.model_validate({"name": "t", "steps": steps}), events


def test_per_host_steps_let_a_fast_host_go_on_and_are_reported_in_order(tmp_path: Path):
    """A chain of per_host steps: h2 does not wait for slow h1 between them; each step is reported once, in order;
    the step after the chain (a barrier) starts only when both hosts are through."""
    here = __name__
    steps = [{"name": n, "run": f"{here}.stamp", "per_host": n != "c",
              "with": {"dir": str(tmp_path), "step": n, "slow_on": "h1" if n == "a" else "", "until": "b-h2"}}
             for n in "abc"]
    runner, playbook, events = _run_two_hosts(steps)
    outcomes = runner.run(playbook)
    at = {f.name: float(f.read_text()) for f in tmp_path.iterdir()}
    assert at["b-h2"] < at["a-h1"]  # h2 finished b while h1 was still in a
    assert min(at["c-h1"], at["c-h2"]) > max(at["b-h1"], at["b-h2"])
    assert events == [(e, n) for n in "abc" for e in ("start", "end")]
    assert [o.step.name for o in outcomes] == list("abc") and all(o.ran == ["h1", "h2"] for o in outcomes)


def test_a_host_failing_in_a_chain_stops_there_while_the_other_finishes_it(tmp_path: Path):
    here = __name__
    steps = [{"name": n, "run": f"{here}.stamp", "per_host": n != "c",
              "with": {"dir": str(tmp_path), "step": n, "fail_on": "h1" if n == "a" else ""}} for n in "abc"]
    runner, playbook, events = _run_two_hosts(steps)
    with pytest.raises(StepFailed) as failed:
        runner.run(playbook)
    assert failed.value.step.name == "a" and set(failed.value.failed) == {"h1"}
    assert sorted(f.name for f in tmp_path.iterdir()) == ["a-h2", "b-h2"]  # h1 stopped at a, nobody reached c
    assert events == [("start", "a"), ("end", "a"), ("start", "b"), ("end", "b")]


def broken_on_h1(ctx, host, **_):
    if host.name == "h1":
        raise RuntimeError("step function bug on h1")
    return Command("true")


def test_a_step_function_raising_in_a_chain_is_raised_not_lost(tmp_path: Path):
    """Even when it raises in the chain's last step (no later step would notice a missing host)."""
    here = __name__
    steps = [{"name": "a", "run": f"{here}.stamp", "per_host": True, "with": {"dir": str(tmp_path), "step": "a"}},
             {"name": "b", "run": f"{here}.broken_on_h1", "per_host": True}]
    runner, playbook, _ = _run_two_hosts(steps)
    with pytest.raises(RuntimeError, match="bug on h1"):
        runner.run(playbook)


def test_hosts_failing_different_steps_of_a_chain_are_all_named(tmp_path: Path):
    here = __name__
    steps = [{"name": n, "run": f"{here}.stamp", "per_host": True,
              "with": {"dir": str(tmp_path), "step": n, "fail_on": {"a": "h1", "b": "h2"}[n]}} for n in "ab"]
    runner, playbook, _ = _run_two_hosts(steps)
    with pytest.raises(StepFailed) as failed:
        runner.run(playbook)
    assert failed.value.step.name == "a"  # where the resume starts
    assert set(failed.value.failed) == {"h1", "h2"}
    assert "'a' (on h1)" in str(failed.value) and "'b' (on h2)" in str(failed.value)


def test_a_chain_of_steps_with_no_host_reports_them_and_goes_on(tmp_path: Path):
    """`workers` steps on a one-host plan: nothing to run, and no error."""
    here = __name__
    steps = [{"name": n, "run": f"{here}.stamp", "per_host": True, "hosts": "workers",
              "with": {"dir": str(tmp_path), "step": n}} for n in "ab"]
    runner, playbook, events = _run_two_hosts(steps, names=("h1",))
    outcomes = runner.run(playbook)
    assert [o.step.name for o in outcomes] == ["a", "b"] and all(o.ran == [] for o in outcomes)
    assert not list(tmp_path.iterdir())


def test_a_step_whose_when_names_no_run_option_is_refused_and_a_known_one_runs_only_when_set(tmp_path: Path):
    with pytest.raises(ValueError, match="when: 'purg' is no run option; use one of .*purge"):
        Playbook.model_validate({"name": "t", "steps": [{"name": "x", "run": f"{__name__}.touch", "when": "purg"}]})
    made = tmp_path / "made"
    step = {"name": "x", "run": f"{__name__}.touch", "when": "purge", "with": {"path": str(made)}}
    assert _run([step]) == [] and not made.exists()  # purge not set: the step is left out
