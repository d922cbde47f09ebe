"""The yrpd CLI run as a user runs it: a subprocess, from the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_yrpd(*args, cwd=None, env=None, timeout=300, check=None):
    """Run the real CLI in a subprocess, as a user would; `check`: the exit code it must end with."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "yrpd", *map(str, args)], cwd=cwd or REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check is not None and proc.returncode != check:
        raise AssertionError(f"yrpd {' '.join(map(str, args))} exited {proc.returncode}, wanted {check}\n"
                             f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc
