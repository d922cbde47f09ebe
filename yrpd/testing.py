"""Scripted hosts for tests: what each host answers to which command, without sshd, root or processes.

As `fabric.testing` scripts a remote session, `ScriptedHosts` scripts yrpd's host group: every `HostGroup` made
while it is active (including those yrpd.api and yrpd.deployment make) runs its commands against the script
instead of a shell. A rule matches a command by a regular expression on its script (first match wins, optionally
for one host only) and answers with stdout, stderr and an exit code, or as an unreachable host. Every command run
is recorded, so a test can also assert what was (not) run where.

    with ScriptedHosts() as hosts:
        hosts.on(r"session_processes\\.py", stdout='{"host": ...}')
        hosts.unreachable("h2")
        report = api.status(deployment)
    assert hosts.ran("h1", r"serving_status\\.py")
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Callable

from yrpd.hostgroup import ALREADY_DONE, CheckedCommand, Command, Host, HostGroup, HostResult


@dataclass
class Rule:
    pattern: re.Pattern
    host: str | None
    answer: Callable[[str, Command], HostResult]


@dataclass
class ScriptedHosts:
    default_exit: int | None = None  # None: a command no rule matches fails the test (AssertionError)
    rules: list[Rule] = field(default_factory=list)
    calls: list[tuple[str, Command]] = field(default_factory=list)
    _down: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    # -- scripting ----------------------------------------------------------------------------------
    def on(self, pattern: str, stdout: str = "", stderr: str = "", exit_code: int = 0, host: str | None = None,
           answer: Callable[[str, Command], tuple[str, str, int]] | None = None) -> "ScriptedHosts":
        """Answer commands whose script matches `pattern` (re.search) with the given output, or with what
        `answer(host, command)` returns as (stdout, stderr, exit code)."""
        def reply(name: str, command: Command) -> HostResult:
            out, err, code = answer(name, command) if answer else (stdout, stderr, exit_code)
            return HostResult(name, str(command), code, out, err)

        self.rules.append(Rule(re.compile(pattern, re.S), host, reply))
        return self

    def unreachable(self, host: str) -> "ScriptedHosts":
        self._down.add(host)
        return self

    # -- asserting ----------------------------------------------------------------------------------
    def ran(self, host: str, pattern: str) -> list[Command]:
        regex = re.compile(pattern, re.S)
        return [cmd for name, cmd in self.calls if name == host and regex.search(cmd.script)]

    # -- what HostGroup calls -----------------------------------------------------------------------
    def run(self, host: Host, command: Command) -> HostResult:
        if isinstance(command, CheckedCommand):  # as the host would: the check, then the step where it fails
            check = self.run(host, command.check)
            if check.ok:
                return HostResult(host.name, str(command), 0, ALREADY_DONE + "\n")
            return check if not check.reachable else self.run(host, command.step)
        with self._lock:
            self.calls.append((host.name, command))
        if host.name in self._down:
            return HostResult(host.name, str(command), None, error=f"ssh to {host.hostname} failed: scripted down")
        for rule in self.rules:
            if (rule.host is None or rule.host == host.name) and rule.pattern.search(command.script):
                return rule.answer(host.name, command)
        if self.default_exit is None:
            raise AssertionError(f"no scripted answer on {host.name} for:\n{command.script[:2000]}")
        return HostResult(host.name, str(command), self.default_exit)

    def __enter__(self) -> "ScriptedHosts":
        self._saved = HostGroup.default_runner_factory
        HostGroup.default_runner_factory = lambda host: _Runner(self, host)
        return self

    def __exit__(self, *exc) -> None:
        HostGroup.default_runner_factory = self._saved


class _Runner:
    def __init__(self, script: ScriptedHosts, host: Host) -> None:
        self.script, self.host = script, host

    def run(self, command: Command, on_line: Callable[[str, str], None] | None = None) -> HostResult:
        result = self.script.run(self.host, command)
        if on_line is not None:
            for line in result.stdout.splitlines():
                on_line(self.host.name, line)
            result.stdout = ""
        return result

    def close(self) -> None:
        pass
