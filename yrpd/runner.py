"""Running a playbook, or one command, for the library's operations, and what they tell their caller meanwhile."""

from __future__ import annotations

from typing import Protocol

from yrpd.hostgroup import Command
from yrpd.playbook import Playbook, PlaybookRunner, StepEnded, StepOutcome, StepSpec, StepStarted
from yrpd.session import Session
from yrpd.steps import NotNeeded, StepContext


class Progress(Protocol):
    """What a long operation tells its caller while it runs."""

    def message(self, text: str) -> None: ...

    def step_started(self, number: int, total: int, step: StepSpec) -> None: ...

    def step_finished(self, step: StepSpec, outcome: StepOutcome) -> None: ...


class Quiet:
    """A Progress that keeps everything to itself."""

    def message(self, text: str) -> None:
        pass

    def step_started(self, number: int, total: int, step: StepSpec) -> None:
        pass

    def step_finished(self, step: StepSpec, outcome: StepOutcome) -> None:
        pass


def run_playbook(playbook: Playbook, group, ctx: StepContext, session: Session, progress: Progress,
                 keep_going: bool = False) -> list[StepOutcome]:
    steps = playbook.steps

    def report(event: StepStarted | StepEnded) -> None:
        if isinstance(event, StepStarted):
            progress.step_started(steps.index(event.step) + 1, len(steps), event.step)
        else:
            progress.step_finished(event.step, event.outcome)

    return PlaybookRunner(group, ctx, session, report).run(playbook, keep_going=keep_going)


def run_on(group, host: str, command: Command | NotNeeded, what: str) -> None:
    """Run one command on one host of the deployment; a failure is a GroupFailure naming `what`."""
    if isinstance(command, NotNeeded):
        return
    group.subset([host]).run(command).raise_on_failure(what)
