"""Where the files that ship beside the code live: host scripts and playbooks.

In a source checkout they sit at the repository root (`deploy_scripts/`, `playbooks/`); an installed wheel
carries them as the packages `yrpd.deploy_scripts` and `yrpd.playbooks` (see pyproject.toml).
"""

from __future__ import annotations

import threading
from functools import lru_cache
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


#: one parse at a time: CPython 3.11 keeps the AST constructor's recursion count in state the threads share, and two
#: parses at once can fail with "SystemError: AST constructor recursion depth mismatch" (python/cpython#106905); the
#: steps build the hosts' commands in threads, so their scripts are parsed in threads
_PARSING = threading.Lock()


def parse_python(text: str):
    """`ast.parse(text)`, never two at once in this process (see _PARSING)."""
    import ast  # only where Python is parsed

    with _PARSING:
        return ast.parse(text)


@lru_cache(maxsize=None)
def asset_dir(name: str) -> Path:
    checkout = _ROOT / name
    if checkout.is_dir():
        return checkout
    installed = Path(__file__).resolve().parent / name
    if installed.is_dir():
        return installed
    raise FileNotFoundError(f"yrpd is installed without its {name}/ directory")


#: the host scripts' shared module (deploy_scripts/hostlib.py), and the import line a script takes it with
HOSTLIB = "hostlib.py"
_HOSTLIB_IMPORT = "from hostlib import "
#: the install scripts' shared shell functions (deploy_scripts/pyinstall.sh), and the line a script sources them with
PYINSTALL = "pyinstall.sh"
_PYINSTALL_SOURCE = f'. "$(dirname "${{BASH_SOURCE[0]}}")/{PYINSTALL}"'


def deploy_script(name: str) -> str:
    """The script's text as it travels to a host: its `from hostlib import ...` line replaced by hostlib's own text (a
    shell script's line sourcing pyinstall.sh by pyinstall.sh's), so it runs as one piece from a here-document
    (where nothing would be found beside it)."""
    scripts = asset_dir("deploy_scripts")
    text = (scripts / name).read_text()
    if not name.endswith(".py"):
        shared = (scripts / PYINSTALL).read_text()
        return "".join(f"# --- deploy_scripts/{PYINSTALL} ---\n{shared}# --- end of {PYINSTALL} ---\n"
                       if line.rstrip("\n") == _PYINSTALL_SOURCE else line for line in text.splitlines(keepends=True))
    import ast  # only for the Python scripts

    text = _as_shipped(text, name)
    if _HOSTLIB_IMPORT not in text:
        return text
    spans = [(n.lineno, n.end_lineno) for n in parse_python(text).body
             if isinstance(n, ast.ImportFrom) and n.module == "hostlib"]
    lines = text.splitlines(keepends=True)
    shared = _as_shipped((scripts / HOSTLIB).read_text(), HOSTLIB)
    for first, last in reversed(spans):  # the whole statement, continuation lines too
        lines[first - 1:last] = [f"# --- deploy_scripts/{HOSTLIB} ---\n{shared}# --- end of {HOSTLIB} ---\n"]
    return "".join(lines)


@lru_cache(maxsize=64)  # every host command carries one or more: tokenize and parse each text once
def _as_shipped(text: str, name: str) -> str:
    """The script as it travels: its docstrings (the module's, each function's and class's) cut to their first line
    and its comment-only lines left out. Every host command must fit one exec argument (128 KiB), and a step can
    carry several scripts, each with hostlib; the full text stays in the source."""
    import ast
    import io
    import tokenize

    if not text.strip():
        return text
    drop = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type == tokenize.COMMENT and not tok.line[:tok.start[1]].strip() and not tok.string.startswith("#!")}
    lines = text.splitlines(keepends=True)
    tree = parse_python(text)
    scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    owners = [tree, *(n for n in ast.walk(tree) if isinstance(n, scopes))]
    for owner in owners:
        doc = owner.body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        start, end = doc.lineno, doc.end_lineno
        # only a docstring on lines of its own: `def f(): """..."""` or `"""..."""; x = 1` stay as written
        if lines[start - 1][:doc.col_offset].strip() or lines[end - 1][doc.end_col_offset:].strip():
            continue
        summary = (doc.value.value.strip().splitlines() or [""])[0]
        if owner is tree:
            summary += f" (in full: yrpd's deploy_scripts/{name})"
        lines[start - 1:end] = [" " * doc.col_offset + repr(summary) + "\n"] + [""] * (end - start)
    return "".join(line for number, line in enumerate(lines, 1) if number not in drop)


def playbook_path(name: str) -> Path:
    return asset_dir("playbooks") / f"{name}.yaml"


def patches_dir() -> Path:
    """The patch series root (`<target>/<series>/manifest.yaml` below it): `patches/` in a source checkout,
    the package `yrpd.patches_data` in an installed wheel (`yrpd.patches` is the module that applies them)."""
    checkout = _ROOT / "patches"
    if any(checkout.glob("*/*/manifest.yaml")):
        return checkout
    installed = Path(__file__).resolve().parent / "patches_data"
    if installed.is_dir():
        return installed
    raise FileNotFoundError("yrpd is installed without its patch series (patches/ or yrpd/patches_data/)")


def container_profiles_dir() -> Path:
    """The container profiles (`<name>.yaml`): `containers/` in a source checkout, the package
    `yrpd.container_profiles` in an installed wheel (`yrpd.containers` is the module that renders them)."""
    checkout = _ROOT / "containers"
    if checkout.is_dir():
        return checkout
    installed = Path(__file__).resolve().parent / "container_profiles"
    if installed.is_dir():
        return installed
    raise FileNotFoundError("yrpd is installed without its container profiles (containers/ or yrpd/container_profiles/)")
