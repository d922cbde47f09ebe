"""Where the files that ship beside the code live: host scripts and playbooks.

In a source checkout they sit at the repository root (`deploy_scripts/`, `playbooks/`); an installed wheel
carries them as the packages `yrpd.deploy_scripts` and `yrpd.playbooks` (see pyproject.toml).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


@lru_cache(maxsize=None)
def asset_dir(name: str) -> Path:
    checkout = _ROOT / name
    if checkout.is_dir():
        return checkout
    installed = Path(__file__).resolve().parent / name
    if installed.is_dir():
        return installed
    raise FileNotFoundError(f"yrpd is installed without its {name}/ directory")


def deploy_script(name: str) -> str:
    return (asset_dir("deploy_scripts") / name).read_text()


def playbook_path(name: str) -> Path:
    return asset_dir("playbooks") / f"{name}.yaml"


def patches_dir() -> Path:
    """The patch series root (`<target>/<series>/manifest.yaml` below it): `patches/` in a source checkout,
    the package `yrpd.patches_data` in an installed wheel (`yrpd.patches` is the module that applies them)."""
    checkout = _ROOT / "patches"
    if any(checkout.glob("*/*/manifest.yaml")):
        return checkout
    installed = Path(__file__).resolve().parent / "patches_data"
    if installed.is_dir():
        return installed
    raise FileNotFoundError("yrpd is installed without its patch series (patches/ or yrpd/patches_data/)")


def container_profiles_dir() -> Path:
    """The container profiles (`<name>.yaml`): `containers/` in a source checkout, the package
    `yrpd.container_profiles` in an installed wheel (`yrpd.containers` is the module that renders them)."""
    checkout = _ROOT / "containers"
    if checkout.is_dir():
        return checkout
    installed = Path(__file__).resolve().parent / "container_profiles"
    if installed.is_dir():
        return installed
    raise FileNotFoundError("yrpd is installed without its container profiles (containers/ or yrpd/container_profiles/)")
