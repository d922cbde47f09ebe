"""Figures a lab test measured, written with where they came from (the committed reports under docs/bench/)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_report(path: str, figures: dict, command: str = "pytest -s tests/lab/test_host_faults.py") -> None:
    """The figures with where they came from: commit (and whether the tree was dirty), CPU, cores, the settings."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    settings = {k: v for k, v in os.environ.items() if k.startswith("YRPD_FAULT_")}
    report = {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain")),
              "cpu": cpu, "cores": os.cpu_count(), "settings": settings,
              "command": command, "figures": figures}
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def report_and_down(deployment, figures: dict, variable: str, test_file: str) -> None:
    """A lab test's end, passed or not: its figures to the file $`variable` names (if set), then `yrpd down`."""
    path = os.environ.get(variable)
    if path:
        write_report(path, figures, command=f"pytest -s {test_file}")
    deployment.cli("down", check=None, timeout=300)
