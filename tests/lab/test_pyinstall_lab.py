"""deploy_scripts/pyinstall.sh installing for real: uv (the pinned release's wheel, fetched once into a cache) set up
from a wheel directory as on a host without an index, a package installed into a fresh venv with it, one progress
line per phase; the sources pip is configured with reach uv; pip where uv cannot be had or is not wanted; a failed
install shows its tail. The packages come from a directory (no index needed once the uv wheel is cached)."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.prereq import missing
from yrpd.versions import UV

pytestmark = pytest.mark.e2e

LIB = REPO / "deploy_scripts" / "pyinstall.sh"
CACHE = Path(os.environ.get("YRPD_UV_WHEEL_CACHE", "/var/cache/yrpd/uv"))
PROBE = "yrpd_pyinstall_probe"


def probe_wheel(directory: Path, version: str = "1.0") -> Path:
    """A pure-Python wheel of one module that says its version (made here: no index has it)."""
    files = {f"{PROBE}/__init__.py": f'VERSION = "{version}"\n'.encode(),
             f"{PROBE}-{version}.dist-info/METADATA":
                 f"Metadata-Version: 2.1\nName: {PROBE.replace('_', '-')}\nVersion: {version}\n".encode(),
             f"{PROBE}-{version}.dist-info/WHEEL":
                 b"Wheel-Version: 1.0\nGenerator: yrpd-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for name, data in files.items())
    files[f"{PROBE}-{version}.dist-info/RECORD"] = (record + f"{PROBE}-{version}.dist-info/RECORD,,\n").encode()
    path = directory / f"{PROBE}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


@pytest.fixture(scope="module")
def uv_wheel() -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    found = sorted(CACHE.glob(f"uv-{UV}-*.whl"))
    if not found:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-input",
                               "-q", "--no-deps", "--only-binary", ":all:", "-d", str(CACHE), f"uv=={UV}"],
                              capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
        found = sorted(CACHE.glob(f"uv-{UV}-*.whl"))
        if not found:
            missing(f"the uv {UV} wheel is not in {CACHE} and could not be fetched: {proc.stderr.strip()[-400:]}")
    return found[0]


@pytest.fixture(scope="module")
def uv_root(tmp_path_factory, uv_wheel) -> tuple[Path, Path]:
    """(a root where uv is set up already, a wheel directory) for the tests not about setting it up."""
    base = tmp_path_factory.mktemp("uv-ready")
    where = wheels(base, uv_wheel)
    got = install(base / "root", where, base / "venv")
    assert got.returncode == 0 and "(uv)" in got.stderr, got.stderr
    return base / "root", where


def wheels(tmp_path: Path, uv_wheel: Path | None, name: str = "wheels") -> Path:
    d = tmp_path / name
    d.mkdir()
    probe_wheel(d)
    if uv_wheel is not None:
        (d / uv_wheel.name).symlink_to(uv_wheel)
    return d


def install(root: Path, where: Path | None, venv: Path, spec: str = f"{PROBE}==1.0", pip_conf: str = "",
            **env) -> subprocess.CompletedProcess:
    """The library as the install scripts use it: uv set up under `root`, a venv, `spec` installed into it in one
    phase, both from `where` alone (given to pyi_init). Only `pip_conf` configures pip (none of the machine's)."""
    conf = root.parent / f"{root.name}-pip.conf"
    conf.write_text(pip_conf)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_", "YRPD_INSTALLER"))}
    clean.update(PIP_CONFIG_FILE=str(conf), **env)
    # (a venv uv installs into needs no pip of its own: made without, it is made in a fraction of the time)
    script = (f'set -euo pipefail; . "{LIB}"; pyi_init "{root}" "{where or ""}"; '
              f'[[ -x "{venv}/bin/python" ]] || python3 -m venv ${{PYI_UV:+--without-pip}} "{venv}"; '
              f'pyi_phase "{spec}" pyi_install "{venv}" "{spec}"')
    return subprocess.run(["bash", "-c", script], env=clean, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)


def version_in(venv: Path) -> str:
    return subprocess.run([str(venv / "bin/python"), "-c", f"import {PROBE}; print({PROBE}.VERSION)"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_uv_installs_from_a_wheel_directory_with_one_line_per_phase_and_is_set_up_once(tmp_path, uv_wheel):
    where = wheels(tmp_path, uv_wheel)
    first = install(tmp_path / "root", where, tmp_path / "venv")
    assert first.returncode == 0, first.stderr
    lines = first.stderr.strip().splitlines()
    assert re.fullmatch(rf"\[install\] uv {re.escape(UV)} into {tmp_path}/root/uv: \d+\.\d s \(pip\)", lines[0]), lines
    assert re.fullmatch(rf"\[install\] {PROBE}==1\.0: \d+\.\d s \(uv\)", lines[1]) and len(lines) == 2, lines
    assert version_in(tmp_path / "venv") == "1.0"
    # a second run finds uv where the first put it: no setup line, the phase line alone
    again = install(tmp_path / "root", where, tmp_path / "venv2")
    assert again.returncode == 0 and again.stderr.count("[install]") == 1 and "(uv)" in again.stderr, again.stderr


def test_uv_takes_the_sources_pip_is_configured_with(tmp_path, uv_root):
    """Nothing on the command line says where the package is: only pip's configuration (find-links, no index). The
    control: the same without that configuration cannot find it."""
    root, where = uv_root
    conf = f"[global]\nfind-links = {where}\nno-index = true\n"
    got = install(root, None, tmp_path / "venv", pip_conf=conf, UV_OFFLINE="1")
    assert got.returncode == 0 and "(uv)" in got.stderr, got.stderr
    assert version_in(tmp_path / "venv") == "1.0"
    blind = install(root, None, tmp_path / "venv-blind", UV_OFFLINE="1")
    assert blind.returncode != 0 and f"[install] {PROBE}==1.0: failed after" in blind.stderr, blind.stderr


def test_pip_installs_where_uv_cannot_be_had_or_is_not_wanted_and_says_why(tmp_path, uv_wheel):
    no_uv = wheels(tmp_path, None, "no-uv")
    fallback = install(tmp_path / "root", no_uv, tmp_path / "venv")
    assert fallback.returncode == 0, fallback.stderr
    assert re.search(rf"\[install\] {PROBE}==1\.0: \d+\.\d s \(pip: uv {re.escape(UV)} could not be installed: .+\)",
                     fallback.stderr), fallback.stderr
    assert version_in(tmp_path / "venv") == "1.0" and not (tmp_path / "root/uv").exists()  # nothing half made
    chosen = install(tmp_path / "root2", wheels(tmp_path, uv_wheel), tmp_path / "venv2", YRPD_INSTALLER="pip")
    assert chosen.returncode == 0 and "(pip: YRPD_INSTALLER=pip)" in chosen.stderr, chosen.stderr
    assert version_in(tmp_path / "venv2") == "1.0" and not (tmp_path / "root2/uv").exists()


def test_a_failed_install_names_its_phase_and_shows_the_installers_own_words(tmp_path, uv_root):
    root, where = uv_root
    for installer in ("uv", "pip"):
        got = install(root, where, tmp_path / f"venv-{installer}", f"{PROBE}==9.9", YRPD_INSTALLER=installer)
        assert got.returncode != 0, got.stderr
        assert f"[install] {PROBE}==9.9: failed after" in got.stderr and "9.9" in got.stderr.split("failed after")[1]
