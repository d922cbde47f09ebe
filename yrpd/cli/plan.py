"""`yrpd plan`: where every instance goes, and the exact per-host commands a deploy would run."""

from __future__ import annotations

# the library is imported inside the command: `yrpd plan --help` and usage errors load none of it (yrpd.api: ~0.2 s)

import json

import click

from yrpd.cli.options import spec_options, version


@click.command()
@spec_options
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON")
@click.option("--playbook", metavar="FILE", help="deploy playbook [playbooks/deploy.yaml]")
@version
def plan(**params) -> int:
    """Show where every instance goes and the commands a deploy would run. Touches no host unless
    devices must be detected (no --devices and none in the config)."""
    from yrpd import api
    from yrpd.spec import spec_from_flags

    view = api.plan(spec_from_flags(params), params.get("playbook"))
    if params["as_json"]:
        click.echo(json.dumps(view.to_dict(), indent=2))
        return 0
    from yrpd.console import out
    from yrpd.render import plan_view

    console = out()
    for renderable in plan_view(view):
        console.print(renderable)
    return 0
