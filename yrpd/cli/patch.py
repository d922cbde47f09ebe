"""`yrpd patch`: the vllm-ascend patch series (list, check, apply, revert on a local source tree).

Exit codes: 0 done (or nothing to do); 1 the tree is partially patched or conflicts (file-by-file report,
nothing changed) or the reinstall command failed; 2 bad input: not a tree of the target, a version no series
supports, a series whose files fail their checksums.
"""

from __future__ import annotations

# the library is imported inside the command: `yrpd patch --help` and usage errors load none of it (yrpd.api: ~0.2 s)

import json
from pathlib import Path

import click

from yrpd.cli.options import version


def _series_option(func):
    return click.option("--series", "series_root", metavar="DIR", type=click.Path(file_okay=False, path_type=Path),
                        help="series directory: one series (holding manifest.yaml) or a root of "
                             "<target>/<series>/ [the series shipped with yrpd]")(func)


def _target_option(func):
    return click.option("--target", "target", metavar="DIR", required=True,
                        type=click.Path(exists=True, file_okay=False, path_type=Path),
                        help="source tree to act on, e.g. /vllm-workspace/vllm-ascend or an unpacked sdist")(func)


def _json_option(func):
    return click.option("--json", "as_json", is_flag=True, help="print the result as one JSON document")(func)


def _reinstall_option(func):
    return click.option("--reinstall-cmd", "reinstall_cmd", metavar="CMD",
                        help="shell command run in the tree only when the tree changed, e.g. "
                             "'pip install -e . --no-deps --no-build-isolation'; it gets YRPD_PATCH_ACTION, "
                             "YRPD_PATCH_SERIES, YRPD_PATCH_VERSION and SETUPTOOLS_SCM_PRETEND_VERSION_FOR_<TARGET> "
                             "(the tree's version, unless already set) [none: the caller decides, see `changed` "
                             "in --json]")(func)


@click.group()
@version
def patch() -> None:
    """List, check, apply and revert yrpd's patch series on a vllm-ascend source tree."""


@patch.command("list")
@_series_option
@_json_option
def list_(series_root: Path | None, as_json: bool) -> int:
    """Show every series: target, versions it applies to, its patches and what they do."""
    from yrpd import patches as P

    all_series = P.load_all(series_root or P.default_root())
    rows = []
    bad = 0
    for s in all_series:
        tampered = s.tampered()
        bad += bool(tampered)
        rows.append((s, tampered))
    if as_json:
        click.echo(json.dumps([{
            "series": s.id, "name": s.name, "target": s.target, "versions": s.versions,
            "source_version": s.source_version, "description": s.description, "directory": str(s.directory),
            "base_tree_sha256": s.base_tree_sha256, "series_sha256": s.digest(), "checksums_ok": not t,
            "files": s.files,
            "patches": [{"file": p.file, "sha256": p.sha256, "description": " ".join(p.description.split())}
                        for p in s.patches],
        } for s, t in rows], indent=2))
    else:
        for s, tampered in rows:
            n = len(s.patches)
            click.echo(f"{s.id}: {s.target} {s.versions} ({n} patch{'es' if n != 1 else ''}, "
                       f"checksums {'FAILED' if tampered else 'ok'})")
            click.echo(f"  {s.description}")
            for p in s.patches:
                click.echo(f"  {p.file}  [{', '.join(p.paths)}]")
            for line in tampered:
                click.echo(f"  TAMPERED: {line}")
    if bad:
        click.echo(f"error: {bad} series failed their checksums", err=True)
        return 2
    return 0


def _emit(outcome, as_json: bool, extra_lines: bool = True) -> None:
    if as_json:
        click.echo(json.dumps(outcome.as_dict(), indent=2))
        return
    click.echo(outcome.message)
    state = outcome.state
    if state.base_matches is False:
        click.echo(f"  note: the touched files differ from those of {state.series.target} "
                   f"{state.series.source_version}, which the series was written against (git apply decided)")
    if extra_lines:
        for f in state.files:
            click.echo(f"  {f.state:<11} {f.path}" + (f" ({f.detail})" if f.detail else ""))


def _reinstall(cmd: str | None, target: Path, outcome) -> int:
    if not cmd or not outcome.changed:
        return 0
    from yrpd import patches as P

    click.echo(f"reinstalling: {cmd}", err=True)
    returncode = P.run_reinstall(cmd, target, outcome)
    if returncode != 0:
        click.echo(f"error: reinstall command exited {returncode}; the tree is "
                   f"{'patched' if outcome.action == 'apply' else 'reverted'}, the installed package may be stale",
                   err=True)
        return 1
    return 0


@patch.command()
@_target_option
@_series_option
@_json_option
def check(target: Path, series_root: Path | None, as_json: bool) -> int:
    """Exit 0 when the tree's series applies cleanly or is already applied (saying which)."""
    from yrpd import patches as P

    _emit(P.check(target, series_root), as_json)
    return 0


@patch.command()
@_target_option
@_series_option
@_reinstall_option
@_json_option
def apply(target: Path, series_root: Path | None, reinstall_cmd: str | None, as_json: bool) -> int:
    """Apply the tree's series (all or nothing; already applied: nothing changes)."""
    from yrpd import patches as P

    outcome = P.apply(target, series_root)
    _emit(outcome, as_json, extra_lines=not outcome.changed)
    return _reinstall(reinstall_cmd, target, outcome)


@patch.command()
@_target_option
@_series_option
@_reinstall_option
@_json_option
def revert(target: Path, series_root: Path | None, reinstall_cmd: str | None, as_json: bool) -> int:
    """Reverse the tree's series; the patched files come back byte for byte."""
    from yrpd import patches as P

    outcome = P.revert(target, series_root)
    _emit(outcome, as_json, extra_lines=False)
    return _reinstall(reinstall_cmd, target, outcome)
