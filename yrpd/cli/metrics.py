"""`yrpd metrics targets` (the deployment's Prometheus scrape targets, for a `file_sd_configs` file) and `yrpd metrics
dashboard` (the Grafana dashboard that reads them)."""

from __future__ import annotations

# the library is imported inside the command: `--help` and usage errors load none of it (yrpd.api: ~0.2 s)

import json

import click

from yrpd.cli.options import session_option, version

#: the dashboard under dashboards/ (shipped as yrpd.dashboards)
DASHBOARD = "grafana-yrpd.json"


@click.group()
def metrics() -> None:
    """The deployment's metrics for a Prometheus the fleet runs."""


@metrics.command()
@session_option
@click.option("--out", type=click.Path(dir_okay=False), metavar="FILE",
              help="write the targets to FILE (replaced whole, so a Prometheus watching it never reads half) "
                   "[stdout]")
@version
def targets(**params) -> int:
    """Print the proxy's and every instance's /metrics as a Prometheus file_sd target list (labels: job, role,
    yrpd_instance, host, yrpd_session). Reads the session alone: no host is contacted."""
    import os

    from yrpd import api
    from yrpd.serving import scrape_targets

    deployment = api.open_deployment(params["session_id"])
    text = json.dumps(scrape_targets(deployment.spec, deployment.plan, deployment.session.id), indent=2) + "\n"
    if params["out"]:
        tmp = f"{params['out']}.tmp"
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, params["out"])
    else:
        click.echo(text, nl=False)
    return 0


@metrics.command()
@click.option("--out", type=click.Path(dir_okay=False), metavar="FILE", help="write it to FILE [stdout]")
@version
def dashboard(**params) -> int:
    """Print yrpd's Grafana dashboard (JSON, for Grafana's import): TTFT/ITL p90, requests and errors, routing, prompt
    tokens computed vs loaded, KV blocks saved/loaded, the data system's memory and reads per host. Its queries
    read what `yrpd metrics targets` lists."""
    from yrpd.assets import asset_dir

    text = (asset_dir("dashboards") / DASHBOARD).read_text()
    if params["out"]:
        with open(params["out"], "w") as fh:
            fh.write(text)
    else:
        click.echo(text, nl=False)
    return 0
