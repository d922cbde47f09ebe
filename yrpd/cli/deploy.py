"""`yrpd deploy`: validate, plan, then run the deploy playbook on every host; resumable."""

from __future__ import annotations

# the library is imported inside the command: `yrpd deploy --help` and usage errors load none of it (yrpd.api: ~0.2 s)

import click

from yrpd.cli.options import spec_options, version


@click.command()
@spec_options
@click.option("--dry-run", is_flag=True, help="print the plan and commands, touch nothing")
@click.option("--playbook", metavar="FILE", help="deploy playbook [playbooks/deploy.yaml]")
@click.option("--new-session", is_flag=True, help="start a new session even if the latest one is still up")
@click.option("--recreate", is_flag=True, default=None,
              help="a changed spec that cannot roll: tear the running session down and deploy anew; runtime docker: "
                   "also replace a container whose spec differs [refuse]")
@click.option("--max-unavailable", type=click.IntRange(0, 64), default=None, metavar="N",
              help="a rolling change: how many old instances may stop before their replacements serve [0 where a "
                   "device is spare for one more instance, else 1]")
@click.option("--drain-timeout", type=click.FloatRange(1, 3600), default=120.0, show_default=True, metavar="S",
              help="a rolling change: how long a replaced instance's requests in flight may take to end")
@click.option("--pull", type=click.Choice(["never", "missing", "always"]), default=None,
              help="runtime docker: pull the image never (it must be on the hosts), when missing, or always [never]")
@version
def deploy(**params) -> int:
    """Deploy PD serving onto the hosts. Re-running it resumes: finished steps are skipped."""
    from yrpd import api
    from yrpd.spec import spec_from_flags

    spec = spec_from_flags(params)
    actions = api.check_container_actions(spec, api.ContainerActions(recreate=bool(params.get("recreate")),
                                                                     pull=params.get("pull") or "never"))
    if params["dry_run"]:
        from yrpd.console import out
        from yrpd.render import plan_view

        console = out()
        for renderable in plan_view(api.plan(spec, params.get("playbook"))):
            console.print(renderable)
        return 0
    from yrpd.cli.progress import ConsoleProgress

    progress = ConsoleProgress()
    done = api.deploy(spec, playbook_file=params.get("playbook"), new_session=params["new_session"],
                      actions=actions, progress=progress, max_unavailable=params.get("max_unavailable"),
                      drain_timeout_s=params["drain_timeout"])
    console = progress.console
    if done.changes:
        console.print(f"changed session {done.session.id} while it served, in {done.seconds:.1f}s; `yrpd status` "
                      "shows its generation")
        click.echo(done.endpoint.removesuffix("/v1") if done.endpoint else "")
        return 0
    console.print(f"deployed session {done.session.id} in {done.seconds:.1f}s; "
                  f"see `yrpd status`, `yrpd logs`; `yrpd down` tears it down")
    if done.endpoint:
        console.print(f"OpenAI-compatible endpoint: {done.endpoint} (model {spec.model_name})")
        console.print(f"try: {done.deployment.sample_request}", soft_wrap=True, highlight=False, markup=False)
        # the URL alone on stdout, for scripts: URL=$(yrpd deploy ...)
        click.echo(done.endpoint.removesuffix("/v1"))
    return 0
