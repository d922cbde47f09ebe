"""`yrpd scale`: change how many prefill and decode instances a running deployment has, without failing a request."""

from __future__ import annotations

# the library is imported inside the command: `yrpd scale --help` and usage errors load none of it (yrpd.api: ~0.2 s)

import click

from yrpd.cli.options import session_option, ssh_options, version


@click.command()
@session_option
@ssh_options
@click.option("--prefill", type=click.IntRange(1, 64), metavar="N", help="prefill instances wanted")
@click.option("--decode", type=click.IntRange(1, 64), metavar="N", help="decode instances wanted")
@click.option("--drain-timeout", type=click.FloatRange(1, 3600), default=120.0, show_default=True, metavar="S",
              help="how long a removed instance's requests in flight may take to end before scale gives up (and "
                   "stops nothing)")
@version
def scale(**params) -> int:
    """Add or remove prefill/decode instances of a running deployment (latest session by default): new ones join
    the proxy once they answer; removed ones are drained first, then stopped."""
    from yrpd import api
    from yrpd.cli.options import ssh_overrides
    from yrpd.cli.progress import ConsoleProgress

    deployment = api.open_deployment(params["session_id"], ssh_overrides(params))
    progress = ConsoleProgress(numbered=False)
    done = api.scale(deployment, prefill=params["prefill"], decode=params["decode"],
                     drain_timeout_s=params["drain_timeout"], progress=progress)
    spec = done.deployment.spec
    if not done.added and not done.removed:
        progress.message(f"session {done.session.id} already has {spec.prefill} prefill and {spec.decode} decode "
                         "instances: nothing changed")
        return 0
    changed = "; ".join(part for part in (f"added {', '.join(done.added)}" if done.added else "",
                                          f"drained and stopped {', '.join(done.removed)}" if done.removed else "")
                        if part)
    progress.message(f"session {done.session.id} now runs {spec.prefill} prefill and {spec.decode} decode instances: "
                     f"{changed} ({done.seconds:.1f}s)")
    return 0
