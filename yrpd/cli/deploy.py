"""`yrpd deploy`: validate, plan, then run the deploy playbook on every host; resumable."""

from __future__ import annotations

import click

from yrpd.cli.options import spec_options, version


@click.command()
@spec_options
@click.option("--dry-run", is_flag=True, help="print the plan and commands, touch nothing")
@click.option("--playbook", metavar="FILE", help="deploy playbook [playbooks/deploy.yaml]")
@click.option("--new-session", is_flag=True, help="start a new session even if the latest one is still up")
@click.option("--recreate", is_flag=True, default=None,
              help="runtime docker: replace a container of this session whose spec differs [refuse]")
@click.option("--pull", type=click.Choice(["never", "missing", "always"]), default=None,
              help="runtime docker: pull the image never (it must be on the hosts), when missing, or always [never]")
@version
def deploy(**params) -> int:
    """Deploy PD serving onto the hosts. Re-running it resumes: finished steps are skipped."""
    from yrpd.cli.options import spec_from_options

    spec = spec_from_options(params)
    options = container_options(spec, params)
    if params["dry_run"]:
        from yrpd.cli.plan import show_plan

        return show_plan(spec, params.get("playbook"), as_json=False)
    return run_deploy(spec, params.get("playbook"), params["new_session"], options)


def container_options(spec, params) -> dict:
    """--recreate and --pull: actions of this deploy, not part of the deployment's identity (spec)."""
    from yrpd.errors import SpecError
    from yrpd.spec import Runtime

    for flag in ("recreate", "pull"):
        if params.get(flag) is not None and spec.runtime is not Runtime.docker:
            raise SpecError(f"--{flag}", "only applies to runtime docker", "drop it, or pass --runtime docker")
    return {"recreate": bool(params.get("recreate")), "pull": params.get("pull") or "never"}


def run_deploy(spec, playbook_file: str | None, new_session: bool, options: dict | None = None) -> int:
    import time
    from pathlib import Path

    from yrpd.assets import playbook_path
    from yrpd.console import err
    from yrpd.deployment import host_group, resolve_inventory, runtime_group, save_deployment
    from yrpd.placement import make_plan
    from yrpd.playbook import PlaybookRunner, StepFailed, load_playbook
    from rich.markup import escape

    from yrpd.render import outcome_line, warning_lines
    from yrpd.session import SessionStore, resolve_root
    from yrpd.steps import StepContext

    console = err()
    started = time.monotonic()
    playbook = load_playbook(Path(playbook_file) if playbook_file else playbook_path("deploy"))
    store = SessionStore(resolve_root(spec.session_root))
    session = None if new_session else reusable_session(store, spec)

    with host_group(spec) as group:
        inventory = resolve_inventory(spec, group, deploying=True)
        placement = make_plan(spec, inventory)
        # runtime docker: the wheels the containers get from here, downloaded before any host is changed
        from yrpd.steps.brought import prepare

        prepare(StepContext(spec=spec, plan=placement))
        if session is None:
            session = store.create()
            console.print(f"session {session.id} ({session.path})")
        else:
            console.print(f"resuming session {session.id}: finished steps are skipped")
        save_deployment(session, spec, inventory, placement)
        session.set_state(phase="deploying", playbook=str(playbook_file or "deploy"))
        ctx = StepContext(spec=spec, plan=placement, session_id=session.id, options=dict(options or {}))
        total = len(playbook.steps)

        def report(event, step, info):
            number = playbook.steps.index(step) + 1
            if event == "start":
                console.print(f"[{number}/{total}] {step.name} ...")
            else:
                console.print(f"      {outcome_line(info['outcome'])}")
                for line in warning_lines(info["outcome"]):
                    console.print(f"      [yellow]{escape(line)}[/yellow]")

        try:
            PlaybookRunner(runtime_group(group, spec, session.id), ctx, session, report).run(playbook)
        except StepFailed as failure:
            session.set_state(phase="failed", failed_step=failure.step.name)
            failure.args = (f"{failure}\nfix the cause and run the same `yrpd deploy` again to resume session "
                            f"{session.id} (finished steps are skipped), or `yrpd down` to remove what was started",)
            raise
    session.set_state(phase="deployed", failed_step=None)
    console.print(f"deployed session {session.id} in {time.monotonic() - started:.1f}s; "
                  f"see `yrpd status`, `yrpd logs`; `yrpd down` tears it down")
    if any(step.run == "proxy.start" for step in playbook.steps):
        from yrpd.serving import endpoint_url, sample_request

        console.print(f"OpenAI-compatible endpoint: {endpoint_url(spec, placement)}/v1 (model {spec.model_name})")
        console.print(f"try: {sample_request(spec, placement)}", soft_wrap=True, highlight=False, markup=False)
        # the URL alone on stdout, for scripts: URL=$(yrpd deploy ...)
        click.echo(endpoint_url(spec, placement))
    return 0


def reusable_session(store, spec):
    """The latest session if it is still up with the same deployment spec; None if a new one is needed.

    A different spec while the latest session is still up is refused: two deployments would fight over
    the same ports and devices.
    """
    from yrpd.errors import SpecError
    from yrpd.spec import DeploySpec
    from yrpd.steps import spec_fingerprint

    latest = store.latest()
    if latest is None or latest.phase in ("down", "new"):
        return None
    try:
        previous = DeploySpec.model_validate(latest.spec_data)
    except Exception:
        return None
    if spec_fingerprint(previous) == spec_fingerprint(spec):
        return latest
    old, new = previous.model_dump(mode="json", exclude={"ssh"}), spec.model_dump(mode="json", exclude={"ssh"})
    changed = sorted(k for k in new if old.get(k) != new.get(k))
    raise SpecError(
        "deploy",
        f"session {latest.id} is still {latest.phase} with a different spec (changed: {', '.join(changed)})",
        "run `yrpd down` first, or pass --new-session to deploy alongside it",
    )
