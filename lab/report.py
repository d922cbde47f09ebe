"""Figures a lab test measured, written with where they came from (the committed reports under docs/bench/)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from yrpd.provenance import record
from yrpd.versions import DEFAULT_ENV_ROOT


def write_report(path: str, figures: dict, command: str = "pytest -s tests/lab/test_host_faults.py",
                 outcomes: dict[str, str] | None = None) -> None:
    """The figures with where they came from (yrpd.provenance: commit, dirty tree, versions, CPU, cores, the command),
    the fault-injection settings in force and, for a test, whether it passed: `outcomes` maps each test whose figures
    these are to "passed" or "failed", and `outcome` says "passed" only if every one did (a figure of a failed run is
    not evidence of the behaviour it measures)."""
    settings = {k: v for k, v in os.environ.items() if k.startswith("YRPD_FAULT_")}
    prov = record([command], vllm_venv=Path(DEFAULT_ENV_ROOT) / "vllm")
    report = {"provenance": prov, "settings": settings}
    if outcomes is not None:
        report["outcome"] = "passed" if outcomes and all(o == "passed" for o in outcomes.values()) else "failed"
        report["tests"] = outcomes
    report["figures"] = figures
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
