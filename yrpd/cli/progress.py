"""The terminal's Progress for yrpd.api: step lines as deploy and down run them, on stderr."""

from __future__ import annotations

from rich.markup import escape

from yrpd.console import err
from yrpd.render import outcome_line, warning_lines


class ConsoleProgress:
    def __init__(self, numbered: bool = True) -> None:
        self.console = err()
        self.numbered = numbered

    def message(self, text: str) -> None:
        self.console.print(escape(text))

    def step_started(self, number: int, total: int, step) -> None:
        self.console.print(f"[{number}/{total}] {step.name} ..." if self.numbered else f"{step.name} ...",
                           markup=False)

    def step_finished(self, step, outcome) -> None:
        self.console.print(f"      {outcome_line(outcome)}")
        for line in warning_lines(outcome):
            self.console.print(f"      [yellow]{escape(line)}[/yellow]")
