"""Errors that reach the user. Each carries the exit code the CLI returns."""

from __future__ import annotations


class YrpdError(Exception):
    """Base class: the message is what the user reads, so it must say what to fix."""

    exit_code = 1


class SpecError(YrpdError):
    """Bad input: one line naming the field and the fix, raised before any host is touched."""

    exit_code = 2

    def __init__(self, field: str, problem: str, fix: str | None = None):
        self.field = field
        self.problem = problem
        self.fix = fix
        text = f"{field}: {problem}"
        if fix:
            text += f"; {fix}"
        super().__init__(text)


class SessionError(YrpdError):
    """No usable session (none yet, unknown id, already torn down)."""

    exit_code = 2


class RemoteError(YrpdError):
    """Something failed on one or more hosts; the message reports each host."""

    exit_code = 1
