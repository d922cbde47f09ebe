"""`kv_connector: ascend-store` against the real vllm-ascend source distributions and the data-system client yrpd
installs: every name yrpd writes (connector, module, backend, config keys, environment) is one the release's source
reads, every HeteroClient call its yuanrong backend makes exists in openyuanrong-datasystem's hetero_client.py (or
is switched off by what yrpd sets), and yrpd refuses exactly the releases whose backend calls what that client lacks.

The sources are parsed (ast), never imported: they need torch_npu and CANN. The sdists come from
scripts/fetch_vllm_ascend_sources.sh into the patch tests' cache; their sha256 is pinned here. Without them (no
index) the tests skip, under CI they fail.
"""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from yrpd import ascend_store
from yrpd.errors import SpecError
from tests.prereq import missing

pytestmark = pytest.mark.e2e

CACHE = Path(os.environ.get("YRPD_VLLM_ASCEND_SRC", "/var/cache/yrpd/vllm-ascend-src"))
ENV_ROOT = Path(os.environ.get("YRPD_TEST_ENV_ROOT", "/opt/yrpd/venvs"))
#: the first release with the yuanrong backend, today's release, and every release whose backend reads
#: YR_CONFIG_PATH (served with a data system the user brings) up to the newest pre-release
SDISTS = {
    "0.19.1rc1": "1e1d27a5cc5775a8b5fc6c09fbae07fb3c5625e5622cdb13d14eb3e2a8837e23",
    "0.23.0": "a58db76eaffcf328b13b315a0db3a57d381a8947d01057ddcefe4ad02372b242",
    "0.27.1rc1": "6fa8b357b624df4c8810c445da24082a9147009d8fe1db33eff815c8ab9805f0",
    "0.28.0rc1": "bde8bf4207d225df86d8f3b7d9b2bd89ff5e5e56af0cbe4bf8b5b691b98bbe95",
    "0.29.0rc1": "680f58f98b8a8a4d92380f77a5d3949107da6db0b7cfc17834898d32fdfcdfd1",
    "0.30.0rc1": "62466241beb151652e95ae47f1d1f5cb7bf66367d6e5c14c74d6b72c0f026ebe",
    "0.30.0rc2": "05cb51448c0cd174ea338b16ebbfc8e215f44b373ea2a0d65f1314523a01152f",
}
KV_TRANSFER = "vllm_ascend/distributed/kv_transfer"
STORE_DIR = f"{KV_TRANSFER}/kv_pool/ascend_store"


_unavailable = missing


@pytest.fixture(scope="module")
def sources() -> Path:
    proc = subprocess.run([str(REPO / "scripts" / "fetch_vllm_ascend_sources.sh"), str(CACHE), *SDISTS],
                          capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
    missing = [v for v in SDISTS if not (CACHE / v / "PKG-INFO").is_file()]
    if proc.returncode != 0 or missing:
        _unavailable(f"vllm-ascend sources not in {CACHE} (missing {missing or 'none'}): "
                     f"{(proc.stderr or proc.stdout).strip()[-800:]}")
    for version, sha in SDISTS.items():
        archive = CACHE / ".sdist" / f"vllm_ascend-{version}.tar.gz"
        assert hashlib.sha256(archive.read_bytes()).hexdigest() == sha, f"{archive} changed upstream"
    return CACHE


@pytest.fixture(scope="module")
def hetero_client() -> tuple[set[str], set[str]]:
    """(public methods, constructor parameters) of HeteroClient in the data-system wheel yrpd installs."""
    found = sorted(ENV_ROOT.glob("ds/lib/python3*/site-packages/yr/datasystem/hetero_client.py"))
    if not found:
        _unavailable(f"no data-system venv under {ENV_ROOT}: run deploy_scripts/install_openyuanrong.sh")
    tree = ast.parse(found[0].read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "HeteroClient")
    methods = {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}
    init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    return methods, {a.arg for a in init.args.args[1:]}


def parse(root: Path, rel: str) -> ast.Module:
    return ast.parse((root / rel).read_text())


def strings_read(trees: list[ast.Module]) -> set[str]:
    """String keys read with .get("k", ...), vLLM's .get_from_extra_config("k", ...) or ["k"] anywhere in the trees."""
    keys = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("get", "get_from_extra_config") \
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                keys.add(node.args[0].value)
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                    and isinstance(node.slice.value, str):
                keys.add(node.slice.value)
    return keys


def env_read(tree: ast.Module) -> set[str]:
    """Environment variables read with os.getenv / os.environ.get / os.environ[...]."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("getenv", "get") \
                and node.args and isinstance(node.args[0], ast.Constant):
            target = ast.unparse(node.func.value)
            if target in ("os", "os.environ"):
                names.add(node.args[0].value)
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ" \
                and isinstance(node.slice, ast.Constant):
            names.add(node.slice.value)
    return names


def client_calls(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(methods called on the backend's HeteroClient, keywords its constructor gets): the attribute the
    HeteroClient(...) result is stored in, then every self.<that>.<method>(...) call."""
    holders, keywords = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and ast.unparse(node.value.func).endswith("HeteroClient"):
            holders |= {ast.unparse(t) for t in node.targets}
            keywords |= {k.arg for k in node.value.keywords}
    assert holders, "the backend builds no HeteroClient"
    calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and ast.unparse(n.func.value) in holders}
    return calls, keywords


def registered(root: Path) -> dict[str, tuple[str, str]]:
    """name -> (module, class) of every KVConnectorFactory.register_connector call in vllm-ascend's registration."""
    out = {}
    for node in ast.walk(parse(root, f"{KV_TRANSFER}/__init__.py")):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("register_connector") and len(node.args) == 3:
            name, module, cls = (a.value if isinstance(a, ast.Constant) else None for a in node.args)
            out[name] = (module, cls)
    return out


@pytest.mark.parametrize("version", list(SDISTS))
def test_connector_module_backend_and_keys_are_what_the_release_reads(sources, version):
    root = sources / version
    names = registered(root)
    assert names[ascend_store.CONNECTOR] == (ascend_store.MODULE, ascend_store.CONNECTOR)
    assert names[ascend_store.HANDOVER][1] and ascend_store.MULTI in names
    module_file = root / (ascend_store.MODULE.replace(".", "/") + ".py")
    assert f"class {ascend_store.CONNECTOR}(" in module_file.read_text()
    # "yuanrong" selects the backend module yrpd names
    backend_file = root / (ascend_store.BACKEND_MODULE.replace(".", "/") + ".py")
    assert backend_file.is_file()
    maps = [n for f in (root / STORE_DIR).rglob("*.py") for n in ast.walk(ast.parse(f.read_text()))
            if isinstance(n, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == ascend_store.BACKEND
                                               for k in n.keys)]
    assert any(ascend_store.BACKEND_MODULE in ast.unparse(m) for m in maps), "no backend map names the module"
    # every key yrpd writes into the pool's and the hand-over's kv_connector_extra_config is read there
    written = ascend_store.kv_transfer_config("kv_producer", lookup_port=8300, handover={
        "kv_port": 62600, "prefill": {"dp_size": 1, "tp_size": 4}, "decode": {"dp_size": 1, "tp_size": 4}})
    mooncake, pool = written["kv_connector_extra_config"]["connectors"]
    store_trees = [ast.parse(f.read_text()) for f in (root / f"{KV_TRANSFER}/kv_pool").rglob("*.py")]
    assert set(pool["kv_connector_extra_config"]) <= strings_read(store_trees)
    p2p = [ast.parse(f.read_text()) for f in (root / f"{KV_TRANSFER}/kv_p2p").rglob("mooncake_connector.py")]
    mooncake_keys = set(mooncake["kv_connector_extra_config"]) | {"tp_size", "dp_size"}
    assert mooncake_keys <= strings_read(p2p)
    assert any(isinstance(n, ast.Attribute) and n.attr == "kv_port" for t in p2p for n in ast.walk(t))


@pytest.mark.parametrize("version", list(SDISTS))
def test_the_backend_calls_only_what_the_installed_client_has_or_yrpd_refuses_the_release(sources, hetero_client,
                                                                                         version):
    methods, params = hetero_client
    backend = parse(sources / version, ascend_store.BACKEND_MODULE.replace(".", "/") + ".py")
    calls, keywords = client_calls(backend)
    missing = calls - methods
    assert keywords <= params, f"constructor keywords the client lacks: {keywords - params}"
    env = env_read(backend)
    try:
        ascend_store.check(version, f"v{version}")
        offered = True
    except SpecError as refusal:
        offered = False
        message = str(refusal)
    if offered:
        # configured through the environment yrpd sets: the worker's address and remote H2D off; the one call the
        # client lacks (device-memory pre-registration) is only made with remote H2D on
        written = ascend_store.worker_env("10.0.0.1:31501")
        assert {ascend_store.WORKER_ENV, ascend_store.REMOTE_H2D_ENV} <= env, env
        assert {k for k in written if k.startswith("DS_")} <= env
        assert missing <= {"pre_register_device_memory"}, missing
        if missing:  # the function making that call tests the remote-H2D setting first
            caller = next(f for f in ast.walk(backend) if isinstance(f, ast.FunctionDef)
                          and any(isinstance(n, ast.Attribute) and n.attr == "pre_register_device_memory"
                                  for n in ast.walk(f)))
            tests = [ast.unparse(n.test) for n in ast.walk(caller) if isinstance(n, ast.If)]
            assert any("remote_h2d" in t for t in tests), tests
    else:
        # refused: it reads YR_CONFIG_PATH, and what it calls beyond the client is what the refusal names
        assert "YR_CONFIG_PATH" in env and ascend_store.WORKER_ENV not in env
        assert set(ascend_store.MISSING_IN_DATASYSTEM) <= missing <= \
            set(ascend_store.MISSING_IN_DATASYSTEM) | {"pre_register_device_memory"}
        for name in ascend_store.MISSING_IN_DATASYSTEM:
            assert name in message
    assert offered == (not ascend_store.reads_json(version))


@pytest.mark.parametrize("version", [v for v in SDISTS if ascend_store.reads_json(v)])
def test_with_a_brought_data_system_the_json_yrpd_writes_is_what_the_release_reads(sources, hetero_client, version,
                                                                                 tmp_path):
    """The releases that read YR_CONFIG_PATH, served with a data system the user brings: every key of the JSON yrpd
    writes is one the backend reads, the worker's address among them, and what the backend calls is the installed
    client's methods plus those the brought wheel must have (yrpd refuses a wheel without them). The brought wheel
    here is the installed 0.8.1 client's methods plus those (a FAKE: no newer wheel is on the package index)."""
    from tests.unit.test_ascend_store import NEWER_CALLS, fake_wheel
    from yrpd import dswheels

    backend = parse(sources / version, ascend_store.BACKEND_MODULE.replace(".", "/") + ".py")
    assert ascend_store.CONFIG_PATH_ENV in env_read(backend)
    written = ascend_store.json_config("10.0.0.1:31501")
    assert set(written) <= strings_read([backend]) and ascend_store.WORKER_KEY in written
    methods, _ = hetero_client
    calls, _ = client_calls(backend)
    assert calls - methods - set(ascend_store.MISSING_IN_DATASYSTEM) <= {"pre_register_device_memory"}
    assert set(NEWER_CALLS) == set(ascend_store.MISSING_IN_DATASYSTEM)
    fake_wheel(tmp_path, "0.9.2", tuple(sorted(methods | set(NEWER_CALLS))))
    ascend_store.check(version, f"v{version}", dswheels.bring(str(tmp_path)))  # offered
