"""The playbook runner's skip rule, on the local host: a step is skipped on a host whose check says it is done,
and without any command at all where the check says the step is not needed there (with the reason it gives)."""

from pathlib import Path

from yrpd.hostgroup import Command, Host, HostGroup
from yrpd.playbook import Playbook, PlaybookRunner
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
