"""`yrpd down`: run the teardown playbook and prove nothing the session started is left."""

from __future__ import annotations

import click

from yrpd.cli.options import session_option, ssh_options, version


@click.command()
@session_option
@ssh_options
@click.option("--purge", is_flag=True, help="also delete the session directory (logs included) on every host")
@version
def down(**params) -> int:
    """Tear a deployment down (latest session by default) and verify nothing is left."""
    import time

    from yrpd.assets import playbook_path
    from yrpd.cli.options import apply_ssh_overrides
    from yrpd.console import err
    from yrpd.deployment import Deployment
    from yrpd.playbook import PlaybookFailed, PlaybookRunner, load_playbook
    from rich.markup import escape

    from yrpd.render import outcome_line, warning_lines
    from yrpd.session import SessionStore, default_root

    console = err()
    started = time.monotonic()
    session = SessionStore(default_root()).get(params["session_id"])
    deployment = Deployment.load(session)
    deployment.spec = apply_ssh_overrides(deployment.spec, params)
    if session.phase == "down":
        console.print(f"session {session.id} was already torn down; checking again")
    playbook = load_playbook(playbook_path("teardown"))
    ctx = deployment.context(purge=params["purge"])

    def report(event, step, info):
        if event == "start":
            console.print(f"{step.name} ...")
        else:
            console.print(f"      {outcome_line(info['outcome'])}")
            for line in warning_lines(info["outcome"]):
                console.print(f"      [yellow]{escape(line)}[/yellow]")

    # docker runtime: a container that is gone or stopped has nothing of the session running in it
    with deployment.group(absent_ok=True) as group:
        try:
            PlaybookRunner(group, ctx, session, report).run(playbook, keep_going=True)
        except PlaybookFailed as failure:
            session.set_state(phase="down-failed")
            failure.args = (f"{failure}\nfix the cause (or bring the host back) and run `yrpd down` again",)
            raise
    session.set_state(phase="down", purged=params["purge"])
    hosts = ", ".join(h.name for h in deployment.plan.hosts)
    console.print(f"session {session.id} is down: no process of it is left on {hosts} ({time.monotonic() - started:.1f}s)")
    return 0
