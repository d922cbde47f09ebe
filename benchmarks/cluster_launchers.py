"""Bring-up and teardown of the data system by each launcher (dscli, yr) on 1 and 2 fake hosts (benchmark, not a
test; issue 31).

    .venv/bin/python benchmarks/cluster_launchers.py [--sizes 1,2] [--runs 3] [--out FILE.json]

Per size a fake-host lab (root needed), then per run and launcher, alternating: `yrpd deploy` of the deploy playbook
cut after the cross-host KV check (the cluster lab test's playbook: no vLLM), then `yrpd down`. Reported per
launcher: the deploy's wall time, the cluster's start (the journal's start_master + start_agent + wait_healthy
seconds) and the down's wall time; medians and each run. The dscli launcher runs from an env root without the yr CLI
(tests/lab/test_cluster_lab.py's), the yr launcher from the machine's venvs. Both share the machine's cores with the
lab's sshds.
"""

from __future__ import annotations

import argparse
import json
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
from lab.cluster import MODEL, cluster_playbook, env_root, put_model  # noqa: E402
from yrpd.provenance import record  # noqa: E402

CLUSTER_STEPS = ("cluster.start_master", "cluster.start_agent", "cluster.wait_healthy")
LAUNCHERS = ("dscli", "yr")


def yrpd(lab, home: Path, *args: str) -> tuple[float, subprocess.CompletedProcess]:
    env = {**os.environ, "YRPD_HOME": str(home)}
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "yrpd", *args, *lab.cli_ssh_args], env=env, capture_output=True,
                          text=True, cwd=REPO, stdin=subprocess.DEVNULL, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"yrpd {args[0]} failed:\n{proc.stderr[-3000:]}")
    return time.monotonic() - t, proc


def cluster_seconds(home: Path) -> float:
    """The slowest host's time in each cluster step, summed (hosts run a step in parallel)."""
    journal = (home / "sessions" / "latest" / "journal.jsonl").read_text().splitlines()
    per_step: dict[str, float] = {}
    for line in journal:
        entry = json.loads(line)
        if entry.get("run") in CLUSTER_STEPS and entry.get("seconds"):
            per_step[entry["run"]] = max(per_step.get(entry["run"], 0.0), entry["seconds"])
    return sum(per_step.values())


def one(lab, work: Path, launcher: str, n: int) -> dict:
    home = work / f"home-{launcher}-{n}"
    config = work / f"{launcher}.yaml"
    config.write_text(f"cluster_launcher: {launcher}\ndatasystem_memory_mb: 256\n")
    hosts = ",".join(h.name for h in lab.hosts)
    deploy_s, _ = yrpd(lab, home, "deploy", "--hosts", hosts, "--model", MODEL, "--env-path", env_root(launcher),
                       "--config", str(config), "--playbook", str(cluster_playbook(work)))
    cluster_s = cluster_seconds(home)
    down_s, _ = yrpd(lab, home, "down")
    return {"deploy_s": round(deploy_s, 2), "cluster_start_s": round(cluster_s, 2), "down_s": round(down_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="")
    opts = ap.parse_args()
    command = " ".join(["benchmarks/cluster_launchers.py", *sys.argv[1:]])
    report = {"provenance": record([command]), "sizes": {}}
    for size in (int(s) for s in opts.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="yrpd-launchers-") as tmp, FakeHostLab(size, Path(tmp) / "lab") as lab:
            put_model(*lab.hosts)
            runs: dict[str, list[dict]] = {name: [] for name in LAUNCHERS}
            for n in range(opts.runs):
                for launcher in LAUNCHERS:  # alternating, so drift in the machine's load hits both alike
                    runs[launcher].append(one(lab, Path(tmp), launcher, n))
                    print(f"{size} host(s) {launcher} run {n}: {runs[launcher][-1]}", file=sys.stderr, flush=True)
            report["sizes"][str(size)] = {
                launcher: {"runs": rows, **{f"median_{k}": statistics.median(r[k] for r in rows)
                                            for k in ("deploy_s", "cluster_start_s", "down_s")}}
                for launcher, rows in runs.items()}
    text = json.dumps(report, indent=2)
    if opts.out:
        Path(opts.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
