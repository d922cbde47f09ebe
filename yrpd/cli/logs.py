"""`yrpd logs`: tail the session's log files on every host, each line prefixed with host and log name."""

from __future__ import annotations

import click

from yrpd.cli.options import session_option, ssh_options, version


@click.command()
@click.argument("name", required=False)
@click.option("-f", "--follow", is_flag=True, help="keep printing new lines (Ctrl-C to stop)")
@click.option("-n", "--lines", "lines", type=click.IntRange(0, 100000), default=20, show_default=True,
              help="lines per log file")
@click.option("--host", "hosts", multiple=True, metavar="HOST", help="only this host (repeatable)")
@session_option
@ssh_options
@version
def logs(**params) -> int:
    """Tail the session's logs from every host: all logs, or those named NAME (e.g. prefill-0)."""
    import re
    import sys
    import threading

    from yrpd.cli.options import apply_ssh_overrides
    from yrpd.deployment import Deployment
    from yrpd.errors import SpecError
    from yrpd.hostgroup import Command
    from yrpd.session import SessionStore, default_root

    name = params.get("name")
    if name is not None and not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", name):
        raise SpecError("NAME", f"{name!r} is not a log name", "use a process or instance name like prefill-0")
    session = SessionStore(default_root()).get(params["session_id"])
    deployment = Deployment.load(session)
    deployment.spec = apply_ssh_overrides(deployment.spec, params)
    known = [h.name for h in deployment.plan.hosts]
    for host in params["hosts"]:
        if host not in known:
            raise SpecError("--host", f"{host!r} is not a host of session {session.id} ({', '.join(known)})", "pick one of them")
    wanted = list(params["hosts"]) or known
    # on the host itself: under the docker runtime the session directory is mounted from there, so logs stay
    # readable after the container is gone
    command = Command(tail_script(deployment.context().host_session_dir, name, params["lines"], params["follow"]),
                      timeout=7 * 24 * 3600 if params["follow"] else 60, on_host=True)

    lock = threading.Lock()
    splitters: dict[str, TailSplitter] = {}

    def emit(host: str, line: str) -> None:
        splitter = splitters.setdefault(host, TailSplitter())
        for log, text in splitter.feed(line):
            with lock:
                sys.stdout.write(f"{host} {log} | {text}\n")
                sys.stdout.flush()

    group = deployment.group().subset(wanted)
    try:
        results = group.run(command, on_line=emit)
    except KeyboardInterrupt:
        return 130
    finally:
        group.close()
    failed = {h: r for h, r in results.items() if not r.ok and r.exit_code not in (130, 143)}
    for host, result in failed.items():
        sys.stderr.write(f"{host}: {result.tail(3) or f'exit {result.exit_code}'}\n")
    return 1 if failed else 0


def tail_script(session_dir: str, name: str | None, lines: int, follow: bool) -> str:
    """Shell for one host: tail the session's *.log files (recursively), with tail's ==> file <== headers."""
    import shlex

    pattern = f"{name}.log" if name else "*.log"
    mode = "-F" if follow else ""
    d = shlex.quote(f"{session_dir}/logs")
    return (
        f"cd {d} 2>/dev/null || {{ echo 'no logs directory {session_dir}/logs on this host' >&2; exit 3; }}\n"
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
