"""`yrpd down`: run the teardown playbook and prove nothing the session started is left."""

from __future__ import annotations

# the library is imported inside the command: `yrpd down --help` and usage errors load none of it (yrpd.api: ~0.2 s)

import click

from yrpd.cli.options import session_option, ssh_options, version


@click.command()
@session_option
@ssh_options
@click.option("--purge", is_flag=True, help="also delete the session directory (logs included) on every host")
@version
def down(**params) -> int:
    """Tear a deployment down (latest session by default) and verify nothing is left."""
    from yrpd import api
    from yrpd.spec import ssh_from_flags
    from yrpd.cli.progress import ConsoleProgress
    from yrpd.session import SessionPhase

    deployment = api.open_deployment(params["session_id"], ssh_from_flags(params))
    progress = ConsoleProgress(numbered=False)
    if deployment.session.phase is SessionPhase.down:
        progress.message(f"session {deployment.session.id} was already torn down; checking again")
    done = api.down(deployment, purge=params["purge"], progress=progress)
    progress.message(f"session {done.session.id} is down: no process of it is left on {', '.join(done.hosts)} "
                     f"({done.seconds:.1f}s)")
    return 0
