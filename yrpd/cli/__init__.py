"""The `yrpd` command. Subcommands live one per module and are imported only when run, so `yrpd --help` is fast."""

from __future__ import annotations

import importlib
import sys

import click

from yrpd import __version__

# name -> (module, one-line help); the help is here so listing commands imports nothing
COMMANDS: dict[str, tuple[str, str]] = {
    "deploy": ("yrpd.cli.deploy", "Deploy PD serving onto the hosts (resumes a failed deploy)."),
    "plan": ("yrpd.cli.plan", "Show where every instance goes and the commands a deploy would run."),
    "status": ("yrpd.cli.status", "Show hosts, processes and instances of a deployment."),
    "logs": ("yrpd.cli.logs", "Tail the session's logs from every host."),
    "down": ("yrpd.cli.down", "Tear a deployment down and verify nothing is left."),
    "scale": ("yrpd.cli.live", "Add or remove prefill/decode instances of a running deployment, dropping no request."),
    "drain": ("yrpd.cli.live", "Move a host's instances elsewhere for maintenance, dropping no request."),
    "undrain": ("yrpd.cli.live", "Let a drained host take instances again."),
    "planner": ("yrpd.cli.live", "Hold the spec's TTFT/ITL targets by adding, removing or moving instances."),
    "metrics": ("yrpd.cli.metrics", "Print the deployment's Prometheus scrape targets, or yrpd's Grafana dashboard."),
    "ask": ("yrpd.cli.ask", "Ask the deployment the demo's two questions; show where each prompt's KV came from."),
    "bench": ("yrpd.cli.bench", "Benchmark a deployment against its baselines (dataset, run, report)."),
    "patch": ("yrpd.cli.patch", "List, check, apply or revert the vllm-ascend patch series on a source tree."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module = importlib.import_module(COMMANDS[name][0])
        return getattr(module, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_text) for name, (_, help_text) in COMMANDS.items()])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="yrpd")
def cli() -> None:
    """Deploy prefill/decode-disaggregated vLLM serving with openYuanrong onto hosts over SSH."""


def main(argv: list[str] | None = None) -> None:
    from yrpd.errors import YrpdError

    try:
        code = cli.main(args=argv, prog_name="yrpd", standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.Abort:
        print("aborted", file=sys.stderr)
        code = 130
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except click.ClickException as exc:
        # one line, no usage block: the message already names the option
        print(f"error: {exc.format_message()}", file=sys.stderr)
        code = 2 if isinstance(exc, click.UsageError) else exc.exit_code
    except YrpdError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = exc.exit_code
    except Exception as exc:  # a bug: say so plainly; the traceback is one variable away
        import os
        import traceback

        if os.environ.get("YRPD_DEBUG"):
            traceback.print_exc()
        print(f"internal error: {type(exc).__name__}: {exc} (set YRPD_DEBUG=1 for the traceback and report it)",
              file=sys.stderr)
        code = 70
    sys.exit(code if isinstance(code, int) else 0)
