"""Playbooks: ordered steps read from YAML, run host-parallel, skipped where their check says done.

A step runs on `all` hosts, the `master`, or the `workers` (every host but the master), in parallel. On each
host the step's check runs first (exit 0 = already done: skip), in the same round trip as the step itself
(`checked_command`). Every host's outcome goes into the session journal. The first step that fails on any host
stops the playbook with one error listing each failed host; a re-run resumes, because finished steps
are skipped by their checks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from yrpd.errors import SpecError
from yrpd.hostgroup import CheckedCommand, Command, GroupFailure, GroupResult, HostGroup, HostResult
from yrpd.placement import HostPlan
from yrpd.session import Session
from yrpd.steps import NotNeeded, StepContext, resolve


class StepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    hosts: Literal["all", "master", "workers"] = "all"
    run: str
    check: str | None = None
    args: dict[str, Any] = Field(default_factory=dict, alias="with")
    when: str | None = None  # an option name (e.g. purge): the step runs only when it is set

    @property
    def id(self) -> str:
        return self.run

    @property
    def function(self):
        """The step function this step runs: steps are told apart by it, not by how the YAML spells `run`."""
        return resolve(self.run)


class Playbook(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    steps: list[StepSpec]


def load_playbook(path: Path) -> Playbook:
    if not path.is_file():
        raise SpecError("--playbook", f"{path} does not exist", "pass the path of a playbook YAML file")
    try:
        playbook = Playbook.model_validate(yaml.safe_load(path.read_text()))
    except yaml.YAMLError as exc:
        raise SpecError("--playbook", f"{path} is not valid YAML: {getattr(exc, 'problem', exc)}", "fix its syntax") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(map(str, err["loc"]))
        raise SpecError("--playbook", f"{path}: {where}: {err['msg']}", "see playbooks/deploy.yaml for the format") from None
    for step in playbook.steps:
        for ref in filter(None, (step.run, step.check)):
            try:
                resolve(ref)
            except (ValueError, ImportError) as exc:
                raise SpecError("--playbook", f"{path}: step {step.name!r}: {exc}", "name a function in yrpd/steps") from None
    return playbook


def step_hosts(step: StepSpec, ctx: StepContext) -> list[HostPlan]:
    if step.hosts == "master":
        return [h for h in ctx.plan.hosts if h.is_master]
    if step.hosts == "workers":
        return [h for h in ctx.plan.hosts if not h.is_master]
    return list(ctx.plan.hosts)


def step_enabled(step: StepSpec, ctx: StepContext) -> bool:
    return step.when is None or bool(ctx.options.get(step.when))


def step_actions(step: StepSpec, ctx: StepContext) -> dict[str, Command | NotNeeded]:
    """Per host of the step: the command it runs there, or why it has nothing to do there."""
    func = resolve(step.run)
    actions: dict[str, Command | NotNeeded] = {}
    for host in step_hosts(step, ctx):
        action = func(ctx, host, **step.args)
        actions[host.name] = NotNeeded("nothing to do") if action is None else action
    return actions


def step_commands(step: StepSpec, ctx: StepContext) -> dict[str, Command]:
    return {n: a for n, a in step_actions(step, ctx).items() if isinstance(a, Command)}


@dataclass(frozen=True)
class PlannedStep:
    """A step as a deploy would run it: per host, its command or why it has nothing to do there."""

    step: StepSpec
    actions: dict[str, Command | NotNeeded]


def describe(playbook: Playbook, ctx: StepContext) -> list[PlannedStep]:
    """The commands each step would run per host (or why not), for `yrpd plan` and `deploy --dry-run`."""
    return [PlannedStep(step, step_actions(step, ctx)) for step in playbook.steps if step_enabled(step, ctx)]


class PlaybookFailed(GroupFailure):
    """One or more steps failed; carries every host's outcome across the steps that ran."""


class StepFailed(PlaybookFailed):
    def __init__(self, step: StepSpec, results: dict[str, HostResult]):
        self.step = step
        super().__init__(f"step '{step.name}'", results)


@dataclass
class StepOutcome:
    step: StepSpec
    ran: list[str]
    skipped: list[str]  # the check found it done
    results: GroupResult
    seconds: float
    not_needed: dict[str, str] = field(default_factory=dict)  # host -> why the step has nothing to do there


Reporter = Callable[[str, StepSpec, dict], None]


class PlaybookRunner:
    def __init__(self, group: HostGroup, ctx: StepContext, session: Session | None = None,
                 report: Reporter | None = None):
        self.group = group
        self.ctx = ctx
        self.session = session
        self.report = report or (lambda event, step, info: None)

    def run(self, playbook: Playbook, keep_going: bool = False) -> list[StepOutcome]:
        """Run every enabled step; raise StepFailed at the first failing one.

        With keep_going (teardown), a host that failed a step is left out of the later steps while the
        other hosts carry on, so one dead host never keeps the rest running; the failure raised at the
        end covers every host that took part."""
        outcomes = []
        failed_steps: list[StepSpec] = []
        failed_hosts: set[str] = set()
        for step in playbook.steps:
            if not step_enabled(step, self.ctx):
                continue
            outcome = self.run_step(step, exclude=failed_hosts)
            outcomes.append(outcome)
            if not outcome.results.ok:
                if not keep_going:
                    raise StepFailed(step, dict(outcome.results))
                failed_steps.append(step)
                failed_hosts |= {n for n, r in outcome.results.items() if not r.ok}
        if failed_steps:
            raise _merge(failed_steps, outcomes)
        return outcomes

    def run_step(self, step: StepSpec, exclude: set[str] = frozenset()) -> StepOutcome:
        started = time.monotonic()
        hosts = [h for h in step_hosts(step, self.ctx) if h.name not in exclude]
        group = self.group.subset(h.name for h in hosts)
        self.report("start", step, {"hosts": [h.name for h in hosts]})
        actions = step_actions(step, self.ctx)
        names = {h.name for h in hosts}
        not_needed = {n: a.reason for n, a in actions.items() if isinstance(a, NotNeeded) and n in names}
        commands = {n: a for n, a in actions.items() if isinstance(a, Command) and n in names}
        checks: dict[str, Command] = {}
        if step.check:
            check = resolve(step.check)
            by_name = {h.name: h for h in hosts}
            for name in list(commands):
                wanted = check(self.ctx, by_name[name], **step.args)
                if isinstance(wanted, Command):
                    checks[name] = wanted
                else:  # nothing to check there: the step has nothing to do there
                    not_needed[name] = wanted.reason if isinstance(wanted, NotNeeded) else "nothing to do"
                    del commands[name]
        # one round trip a host: the check, and the step where it fails. A step that copies files first keeps its
        # check apart (a resume would pay for the copies' size checks), as does one whose check runs elsewhere
        together = {n for n in checks if not commands[n].uploads and checks[n].on_host == commands[n].on_host}
        sent = {n: CheckedCommand.of(checks[n], c) if n in together else c for n, c in commands.items()}
        separate = {n: checks[n] for n in checks if n not in together}
        results = GroupResult()
        skipped: list[str] = []
        if separate:
            for name, result in group.subset(separate).run(separate).items():
                if result.ok:
                    skipped.append(name)
                elif not result.reachable:
                    results[name] = result  # unreachable: fail now, don't try the step
            sent = {n: c for n, c in sent.items() if n not in skipped and n not in results}
        for name, result in group.subset(sent).run(sent).items():
            if name in together and CheckedCommand.already_done(result):
                skipped.append(name)
            else:
                results[name] = result
        seconds = time.monotonic() - started
        for name in sorted(skipped):
            self._journal(step, name, "skipped", None)
        for name, reason in sorted(not_needed.items()):
            self._journal(step, name, "skipped", None, reason=reason)
        for name, result in sorted(results.items()):
            self._journal(step, name, "done" if result.ok else ("unreachable" if not result.reachable else "failed"), result)
        ran = sorted(n for n, r in results.items() if r.reachable)
        outcome = StepOutcome(step, ran, sorted(skipped), results, seconds, not_needed)
        self.report("end", step, {"outcome": outcome})
        return outcome

    def _journal(self, step: StepSpec, host: str, outcome: str, result: HostResult | None, **extra: Any) -> None:
        if self.session is None:
            return
        entry: dict[str, Any] = {"step": step.name, "run": step.run, "host": host, "outcome": outcome, **extra}
        if result is not None:
            entry.update(exit_code=result.exit_code, seconds=round(result.duration, 3))
            if not result.ok:
                entry["error"] = result.tail()
        self.session.journal(**entry)


def _merge(failed: list[StepSpec], outcomes: list[StepOutcome]) -> PlaybookFailed:
    merged: dict[str, HostResult] = {}
    for outcome in outcomes:
        for name, result in outcome.results.items():
            if name not in merged or not result.ok:
                merged[name] = result
    if len(failed) == 1:
        return StepFailed(failed[0], merged)
    return PlaybookFailed("steps " + ", ".join(f"'{s.name}'" for s in failed), merged)
