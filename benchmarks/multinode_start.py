"""Start-up of one TP 2 instance two ways, side by side (benchmark, not a test; issue 45): vLLM's mp executor in one
`vllm serve` (one host), and vLLM's multi-node launcher, two `vllm serve` processes with `--nnodes 2` (the second
`--headless`), as yrpd starts an instance spanning two hosts with multi_node_backend mp. Here both nodes run on this
machine over loopback (gloo between them), one core each, so what the launcher's second process and its rendezvous
cost shows apart from any network. Ray, the other backend, cannot be measured here: vLLM's Ray executor refuses the
CPU platform.

    .venv/bin/python benchmarks/multinode_start.py [--runs 3] [--model DIR] [--out FILE.json]

Per run, the two ways in turn (A B A B ...): time from the first process's start until /health answers 200, then
until a first greedy completion (8 tokens) has come back; then every process of the run is killed. Reported: each
way's medians and runs, and the per-pair ratio launcher / one process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "deploy_scripts"))
from hostlib import unlink_unheld

from yrpd.provenance import record

VENV = Path(os.environ.get("YRPD_VLLM_VENV", "/opt/yrpd/venvs/vllm"))
PORT, MASTER_PORT = 18190, 29690
ARGS = ["--served-model-name", "m", "--enforce-eager", "--kv-cache-memory-bytes", str(256 * 2**20),
        "--max-model-len", "2048", "--dtype", "float32", "--tensor-parallel-size", "2"]
ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}


def launch(model: str, way: str, logs: Path) -> list[subprocess.Popen]:
    serve = [str(VENV / "bin/vllm"), "serve", model, *ARGS]
    if way == "one process":
        runs = [(serve + ["--host", "127.0.0.1", "--port", str(PORT)], "0|1")]
    else:
        nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(MASTER_PORT)]
        runs = [(serve + nodes + ["--node-rank", "0", "--host", "127.0.0.1", "--port", str(PORT)], "0"),
                (serve + nodes + ["--node-rank", "1", "--headless"], "1")]
    procs = []
    for i, (argv, cores) in enumerate(runs):
        with open(logs / f"{way.replace(' ', '-')}-{i}.log", "ab") as log:
            procs.append(subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                          env={**os.environ, **ENV, "VLLM_CPU_OMP_THREADS_BIND": cores},
                                          start_new_session=True))
    return procs


def answered(path: str, body: dict | None = None) -> bool:
    data = json.dumps(body).encode() if body else None
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status == 200 and (body is None or bool(json.load(resp)["choices"][0]["text"]))
    except OSError:
        return False


def one_run(model: str, way: str, logs: Path) -> dict:
    before = set(os.listdir("/dev/shm"))
    started = time.monotonic()
    procs = launch(model, way, logs)
    try:
        while not answered("/health"):
            if any(p.poll() is not None for p in procs):
                raise SystemExit(f"{way}: a process exited before /health answered; see {logs}")
            if time.monotonic() - started > 600:
                raise SystemExit(f"{way}: no /health after 600 s; see {logs}")
            time.sleep(0.2)
        healthy = time.monotonic() - started
        assert answered("/v1/completions", {"model": "m", "prompt": "The capital of France is", "max_tokens": 8,
                                            "temperature": 0}), f"{way}: no completion"
        return {"healthy_s": round(healthy, 2), "first_answer_s": round(time.monotonic() - started, 2)}
    finally:
        end_run(procs, before)


def end_run(procs: list[subprocess.Popen], shm_before: set[str]) -> None:
    """Kill each process's group and wait; then the shared memory the run left that nobody holds goes (killed with
    -9, vLLM leaves its segments, its CPU all-reduce buffers too)."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    time.sleep(3)  # the ports and the cores free again before the next run
    unlink_unheld(sorted(f"/dev/shm/{n}" for n in set(os.listdir("/dev/shm")) - shm_before))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default="/opt/yrpd/venvs/models/tiny-qwen2")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    ways = ("one process", "launcher")
    runs: dict[str, list[dict]] = {w: [] for w in ways}
    with tempfile.TemporaryDirectory(prefix="yrpd-multinode-") as tmp:
        for _ in range(args.runs):
            for way in ways:
                runs[way].append(one_run(args.model, way, Path(tmp)))
                print(way, runs[way][-1], flush=True)
    report = {
        "provenance": record([" ".join(sys.argv)], vllm_venv=VENV),
        "model": args.model, "what": "TP 2 on this machine, one core a rank: one `vllm serve` vs vLLM's multi-node "
                                    "launcher (two, --nnodes 2, over loopback); ray not measurable on CPU",
        "ways": {w: {"median_healthy_s": statistics.median(r["healthy_s"] for r in runs[w]),
                     "median_first_answer_s": statistics.median(r["first_answer_s"] for r in runs[w]),
                     "runs": runs[w]} for w in ways},
        "ratio_launcher_over_one_process_healthy": [
            round(b["healthy_s"] / a["healthy_s"], 3) for a, b in zip(runs["one process"], runs["launcher"])],
    }
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
