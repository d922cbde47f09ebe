"""`yrpd scale`, `yrpd drain HOST`, `yrpd undrain HOST`, `yrpd planner`: change a running deployment without failing
a request."""

from __future__ import annotations

import signal

# the library is imported inside the commands: `--help` and usage errors load none of it (yrpd.api: ~0.2 s)

import click

from yrpd.cli.options import session_option, ssh_options, version

drain_timeout = click.option(
    "--drain-timeout", type=click.FloatRange(1, 3600), default=120.0, show_default=True, metavar="S",
    help="how long a removed instance's requests in flight may take to end before it gives up (and stops nothing)")


def _open(params):
    from yrpd import api
    from yrpd.spec import ssh_from_flags
    from yrpd.cli.progress import ConsoleProgress

    return api, api.open_deployment(params["session_id"], ssh_from_flags(params)), ConsoleProgress(numbered=False)


def _moved(done) -> str:
    return "; ".join(part for part in (f"added {', '.join(done.added)}" if done.added else "",
                                       f"drained and stopped {', '.join(done.removed)}" if done.removed else "")
                     if part) or "nothing moved"


@click.command()
@session_option
@ssh_options
@click.option("--prefill", type=click.IntRange(1, 64), metavar="N", help="prefill instances wanted")
@click.option("--decode", type=click.IntRange(1, 64), metavar="N", help="decode instances wanted")
@click.option("--hosts", "add_hosts", metavar="LIST",
              help="hosts to add first (h3,h4 or user@host:port): they join the cluster, and added instances may go there")
@drain_timeout
@version
def scale(**params) -> int:
    """Add or remove prefill/decode instances of a running deployment (latest session by default), and add hosts:
    new instances join the proxy once they answer; removed ones are drained first, then stopped."""
    api, deployment, progress = _open(params)
    hosts = params["add_hosts"].split(",") if params["add_hosts"] is not None else None
    done = api.scale(deployment, prefill=params["prefill"], decode=params["decode"], hosts=hosts,
                     drain_timeout_s=params["drain_timeout"], progress=progress)
    spec = done.deployment.spec
    joined = [line for line in done.lines if line.startswith("join ")]
    if joined and not done.added and not done.removed:
        progress.message(f"session {done.session.id} now spans {', '.join(h.name for h in spec.hosts)}; it runs "
                         f"{spec.prefill} prefill and {spec.decode} decode instances ({done.seconds:.1f}s)")
        return 0
    if not done.added and not done.removed:
        progress.message(f"session {done.session.id} already has {spec.prefill} prefill and {spec.decode} decode "
                         "instances: nothing changed")
        return 0
    progress.message(f"session {done.session.id} now runs {spec.prefill} prefill and {spec.decode} decode instances: "
                     f"{_moved(done)} ({done.seconds:.1f}s)")
    return 0


@click.command()
@click.argument("host")
@session_option
@ssh_options
@drain_timeout
@version
def drain(**params) -> int:
    """Take HOST out for maintenance: its instances move to free devices elsewhere (each replacement serves before
    the old one drains), or stop where none is free; it takes no instance until `yrpd undrain HOST`."""
    api, deployment, progress = _open(params)
    done = api.drain_host(deployment, params["host"], drain_timeout_s=params["drain_timeout"], progress=progress)
    spec = done.deployment.spec
    progress.message(f"{params['host']} is drained in session {done.session.id}: {_moved(done)}; the deployment runs "
                     f"{spec.prefill} prefill and {spec.decode} decode instances ({done.seconds:.1f}s)")
    return 0


@click.command()
@click.argument("host")
@session_option
@ssh_options
@version
def undrain(**params) -> int:
    """Bring HOST back from maintenance: it takes instances again, and those its drain stopped start again."""
    api, deployment, progress = _open(params)
    done = api.undrain_host(deployment, params["host"], progress=progress)
    progress.message(f"{params['host']} is back in session {done.session.id}: {_moved(done)} ({done.seconds:.1f}s)")
    return 0


@click.command()
@session_option
@ssh_options
@click.option("--for", "seconds", type=click.FloatRange(1, None), default=None, metavar="S",
              help="stop after S seconds [run until interrupted]")
@version
def planner(**params) -> int:
    """Hold the `planner:` targets of the deployment's spec: every interval, read the proxy's TTFT/ITL over the
    window and add, remove or move one prefill/decode instance within the hosts' devices (one change, then a
    cool-down). Each decision and its reason show in `yrpd status` and the session journal."""
    api, deployment, progress = _open(params)
    settings = deployment.spec.planner
    if settings is not None:
        itl = f", ITL p90 {settings.itl_p90_ms:g} ms" if settings.itl_p90_ms else ""
        progress.message(f"planner for session {deployment.session.id}: TTFT p90 {settings.ttft_p90_ms:g} ms{itl}, "
                         f"prefill {settings.min_prefill}-{settings.max_prefill}, decode {settings.min_decode}-"
                         f"{settings.max_decode}; Ctrl-C stops it (what it changed stays)")
    # Ctrl-C and a plain `kill` stop it, also where it was started in the background by a script: a shell without
    # job control starts those with SIGINT ignored, and Python then leaves it ignored (seen in CI: the SIGINT was lost)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        decisions = api.run_planner(deployment, seconds=params["seconds"], progress=progress)
    except KeyboardInterrupt:
        progress.message("planner stopped")
        return 0
    acted = [d for d in decisions if d.action.value != "hold"]
    progress.message(f"planner ran {len(decisions)} rounds, changed the deployment {len(acted)} times")
    return 0
