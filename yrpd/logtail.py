"""Reading a session's log files on the hosts: the tail command and the splitting of its output into lines per log,
and the lines naming one request, from every host, in time order (`yrpd logs --request`)."""

from __future__ import annotations

import datetime
import re
import shlex
from dataclasses import dataclass

from yrpd.layout import HostSessionLayout


def tail_script(layout: HostSessionLayout, name: str | None, lines: int, follow: bool) -> str:
    """Shell for one host: tail the session's *.log files (recursively), with tail's ==> file <== headers."""
    pattern = f"{name}.log" if name else "*.log"
    mode = "-F" if follow else ""
    d = shlex.quote(layout.logs_dir)
    return (
        f"cd {d} 2>/dev/null || {{ echo 'no logs directory {layout.logs_dir} on this host' >&2; exit 3; }}\n"
        f"files=$(find . -type f -name {shlex.quote(pattern)} | sort)\n"
        f'if [ -z "$files" ]; then exit 0; fi\n'
        f"exec tail -v {mode} -n {lines} $files"
    )


class TailSplitter:
    """Turns `tail -v` output into (log name, line) pairs; drops the blank line tail puts before a header."""

    def __init__(self) -> None:
        self.current = "?"
        self.pending_blank = False

    def feed(self, line: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if line.startswith("==> ") and line.endswith(" <=="):
            self.pending_blank = False
            path = line[4:-4].removeprefix("./")
            self.current = path[:-4] if path.endswith(".log") else path
            return out
        if self.pending_blank:
            out.append((self.current, ""))
            self.pending_blank = False
        if line == "":
            self.pending_blank = True
            return out
        out.append((self.current, line))
        return out


def grep_script(layout: HostSessionLayout, text: str) -> str:
    """Shell for one host: every line of the session's *.log files that contains `text`, as `./NAME.log:LINE`."""
    d = shlex.quote(layout.logs_dir)
    return (
        f"cd {d} 2>/dev/null || {{ echo 'no logs directory {layout.logs_dir} on this host' >&2; exit 3; }}\n"
        # grep's 1 is "no such line": an answer, not a failure
        f"grep -r -H -F --include='*.log' -e {shlex.quote(text)} .; [ $? -le 1 ]"
    )


# the two line formats of the session's logs: Python logging's (the proxy, yrpd's own processes) and vLLM's
_STAMPED = (re.compile(r"^(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:[,.](\d{1,6}))?"),
            re.compile(r"^(?:\([^)]*\) )?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)"))


def line_time(line: str, year: int) -> datetime.datetime | None:
    """When a log line was written, from its own stamp (vLLM's has no year: `year` is assumed); None without one."""
    m = _STAMPED[0].match(line)
    if m:
        y, mo, d, h, mi, s, frac = m.groups()
        return datetime.datetime(int(y), int(mo), int(d), int(h), int(mi), int(s),
                                 int((frac or "0").ljust(6, "0")))
    m = _STAMPED[1].match(line)
    if m:
        mo, d, h, mi, s = map(int, m.groups())
        return datetime.datetime(year, mo, d, h, mi, s)
    return None


@dataclass(frozen=True)
class LogLine:
    host: str
    log: str
    text: str
    at: datetime.datetime | None


def grep_lines(host: str, output: str, year: int) -> list[LogLine]:
    """grep_script's output on `host` as LogLines."""
    out = []
    for raw in output.splitlines():
        path, sep, text = raw.partition(":")
        if not sep:
            continue
        log = path.removeprefix("./")
        out.append(LogLine(host, log[:-4] if log.endswith(".log") else log, text, line_time(text, year)))
    return out


def in_time_order(lines: list[LogLine]) -> list[LogLine]:
    """Every host's lines by their stamps (a line without one stays after the line before it in its file); equal
    stamps keep host and file order."""
    keyed, last = [], datetime.datetime.min
    for n, line in enumerate(lines):
        last = line.at or last
        keyed.append((last, n, line))
    return [line for _, _, line in sorted(keyed, key=lambda k: (k[0], k[1]))]
