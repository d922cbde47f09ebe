"""`yrpd logs`: tail the session's log files on every host, each line prefixed with host and log name."""

from __future__ import annotations

# the library is imported inside the command: `yrpd logs --help` and usage errors load none of it (yrpd.api: ~0.2 s)

import click

from yrpd.cli.options import session_option, ssh_options, version


@click.command()
@click.argument("name", required=False)
@click.option("-f", "--follow", is_flag=True, help="keep printing new lines (Ctrl-C to stop)")
@click.option("-n", "--lines", "lines", type=click.IntRange(0, 100000), default=20, show_default=True,
              help="lines per log file")
@click.option("--host", "hosts", multiple=True, metavar="HOST", help="only this host (repeatable)")
@click.option("--request", "request_id", metavar="ID",
              help="the lines of one request (its X-Request-Id: the proxy logs it as id=...) from every host, in time "
                   "order: the proxy's, prefill's and decode's connector lines, with the time since the first")
@session_option
@ssh_options
@version
def logs(**params) -> int:
    """Tail the session's logs from every host: all logs, or those named NAME (e.g. prefill-0)."""
    import re
    import sys

    from yrpd import api
    from yrpd.spec import ssh_from_flags
    from yrpd.errors import SpecError

    name = params.get("name")
    if name is not None and not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", name):
        raise SpecError("NAME", f"{name!r} is not a log name", "use a process or instance name like prefill-0")
    deployment = api.open_deployment(params["session_id"], ssh_from_flags(params))
    if params.get("request_id"):
        return _request(api, deployment, params["request_id"])

    def emit(host: str, log: str, text: str) -> None:
        sys.stdout.write(f"{host} {log} | {text}\n")
        sys.stdout.flush()

    try:
        results = api.logs(deployment, emit, name=name, lines=params["lines"], follow=params["follow"],
                           hosts=list(params["hosts"]))
    except KeyboardInterrupt:
        return 130
    failed = {h: r for h, r in results.items() if not r.ok and r.exit_code not in (130, 143)}
    for host, result in failed.items():
        sys.stderr.write(f"{host}: {result.tail(3) or f'exit {result.exit_code}'}\n")
    return 1 if failed else 0


def _request(api, deployment, request_id: str) -> int:
    import sys

    lines, results = api.request_lines(deployment, request_id)
    first = next((line.at for line in lines if line.at), None)
    for line in lines:
        since = f"+{(line.at - first).total_seconds():7.3f}s" if line.at and first else " " * 9
        sys.stdout.write(f"{since} {line.host} {line.log} | {line.text}\n")
    failed = {h: r for h, r in results.items() if not r.ok}
    for host, result in failed.items():
        sys.stderr.write(f"{host}: {result.tail(3) or f'exit {result.exit_code}'}\n")
    if not lines and not failed:
        sys.stderr.write(f"no log line of session {deployment.session.id} names {request_id}\n")
        return 1
    return 1 if failed else 0
