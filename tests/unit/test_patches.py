"""Patch manager logic on small synthetic trees: manifests, checksums, version detection, state decisions,
all-or-nothing apply, byte-for-byte revert. The real vllm-ascend trees are in tests/lab/test_patch_sources.py."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_yrpd
from yrpd import patches as P

PKG_INFO = "Metadata-Version: 2.1\nName: demo_pkg\nVersion: {version}\nSummary: demo\n\nlong description\nVersion: 9\n"
A_PY = "".join(f"line {i}\n" for i in range(1, 21))
B_PY = "def f():\n    return 1\n\n\ndef g():\n    return 2\n"


def git_env(ceiling: Path) -> dict[str, str]:
    return {**os.environ, "GIT_CEILING_DIRECTORIES": str(ceiling), "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@example.invalid", "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@example.invalid"}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=git_env(cwd.parent), check=True, capture_output=True,
                          text=True).stdout


def make_tree(root: Path, version: str = "1.2.0") -> Path:
    root.mkdir(parents=True)
    (root / "PKG-INFO").write_text(PKG_INFO.format(version=version))
    pkg = root / "demo_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(A_PY)
    (pkg / "b.py").write_text(B_PY)
    (root / "README").write_text("demo\n")
    return root


def snapshot(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            out[rel] = ("dir",) if p.is_dir() else (p.stat().st_mode, hashlib.sha256(p.read_bytes()).hexdigest())
    return out


@pytest.fixture(scope="module")
def _series_template(tmp_path_factory) -> Path:
    """Series demo-pkg/1.2 for demo_pkg >=1.2,<1.3 with two patches: 0001 edits a.py and b.py,
    0002 edits b.py again and creates c.py. Made with git from a pristine tree, like the real ones."""
    tmp_path = tmp_path_factory.mktemp("series-template")
    work = make_tree(tmp_path / "mk" / "work")
    git(work, "init", "-q")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "pristine")
    base = {p: P.file_sha256(work / p) for p in ("demo_pkg/a.py", "demo_pkg/b.py")}
    base["demo_pkg/c.py"] = None
    (work / "demo_pkg/a.py").write_text(A_PY.replace("line 10\n", "line 10\nline 10.5 (patched)\n"))
    (work / "demo_pkg/b.py").write_text(B_PY.replace("return 1", "return 100"))
    git(work, "commit", "-q", "-am", "First change\n\nBody with a diff-like line:\n--- a/demo_pkg/zzz.py\n")
    (work / "demo_pkg/b.py").write_text((work / "demo_pkg/b.py").read_text().replace("return 2", "return 200"))
    (work / "demo_pkg/c.py").write_text("NEW = True\n")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "Second change")
    result = {p: P.file_sha256(work / p) for p in ("demo_pkg/a.py", "demo_pkg/b.py", "demo_pkg/c.py")}
    root = tmp_path / "series"
    sdir = root / "demo-pkg" / "1.2"
    sdir.mkdir(parents=True)
    git(work, "format-patch", "-q", "-2", "--no-signature", "-o", str(sdir))
    names = sorted(p.name for p in sdir.glob("*.patch"))
    manifest = {
        "schema": P.SERIES_SCHEMA, "name": "demo", "target": "demo-pkg", "import_package": "demo_pkg",
        "versions": ">=1.2,<1.3", "source_version": "1.2.0", "description": "demo series",
        "base": {"tree_sha256": P.tree_identity(base), "files": base},
        "result": {"files": result},
        "patches": [{"file": n, "sha256": P.file_sha256(sdir / n), "description": f"patch {n}"} for n in names],
    }
    (sdir / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return root


@pytest.fixture
def series_root(_series_template, tmp_path) -> Path:
    import shutil

    return Path(shutil.copytree(_series_template, tmp_path / "series"))


@pytest.fixture
def tree(tmp_path) -> Path:
    return make_tree(tmp_path / "trees" / "demo")


def state_of(tree: Path, root: Path) -> P.TreeState:
    series, version = P.resolve(tree, root)
    return P.inspect(tree, series, version)


def manifest_of(root: Path) -> Path:
    return root / "demo-pkg" / "1.2" / "manifest.yaml"


def rewrite_manifest(root: Path, **changes) -> None:
    path = manifest_of(root)
    data = yaml.safe_load(path.read_text())
    data.update(changes)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


# --- series and manifests ------------------------------------------------------------------------------------


def test_shipped_series_load_and_verify():
    from yrpd.assets import patches_dir

    assert patches_dir() == REPO / "patches"
    series = P.load_all(P.default_root())
    assert {s.id for s in series} >= {"vllm-ascend/0.10.0rc1", "vllm-ascend/0.23.0.post1"}
    for s in series:
        s.verify()
        assert s.target == "vllm-ascend" and s.import_package == "vllm_ascend"
        assert s.matches(s.source_version)
        assert s.base_files and s.result_files and s.base_tree_sha256 == P.tree_identity(s.base_files)
        for p in s.patches:
            assert p.description and p.file.startswith("0001-")


def test_shipped_series_names_match_the_connector():
    from yrpd.connector import CONNECTOR_NAME, MODULE_PATH

    for s in P.load_all(P.default_root()):
        text = "".join(p.path.read_text() for p in s.patches)
        assert f'"{CONNECTOR_NAME}"' in text and f'"{MODULE_PATH}"' in text


def test_series_ranges_do_not_overlap():
    series = P.load_all(P.default_root())
    for s in series:
        others = [o.id for o in series if o is not s and o.target == s.target and o.matches(s.source_version)]
        assert not others, f"{s.source_version} matches {others} too"


def test_load_series_reads_paths_and_ignores_commit_message(series_root):
    (s,) = P.load_all(series_root)
    assert s.id == "demo-pkg/1.2" and s.versions == ">=1.2,<1.3"
    assert [p.paths for p in s.patches] == [("demo_pkg/a.py", "demo_pkg/b.py"), ("demo_pkg/b.py", "demo_pkg/c.py")]
    assert s.patches[1].creates == ("demo_pkg/c.py",)
    assert s.files == ["demo_pkg/a.py", "demo_pkg/b.py", "demo_pkg/c.py"]
    assert s.tampered() == []
    assert len(s.digest()) == 64
    assert P.load_all(series_root / "demo-pkg" / "1.2")[0].id == s.id  # a single series directory works too


def test_tree_identity_is_the_sha256sum_formula(tmp_path):
    (tmp_path / "x").write_text("x\n")
    (tmp_path / "y").write_text("y\n")
    hashes = {"y": P.file_sha256(tmp_path / "y"), "x": P.file_sha256(tmp_path / "x")}
    text = f"{hashes['x']}  x\n{hashes['y']}  y\n"  # sha256sum x y | LC_ALL=C sort -k2
    assert P.tree_identity(hashes) == hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize("change, message", [
    ({"schema": "other/1"}, "schema"),
    ({"versions": "=>1.2"}, "PEP 440"),
    ({"target": ""}, "target is missing"),
    ({"patches": [{"file": "../evil.patch", "sha256": "0" * 64}]}, "must be a .patch file name"),
    ({"patches": [{"file": "0009-missing.patch", "sha256": "0" * 64}]}, "is missing"),
])
def test_bad_manifests_are_rejected(series_root, change, message):
    rewrite_manifest(series_root, **change)
    with pytest.raises(P.PatchError, match=message):
        P.load_all(series_root)


def test_manifest_must_list_every_patch_and_file(series_root):
    data = yaml.safe_load(manifest_of(series_root).read_text())
    rewrite_manifest(series_root, patches=data["patches"][:1])
    with pytest.raises(P.PatchError, match="not listed in the manifest"):
        P.load_all(series_root)
    rewrite_manifest(series_root, patches=data["patches"])
    base = dict(data["base"])
    base["files"] = {k: v for k, v in base["files"].items() if k != "demo_pkg/a.py"}
    rewrite_manifest(series_root, base=base)
    with pytest.raises(P.PatchError, match="base.files lists"):
        P.load_all(series_root)
    base = dict(data["base"], tree_sha256="f" * 64)
    rewrite_manifest(series_root, base=base)
    with pytest.raises(P.PatchError, match="tree_sha256 does not match"):
        P.load_all(series_root)


def test_tampered_patch_is_refused(series_root, tree):
    patch = sorted((series_root / "demo-pkg" / "1.2").glob("*.patch"))[0]
    patch.write_bytes(patch.read_bytes() + b"\n")
    before = snapshot(tree)
    with pytest.raises(P.PatchError, match="failed its checksum"):
        P.apply(tree, series_root)
    assert snapshot(tree) == before
    proc = run_yrpd("patch", "apply", "--target", tree, "--series", series_root, check=2)
    assert "failed its checksum" in proc.stderr and patch.name in proc.stderr
    proc = run_yrpd("patch", "list", "--series", series_root, check=2)
    assert "TAMPERED" in proc.stdout
    assert snapshot(tree) == before


# --- versions ------------------------------------------------------------------------------------------------


def test_detect_version_sources(tmp_path):
    t = tmp_path / "t"
    (t / "demo_pkg").mkdir(parents=True)
    with pytest.raises(P.PatchError, match="cannot tell the version"):
        P.detect_version(t, "demo_pkg")
    (t / "setup.py").write_text("setup(name='demo', version='0.5.0')\n")
    assert P.detect_version(t, "demo_pkg") == P.TreeVersion(None, "0.5.0", "setup.py")
    git(t, "init", "-q")
    git(t, "add", "-A")
    git(t, "commit", "-q", "-m", "x")
    git(t, "tag", "v0.6.0rc1")
    assert P.detect_version(t, "demo_pkg") == P.TreeVersion(None, "0.6.0rc1", "git tag")
    (t / "demo_pkg.egg-info").mkdir()
    (t / "demo_pkg.egg-info" / "PKG-INFO").write_text("Name: demo-pkg\nVersion: 0.7.0\n")
    assert P.detect_version(t, "demo_pkg").version == "0.7.0"
    # what setuptools-scm writes
    (t / "demo_pkg" / "_version.py").write_text("__version__ = version = '0.8.0.dev3+g1234'\n")
    assert P.detect_version(t, "demo_pkg") == P.TreeVersion(None, "0.8.0.dev3+g1234", "demo_pkg/_version.py")
    (t / "PKG-INFO").write_text(PKG_INFO.format(version="0.9.0"))  # only the header block counts
    assert P.detect_version(t, "demo_pkg") == P.TreeVersion("demo_pkg", "0.9.0", "PKG-INFO")


def test_wrong_version_is_one_clear_line(series_root, tmp_path):
    t = make_tree(tmp_path / "old", version="1.1.9")
    before = snapshot(t)
    for action in ("check", "apply", "revert"):
        proc = run_yrpd("patch", action, "--target", t, "--series", series_root, check=2)
        assert proc.stderr.strip().splitlines() == [
            f"error: demo-pkg 1.1.9 (from PKG-INFO) in {t} is not supported by any patch series; "
            f"supported versions: >=1.2,<1.3 (demo-pkg/1.2)"]
    assert snapshot(t) == before


def test_prerelease_and_post_versions_follow_the_specifier(series_root, tmp_path):
    (s,) = P.load_all(series_root)
    assert s.matches("1.2.0") and s.matches("1.2.5.post1") and s.matches("1.2.9rc1")
    assert not s.matches("1.3.0rc1") and not s.matches("1.1.9") and not s.matches("not-a-version")


def test_not_a_tree_and_other_package(series_root, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(P.PatchError, match="is not a source tree of demo-pkg"):
        P.resolve(plain, series_root)
    other = make_tree(tmp_path / "other")
    (other / "PKG-INFO").write_text("Name: something-else\nVersion: 1.2.0\n")
    with pytest.raises(P.PatchError, match="is something-else 1.2.0"):
        P.resolve(other, series_root)


def test_overlapping_series_are_refused(series_root, tree):
    import shutil

    shutil.copytree(series_root / "demo-pkg" / "1.2", series_root / "demo-pkg" / "1.2-copy")
    with pytest.raises(P.PatchError, match="overlap"):
        P.resolve(tree, series_root)


# --- states and actions --------------------------------------------------------------------------------------


def test_apply_is_idempotent_and_revert_restores_bytes(series_root, tree):
    pristine = snapshot(tree)
    st = state_of(tree, series_root)
    assert st.state == P.APPLICABLE and st.base_matches is True
    assert [f.state for f in st.files] == [P.APPLICABLE] * 3

    proc = run_yrpd("patch", "check", "--target", tree, "--series", series_root, check=0)
    assert "applies cleanly" in proc.stdout
    proc = run_yrpd("patch", "apply", "--target", tree, "--series", series_root, check=0)
    assert "applied series demo-pkg/1.2 (2 patches, 3 files)" in proc.stdout
    assert (tree / "demo_pkg/c.py").read_text() == "NEW = True\n"
    assert "return 100" in (tree / "demo_pkg/b.py").read_text() and "return 200" in (tree / "demo_pkg/b.py").read_text()
    record = json.loads((tree / P.RECORD_FILE).read_text())
    assert record["series"] == "demo-pkg/1.2" and record["version"] == "1.2.0"
    assert record["files"]["demo_pkg/c.py"] == {"before": None, "after": P.file_sha256(tree / "demo_pkg/c.py")}
    patched = snapshot(tree)

    st = state_of(tree, series_root)
    assert st.state == P.APPLIED and st.record and st.base_matches is True
    out = P.apply(tree, series_root)
    assert out.changed is False and "already applied" in out.message
    assert snapshot(tree) == patched

    out = P.revert(tree, series_root)
    assert out.changed is True
    assert snapshot(tree) == pristine
    out = P.revert(tree, series_root)
    assert out.changed is False and "nothing to revert" in out.message
    assert snapshot(tree) == pristine


def test_partial_tree_is_reported_file_by_file_and_untouched(series_root, tree):
    (s,) = P.load_all(series_root)
    # apply the series' changes to a.py only
    subprocess.run(["git", "apply", "--include=demo_pkg/a.py", *[str(p.path) for p in s.patches]], cwd=tree,
                   check=True, env=git_env(tree.parent))
    before = snapshot(tree)
    st = state_of(tree, series_root)
    assert st.state == P.PARTIAL
    assert {f.path: f.state for f in st.files} == {"demo_pkg/a.py": P.APPLIED, "demo_pkg/b.py": P.APPLICABLE,
                                                   "demo_pkg/c.py": P.APPLICABLE}
    for action in ("apply", "revert", "check"):
        proc = run_yrpd("patch", action, "--target", tree, "--series", series_root, check=1)
        assert "partially applied" in proc.stderr and "nothing changed" in proc.stderr
        assert "applied     demo_pkg/a.py" in proc.stderr and "applicable  demo_pkg/b.py" in proc.stderr
    assert snapshot(tree) == before


def test_conflicting_and_missing_files(series_root, tree):
    b = tree / "demo_pkg/b.py"
    b.write_text(B_PY.replace("return 1", "return -1"))
    before = snapshot(tree)
    st = state_of(tree, series_root)
    assert st.state == P.CONFLICTING
    states = {f.path: f for f in st.files}
    assert states["demo_pkg/b.py"].state == P.CONFLICTING and "patch" in states["demo_pkg/b.py"].detail
    assert states["demo_pkg/a.py"].state == P.APPLICABLE
    with pytest.raises(P.PatchStateError, match="apply refused, nothing changed"):
        P.apply(tree, series_root)
    assert snapshot(tree) == before

    b.unlink()
    st = state_of(tree, series_root)
    assert st.state == P.CONFLICTING
    assert {f.path: f.state for f in st.files}["demo_pkg/b.py"] == P.MISSING
    proc = run_yrpd("patch", "apply", "--target", tree, "--series", series_root, check=1)
    assert "missing     demo_pkg/b.py" in proc.stderr


def test_existing_created_file_conflicts(series_root, tree):
    (tree / "demo_pkg/c.py").write_text("something else\n")
    before = snapshot(tree)
    st = state_of(tree, series_root)
    assert st.state == P.CONFLICTING
    assert {f.path: f.state for f in st.files}["demo_pkg/c.py"] == P.CONFLICTING
    with pytest.raises(P.PatchStateError):
        P.apply(tree, series_root)
    assert snapshot(tree) == before


def test_modified_tree_that_still_applies(series_root, tree):
    """A tree whose touched files differ from the source version (e.g. a neighbouring release) but where
    git apply still applies: applicable, with a note; revert restores the recorded bytes."""
    a = tree / "demo_pkg/a.py"
    a.write_text("header\n" + A_PY)
    pristine = snapshot(tree)
    st = state_of(tree, series_root)
    assert st.state == P.APPLICABLE and st.base_matches is False
    proc = run_yrpd("patch", "check", "--target", tree, "--series", series_root, check=0)
    assert "note: the touched files differ" in proc.stdout
    P.apply(tree, series_root)
    assert state_of(tree, series_root).state == P.APPLIED
    P.revert(tree, series_root)
    assert snapshot(tree) == pristine


def test_applied_outside_yrpd_and_stale_record(series_root, tree):
    (s,) = P.load_all(series_root)
    pristine = snapshot(tree)
    subprocess.run(["git", "apply", *[str(p.path) for p in s.patches]], cwd=tree, check=True, env=git_env(tree.parent))
    proc = run_yrpd("patch", "check", "--target", tree, "--series", series_root, check=0)
    assert "already applied (no .yrpd-patches.json: applied outside yrpd)" in proc.stdout
    P.revert(tree, series_root)
    assert snapshot(tree) == pristine
    (tree / P.RECORD_FILE).write_text("{}\n")
    out = P.revert(tree, series_root)
    assert out.changed and "stale" in out.message
    assert snapshot(tree) == pristine


def test_tree_inside_another_git_repository(series_root, tmp_path):
    """git apply run inside a repository takes paths relative to its root and skips the rest silently;
    the manager keeps git from looking above the tree."""
    outer = tmp_path / "outer"
    outer.mkdir()
    git(outer, "init", "-q")
    tree = make_tree(outer / "vendor" / "demo")
    out = P.apply(tree, series_root)
    assert out.changed and "return 100" in (tree / "demo_pkg/b.py").read_text()
    assert state_of(tree, series_root).state == P.APPLIED


def test_reinstall_cmd_runs_only_when_changed(series_root, tree, tmp_path):
    marker = tmp_path / "reinstalled"
    cmd = f'echo "$PWD $SETUPTOOLS_SCM_PRETEND_VERSION_FOR_DEMO_PKG $YRPD_PATCH_ACTION $YRPD_PATCH_SERIES" > {marker}'
    run_yrpd("patch", "apply", "--target", tree, "--series", series_root, "--reinstall-cmd", cmd, check=0)
    assert marker.read_text().split() == [str(tree), "1.2.0", "apply", "demo-pkg/1.2"]
    marker.unlink()
    run_yrpd("patch", "apply", "--target", tree, "--series", series_root, "--reinstall-cmd", cmd, check=0)
    assert not marker.exists()
    proc = run_yrpd("patch", "revert", "--target", tree, "--series", series_root, "--reinstall-cmd", "exit 3", check=1)
    assert "reinstall command exited 3" in proc.stderr
    assert state_of(tree, series_root).state == P.APPLICABLE


def test_json_output(series_root, tree):
    proc = run_yrpd("patch", "check", "--target", tree, "--series", series_root, "--json", check=0)
    doc = json.loads(proc.stdout)
    assert doc["state"] == "applicable" and doc["changed"] is False and doc["version"] == "1.2.0"
    assert [f["path"] for f in doc["files"]] == ["demo_pkg/a.py", "demo_pkg/b.py", "demo_pkg/c.py"]
    doc = json.loads(run_yrpd("patch", "apply", "--target", tree, "--series", series_root, "--json", check=0).stdout)
    assert doc["changed"] is True and doc["state_after"] == "applied" and len(doc["series_sha256"]) == 64
    listing = json.loads(run_yrpd("patch", "list", "--series", series_root, "--json", check=0).stdout)
    assert listing[0]["series"] == "demo-pkg/1.2" and listing[0]["checksums_ok"] is True


def test_list_shows_the_shipped_series():
    proc = run_yrpd("patch", "list", check=0)
    assert "vllm-ascend/0.10.0rc1: vllm-ascend ==0.10.0rc1 (1 patch, checksums ok)" in proc.stdout
    assert "vllm-ascend/0.23.0.post1: vllm-ascend >=0.23.0,<=0.23.0.post1 (1 patch, checksums ok)" in proc.stdout
    assert "YuanrongConnector" in proc.stdout
    assert "patch" in run_yrpd("--help", check=0).stdout


def test_recorded_version_survives_a_rebuilt_version_file(series_root, tmp_path):
    """A git checkout without PKG-INFO gets its version from the _version.py setuptools-scm writes; after a
    reinstall of the patched (dirty) checkout that may read 1.2.1.dev0+g...: the record keeps the tree known."""
    tree = make_tree(tmp_path / "clone")
    (tree / "PKG-INFO").unlink()
    (tree / "demo_pkg/_version.py").write_text("__version__ = version = '1.2.0'\n")
    pristine = snapshot(tree)
    P.apply(tree, series_root)
    (tree / "demo_pkg/_version.py").write_text("__version__ = version = '1.3.0.dev0+gabc.d20250101'\n")
    proc = run_yrpd("patch", "check", "--target", tree, "--series", series_root, check=0)
    assert "demo-pkg 1.2.0 (from .yrpd-patches.json; demo_pkg/_version.py now says 1.3.0.dev0" in proc.stdout
    P.revert(tree, series_root)
    (tree / "demo_pkg/_version.py").write_text("__version__ = version = '1.2.0'\n")
    assert snapshot(tree) == pristine
    # without a record the rebuilt version is refused
    (tree / "demo_pkg/_version.py").write_text("__version__ = version = '1.3.0.dev0+gabc.d20250101'\n")
    run_yrpd("patch", "check", "--target", tree, "--series", series_root, check=2)


def test_series_files_are_packaged():
    """pyproject.toml ships patches/ as the package yrpd.patches_data; every series file must match its globs."""
    import fnmatch
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "yrpd.patches_data" in config["packages"]
    assert config["package-dir"]["yrpd.patches_data"] == "patches"
    globs = config["package-data"]["yrpd.patches_data"]
    files = [p.relative_to(REPO / "patches").as_posix() for p in (REPO / "patches").rglob("*") if p.is_file()
             and "__pycache__" not in p.parts]
    assert files
    for rel in files:
        assert any(fnmatch.fnmatch(rel, g) and rel.count("/") == g.count("/") for g in globs), rel
