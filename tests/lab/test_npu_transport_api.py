"""yrpd's NPU transport (yrpd/connector/transport.py: NpuTransport, hetero_client_factory, device_blob_lists) against
the data-system client yrpd installs, by reading both sources: it has never run here (HeteroClient's device calls
need CANN and an NPU), so every call it makes is checked for name, arity and keywords against
yr/datasystem/hetero_client.py of the pinned wheel, and every attribute it reads back for presence."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.prereq import missing

pytestmark = pytest.mark.e2e

ENV_ROOT = Path(os.environ.get("YRPD_TEST_ENV_ROOT", "/opt/yrpd/venvs"))
TRANSPORT = REPO / "yrpd" / "connector" / "transport.py"
WORKER = REPO / "yrpd" / "connector" / "worker.py"


@pytest.fixture(scope="module")
def client_source() -> Path:
    found = sorted(ENV_ROOT.glob("ds/lib/python3*/site-packages/yr/datasystem"))
    if not found:
        missing(f"no data-system venv under {ENV_ROOT}: run deploy_scripts/install_openyuanrong.sh")
    return found[0]


def classes(path: Path) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}


def signature(cls: ast.ClassDef, name: str) -> tuple[list[str], int]:
    """(parameter names after self, how many have no default) of a method."""
    fn = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == name)
    params = [a.arg for a in fn.args.args[1:]]
    return params, len(params) - len(fn.args.defaults)


def attributes_set(cls: ast.ClassDef) -> set[str]:
    return {t.attr for n in ast.walk(cls) if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"}


def test_every_hetero_client_call_of_the_npu_transport_exists_with_that_shape(client_source):
    hetero = classes(client_source / "hetero_client.py")
    client = hetero["HeteroClient"]
    ours = classes(TRANSPORT)["NpuTransport"]
    # the transport's calls go through DsConnection.call("name", lambda c: c.<method>(args...))
    calls = [n for n in ast.walk(ours) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and ast.unparse(n.func.value) == "c"]
    assert {c.func.attr for c in calls} == {"exist", "mset_d2h", "mget_h2d", "delete"}
    for call in calls:
        params, required = signature(client, call.func.attr)
        given = len(call.args) + len(call.keywords)
        assert required <= given <= len(params), (call.func.attr, params, ast.unparse(call))
        assert {k.arg for k in call.keywords} <= set(params), ast.unparse(call)
    # the factory's constructor keywords
    tree = ast.parse(TRANSPORT.read_text())
    made = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "HeteroClient"]
    init_params, _ = signature(client, "__init__")
    assert made and all({k.arg for k in m.keywords} <= set(init_params) for m in made)
    # Blob(dev_ptr, size) and DeviceBlobList(dev_idx, blob_list) as device_blob_lists builds them, and the attributes
    # save_blocks reads back to count the bytes it wrote
    for name, arity, attrs in (("Blob", 2, {"size"}), ("DeviceBlobList", 2, {"blob_list"})):
        params, required = signature(hetero[name], "__init__")
        assert required <= arity <= len(params), (name, params)
        assert attrs <= attributes_set(hetero[name]), name


def test_what_the_connector_imports_for_the_npu_path_is_exported(client_source):
    exported = set()
    for node in ast.walk(ast.parse((client_source / "__init__.py").read_text())):
        if isinstance(node, ast.ImportFrom):
            exported |= {a.asname or a.name for a in node.names}
    imported = set()
    for path in (TRANSPORT, WORKER):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "yr.datasystem":
                imported |= {a.name for a in node.names}
    assert {"HeteroClient", "Blob", "DeviceBlobList"} <= imported
    assert imported <= exported, imported - exported
