"""The control plane at 1 to 16 fake hosts: `yrpd deploy`, `status`, `logs` and `down` wall times (benchmark, not a
test; issue 17).

    .venv/bin/python benchmarks/control_plane.py [--sizes 1,4,8,16] [--runs 5] [--out FILE.json]

For each size: a fake-host lab of that many hosts (root needed; each a network namespace with its own sshd), then
one `yrpd deploy` of the whole product (openYuanrong's cluster and data system on every host, one prefill and one
decode instance of the tiny built-in model on the first two hosts, the proxy), `status --json` `--runs` times (a
fresh CLI process each, as a user runs it), `logs` once, `down` once. Each host's venvs are the machine's own
(env_path), so installs are checks that pass: deploy time is orchestration, the cluster's start and the model's
load. The deploy journal's per-host step times split it. The instances load the model while openYuanrong starts
(playbooks/deploy.yaml), so the model load is the window from starting the instances to their /health: when the
instances were still loading once the cluster was up (the /health wait outlasted the connector's 5 s reconnect by
a second), the cluster's start was hidden in that window and `orchestration` is the deploy's wall time less the
model build and the window; otherwise it is the wall time less the model build and the /health wait only (the
cluster counted in full). Fake hosts share this machine's cores (each
idle data system worker takes a few percent of one), so host-side work that would run in parallel on real hosts
queues here: the controller's own CPU time per `status` is reported beside its wall time, with the load average.
`status` is timed once the machine's busy cores stop falling after the deploy (`settled`: what the deployment
costs idle), then again with every host's data system processes paused (SIGSTOP; their ports still
accept connections, so status finds them healthy), which leaves the shared cores to the status work itself.
`--out` writes {"provenance": yrpd.provenance.record, "sizes": [one object per size]}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from yrpd.provenance import record  # noqa: E402
from yrpd.versions import DEFAULT_ENV_ROOT  # noqa: E402

from lab.fakehosts import FakeHostLab  # noqa: E402
from yrpd.connector.config import ConnectorConfig  # noqa: E402

ENV_ROOT = os.environ.get("YRPD_TEST_ENV_ROOT", "/opt/yrpd/venvs")
#: from starting the instances to their /health answer, in playbook order: the model loads through all of it
LOAD_WINDOW = ("instances.start", "cluster.start_master", "cluster.start_agent", "cluster.wait_healthy",
               "cluster.check_kv", "instances.wait_healthy")
CLUSTER_STEPS = LOAD_WINDOW[1:-1]


def yrpd(lab, home, *args, timeout=1800):
    ssh = lab.cli_ssh_args
    env = {**os.environ, "YRPD_HOME": str(home)}
    t = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "yrpd", *args, *ssh], env=env, capture_output=True, text=True,
                          cwd=REPO, stdin=subprocess.DEVNULL, timeout=timeout)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc.cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)  # the controller's own
    return proc, time.monotonic() - t


def journal_split(home: Path) -> dict:
    """Slowest host's seconds per step of the last deploy (the journal has one line per host and step)."""
    session = max((home / "sessions").glob("2*"))
    slowest: dict[str, float] = {}
    for line in (session / "journal.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry.get("seconds") is not None:
            slowest[entry["run"]] = max(slowest.get(entry["run"], 0.0), entry["seconds"])
    return slowest


def busy_cores(window: float) -> float:
    """Cores this machine kept busy (all processes, every fake host's included) over the next `window` seconds."""
    def busy() -> int:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields) - fields[3] - fields[4]  # all but idle and iowait

    before = busy()
    time.sleep(window)
    return (busy() - before) / os.sysconf("SC_CLK_TCK") / window


def settle(limit_s: float = 90.0, window: float = 3.0, tolerance: float = 0.1) -> dict:
    """Wait until the deploy's aftermath is over: the busy cores of two windows in a row differ by less than
    `tolerance` (the idle level of what was deployed), at most `limit_s`."""
    started, last = time.monotonic(), busy_cores(window)
    while time.monotonic() - started < limit_s:
        now = busy_cores(window)
        if abs(now - last) < tolerance:
            break
        last = now
    return {"waited_s": round(time.monotonic() - started, 1), "busy_cores": round(now, 2)}


def status_runs(lab, home: Path, n: int, runs: int, require_healthy: bool = True) -> dict:
    times, cpu, problems = [], [], set()
    for _ in range(runs):
        proc, took = yrpd(lab, home, "status", "--json")
        report = json.loads(proc.stdout)
        if require_healthy and not report.get("healthy"):
            raise RuntimeError(f"status on {n} hosts: not healthy: {proc.stdout[-2000:]}")
        problems.update(report.get("problems", []))
        times.append(took)
        cpu.append(proc.cpu_s)
    return {"median": round(statistics.median(times), 2), "min": round(min(times), 2), "max": round(max(times), 2),
            "runs": runs, "controller_cpu_median": round(statistics.median(cpu), 2), "problems": sorted(problems)}


def data_system_pids(lab) -> list[int]:
    """The lab's data system workers and masters (its hosts' processes only: another lab's are left alone)."""
    found = []
    for host in lab.hosts:
        for pid in host.pids():
            try:
                if b"datasystem_worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                pass
    return found


def measure(n: int, runs: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="yrpd-cp-"))
    with FakeHostLab(n, work / "lab") as lab:
        hosts = [h.name for h in lab.hosts]
        config = work / "yrpd.yaml"
        config.write_text("hosts:\n" + "".join(f"  - {{address: {h}, devices: [0, 1]}}\n"
                                               for h in hosts) +
                          f"device_kind: cpu\nmodel: builtin:tiny-qwen2\nenv_path: {ENV_ROOT}\n"
                          "datasystem_memory_mb: 64\ncluster_mode: ds_only\n")
        home = work / "home"
        out: dict = {"hosts": n}
        try:
            proc, out["deploy_s"] = yrpd(lab, home, "deploy", "--hosts", ",".join(hosts), "--config", str(config))
            if proc.returncode != 0:
                raise RuntimeError(f"deploy on {n} hosts failed:\n{proc.stderr[-3000:]}")
            steps = journal_split(home)
            waited = steps.get("instances.wait_healthy", 0.0)
            # the model still loaded once the cluster was up: the wait outlasted the connector's reconnect (which
            # alone can keep it up to retry_backoff_s after the cluster is up) by a second
            out["cluster_hidden"] = waited > ConnectorConfig.retry_backoff_s + 1.0
            window = sum(steps.get(s, 0.0) for s in LOAD_WINDOW) if out["cluster_hidden"] else waited
            model = steps.get("model.build", 0.0) + window
            out["orchestration_s"] = round(out["deploy_s"] - model, 1)
            out["model_s"] = round(model, 1)
            out["cluster_s"] = round(sum(steps.get(s, 0.0) for s in CLUSTER_STEPS), 1)
            out["slowest_steps"] = dict(sorted(steps.items(), key=lambda kv: -kv[1])[:6])
            # timed once the machine is back to what the deployment costs idle (the deploy's last steps and the
            # data system workers' start-up keep the shared cores busy for a while after `deploy` returns)
            out["settled"] = settle()
            out["status_s"] = status_runs(lab, home, n, runs)
            # what the fake hosts had to share: their load while idle (all of them run on this machine's cores)
            out["load_1min"] = os.getloadavg()[0]
            # the same with every host's data system processes paused (SIGSTOP): the shared cores then serve the
            # status work itself, as each real host's own cores would (their ports still accept connections)
            paused = data_system_pids(lab)
            try:
                for pid in paused:
                    os.kill(pid, signal.SIGSTOP)
                # (a connector may notice its paused worker: such problems are listed, not fatal)
                out["status_ds_paused_s"] = status_runs(lab, home, n, runs, require_healthy=False)
            finally:
                for pid in paused:
                    os.kill(pid, signal.SIGCONT)
            proc, out["logs_s"] = yrpd(lab, home, "logs", "-n", "5")
            if proc.returncode != 0:
                raise RuntimeError(f"logs on {n} hosts failed:\n{proc.stderr[-2000:]}")
        finally:
            proc, out["down_s"] = yrpd(lab, home, "down")
            out["down_ok"] = proc.returncode == 0
        for key in ("deploy_s", "logs_s", "down_s"):
            out[key] = round(out[key], 1)
    shutil.rmtree(work, ignore_errors=True)  # the lab's keys and the sessions: nothing of the run stays behind
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1,4,8,16")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = []
    for n in (int(s) for s in args.sizes.split(",")):
        results.append(measure(n, args.runs))
        print(json.dumps(results[-1]), flush=True)
    base = results[0]["status_s"]["median"]
    paused_base = results[0]["status_ds_paused_s"]["median"]
    for r in results:
        print(f"{r['hosts']:>3} hosts: deploy {r['deploy_s']}s (orchestration {r['orchestration_s']}s, model "
              f"{r['model_s']}s, cluster {r['cluster_s']}s{' hidden' if r['cluster_hidden'] else ''}), status median {r['status_s']['median']}s ({r['status_s']['median'] / base:.2f}x "
              f"of {results[0]['hosts']} host; controller CPU {r['status_s']['controller_cpu_median']}s; data system "
              f"paused {r['status_ds_paused_s']['median']}s, {r['status_ds_paused_s']['median'] / paused_base:.2f}x), "
              f"logs {r['logs_s']}s, down {r['down_s']}s, load {r['load_1min']:.1f}, busy cores idle "
              f"{r['settled']['busy_cores']} (settled after {r['settled']['waited_s']}s)")
    if args.out:
        prov = record([" ".join(["benchmarks/control_plane.py", *sys.argv[1:]])],
                      vllm_venv=Path(DEFAULT_ENV_ROOT) / "vllm")
        args.out.write_text(json.dumps({"provenance": prov, "sizes": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
