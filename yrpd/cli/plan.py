"""`yrpd plan`: where every instance goes, and the exact per-host commands a deploy would run."""

from __future__ import annotations

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
    from yrpd.cli.options import spec_from_options

    spec = spec_from_options(params)
    return show_plan(spec, params.get("playbook"), params["as_json"])


def show_plan(spec, playbook_file: str | None, as_json: bool) -> int:
    from pathlib import Path

    from yrpd.assets import playbook_path
    from yrpd.console import out
    from yrpd.deployment import resolve_inventory
    from yrpd.placement import make_plan
    from yrpd.playbook import describe, load_playbook
    from yrpd.render import plan_commands, plan_table
    from yrpd.steps import StepContext

    playbook = load_playbook(Path(playbook_file) if playbook_file else playbook_path("deploy"))
    inventory = resolve_inventory(spec)
    placement = make_plan(spec, inventory)
    ctx = StepContext(spec=spec, plan=placement)
    steps = in_containers(spec, ctx, describe(playbook, ctx))
    if as_json:
        data = placement.to_dict()
        data["steps"] = [
            {"name": step.name, "hosts": {host: str(cmd) for host, cmd in commands.items()}} for step, commands in steps
        ]
        click.echo(json.dumps(data, indent=2))
        return 0
    console = out()
    for renderable in plan_table(spec, placement):
        console.print(renderable)
    console.print()
    for renderable in plan_commands(steps):
        console.print(renderable)
    return 0


def in_containers(spec, ctx, steps):
    """Runtime docker: show which commands run inside the container (`docker exec`), as deploy runs them."""
    from yrpd.spec import Runtime

    if spec.runtime is not Runtime.docker:
        return steps
    from yrpd.containers import container_name, container_profile
    from yrpd.hostgroup import as_run_in, env_preamble
    from yrpd.steps import NotNeeded

    name, engine = container_name(ctx.session_id), spec.container_engine.value
    preamble = env_preamble(container_profile(spec).env_scripts)
    return [(step, {host: cmd if isinstance(cmd, NotNeeded) else as_run_in(cmd, name, engine, preamble=preamble)
                    for host, cmd in commands.items()}) for step, commands in steps]
