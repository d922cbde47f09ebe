"""Playbooks: ordered steps read from YAML, run host-parallel, skipped where their check says done.

A step runs on `all` hosts, the `master`, or the `workers` (every host but the master), in parallel. On each
host the step's check runs first (exit 0 = already done: skip), in the same round trip as the step itself
(`hostgroup.CheckedCommand`). Consecutive `per_host` steps form a chain each host runs at its own pace. Every
host's outcome goes into the session journal. The first step that fails on any host stops the playbook (a chain
once its other hosts are through it) with one error listing each failed host; a re-run resumes, because finished
steps are skipped by their checks.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from yrpd.assets import playbook_path
from yrpd.errors import SpecError
from yrpd.hostgroup import CheckedCommand, Command, GroupFailure, GroupResult, HostGroup, HostResult
from yrpd.placement import HostPlan
from yrpd.session import Session
from yrpd.steps import NotNeeded, RunOptions, StepContext, resolve


class StepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    hosts: Literal["all", "master", "workers"] = "all"
    run: str
    check: str | None = None
    args: dict[str, Any] = Field(default_factory=dict, alias="with")
    when: str | None = None  # a flag of RunOptions (e.g. purge): the step runs only when it is set
    #: on a host it needs only that host's earlier steps: a host goes on to it without waiting for the others
    per_host: bool = False

    @field_validator("when")
    @classmethod
    def _known_flag(cls, value: str | None) -> str | None:
        if value is not None and value not in RunOptions.flags():
            raise ValueError(f"when: {value!r} is no run option; use one of {', '.join(sorted(RunOptions.flags()))}")
        return value

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


def named_playbook(playbook_file: str | Path | None, default: str = "deploy") -> Playbook:
    """The playbook in `playbook_file`, or the built-in one named `default` (playbooks/NAME.yaml)."""
    return load_playbook(Path(playbook_file) if playbook_file else playbook_path(default))


def step_hosts(step: StepSpec, ctx: StepContext) -> list[HostPlan]:
    if step.hosts == "master":
        return [h for h in ctx.plan.hosts if h.is_master]
    if step.hosts == "workers":
        return [h for h in ctx.plan.hosts if not h.is_master]
    return list(ctx.plan.hosts)


def step_enabled(step: StepSpec, ctx: StepContext) -> bool:
    return step.when is None or bool(getattr(ctx.options, step.when))


def step_actions(step: StepSpec, ctx: StepContext,
                 hosts: list[HostPlan] | None = None) -> dict[str, Command | NotNeeded]:
    """Per host of the step (or of those given): the command it runs there, or why it has nothing to do there."""
    func = resolve(step.run)
    actions: dict[str, Command | NotNeeded] = {}
    for host in step_hosts(step, ctx) if hosts is None else hosts:
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


@dataclass(frozen=True)
class RoundTrips:
    """What a step sends each host: `sent` (its command, behind its check where `together`), `separate` (checks
    that go first, on their own), and `not_needed` (why a host gets nothing)."""

    sent: dict[str, Command]
    separate: dict[str, Command]
    together: set[str]
    not_needed: dict[str, str]


def round_trips(step: StepSpec, ctx: StepContext, hosts: list[HostPlan]) -> RoundTrips:
    names = {h.name for h in hosts}
    actions = step_actions(step, ctx, hosts)
    not_needed = {n: a.reason for n, a in actions.items() if isinstance(a, NotNeeded) and n in names}
    commands = {n: a for n, a in actions.items() if isinstance(a, Command) and n in names}
    checks: dict[str, Command] = {}
    if step.check:
        check = resolve(step.check)
        by_name = {h.name: h for h in hosts}
        for name in list(commands):
            wanted = check(ctx, by_name[name], **step.args)
            if isinstance(wanted, Command):
                checks[name] = wanted
            else:  # nothing to check there: the step has nothing to do there
                not_needed[name] = wanted.reason if isinstance(wanted, NotNeeded) else "nothing to do"
                del commands[name]
    # one round trip a host: the check, and the step where it fails. A step that copies files first keeps its
    # check apart (a resume would pay for the copies' size checks), as does one whose check runs elsewhere
    together = {n for n in checks if not commands[n].uploads and checks[n].on_host == commands[n].on_host}
    sent = {n: CheckedCommand.of(checks[n], c) if n in together else c for n, c in commands.items()}
    return RoundTrips(sent, {n: checks[n] for n in checks if n not in together}, together, not_needed)


class PlaybookFailed(GroupFailure):
    """One or more steps failed; carries every host's outcome across the steps that ran."""


class StepFailed(PlaybookFailed):
    """`step` failed (the first, when hosts of a per-host chain failed different steps: `label` names them all)."""

    def __init__(self, step: StepSpec, results: dict[str, HostResult], label: str | None = None):
        self.step = step
        super().__init__(label or f"step '{step.name}'", results)


@dataclass
class StepOutcome:
    step: StepSpec
    ran: list[str]
    skipped: list[str]  # the check found it done
    results: GroupResult
    seconds: float
    not_needed: dict[str, str] = field(default_factory=dict)  # host -> why the step has nothing to do there


@dataclass(frozen=True)
class StepStarted:
    step: StepSpec
    hosts: list[str]


@dataclass(frozen=True)
class StepEnded:
    step: StepSpec
    outcome: StepOutcome


#: told of each step as it starts and as it ends on all its hosts
Reporter = Callable[[StepStarted | StepEnded], None]


class PlaybookRunner:
    def __init__(self, group: HostGroup, ctx: StepContext, session: Session | None = None,
                 report: Reporter | None = None):
        self.group = group
        self.ctx = ctx
        self.session = session
        self.report = report or (lambda event: None)

    def run(self, playbook: Playbook, keep_going: bool = False) -> list[StepOutcome]:
        """Run every enabled step; raise StepFailed at the first failing one.

        Consecutive `per_host` steps form a chain that each host runs at its own pace (a fast host does not wait
        for a slow one); each step is reported and journalled once it has ended on all its hosts, in playbook
        order. A host that fails a step of a chain stops there; the others finish the chain, then the playbook
        stops. With keep_going (teardown), a host that failed a step is left out of the later steps while the
        other hosts carry on, so one dead host never keeps the rest running; the failure raised at the
        end covers every host that took part."""
        outcomes: list[StepOutcome] = []
        failed_steps: list[StepSpec] = []
        failed_hosts: set[str] = set()
        for chain in _chains([s for s in playbook.steps if step_enabled(s, self.ctx)], keep_going):
            ran = self.run_chain(chain) if len(chain) > 1 else [self.run_step(chain[0], exclude=failed_hosts)]
            outcomes += ran
            if not keep_going and any(not o.results.ok for o in ran):
                raise _chain_failure(ran)
            for outcome in ran:
                if outcome.results.ok:
                    continue
                failed_steps.append(outcome.step)
                failed_hosts |= {n for n, r in outcome.results.items() if not r.ok}
        if failed_steps:
            raise _merge(failed_steps, outcomes)
        return outcomes

    def run_chain(self, chain: list[StepSpec]) -> list[StepOutcome]:
        """Each host runs its part of the chain's steps in order, in parallel with the other hosts."""
        per_step = [step_hosts(step, self.ctx) for step in chain]
        hosts = {h.name: h for step_members in per_step for h in step_members}
        if not hosts:  # e.g. a chain of `workers` steps on one host: each step reports it had no host
            return [self.run_step(step) for step in chain]
        done: list[dict[str, tuple[_Attempt, float, float]]] = [{} for _ in chain]  # host -> attempt, start, end
        members = [{h.name for h in step_members} for step_members in per_step]
        stopped: set[str] = set()
        errors: list[BaseException] = []  # a step function that raised: re-raised here, never lost
        cancelled = threading.Event()  # after such an error or Ctrl-C, no host starts another step
        changed = threading.Condition()

        def on_host(name: str) -> None:
            try:
                for i, step in enumerate(chain):
                    if name not in members[i]:
                        continue
                    if cancelled.is_set():
                        return
                    started = time.monotonic()
                    attempt = self._attempt(step, [hosts[name]])
                    with changed:
                        done[i][name] = (attempt, started, time.monotonic())
                        changed.notify_all()
                    if not attempt.results.ok:
                        return  # stopped (below): the host's later steps wait for a resume
            except BaseException as exc:
                cancelled.set()
                with changed:
                    errors.append(exc)
                raise
            finally:  # also when a step function raised: the waiting below must not hang
                with changed:
                    stopped.add(name)
                    changed.notify_all()

        outcomes = []
        pool = ThreadPoolExecutor(max_workers=min(self.group.max_parallel, len(hosts)))
        try:
            for name in hosts:
                pool.submit(on_host, name)
            for i, step in enumerate(chain):
                self.report(StepStarted(step, sorted(members[i])))
                with changed:
                    # ended on every host of the step, but for those that stopped before it
                    changed.wait_for(lambda: all(n in done[i] or n in stopped for n in members[i]))
                    parts = dict(done[i])
                    if errors:
                        raise errors[0]
                seconds = (max(e for _, _, e in parts.values()) - min(b for _, b, _ in parts.values())) if parts else 0.0
                outcomes.append(self._finish(step, _Attempt.merged(a for a, _, _ in parts.values()), seconds))
        except BaseException as exc:
            cancelled.set()
            if isinstance(exc, KeyboardInterrupt):
                self.group.close()  # ends the hosts' running commands so their threads can finish
            raise
        finally:
            pool.shutdown(wait=True)
        return outcomes

    def run_step(self, step: StepSpec, exclude: set[str] = frozenset()) -> StepOutcome:
        started = time.monotonic()
        hosts = [h for h in step_hosts(step, self.ctx) if h.name not in exclude]
        self.report(StepStarted(step, [h.name for h in hosts]))
        attempt = self._attempt(step, hosts)
        return self._finish(step, attempt, time.monotonic() - started)

    def _attempt(self, step: StepSpec, hosts: list[HostPlan]) -> "_Attempt":
        """The step on these hosts: skipped where its check passes, run where it fails."""
        group = self.group.subset(h.name for h in hosts)
        trips = round_trips(step, self.ctx, hosts)
        not_needed, sent, separate, together = trips.not_needed, trips.sent, trips.separate, trips.together
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
        return _Attempt(skipped, not_needed, results)

    def _finish(self, step: StepSpec, attempt: "_Attempt", seconds: float) -> StepOutcome:
        for name in sorted(attempt.skipped):
            self._journal(step, name, "skipped", None)
        for name, reason in sorted(attempt.not_needed.items()):
            self._journal(step, name, "skipped", None, reason=reason)
        for name, result in sorted(attempt.results.items()):
            self._journal(step, name, "done" if result.ok else ("unreachable" if not result.reachable else "failed"), result)
        ran = sorted(n for n, r in attempt.results.items() if r.reachable)
        outcome = StepOutcome(step, ran, sorted(attempt.skipped), attempt.results, seconds, attempt.not_needed)
        self.report(StepEnded(step, outcome))
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


@dataclass
class _Attempt:
    """What one try of a step did on some hosts."""

    skipped: list[str]
    not_needed: dict[str, str]
    results: GroupResult

    @classmethod
    def merged(cls, attempts: Iterable["_Attempt"]) -> "_Attempt":
        out = cls([], {}, GroupResult())
        for a in attempts:
            out.skipped += a.skipped
            out.not_needed.update(a.not_needed)
            out.results.update(a.results)
        return out


def _chains(steps: list[StepSpec], keep_going: bool) -> list[list[StepSpec]]:
    """The steps in order, consecutive `per_host` ones together (a teardown runs step by step)."""
    chains: list[list[StepSpec]] = []
    for step in steps:
        if step.per_host and not keep_going and chains and chains[-1][-1].per_host:
            chains[-1].append(step)
        else:
            chains.append([step])
    return chains


def _chain_failure(ran: list[StepOutcome]) -> StepFailed:
    """The failure of a chain whose hosts may each have stopped at a different step: every failed host with its
    own step's result, named after the first failed step (where a resume starts)."""
    failed = [o for o in ran if not o.results.ok]
    if len(failed) == 1:
        return StepFailed(failed[0].step, dict(failed[0].results))
    label = "steps " + ", ".join(f"'{o.step.name}' (on {', '.join(sorted(n for n, r in o.results.items() if not r.ok))})"
                                 for o in failed)
    return StepFailed(failed[0].step, _per_host(ran), label=label)


def _per_host(outcomes: list[StepOutcome]) -> dict[str, HostResult]:
    """Each host's result across the outcomes: its failure if it had one, else its last result."""
    merged: dict[str, HostResult] = {}
    for outcome in outcomes:
        for name, result in outcome.results.items():
            if name not in merged or not result.ok:
                merged[name] = result
    return merged


def _merge(failed: list[StepSpec], outcomes: list[StepOutcome]) -> PlaybookFailed:
    merged = _per_host(outcomes)
    if len(failed) == 1:
        return StepFailed(failed[0], merged)
    return PlaybookFailed("steps " + ", ".join(f"'{s.name}'" for s in failed), merged)
