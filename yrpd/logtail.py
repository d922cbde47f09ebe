"""Reading a session's log files on the hosts: the tail command and the splitting of its output into lines per log."""

from __future__ import annotations

import shlex

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
