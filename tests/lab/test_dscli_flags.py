"""The data system worker as `dscli start -w` would start it: read from the installed openyuanrong-datasystem itself
(its worker binary's `--help`, the flags with their built-in defaults, and dscli's worker_config.json, whose every
non-empty value dscli passes), compared with the flags yrpd's dscli launcher gives the same binary
(yrpd.cluster.dsconfig). Every flag whose effective value differs between the two is a path yrpd puts under the
session or a difference dsconfig names with its reason."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.prereq import missing
from yrpd.cluster import dsconfig
from yrpd.cluster.yrconfig import YrNode

pytestmark = [pytest.mark.lab]

DS_VENV = Path(os.environ.get("YRPD_TEST_ENV_ROOT", "/opt/yrpd/venvs")) / "ds"
#: what openYuanrong's vLLM deployment gives `dscli start -w` on its command line (so not dscli's defaults)
ON_DSCLIS_COMMAND_LINE = ("worker_address", "etcd_address", "shared_memory_size_mb")


def package() -> Path:
    found = sorted(DS_VENV.glob("lib/python3*/site-packages/yr/datasystem/datasystem_worker"))
    if not found:
        missing(f"{DS_VENV}: no openyuanrong-datasystem installed (scripts/test.sh installs it)")
    return found[0].parent


def binary_defaults(pkg: Path) -> dict[str, tuple[str, str]]:
    """flag -> (type, default) as the worker binary prints them."""
    text = subprocess.run([str(pkg / "datasystem_worker"), "--help"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LD_LIBRARY_PATH": str(pkg / "lib")}).stdout
    flags, current = {}, None
    for line in text.splitlines():
        if m := re.match(r"^  -(\w+) ", line):
            current = m.group(1)
        elif (m := re.match(r"^\s+type: (\w+) default: (.*)$", line)) and current:
            flags[current] = (m.group(1), m.group(2).strip())
            current = None
    return flags


def same(kind: str, a: object, b: object) -> bool:
    def norm(v: object) -> str:
        v = str(v).strip()
        if len(v) >= 2 and v[0] == v[-1] == '"':
            v = v[1:-1]
        if kind == "bool" or isinstance(v, bool):
            return {"1": "true", "0": "false"}.get(v.lower(), v.lower())
        return v
    return norm(a) == norm(b)


def test_yrpds_worker_runs_with_dsclis_effective_flags_but_the_differences_it_names():
    pkg = package()
    defaults = binary_defaults(pkg)
    assert len(defaults) > 100, "datasystem_worker --help listed no flags"
    dscli = {k: str(v.get("value", "")).strip()
             for k, v in json.loads((pkg / "worker_config.json").read_text()).items()}
    # (publishing its own KV events, as where the proxy follows the caches': a flag yrpd sets only then)
    node = YrNode(host_ip="10.0.0.1", master_ip="10.0.0.1", is_master=True, mode="ds_only",
                  deploy_path="/tmp/yrpd_sessions/S/yr", ds_venv=str(DS_VENV),
                  kv_events_socket="/tmp/yrpd_sessions/S/run/kv-events-datasystem.sock")
    ours = {k: dsconfig._flag(v) for k, v in dsconfig.worker_args(node).items()}
    assert not [k for k in ours if k not in defaults], "yrpd passes a flag this worker does not have"

    # dscli's effective value of a flag: its config's non-empty value, else the binary's default
    def dscli_value(k: str) -> str:
        return dscli[k] if dscli.get(k) else defaults[k][1]

    named = set(dsconfig.PATHS_UNDER_SESSION) | set(dsconfig.DIFFERS_FROM_DSCLI) | set(ON_DSCLIS_COMMAND_LINE)
    unexplained = []
    for k, (kind, default) in defaults.items():
        want = dscli_value(k)
        got = ours.get(k, default)
        if not same(kind, want, got) and k not in named:
            unexplained.append(f"{k}: dscli {want!r}, yrpd {got!r}")
    assert unexplained == [], unexplained
    # dscli's own defaults that are not the binary's reach yrpd's worker: the ones it names are exactly those
    dscli_only = {k for k, v in dscli.items() if v and k in defaults and not same(defaults[k][0], v, defaults[k][1])}
    assert set(dsconfig.DSCLI_DEFAULTS) <= dscli_only
    assert dscli_only <= named | set(dsconfig.DSCLI_DEFAULTS), dscli_only - named - set(dsconfig.DSCLI_DEFAULTS)
    # every path is absolute, under the session (dscli's are relative to its home, the binary's under $HOME)
    for k in dsconfig.PATHS_UNDER_SESSION:
        assert ours[k].startswith("/tmp/yrpd_sessions/S/"), (k, ours[k])
    # the reasons are where a reader looks: a named difference yrpd does not make is stale
    assert all(k in ours for k in dsconfig.DIFFERS_FROM_DSCLI if not k.startswith(("etcd_", "enable_etcd",
                                                                                      "curve", "enable_curve",
                                                                                      "spill_")))
