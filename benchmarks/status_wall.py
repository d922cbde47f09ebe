"""Wall time of `yrpd status` against 1 and 3 fake hosts (benchmark, not a test).

    .venv/bin/python benchmarks/status_wall.py [--runs 5]

Starts a fake-host lab (root needed), deploys the heartbeat test playbook, times `yrpd status --json`
(a fresh CLI process each run, as a user runs it), then tears everything down.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lab.fakehosts import FakeHostLab  # noqa: E402

PLAYBOOK = REPO / "tests" / "lab" / "playbooks" / "heartbeat.yaml"


def yrpd(lab, home, *args):
    ssh = lab.cli_ssh_args
    env = {**os.environ, "YRPD_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "yrpd", *args, *ssh], env=env, capture_output=True, text=True,
                          cwd=REPO, stdin=subprocess.DEVNULL)


def measure(n: int, runs: int) -> list[float]:
    work = Path(tempfile.mkdtemp(prefix="yrpd-bench-"))
    with FakeHostLab(n, work / "lab") as lab:
        lab.start()
        for host in lab.hosts:
            host.exec("mkdir -p /tmp/m && echo '{}' > /tmp/m/config.json")
        hosts = ",".join(h.name for h in lab.hosts)
        home = work / "home"
        deployed = yrpd(lab, home, "deploy", "--hosts", hosts, "--model", "/tmp/m", "--devices", "0-1",
                        "--playbook", str(PLAYBOOK))
        assert deployed.returncode == 0, deployed.stderr
        times = []
        try:
            for _ in range(runs):
                t = time.monotonic()
                result = yrpd(lab, home, "status", "--json")
                times.append(time.monotonic() - t)
                assert result.returncode == 0, result.stderr
        finally:
            yrpd(lab, home, "down")
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    for n in (1, 3):
        times = measure(n, args.runs)
        print(f"{n} host(s): median {statistics.median(times):.2f}s  min {min(times):.2f}s  max {max(times):.2f}s  "
              f"({args.runs} runs)")


if __name__ == "__main__":
    main()
