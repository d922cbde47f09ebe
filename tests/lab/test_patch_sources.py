"""The vllm-ascend patch series against the real vllm-ascend source distributions, through the `yrpd patch` CLI.

The sdists come from scripts/fetch_vllm_ascend_sources.sh (cached in $YRPD_VLLM_ASCEND_SRC, default
/var/cache/yrpd/vllm-ascend-src); one per series (its manifest's source_version). Every test works on a copy.
Without the sources (no index reachable) the tests skip - under CI they fail.

The connector-name check runs vllm-ascend's registration code in the vLLM CPU venv ($YRPD_VLLM_VENV, default
/opt/yrpd/venvs/vllm; see tests/lab/scripts/patch_registration_check.py for what runs and what cannot run without
torch_npu / Ascend CANN).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_yrpd
from tests.doc_commands import acts_on_a_source_tree, commands, words
from tests.prereq import missing

pytestmark = pytest.mark.e2e

SERIES_ROOT = REPO / "patches" / "vllm-ascend"
GUIDE_TREE = "/vllm-workspace/vllm-ascend"  # where the guide's image has the source tree
CACHE = Path(os.environ.get("YRPD_VLLM_ASCEND_SRC", "/var/cache/yrpd/vllm-ascend-src"))
CHECK_SCRIPT = Path(__file__).parent / "scripts" / "patch_registration_check.py"  # runs in the vLLM venv

# how each source version registers KV connectors (see docs/dev/patches.md):
#   package      - at import of vllm_ascend.distributed (0.10.x)
#   entry-point  - vllm.general_plugins entry point ascend_kv_connector = vllm_ascend:register_connector
REGISTRATION_PATH = {"0.10.0rc1": "package", "0.23.0.post1": "entry-point"}


def _manifests() -> dict[str, dict]:
    out = {}
    for manifest in sorted(SERIES_ROOT.glob("*/manifest.yaml")):
        data = yaml.safe_load(manifest.read_text())
        out[manifest.parent.name] = data
    return out


MANIFESTS = _manifests()
VERSIONS = [m["source_version"] for m in MANIFESTS.values()]


_unavailable = missing


@pytest.fixture(scope="module")
def sources() -> Path:
    proc = subprocess.run([str(REPO / "scripts" / "fetch_vllm_ascend_sources.sh"), str(CACHE)], capture_output=True,
                          text=True, timeout=1800, stdin=subprocess.DEVNULL)
    missing = [v for v in VERSIONS if not (CACHE / v / "PKG-INFO").is_file()]
    if proc.returncode != 0 or missing:
        _unavailable(f"vllm-ascend sources not available in {CACHE} (missing {missing or 'none'}); fetch script "
                     f"exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-800:]}")
    return CACHE


def _copy_tree(sources: Path, version: str, dest: Path) -> Path:
    tree = dest / f"vllm-ascend-{version}"
    shutil.copytree(sources / version, tree, symlinks=True)
    return tree


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry below root: files by sha256 and mode, symlinks by target, directories by mode."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            st = path.lstat()
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                out[rel] = ("dir", st.st_mode)
            else:
                out[rel] = ("file", st.st_mode, hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def _changed(before: dict, after: dict) -> set[str]:
    return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


def _touched_files(version: str) -> set[str]:
    manifest = next(m for m in MANIFESTS.values() if m["source_version"] == version)
    return set(manifest["base"]["files"])


def _series_dir(version: str) -> Path:
    return next(SERIES_ROOT / name for name, m in MANIFESTS.items() if m["source_version"] == version)


def test_every_series_has_a_registration_path():
    assert VERSIONS, "no vllm-ascend series found"
    assert set(VERSIONS) <= set(REGISTRATION_PATH), \
        f"add the registration path of {set(VERSIONS) - set(REGISTRATION_PATH)} to REGISTRATION_PATH"


@pytest.mark.parametrize("version", VERSIONS)
def test_apply_reapply_revert_byte_for_byte(sources, tmp_path, version):
    tree = _copy_tree(sources, version, tmp_path)
    pristine = snapshot(tree)

    # the README's `yrpd patch check --target /vllm-workspace/vllm-ascend`, on this tree
    [documented] = commands(acts_on_a_source_tree)
    assert words(documented)[:2] == ["patch", "check"], f"extend this test to run {documented!r}"
    proc = run_yrpd(*[str(tree) if w == GUIDE_TREE else w for w in words(documented)], check=0)
    assert f"vllm-ascend {version} (from PKG-INFO)" in proc.stdout
    assert "applies cleanly" in proc.stdout
    assert snapshot(tree) == pristine

    proc = run_yrpd("patch", "apply", "--target", tree, "--json", check=0)
    result = json.loads(proc.stdout)
    assert result["changed"] is True and result["state_before"] == "applicable" and result["state_after"] == "applied"
    patched = snapshot(tree)
    assert _changed(pristine, patched) == _touched_files(version) | {".yrpd-patches.json"}
    record = json.loads((tree / ".yrpd-patches.json").read_text())
    assert record["series"] == f"vllm-ascend/{_series_dir(version).name}" and record["version"] == version
    connector_line = "register_connector(\"YuanrongConnector\""
    assert any(connector_line in (tree / f).read_text() for f in _touched_files(version))

    proc = run_yrpd("patch", "check", "--target", tree, check=0)
    assert "already applied" in proc.stdout

    # re-apply: a no-op, nothing touched (not even the record)
    proc = run_yrpd("patch", "apply", "--target", tree, check=0)
    assert "already applied" in proc.stdout and "nothing changed" in proc.stdout
    assert snapshot(tree) == patched
    again = json.loads(run_yrpd("patch", "apply", "--target", tree, "--json", check=0).stdout)
    assert again["changed"] is False and again["state_before"] == "applied"
    assert snapshot(tree) == patched

    proc = run_yrpd("patch", "revert", "--target", tree, check=0)
    assert "reverted" in proc.stdout
    assert snapshot(tree) == pristine, f"not restored byte for byte: {_changed(pristine, snapshot(tree))}"

    # revert of a pristine tree: nothing to do, nothing changed
    proc = run_yrpd("patch", "revert", "--target", tree, check=0)
    assert "nothing to revert" in proc.stdout
    assert snapshot(tree) == pristine


@pytest.mark.parametrize("version", VERSIONS)
def test_tampered_patch_fails_its_checksum(sources, tmp_path, version):
    tree = _copy_tree(sources, version, tmp_path)
    series_root = tmp_path / "series"
    shutil.copytree(REPO / "patches", series_root)
    patch_file = next((series_root / "vllm-ascend" / _series_dir(version).name).glob("*.patch"))
    # a change that still applies cleanly: only the checksum can catch it
    text = patch_file.read_text()
    patch_file.write_text(text.replace("YuanrongConnector\")", "YuanrongConnector\")  # injected", 1))
    assert patch_file.read_text() != text
    pristine = snapshot(tree)

    proc = run_yrpd("patch", "apply", "--target", tree, "--series", series_root, check=2)
    assert "failed its checksum" in proc.stderr and patch_file.name in proc.stderr
    assert snapshot(tree) == pristine
    proc = run_yrpd("patch", "check", "--target", tree, "--series", series_root, check=2)
    assert "failed its checksum" in proc.stderr
    proc = run_yrpd("patch", "list", "--series", series_root, check=2)
    assert "TAMPERED" in proc.stdout
    # the shipped series is fine
    run_yrpd("patch", "list", check=0)


@pytest.mark.parametrize("version", VERSIONS)
def test_wrong_target_version_is_refused(sources, tmp_path, version):
    tree = _copy_tree(sources, version, tmp_path)
    pkg_info = tree / "PKG-INFO"
    pkg_info.write_text(pkg_info.read_text().replace(f"Version: {version}\n", "Version: 0.9.1\n", 1))
    pristine = snapshot(tree)
    for action in ("check", "apply", "revert"):
        proc = run_yrpd("patch", action, "--target", tree, check=2)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert "vllm-ascend 0.9.1 (from PKG-INFO)" in lines[0] and "supported versions" in lines[0]
        for manifest in MANIFESTS.values():
            assert manifest["versions"] in lines[0]
    assert snapshot(tree) == pristine

    # the right version, but a series for another version forced with --series
    tree2 = _copy_tree(sources, version, tmp_path / "other")
    other = next(name for name, m in MANIFESTS.items() if m["source_version"] != version)
    proc = run_yrpd("patch", "apply", "--target", tree2, "--series", SERIES_ROOT / other, check=2)
    assert f"vllm-ascend {version}" in proc.stderr and MANIFESTS[other]["versions"] in proc.stderr
    assert not (tree2 / ".yrpd-patches.json").exists()


@pytest.mark.parametrize("version", VERSIONS)
def test_conflicting_tree_is_reported_file_by_file_and_left_alone(sources, tmp_path, version):
    tree = _copy_tree(sources, version, tmp_path)
    (touched,) = _touched_files(version)
    target = tree / touched
    lines = target.read_text().splitlines(keepends=True)
    lines[-2] = lines[-2].rstrip("\n") + "  # local edit\n"  # inside the patch's context
    target.write_text("".join(lines))
    pristine = snapshot(tree)
    for action in ("check", "apply", "revert"):
        proc = run_yrpd("patch", action, "--target", tree, check=1)
        assert "conflicts with the tree" in proc.stderr and "nothing changed" in proc.stderr
        assert f"conflicting {touched}" in proc.stderr
    assert snapshot(tree) == pristine


@pytest.mark.parametrize("version", VERSIONS)
def test_git_am_as_in_the_guide(sources, tmp_path, version):
    """The guide applies its patch with `git am` in a git clone; ours must too, and yrpd must see it applied."""
    tree = _copy_tree(sources, version, tmp_path)
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}

    def git(*args):
        return subprocess.run(["git", *args], cwd=tree, env=env, check=True, capture_output=True, text=True)

    git("init", "-q")
    git("add", "-A", "-f")
    git("commit", "-q", "-m", "pristine")
    patch_file = next(_series_dir(version).glob("*.patch"))
    git("am", "-q", str(patch_file))
    assert "YuanrongConnector" in git("log", "-1", "--format=%s").stdout
    proc = run_yrpd("patch", "check", "--target", tree, check=0)
    assert "already applied" in proc.stdout and "applied outside yrpd" in proc.stdout
    proc = run_yrpd("patch", "revert", "--target", tree, check=0)
    assert git("diff", "HEAD~1").stdout == ""  # the working tree is the pristine commit again


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    venv = Path(os.environ.get("YRPD_VLLM_VENV", "/opt/yrpd/venvs/vllm"))
    python = venv / "bin" / "python"
    if not python.exists():
        _unavailable(f"vLLM CPU venv {venv} not found (scripts/install_vllm_cpu.sh)")
    # a cheap look (importing vLLM costs ~15 s; the checks themselves do that)
    proc = subprocess.run([str(python), "-c", "import importlib.util as u, pathlib; s = u.find_spec('vllm'); "
                           "assert s and (pathlib.Path(s.origin).parent / 'distributed/kv_transfer/kv_connector/"
                           "factory.py').is_file()"],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        _unavailable(f"vLLM not installed in {venv}: {proc.stderr.strip()[-500:]}")
    return python


def _start_registration(python: Path, tree: Path, version: str, preregister: bool = False):
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{REPO}", "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_PLUGINS": "ascend_kv_connector", "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [str(python), str(CHECK_SCRIPT), "--path", REGISTRATION_PATH[version]]
    if preregister:
        cmd.append("--preregister")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tree.parent, stdin=subprocess.DEVNULL)
    return proc, tree


def _registration_result(started) -> dict:
    proc, tree = started
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"registration check failed:\n{out[-3000:]}\n{err[-3000:]}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["vllm_ascend_file"] == str(tree / "vllm_ascend" / "__init__.py")
    return result


@pytest.mark.parametrize("version", VERSIONS)
def test_connector_name_resolves_to_our_class(sources, vllm_python, tmp_path, version):
    """vllm-ascend's own registration code (patched) runs in vLLM 0.32 CPU; the factory then resolves
    "YuanrongConnector" without kv_connector_module_path to yrpd.connector's class. The unpatched tree does not
    know the name; a name yrpd registered first does not break vllm-ascend's registration."""
    pristine = _copy_tree(sources, version, tmp_path / "pristine")
    tree = _copy_tree(sources, version, tmp_path / "patched")
    run_yrpd("patch", "apply", "--target", tree, check=0)

    # three independent interpreters, started together (each spends ~15 s importing vLLM)
    started = [_start_registration(vllm_python, pristine, version),
               _start_registration(vllm_python, tree, version),
               _start_registration(vllm_python, tree, version, preregister=True)]
    before, after, both = [_registration_result(s) for s in started]

    assert before["registered"] is False and before["resolved"] is None
    assert "Unsupported connector type" in before["error"]

    if REGISTRATION_PATH[version] == "entry-point":
        assert after["entry_point"] == "vllm_ascend:register_connector"
    assert after["registered"] is True  # registered while yrpd was not importable: the loader is lazy
    assert after["resolved"] == "yrpd.connector.connector.YuanrongConnector" and after["is_yrpd_class"] is True
    assert Path(after["yrpd_file"]).resolve().is_relative_to(REPO.resolve())

    assert both["registered"] is True and both["is_yrpd_class"] is True
