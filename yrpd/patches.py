"""Patch series for upstream source trees (vllm-ascend) and the logic that applies them safely.

A series is a directory `patches/<target>/<name>/` holding numbered `git format-patch` files and a
`manifest.yaml`:

    schema: yrpd.patch-series/1
    name: yuanrong-connector
    target: vllm-ascend              # distribution name of the patched package
    import_package: vllm_ascend      # its top-level package: marks a source tree of the target
    versions: "==0.10.0rc1"          # PEP 440 specifier: the tree versions this series is for
    source_version: 0.10.0rc1        # the sdist the series was written against (the fetch script's input)
    source_sha256: ...               # sha256 of that sdist
    description: ...
    base:                            # the touched files before the series, as in the source sdist
      tree_sha256: ...               # tree_identity() of those files
      files: {path: sha256}
    result:
      files: {path: sha256}          # the same files after the whole series
    patches:
      - file: 0001-....patch
        sha256: ...
        description: ...

Deciding the state of a tree uses `git apply --check` forwards and `git apply --reverse --check`
backwards (both work in directories that are not git repositories), per file and for the whole series,
plus the file hashes of the manifest when they match. `git apply` is all-or-nothing, so a series is either
applied completely or the tree is left as it was.

Applying writes `.yrpd-patches.json` at the root of the tree (what was applied, file hashes before and after);
reverting removes it, so a revert restores the tree byte for byte.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from yrpd import __version__
from yrpd.errors import YrpdError

SERIES_SCHEMA = "yrpd.patch-series/1"
RECORD_SCHEMA = "yrpd.patch-record/1"
RECORD_FILE = ".yrpd-patches.json"

# states of one file and of a tree
APPLIED = "applied"          # the series' changes are present
APPLICABLE = "applicable"    # pristine: the series applies cleanly
PARTIAL = "partial"          # some files applied, the others applicable
CONFLICTING = "conflicting"  # at least one file neither applies nor reverse-applies
MISSING = "missing"          # a file the series modifies is absent


class PatchError(YrpdError):
    """Bad input: unknown or wrong-version tree, tampered or malformed series. Nothing was changed."""

    exit_code = 2


class UnsupportedVersion(PatchError):
    """The tree is a known target at a version no series covers."""

    def __init__(self, message: str, target: str, version: str):
        super().__init__(message)
        self.target, self.version = target, version


class PatchStateError(YrpdError):
    """The tree is partially patched or conflicts with the series. Nothing was changed."""

    exit_code = 1


# ---------------------------------------------------------------------------------------------------------------
# hashing


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tree_identity(file_hashes: dict[str, str | None]) -> str:
    """sha256 over `sha256sum`-style lines ("<sha256>  <path>\\n") sorted by path; an absent file counts
    as "-". Reproducible in a shell: `sha256sum FILES | LC_ALL=C sort -k2 | sha256sum`."""
    text = "".join(f"{file_hashes[p] or '-'}  {p}\n" for p in sorted(file_hashes))
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# series


@dataclass(frozen=True)
class Patch:
    file: str
    sha256: str
    description: str
    path: Path
    paths: tuple[str, ...]  # files it touches, relative to the tree root
    creates: tuple[str, ...] = ()
    deletes: tuple[str, ...] = ()

    def actual_sha256(self) -> str:
        return file_sha256(self.path)


@dataclass(frozen=True)
class Series:
    directory: Path
    name: str
    target: str
    import_package: str
    versions: str
    source_version: str
    source_sha256: str | None
    description: str
    base_files: dict[str, str | None]
    base_tree_sha256: str | None
    result_files: dict[str, str | None]
    patches: tuple[Patch, ...]

    @property
    def id(self) -> str:
        """`<target>/<directory name>`, e.g. vllm-ascend/0.10.0rc1."""
        return f"{self.target}/{self.directory.name}"

    @property
    def files(self) -> list[str]:
        seen: dict[str, None] = {}
        for patch in self.patches:
            for p in patch.paths:
                seen.setdefault(p, None)
        return list(seen)

    def specifier(self):
        from packaging.specifiers import SpecifierSet

        return SpecifierSet(self.versions)

    def matches(self, version: str) -> bool:
        from packaging.version import InvalidVersion, Version

        try:
            parsed = Version(version)
        except InvalidVersion:
            return False
        return self.specifier().contains(parsed, prereleases=True)

    def tampered(self) -> list[str]:
        """One line per patch whose file does not hash to the manifest's sha256."""
        problems = []
        for patch in self.patches:
            actual = patch.actual_sha256()
            if actual != patch.sha256:
                problems.append(f"{patch.path}: sha256 {actual} does not match the manifest's {patch.sha256}")
        return problems

    def verify(self) -> None:
        problems = self.tampered()
        if problems:
            raise PatchError(f"series {self.id} failed its checksum, refusing to use it: " + "; ".join(problems))

    def digest(self) -> str:
        """Identity of the whole series (manifest and patch files): for records and derived image tags."""
        hashes = {"manifest.yaml": file_sha256(self.directory / "manifest.yaml")}
        for patch in self.patches:
            hashes[patch.file] = patch.actual_sha256()
        return tree_identity(hashes)


_DIFF_GIT = re.compile(r"^diff --git a/(\S+) b/(\S+)$")


def patch_paths(text: str) -> tuple[list[str], list[str], list[str]]:
    """(touched, created, deleted) paths of a git-style patch. Only the headers after each `diff --git`
    line are read, so a commit message with `---` lines cannot confuse it."""
    touched: list[str] = []
    created: list[str] = []
    deleted: list[str] = []
    in_header = False
    current: str | None = None
    for line in text.splitlines():
        m = _DIFF_GIT.match(line)
        if m:
            current = m.group(2)
            if current not in touched:
                touched.append(current)
            in_header = True
            continue
        if line.startswith('diff --git "'):
            raise PatchError("quoted paths in patches are not supported (a path with unusual characters)")
        if not in_header:
            continue
        if line.startswith("@@") or line.startswith("GIT binary patch"):
            in_header = False
        elif line.startswith("new file mode") and current:
            created.append(current)
        elif line.startswith("deleted file mode") and current:
            deleted.append(current)
    return touched, created, deleted


def _load_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PatchError(f"{path}: cannot read the manifest: {exc}") from exc
    if not isinstance(data, dict):
        raise PatchError(f"{path}: the manifest must be a mapping")
    return data


def _hash_map(value: Any, where: str) -> dict[str, str | None]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise PatchError(f"{where} must map file paths to sha256 values")
    out: dict[str, str | None] = {}
    for key, sha in value.items():
        if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
            raise PatchError(f"{where}: {key}: {sha!r} is not a sha256 hex digest")
        out[key] = sha
    return out


def load_series(directory: Path) -> Series:
    """Read one series directory and check that the manifest and the patch files agree (names, touched files).
    Checksums are checked by Series.verify(), so `list` can still show a tampered series."""
    directory = Path(directory)
    manifest_path = directory / "manifest.yaml"
    data = _load_yaml(manifest_path)
    where = str(manifest_path)
    if data.get("schema") != SERIES_SCHEMA:
        raise PatchError(f"{where}: schema is {data.get('schema')!r}, expected {SERIES_SCHEMA!r}")
    for key in ("name", "target", "import_package", "versions", "source_version", "description", "patches"):
        if not data.get(key):
            raise PatchError(f"{where}: {key} is missing")
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        SpecifierSet(str(data["versions"]))
    except InvalidSpecifier as exc:
        raise PatchError(f"{where}: versions {data['versions']!r} is not a PEP 440 specifier") from exc
    entries = data["patches"]
    if not isinstance(entries, list):
        raise PatchError(f"{where}: patches must be a list")
    patches: list[Patch] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not entry.get("file") or not entry.get("sha256"):
            raise PatchError(f"{where}: patches[{i}] needs file and sha256")
        name = str(entry["file"])
        if "/" in name or name.startswith(".") or not name.endswith(".patch"):
            raise PatchError(f"{where}: patches[{i}].file {name!r} must be a .patch file name in the series directory")
        path = directory / name
        if not path.is_file():
            raise PatchError(f"{where}: patch file {name} is missing")
        touched, created, deleted = patch_paths(path.read_text(errors="replace"))
        if not touched:
            raise PatchError(f"{path}: not a git patch (no 'diff --git' section)")
        for p in touched:
            if p.startswith("/") or ".." in Path(p).parts:
                raise PatchError(f"{path}: touches {p!r}, outside the tree")
        patches.append(Patch(file=name, sha256=str(entry["sha256"]).lower(),
                             description=str(entry.get("description", "")).strip(), path=path,
                             paths=tuple(touched), creates=tuple(created), deletes=tuple(deleted)))
    listed = {p.file for p in patches}
    stray = sorted(p.name for p in directory.glob("*.patch") if p.name not in listed)
    if stray:
        raise PatchError(f"{where}: {', '.join(stray)} not listed in the manifest")
    base = data.get("base") or {}
    result = data.get("result") or {}
    series = Series(
        directory=directory, name=str(data["name"]), target=str(data["target"]),
        import_package=str(data["import_package"]), versions=str(data["versions"]),
        source_version=str(data["source_version"]), source_sha256=data.get("source_sha256"),
        description=" ".join(str(data["description"]).split()),
        base_files=_hash_map(base.get("files"), f"{where}: base.files"),
        base_tree_sha256=base.get("tree_sha256"),
        result_files=_hash_map(result.get("files"), f"{where}: result.files"),
        patches=tuple(patches),
    )
    for label, hashes in (("base.files", series.base_files), ("result.files", series.result_files)):
        if hashes and set(hashes) != set(series.files):
            raise PatchError(f"{where}: {label} lists {sorted(hashes)}, the patches touch {sorted(series.files)}")
    if series.base_files and series.base_tree_sha256 and tree_identity(series.base_files) != series.base_tree_sha256:
        raise PatchError(f"{where}: base.tree_sha256 does not match base.files")
    return series


def load_all(root: Path) -> list[Series]:
    """Every series under root: root itself when it holds a manifest, else root/<target>/<name>/ (and
    root/<name>/)."""
    root = Path(root)
    if not root.is_dir():
        raise PatchError(f"series directory {root} does not exist")
    if (root / "manifest.yaml").is_file():
        return [load_series(root)]
    manifests = sorted(set(root.glob("*/manifest.yaml")) | set(root.glob("*/*/manifest.yaml")))
    if not manifests:
        raise PatchError(f"no patch series (manifest.yaml) under {root}")
    return [load_series(m.parent) for m in manifests]


def default_root() -> Path:
    # not at the top: this module also runs in the container from the patch bundle, which ships no yrpd.assets
    from yrpd.assets import patches_dir

    return patches_dir()


# ---------------------------------------------------------------------------------------------------------------
# target trees


@dataclass(frozen=True)
class TreeVersion:
    name: str | None      # distribution name if the source says it
    version: str
    source: str           # where it was read, e.g. "PKG-INFO"


def _read_pkg_info(path: Path) -> tuple[str | None, str | None]:
    name = version = None
    try:
        with open(path, errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    break  # end of the header block
                if line.startswith("Name:"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("Version:"):
                    version = line.split(":", 1)[1].strip()
    except OSError:
        return None, None
    return name, version


_VERSION_PY = re.compile(r"""^(?:__version__|version)\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)
_SETUP_VERSION = re.compile(r"""\bversion\s*=\s*['"]([0-9][^'"]*)['"]""")


def normalize_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def detect_version(tree: Path, import_package: str) -> TreeVersion:
    """The version of the source tree, from (first found): PKG-INFO (an sdist), <import_package>/_version.py
    (written by setuptools-scm at build or develop install), *.egg-info/PKG-INFO, `git describe --tags
    --exact-match` (a git clone at a tag), a literal version= in setup.py."""
    tree = Path(tree)
    name, version = _read_pkg_info(tree / "PKG-INFO")
    if version:
        return TreeVersion(name, version, "PKG-INFO")
    version_py = tree / import_package / "_version.py"
    if version_py.is_file():
        m = _VERSION_PY.search(version_py.read_text(errors="replace"))
        if m:
            return TreeVersion(None, m.group(1), f"{import_package}/_version.py")
    for info in sorted(tree.glob("*.egg-info/PKG-INFO")):
        name, version = _read_pkg_info(info)
        if version:
            return TreeVersion(name, version, str(info.relative_to(tree)))
    if (tree / ".git").exists() and shutil.which("git"):
        proc = subprocess.run(["git", "describe", "--tags", "--exact-match"], cwd=tree, capture_output=True,
                              text=True, env=_git_env(tree), stdin=subprocess.DEVNULL)
        tag = proc.stdout.strip()
        if proc.returncode == 0 and tag:
            return TreeVersion(None, tag[1:] if tag[:1] in "vV" else tag, "git tag")
    setup_py = tree / "setup.py"
    if setup_py.is_file():
        m = _SETUP_VERSION.search(setup_py.read_text(errors="replace"))
        if m:
            return TreeVersion(None, m.group(1), "setup.py")
    raise PatchError(f"cannot tell the version of {tree}: no PKG-INFO, {import_package}/_version.py, *.egg-info, "
                     f"git tag or setup.py version found")


def select_series(tree: Path, candidates: Iterable[Series]) -> tuple[Series, TreeVersion]:
    """The one series for this tree's target and version; PatchError (exit 2) naming the version found and
    the supported ranges otherwise."""
    tree = Path(tree)
    candidates = list(candidates)
    if not tree.is_dir():
        raise PatchError(f"target {tree} is not a directory")
    targets = {}
    for s in candidates:
        targets.setdefault((s.target, s.import_package), []).append(s)
    found = [(key, group) for key, group in targets.items() if (tree / key[1]).is_dir()]
    if not found:
        wanted = ", ".join(f"{t} (a {p}/ package directory)" for t, p in targets)
        raise PatchError(f"{tree} is not a source tree of {wanted}")
    if len(found) > 1:
        raise PatchError(f"{tree} looks like a tree of several targets: {', '.join(k[0] for k, _ in found)}")
    (target, import_package), group = found[0]
    version = detect_version(tree, import_package)
    if version.name and normalize_name(version.name) != normalize_name(target):
        raise PatchError(f"{tree} is {version.name} {version.version} (from {version.source}), not {target}")
    ranges = "; ".join(f"{s.versions} ({s.id})" for s in group)
    matching = [s for s in group if s.matches(version.version)]
    if not matching:
        # A reinstall after patching can rewrite the version a build tool derives from git (setuptools-scm
        # turns a dirty 0.10.0rc1 checkout into 0.10.0rc2.dev0+g...): the version recorded when the series
        # was applied (checked then) still identifies the tree, so check and revert keep working.
        record = read_record(tree) or {}
        recorded = record.get("version")
        if isinstance(recorded, str) and recorded != version.version:
            by_record = [s for s in group if s.matches(recorded) and s.id == record.get("series")]
            if by_record:
                return by_record[0], TreeVersion(version.name, recorded,
                                                 f"{RECORD_FILE}; {version.source} now says {version.version}")
        raise UnsupportedVersion(f"{target} {version.version} (from {version.source}) in {tree} is not supported by "
                                 f"any patch series; supported versions: {ranges}", target, version.version)
    if len(matching) > 1:
        raise PatchError(f"{target} {version.version} matches several series ({', '.join(s.id for s in matching)}); "
                         f"their version ranges overlap")
    return matching[0], version


# ---------------------------------------------------------------------------------------------------------------
# git apply


def _git_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    # never let git find a repository *above* the tree (it would take patch paths relative to that repository's
    # root and silently skip them); a repository at the tree itself is fine
    env["GIT_CEILING_DIRECTORIES"] = str(Path(tree).resolve().parent)
    env["LC_ALL"] = "C"
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    return env


def _git_apply(tree: Path, patches: list[Path], *, reverse: bool = False, check: bool = True,
               include: str | None = None) -> tuple[bool, str]:
    if not shutil.which("git"):
        raise PatchError("git is needed to check and apply patches: install git")
    cmd = ["git", "apply", "--whitespace=nowarn"]
    if check:
        cmd.append("--check")
    if reverse:
        cmd.append("--reverse")
    if include is not None:
        cmd.append("--include=" + re.sub(r"([*?\[\]\\])", r"\\\1", include))
    cmd += [str(p.resolve()) for p in patches]
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env=_git_env(tree), stdin=subprocess.DEVNULL)
    return proc.returncode == 0, (proc.stderr or proc.stdout).strip()


def _reasons(output: str, path: str) -> str:
    lines = [ln.removeprefix("error: ") for ln in output.splitlines() if path in ln]
    if not output:
        return ""
    return "; ".join(lines) or output.splitlines()[-1]


@dataclass
class FileState:
    path: str
    state: str
    sha256: str | None
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "state": self.state, "sha256": self.sha256, "detail": self.detail}


@dataclass
class TreeState:
    tree: Path
    series: Series
    version: TreeVersion
    state: str
    files: list[FileState]
    base_matches: bool | None  # the touched files are the source version's (pristine or patched); None: unknown
    record: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.state in (APPLIED, APPLICABLE)

    def summary(self) -> str:
        head = (f"{self.series.target} {self.version.version} (from {self.version.source}) in {self.tree}: "
                f"series {self.series.id}")
        if self.state == APPLIED:
            how = "recorded in " + RECORD_FILE if self.record else f"no {RECORD_FILE}: applied outside yrpd"
            return f"{head} is already applied ({how})"
        if self.state == APPLICABLE:
            return f"{head} applies cleanly (not applied yet)"
        if self.state == PARTIAL:
            return f"{head} is partially applied"
        return f"{head} conflicts with the tree"

    def as_dict(self) -> dict[str, Any]:
        return {"tree": str(self.tree), "series": self.series.id, "target": self.series.target,
                "version": self.version.version, "version_source": self.version.source, "state": self.state,
                "base_matches": self.base_matches, "files": [f.as_dict() for f in self.files],
                "recorded": self.record is not None}


def read_record(tree: Path) -> dict[str, Any] | None:
    path = Path(tree) / RECORD_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"schema": "unreadable"}
    return data if isinstance(data, dict) else {"schema": "unreadable"}


def _current_hashes(tree: Path, paths: Iterable[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for p in paths:
        f = tree / p
        out[p] = file_sha256(f) if f.is_file() else None
    return out


def inspect(tree: Path, series: Series, version: TreeVersion) -> TreeState:
    """Decide, file by file, whether the series is applied, applicable or conflicting in the tree."""
    tree = Path(tree)
    forward = [p.path for p in series.patches]
    backward = list(reversed(forward))
    hashes = _current_hashes(tree, series.files)
    creates = {p for patch in series.patches for p in patch.creates}
    deletes = {p for patch in series.patches for p in patch.deletes}
    # the touched files are those of the source version, pristine or patched (None: no hashes in the manifest)
    base_matches = ((hashes == series.base_files or hashes == series.result_files) if series.base_files else None)
    fwd_all, fwd_out = _git_apply(tree, forward)
    rev_all, rev_out = _git_apply(tree, backward, reverse=True)
    files: list[FileState] = []
    for path in series.files:
        sha = hashes[path]
        if sha is not None and series.result_files.get(path) == sha and path not in deletes:
            files.append(FileState(path, APPLIED, sha, "matches the patched file"))
            continue
        if sha is not None and series.base_files.get(path) == sha and fwd_all:
            files.append(FileState(path, APPLICABLE, sha, "matches the pristine file"))
            continue
        fwd, fout = (fwd_all, fwd_out) if len(series.files) == 1 else _git_apply(tree, forward, include=path)
        rev, rout = (rev_all, rev_out) if len(series.files) == 1 else _git_apply(tree, backward, reverse=True,
                                                                                  include=path)
        if fwd and not rev:
            files.append(FileState(path, APPLICABLE, sha, "applies cleanly"))
        elif rev and not fwd:
            files.append(FileState(path, APPLIED, sha, "the changes are present"))
        elif rev and fwd:
            files.append(FileState(path, CONFLICTING, sha, "applies both ways: cannot tell whether it is patched"))
        elif sha is None and path not in creates:
            files.append(FileState(path, MISSING, None, "the file is absent"))
        else:
            files.append(FileState(path, CONFLICTING, sha, _reasons(fout, path) or "does not apply"))
    states = {f.state for f in files}
    if states == {APPLIED} and rev_all:
        state = APPLIED
    elif states == {APPLICABLE} and fwd_all:
        state = APPLICABLE
    elif states <= {APPLIED, APPLICABLE} and APPLIED in states and APPLICABLE in states:
        state = PARTIAL
    else:
        state = CONFLICTING
        if states <= {APPLIED, APPLICABLE}:  # every file alone is fine, the sequence is not
            detail = (fwd_out if APPLICABLE in states else rev_out) or "the series does not apply as a whole"
            files.append(FileState("(series)", CONFLICTING, None, detail.splitlines()[-1]))
    return TreeState(tree=tree, series=series, version=version, state=state, files=files, base_matches=base_matches,
                     record=read_record(tree))


# ---------------------------------------------------------------------------------------------------------------
# actions


@dataclass
class Outcome:
    action: str                 # check | apply | revert
    state: TreeState            # the state before acting
    changed: bool
    message: str
    after: str | None = None    # the state after acting
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"action": self.action, "changed": self.changed, "message": self.message,
                "state_before": self.state.state, "state_after": self.after or self.state.state,
                **self.state.as_dict(), **self.extra}


def _conflict_error(state: TreeState, action: str) -> PatchStateError:
    lines = [f"  {f.state:<11} {f.path}" + (f": {f.detail}" if f.detail else "") for f in state.files]
    verdict = "nothing changed" if action == "check" else f"{action} refused, nothing changed"
    return PatchStateError(f"{state.summary()}; {verdict}:\n" + "\n".join(lines))


def resolve(tree: Path, series_root: Path | None = None) -> tuple[Series, TreeVersion]:
    """Pick the series for the tree (its target and version) and verify its checksums."""
    candidates = load_all(series_root or default_root())
    series, version = select_series(tree, candidates)
    series.verify()
    return series, version


def check(tree: Path, series_root: Path | None = None) -> Outcome:
    series, version = resolve(tree, series_root)
    state = inspect(tree, series, version)
    if not state.ok:
        raise _conflict_error(state, "check")
    return Outcome("check", state, False, state.summary())


def apply(tree: Path, series_root: Path | None = None) -> Outcome:
    """Apply the tree's series: a no-op when it is already applied; all or nothing otherwise."""
    tree = Path(tree)
    series, version = resolve(tree, series_root)
    state = inspect(tree, series, version)
    if state.state == APPLIED:
        return Outcome("apply", state, False, state.summary() + "; nothing changed", after=APPLIED)
    if state.state != APPLICABLE:
        raise _conflict_error(state, "apply")
    before = {f.path: f.sha256 for f in state.files}  # hashed by inspect() just now
    ok, out = _git_apply(tree, [p.path for p in series.patches], check=False)
    if not ok:  # git apply is atomic: the tree is as it was
        raise PatchStateError(f"git apply failed in {tree}, nothing changed: {out}")
    after = _current_hashes(tree, series.files)
    if before == series.base_files and series.result_files and after != series.result_files:
        _git_apply(tree, [p.path for p in reversed(series.patches)], reverse=True, check=False)
        raise PatchStateError(f"{tree}: the patched files do not hash to the manifest's result; reverted")
    record = {
        "schema": RECORD_SCHEMA,
        "series": series.id,
        "name": series.name,
        "series_sha256": series.digest(),
        "target": series.target,
        "version": version.version,
        "version_source": version.source,
        "patches": [{"file": p.file, "sha256": p.sha256} for p in series.patches],
        "files": {p: {"before": before[p], "after": after[p]} for p in series.files},
        "applied_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "applied_by": _yrpd_version(),
    }
    try:
        _write_json(tree / RECORD_FILE, record)
    except OSError as exc:
        _git_apply(tree, [p.path for p in reversed(series.patches)], reverse=True, check=False)
        raise PatchError(f"cannot write {tree / RECORD_FILE} ({exc}); the patches were reverted") from exc
    n = len(series.patches)
    msg = (f"{series.target} {version.version} in {tree}: applied series {series.id} "
           f"({n} patch{'es' if n != 1 else ''}, {len(series.files)} file{'s' if len(series.files) != 1 else ''})")
    return Outcome("apply", state, True, msg, after=APPLIED, extra={"series_sha256": record["series_sha256"]})


def run_reinstall(command: str, tree: Path, outcome: Outcome) -> int:
    """Run the user's reinstall command in the tree after apply/revert changed it; its exit status. The command
    sees YRPD_PATCH_ACTION, YRPD_PATCH_SERIES and YRPD_PATCH_VERSION."""
    state = outcome.state
    env = dict(os.environ, YRPD_PATCH_ACTION=outcome.action, YRPD_PATCH_SERIES=state.series.id,
               YRPD_PATCH_VERSION=state.version.version)
    # keep the version the tree had: setuptools-scm would derive a dev version from the now dirty git checkout
    pretend = "SETUPTOOLS_SCM_PRETEND_VERSION_FOR_" + re.sub(r"[^A-Za-z0-9]+", "_", state.series.target).upper()
    env.setdefault(pretend, state.version.version)
    return subprocess.run(command, shell=True, cwd=tree, env=env).returncode


def revert(tree: Path, series_root: Path | None = None) -> Outcome:
    """Reverse the tree's series and remove the record; the touched files come back byte for byte."""
    tree = Path(tree)
    series, version = resolve(tree, series_root)
    state = inspect(tree, series, version)
    record_path = tree / RECORD_FILE
    if state.state == APPLICABLE:
        if record_path.exists():
            record_path.unlink()
            return Outcome("revert", state, True, f"{state.summary()}: removed the stale {RECORD_FILE}",
                           after=APPLICABLE)
        return Outcome("revert", state, False, f"{state.summary()}: nothing to revert", after=APPLICABLE)
    if state.state != APPLIED:
        raise _conflict_error(state, "revert")
    ok, out = _git_apply(tree, [p.path for p in reversed(series.patches)], reverse=True, check=False)
    if not ok:
        raise PatchStateError(f"git apply --reverse failed in {tree}, nothing changed: {out}")
    now = _current_hashes(tree, series.files)
    expected: dict[str, str | None] | None = None
    record = state.record
    if record and record.get("series") == series.id and isinstance(record.get("files"), dict):
        expected = {p: (v or {}).get("before") for p, v in record["files"].items()}
    elif series.base_files:
        expected = series.base_files
    if record_path.exists():
        record_path.unlink()
    mismatch = sorted(p for p in series.files if expected is not None and p in expected and expected[p] != now[p])
    if mismatch:
        raise PatchStateError(f"{tree}: reverted, but {', '.join(mismatch)} differ from the recorded original")
    msg = f"{series.target} {version.version} in {tree}: reverted series {series.id}"
    return Outcome("revert", state, True, msg, after=APPLICABLE)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _yrpd_version() -> str:
    return f"yrpd {__version__}"
