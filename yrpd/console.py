"""Rich consoles: results on stdout, progress and errors on stderr. Wide when not a terminal, so pipes and
CI logs get whole table rows instead of wrapped cells."""

from __future__ import annotations

import sys

from rich.console import Console


def _console(stderr: bool) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return Console(file=stream, width=None if tty else 200, soft_wrap=not tty, highlight=False)


def out() -> Console:
    return _console(stderr=False)


def err() -> Console:
    return _console(stderr=True)
