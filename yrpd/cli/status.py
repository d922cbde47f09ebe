"""`yrpd status`: one view of hosts, processes and instances, queried from all hosts in parallel."""

from __future__ import annotations

# the library is imported inside the command: `yrpd status --help` and usage errors load none of it (yrpd.api: ~0.2 s)

import json

import click

from yrpd.cli.options import session_option, ssh_options, version


@click.command()
@session_option
@ssh_options
@click.option("--json", "as_json", is_flag=True, help="print the status as JSON")
@click.option("--watch", is_flag=True, help="refresh the view in place, with rates per instance (Ctrl-C stops)")
@click.option("--interval", type=click.FloatRange(0.5, 3600), default=2.0, show_default=True, metavar="S",
              help="--watch: seconds between looks")
@version
def status(**params) -> int:
    """Show hosts, processes and instances of a deployment. Exit status 1 when anything is unhealthy."""
    from yrpd import api
    from yrpd.spec import ssh_from_flags

    deployment = api.open_deployment(params["session_id"], ssh_from_flags(params))
    if params["watch"]:
        if params["as_json"]:
            from yrpd.errors import SpecError

            raise SpecError("--watch", "draws in the terminal", "drop --json, or poll `yrpd status --json`")
        return _watch(api, deployment, params["interval"])
    report = api.status(deployment)
    if params["as_json"]:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        from yrpd.console import out
        from yrpd.render import status_tables, status_verdict

        console = out()
        for table in status_tables(report):
            console.print(table)
        console.print(status_verdict(report))
    return 0 if report.healthy else 1


def _watch(api, deployment, interval: float) -> int:
    import time

    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    from yrpd.console import out
    from yrpd.render import rates_table, status_tables, status_verdict

    before = None
    try:
        with Live(console=out(), auto_refresh=False, transient=False) as live:
            while True:
                looked = time.monotonic()
                report = api.status(deployment)
                parts = [*status_tables(report)]
                if before is not None:
                    parts.append(rates_table(before[0], report, looked - before[1]))
                parts += [Text.from_markup(status_verdict(report)),
                          Text(f"updated {time.strftime('%H:%M:%S')}, every {interval:g} s; Ctrl-C stops", style="dim")]
                live.update(Group(*parts), refresh=True)
                before = (report, looked)
                time.sleep(max(0.0, interval - (time.monotonic() - looked)))
    except KeyboardInterrupt:
        return 0
