"""The docs that are generated from the code are up to date, and the commands the docs show parse."""

import re
import shlex
from pathlib import Path

import pytest

from yrpd.config_reference import render

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_configuration_reference_matches_the_spec_model():
    committed = (DOCS / "configuration-reference.md").read_text()
    assert committed == render(), "regenerate: python -m yrpd.config_reference > docs/configuration-reference.md"


def doc_commands():
    """Every `yrpd ...` line inside a fenced block of README.md and docs/*.md."""
    found = []
    for path in [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]:
        in_block = False
        for line in path.read_text().splitlines():
            if line.startswith("```"):
                in_block = not in_block
                continue
            text = line.split("#", 1)[0].strip()
            text = re.sub(r"^(\.venv/bin/|url=\$\()", "", text)
            if in_block and text.startswith("yrpd "):
                found.append((path.name, text.rstrip(")")))
    return found


@pytest.mark.parametrize("where,command", doc_commands())
def test_documented_command_is_accepted_by_the_cli(where, command):
    """Each documented command line parses: its subcommand and every option exist (nothing is run). Paths
    that exist only on the reader's machine are the one thing allowed to fail."""
    import click

    from yrpd.cli import cli

    words = shlex.split(command)[1:]
    ctx = cli.make_context("yrpd", list(words), resilient_parsing=True)
    sub, rest = cli.get_command(ctx, words[0]), words[1:]
    assert sub is not None, f"{where}: unknown subcommand in {command!r}"
    if isinstance(sub, click.Group):
        sub, rest = sub.get_command(ctx, rest[0]), rest[1:]
        assert sub is not None, f"{where}: unknown subcommand in {command!r}"
    try:
        sub.make_context(sub.name, rest, parent=ctx).close()
    except click.BadParameter as exc:
        assert "does not exist" in exc.format_message(), f"{where}: {command!r}: {exc.format_message()}"
