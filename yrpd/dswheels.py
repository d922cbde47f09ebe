"""The data system the user brings: openyuanrong-datasystem wheels in a directory of theirs (`datasystem_wheels`),
newer than the one on the package index, from openYuanrong's own releases or an internal mirror.

What such a wheel can serve is read from the wheel itself, at plan time, without installing or importing it: its
version (the dist-info's METADATA), the methods of the Python client vllm-ascend's yuanrong backend uses
(`yr/datasystem/hetero_client.py`, class HeteroClient, parsed, not run: the wheel may be for another Python or
architecture than the controller's) and whether its dscli knows a coordinator (`yr/datasystem/cli/start.py`). Pure
apart from reading the files.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from yrpd.assets import parse_python
from yrpd.errors import SpecError

DIST = "openyuanrong_datasystem"
CLIENT_MODULE = "yr/datasystem/hetero_client.py"
CLIENT_CLASS = "HeteroClient"
DSCLI_START = "yr/datasystem/cli/start.py"
FIELD = "datasystem_wheels"


@dataclass(frozen=True)
class BroughtDataSystem:
    directory: Path
    version: str
    wheels: tuple[Path, ...]  # every openyuanrong-datasystem wheel there (one per Python and architecture)
    client_methods: frozenset[str]  # HeteroClient's public methods
    coordinator: bool  # dscli can start a worker with a coordinator (--coordinator_address)

    @property
    def digest(self) -> str:
        """Of the wheel files as they are now (names, sizes, times): a rebuilt wheel of the same version is another
        set to fetch and another derived image."""
        stats = [(w.name, w.stat().st_size, w.stat().st_mtime_ns) for w in self.wheels]
        return hashlib.sha256(repr(stats).encode()).hexdigest()[:16]

    def lacks(self, methods: tuple[str, ...]) -> list[str]:
        return [m for m in methods if m not in self.client_methods]


def read_wheel(wheel: Path) -> tuple[str, frozenset[str], bool]:
    """(version, HeteroClient's public methods, dscli knows a coordinator) of one openyuanrong-datasystem wheel."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = next((n for n in names if n.endswith(".dist-info/METADATA")), None)
        if meta is None or CLIENT_MODULE not in names:
            raise ValueError(f"{wheel.name} is not an openyuanrong-datasystem wheel (no METADATA or {CLIENT_MODULE})")
        version = next((line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                        if line.startswith("Version:")), "")
        tree = parse_python(z.read(CLIENT_MODULE).decode())
        start = z.read(DSCLI_START).decode() if DSCLI_START in names else ""
    methods = frozenset(f.name for node in tree.body if isinstance(node, ast.ClassDef) and node.name == CLIENT_CLASS
                        for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and not f.name.startswith("_"))
    if not version or not methods:
        raise ValueError(f"{wheel.name}: no version in its METADATA or no class {CLIENT_CLASS} in {CLIENT_MODULE}")
    return version, methods, "coordinator_address" in start


@functools.lru_cache(maxsize=8)
def bring(directory: str) -> BroughtDataSystem:
    """The data system in `directory`; SpecError (field datasystem_wheels) where there is none, or several versions,
    or a wheel that cannot be read."""
    path = Path(directory).expanduser().resolve()
    if not path.is_dir():
        raise SpecError(FIELD, f"{directory} is not a directory", "name the directory holding the "
                        "openyuanrong_datasystem-*.whl files")
    wheels = tuple(sorted(path.glob(f"{DIST}-*.whl")))
    if not wheels:
        raise SpecError(FIELD, f"{directory} holds no {DIST}-*.whl", "put the data system's wheels there (one per "
                        "Python version and architecture of the hosts)")
    versions = {w.name.split("-")[1] for w in wheels}
    if len(versions) > 1:
        raise SpecError(FIELD, f"{directory} holds openyuanrong-datasystem {', '.join(sorted(versions))}",
                        "keep the wheels of one version there")
    try:
        version, methods, coordinator = read_wheel(wheels[0])
    except (ValueError, zipfile.BadZipFile, SyntaxError, UnicodeDecodeError) as e:
        raise SpecError(FIELD, f"{wheels[0].name}: {e}", "bring the wheels as openYuanrong publishes them") from None
    return BroughtDataSystem(path, version, wheels, methods, coordinator)
