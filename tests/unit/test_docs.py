"""The docs that are generated from the code are up to date, and every command the docs show is run by a test.

Which test runs which documented command: tests/doc_commands.py. This file runs the ones that need no host and
checks the published benchmark against the command that is documented to produce it."""

import json
import os
import subprocess
import sys

import pytest

from tests.doc_commands import (REPO, RUNNERS, as_run_without_changes, commands, documented_commands,
                                is_the_published_benchmark, needs_no_host, words)
from tests.doc_figures import FIGURE, FIGURE_DOCS, blocks, found_in, numbers, provenance_missing, unsupported
from yrpd.config_reference import render

DOCS = REPO / "docs"
PUBLISHED_RESULTS = DOCS / "bench" / "cpu-bench-qwen2-results.json"


def test_configuration_reference_matches_the_spec_model():
    committed = (DOCS / "configuration-reference.md").read_text()
    assert committed == render(), "regenerate: python -m yrpd.config_reference > docs/configuration-reference.md"


@pytest.mark.parametrize("where,command", documented_commands())
def test_every_documented_command_is_run_by_some_test(where, command):
    runners = [r.__name__ for r in RUNNERS if r(command)]
    assert runners, f"{where}: no test runs {command!r}: extend a predicate in tests/doc_commands.py and its test"


@pytest.mark.parametrize("where,command", documented_commands())
def test_documented_command_is_accepted_by_the_cli(where, command):
    """Each documented command line parses: its subcommand and every option exist. Paths that exist only on the
    reader's machine are the one thing allowed to fail."""
    import click

    from yrpd.cli import cli

    argv = words(command)
    ctx = cli.make_context("yrpd", list(argv), resilient_parsing=True)
    sub, rest = cli.get_command(ctx, argv[0]), argv[1:]
    assert sub is not None, f"{where}: unknown subcommand in {command!r}"
    if isinstance(sub, click.Group):
        sub, rest = sub.get_command(ctx, rest[0]), rest[1:]
        assert sub is not None, f"{where}: unknown subcommand in {command!r}"
    try:
        sub.make_context(sub.name, rest, parent=ctx).close()
    except click.BadParameter as exc:
        assert "does not exist" in exc.format_message(), f"{where}: {command!r}: {exc.format_message()}"


@pytest.mark.parametrize("command", commands(needs_no_host))
def test_documented_placement_runs_and_touches_nothing(command, tmp_path):
    """`yrpd plan ...` as documented, and `yrpd deploy ...` as documented plus --dry-run: the plan table and the
    per-host commands, no session written."""
    argv = as_run_without_changes(command)
    home = tmp_path / "home"
    proc = subprocess.run([sys.executable, "-m", "yrpd", *argv], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "YRPD_HOME": str(home)}, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Placement: 1 prefill") and "prefill-0" in proc.stdout and "decode-0" in proc.stdout
    assert "Commands per host, in order" in proc.stdout
    assert "\ndtype: " in proc.stdout  # the dtype the instances will compute in, and why
    assert not (home / "sessions").exists() or not any((home / "sessions").iterdir())


def test_documented_commands_exist_for_every_runner():
    """A predicate that selects nothing means its test silently runs nothing."""
    for runner in RUNNERS:
        assert commands(runner), f"{runner.__name__} selects no documented command"


@pytest.mark.parametrize("command", commands(is_the_published_benchmark))
def test_published_benchmark_results_are_what_the_documented_command_produces(command):
    """docs/bench/ holds the results of `yrpd bench run` as benchmarks.md shows it (plain `yrpd bench run` means
    the defaults): the dataset and answer length recorded in the results are the command's options."""
    from yrpd.cli.bench import run as bench_run

    params = bench_run.make_context("run", words(command)[2:]).params
    results = json.loads(PUBLISHED_RESULTS.read_text())
    dataset = results["dataset"]
    for option in ("groups", "prompts_per_group", "prefix_len", "suffix_len", "seed"):
        assert dataset[option] == params[option], (option, command)
    assert dataset["prompts"] == params["groups"] * params["prompts_per_group"]
    for name, target in results["targets"].items():
        assert target["metrics"]["completed"] == dataset["prompts"], name
        assert target["metrics"]["total_output_tokens"] == dataset["prompts"] * params["output_len"], name


@pytest.mark.parametrize("doc", FIGURE_DOCS)
def test_every_measured_figure_rests_on_a_linked_report_that_says_where_it_came_from(doc):
    """tests/doc_figures.py: each figure's paragraph, list item or table row (or what introduces it) links a report
    under docs/bench/ that names its commit, CPU and command."""
    problems = [why for block in blocks(doc) if (why := unsupported(block))]
    assert problems == [], "\n".join(problems)


def test_every_report_any_doc_links_exists_and_says_where_it_came_from():
    linked = {r for doc in ("README.md", *(p.relative_to(REPO).as_posix() for p in DOCS.glob("*.md")))
              for block in blocks(doc) for r in block.reports()}
    assert linked
    lacking = {r: provenance_missing(r) for r in sorted(linked) if provenance_missing(r)}
    assert lacking == {}, lacking


def test_the_readmes_figures_are_the_ones_in_their_reports():
    """Each figure README.md states (each end of a range) is a number of a report its row links, as rounded there."""
    wrong = []
    for block in blocks("README.md"):
        pool = [n for r in block.reports() for n in numbers(r)]
        for figure in block.figures():
            match = FIGURE.match(figure)
            for value in filter(None, match.groups()[:2]):
                if not found_in(value, pool):
                    wrong.append(f"README.md:{block.line}: {figure} ({value} is in none of {block.reports()})")
    assert wrong == [], "\n".join(wrong)


GOOD = {"provenance": {"commit": "abc1234", "dirty": False, "yrpd": "0", "vllm": "0", "python": "3.11", "cpu": "X",
                       "cpu_flags": [], "cores": 2, "commands": ["yrpd bench run"], "inputs": {}, "recorded": "t"},
        "figures": {"took_s": 1.25}}


def test_the_figure_check_finds_what_it_must(tmp_path):
    """The control: a figure without a link, one linking a report without provenance, and one with a good report."""
    (tmp_path / "docs" / "bench").mkdir(parents=True)
    (tmp_path / "docs" / "bench" / "good.json").write_text(json.dumps(GOOD))
    (tmp_path / "docs" / "bench" / "bare.json").write_text(json.dumps({"figures": {"took_s": 1.25}}))
    doc = "docs/x.md"
    text = ("It took 1.25 s.\n\nIt took 1.25 s ([r](bench/bare.json)).\n\nIt took 1.25 s ([r](bench/good.json)).\n\n"
            "A setting: `timeout 30 s`, no figure.\n\n| what | s |\n|---|---|\n| took 1.25 s | x |\n")
    found = [unsupported(b, tmp_path) for b in blocks(doc, text)]
    assert [f.split(": ", 2)[-1] if f else None for f in found] == [
        "no report linked", "reports without provenance {'docs/bench/bare.json': ['commit', 'cpu', 'command']}", None,
        None, None, "no report linked"]  # the table's head row has no figure; its row has
    assert found_in("1.3", numbers("docs/bench/good.json", tmp_path)) and not found_in("1.5", [1.25])
