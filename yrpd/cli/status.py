"""`yrpd status`: one view of hosts, processes and instances, queried from all hosts in parallel."""

from __future__ import annotations

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
    from yrpd.cli.options import apply_ssh_overrides
    from yrpd.console import out
    from yrpd.deployment import Deployment
    from yrpd.render import status_tables
    from yrpd.session import SessionStore, default_root
    from yrpd.status import collect_status

    session = SessionStore(default_root()).get(params["session_id"])
    deployment = Deployment.load(session)
    deployment.spec = apply_ssh_overrides(deployment.spec, params)
    report = collect_status(deployment)
    if params["as_json"]:
        click.echo(json.dumps(report, indent=2))
    else:
        console = out()
        for table in status_tables(report):
            console.print(table)
        verdict = "[green]healthy[/green]" if report["healthy"] else "[red]unhealthy[/red]: " + "; ".join(report["problems"])
        console.print(verdict)
    return 0 if report["healthy"] else 1
