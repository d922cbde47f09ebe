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
@version
def status(**params) -> int:
    """Show hosts, processes and instances of a deployment. Exit status 1 when anything is unhealthy."""
    from yrpd import api
    from yrpd.cli.options import ssh_overrides

    report = api.status(api.open_deployment(params["session_id"], ssh_overrides(params)))
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
