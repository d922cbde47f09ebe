"""The layers of the yrpd package, bottom first, and a check of its imports against them, read from the code.

A module may import from its own layer and the layers below; never from one above, and no chain of imports may come
back to where it started (import loops hide an upward import). Every import counts, those inside functions too (they
run sooner or later); only `if TYPE_CHECKING:` blocks are left out, as Python leaves them out. A new module must be
placed here: an unplaced one fails the test. docs/architecture.md draws this list.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "yrpd"

#: bottom first: (what the layer is, the modules or packages in it)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("facts every layer reads: errors, versions, paths on the hosts, port blocks, the model catalogue, sessions",
     ("yrpd", "yrpd.errors", "yrpd.versions", "yrpd.console", "yrpd.assets", "yrpd.layout", "yrpd.ports",
      "yrpd.models", "yrpd.credentials", "yrpd.logtail", "yrpd.session")),
    ("what runs on the hosts or inside vLLM (stdlib and vLLM's own packages only)",
     ("yrpd.connector", "yrpd.proxy", "yrpd.demo")),
    ("acting on hosts: SSH and local runners", ("yrpd.hostgroup", "yrpd.testing")),
    ("catalogues the spec checks against: container profiles, patches, wheel sets, connector rules, cluster configs",
     ("yrpd.containers", "yrpd.patches", "yrpd.wheels", "yrpd.ascend_store", "yrpd.cluster")),
    ("the user's spec", ("yrpd.spec", "yrpd.config_reference")),
    ("the plan: placement and its dtype, the reconciler's steps, the SLA planner's decision",
     ("yrpd.placement", "yrpd.reconcile", "yrpd.planner")),
    ("what serves where: launches, exposure, the bench peers' own venvs",
     ("yrpd.serving", "yrpd.exposure", "yrpd.peers")),
    ("steps: pure functions of (context, host) returning a command", ("yrpd.steps",)),
    ("running steps and reading hosts back", ("yrpd.playbook", "yrpd.runner", "yrpd.deployment", "yrpd.status")),
    ("the library API, and where its measurements came from",
     ("yrpd.live", "yrpd.api", "yrpd.bench", "yrpd.provenance")),
    ("presentation", ("yrpd.render",)),
    ("the command line", ("yrpd.cli", "yrpd.__main__")),
]


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the package that `name` imports (a name imported from a package counts as its submodule when
    there is one, else as the package)."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            named.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
            named.update(subs or {base})
    found = set()
    for module in named:
        while module and module not in known:
            module = module.rpartition(".")[0]
        if module and module.split(".")[0] == "yrpd" and module != name:
            found.add(module)
    return found


def layer_of(module: str) -> int | None:
    best, depth = None, -1
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if (module == member or module.startswith(member + ".")) and member.count(".") > depth:
                best, depth = index, member.count(".")
    return best


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_every_module_has_a_layer():
    assert [m for m in modules() if layer_of(m) is None] == []


def upward(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)}: {LAYERS[layer_of(b)][0]})"
                  for a, targets in g.items() for b in targets if layer_of(b) > layer_of(a))


def loops(g: dict[str, set[str]]) -> list[str]:
    found, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(g[module]):
            if state.get(target) == "open":
                found.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(g):
        if module not in state:
            visit(module, [module])
    return found


def test_no_module_imports_from_a_layer_above_its_own():
    assert upward(graph()) == []


def test_no_import_comes_back_to_where_it_started():
    assert loops(graph()) == []


def test_the_check_sees_an_upward_import_and_a_loop(tmp_path, monkeypatch):
    """The control: a package whose lowest module imports its highest (inside a function), which imports it back."""
    pkg = tmp_path / "yrpd"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("def f():\n    from yrpd.cli import main\n")
    (pkg / "cli" / "__init__.py").write_text("from yrpd import errors\nmain = 1\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["PACKAGE"]), "PACKAGE", pkg)
    g = graph()
    assert upward(g) == ["yrpd.errors (layer 0) imports yrpd.cli (layer 11: the command line)"]
    assert loops(g) == ["yrpd.cli -> yrpd.errors -> yrpd.cli"]


# -- what ships to the hosts


def loaded_at_import(source: str, module: str) -> set[str]:
    """The yrpd modules the import of `module` loads: its imports outside functions (module level, if/try
    included); for a package's __init__, pass `<package>.__init__`."""
    package = module
    found: set[str] = set()

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if isinstance(node, ast.ClassDef):
                    visit(node.body)
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level] + ([base] if base else []))
                if base.startswith("yrpd"):
                    found.update({f"{base}.{a.name}" for a in node.names} | {base})
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("yrpd"))
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []) or [])

    visit(ast.parse(source).body)
    return found


def shipped_modules(files: list[str]) -> set[str]:
    return {f.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for f in files if f.endswith(".py")}


@pytest.mark.parametrize("which", ["code", "patch"])
def test_a_module_shipped_to_the_hosts_loads_only_what_ships_with_it(which):
    """The connector/proxy bundle and the patch bundle run on the hosts without the rest of yrpd: an import of a
    module left behind fails there ("No module named yrpd.assets"), not here. The control: the same check finds
    such an import in a module written for it."""
    import base64
    import io
    import tarfile

    from yrpd.steps.container import patch_bundle
    from yrpd.steps.vllm_env import bundle

    _, encoded = bundle() if which == "code" else patch_bundle()
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(encoded))) as tar:
        sources = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()
                   if m.name.startswith("yrpd/") and m.name.endswith(".py")}
    shipped = shipped_modules(list(sources))
    # a name imported from a shipped package may be a function or class of it, not a module
    missing = {(f, m) for f, src in sources.items()
               for m in loaded_at_import(src, f.removesuffix(".py").replace("/", "."))
               if m not in shipped and m.rsplit(".", 1)[0] not in shipped}
    assert missing == set()
    assert loaded_at_import("from yrpd.assets import patches_dir\n", "yrpd.patches") - shipped  # the control
