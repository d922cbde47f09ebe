"""Figures a lab test measured, written with where they came from (the committed reports under docs/bench/)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from yrpd.provenance import record
from yrpd.versions import DEFAULT_ENV_ROOT


def write_report(path: str, figures: dict, command: str = "pytest -s tests/lab/test_host_faults.py") -> None:
    """The figures with where they came from (yrpd.provenance: commit, dirty tree, versions, CPU, cores, the command)
    and the fault-injection settings in force."""
    settings = {k: v for k, v in os.environ.items() if k.startswith("YRPD_FAULT_")}
    prov = record([command], vllm_venv=Path(DEFAULT_ENV_ROOT) / "vllm")
    report = {"provenance": prov, "settings": settings, "figures": figures}
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def report_and_down(deployment, figures: dict, variable: str, test_file: str) -> None:
    """A lab test's end, passed or not: its figures to the file $`variable` names (if set), then `yrpd down`."""
    path = os.environ.get(variable)
    if path:
        write_report(path, figures, command=f"pytest -s {test_file}")
    deployment.cli("down", check=None, timeout=300)
