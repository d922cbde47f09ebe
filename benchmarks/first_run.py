"""The first run as a new user meets it: `./scripts/demo.sh` on this machine from nothing of its own, timed, N times
(benchmark, not a test; issue 48).

    python3 benchmarks/first_run.py [--repeat N] [--out-dir DIR] [--purge PKG ...] [--no-drop-caches]

Runs with the system Python (it removes the project's .venv). Before each run it removes what the demo makes or
leaves: the deployment (`yrpd down`), yrpd's env root (/opt/yrpd/venvs: uv, the data-system venv, etcd, the vLLM venv,
the built model and the caches kept there), the project's .venv, uv's, pip's and Hugging Face's caches, yrpd's
sessions, the apt packages named by --purge (none by default: the demo installs none on this kind of machine since it
stopped asking for openssh-server, the one it lacks when new), and the kernel's page cache where the sandbox allows
it. It stops, removing nothing, where `yrpd down` fails. What stays is what a new machine of this kind has: the package
index, the apt lists, the torch file on disk.

Each output line is timed as it arrives, so the report splits every run into what comes before the deploy (the installs
and, since the demo makes it beside vLLM's self check, the model), the deploy (its own figure and each step of over a second), and the end (status and the two questions);
it also keeps every `[install]` phase line. A run counts only if both answers are the known ones (Paris, Au).
The report (first-run.json, first-run.md in --out-dir): each run, the medians, provenance.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from yrpd.provenance import git_state, record  # noqa: E402

ENV_ROOT = Path("/opt/yrpd/venvs")
HOME = Path.home()
WIPED = [ENV_ROOT, REPO / ".venv", HOME / ".cache/uv", HOME / ".cache/pip", HOME / ".cache/huggingface",
         HOME / ".cache/vllm", HOME / ".yrpd/sessions", Path("/tmp/yrpd_sessions")]
#: the lines where the scripts say what a phase took
PHASE = re.compile(r"^\[(install|install_vllm_cpu|demo)\] .*\d s\b")
STEP = re.compile(r"^\[(?P<n>\d+)/\d+\] (?P<title>.+?) \.\.\.$")
STEP_DONE = re.compile(r"^\s+(done|already done) on .*\((?P<s>\d+\.\d)s\)$")
DEPLOYED = re.compile(r"^deployed session \S+ in (?P<s>\d+\.\d)s")
#: the demo's two questions and what a correct answer names
KNOWN = [("capital of France", "Paris"), ("chemical symbol of gold", "Au")]


def wipe(purge: list[str], drop_caches: bool) -> list[str]:
    """Remove what a run makes; what was done, as lines for the report."""
    done = []
    yrpd_cli = REPO / ".venv/bin/yrpd"
    if yrpd_cli.exists():
        proc = subprocess.run([str(yrpd_cli), "down"], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=600)
        if proc.returncode not in (0, 2):  # 2: no deployment to take down
            raise SystemExit(f"first_run.py: `yrpd down` failed ({proc.returncode}), so the venvs may be in use; "
                             f"nothing removed: {proc.stderr.strip()[-400:]}")
        done.append(f"yrpd down: exit {proc.returncode}")
    for path in WIPED:
        if path.is_symlink():
            path.unlink()
        elif path.exists():
            shutil.rmtree(path)
        else:
            continue
        done.append(f"removed {path}")
    installed = [p for p in purge if subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True,
                                                    text=True).stdout.endswith("install ok installed")]
    if installed:
        subprocess.run(["apt-get", "purge", "-y", "-qq", *installed], check=True, capture_output=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        done.append(f"apt-get purge {' '.join(installed)}")
    if drop_caches:
        subprocess.run(["sync"], check=False)
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            done.append("dropped the page cache")
        except OSError as exc:
            done.append(f"page cache kept ({exc.strerror})")
    return done


def one(n: int, purge: list[str], drop_caches: bool, log_dir: Path) -> dict:
    wiped = wipe(purge, drop_caches)
    started = time.monotonic()
    lines: list[tuple[float, str]] = []
    log = log_dir / f"demo-{n}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["./scripts/demo.sh"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            at = round(time.monotonic() - started, 1)
            lines.append((at, line.rstrip("\n")))
            out.write(f"{at:7.1f} {line}")
        rc = proc.wait()
    wall = round(time.monotonic() - started, 1)
    run: dict = {"run": n, "exit": rc, "wall_s": wall, "wiped": wiped, "log": str(log), "phases": [], "steps": []}
    deploy_start = next((at for at, text in lines if text.startswith("session ")), None)
    deployed = next(((at, float(m["s"])) for at, text in lines if (m := DEPLOYED.match(text))), None)
    if deploy_start is not None:
        run["installs_s"] = deploy_start
    if deployed is not None:
        run["deploy_s"] = deployed[1]
        run["after_deploy_s"] = round(wall - deployed[0], 1)
    title = None
    for _, text in lines:
        if PHASE.match(text):
            run["phases"].append(text)
        elif m := STEP.match(text):
            title = m["title"]
        elif (m := STEP_DONE.match(text)) and title and float(m["s"]) >= 1.0:
            run["steps"].append({"step": title, "s": float(m["s"])})
    answers = [text[3:] for _, text in lines if text.startswith("A: ")]
    run["answers"] = answers
    run["correct"] = len(answers) == len(KNOWN) and all(want in got for got, (_, want) in zip(answers, KNOWN))
    return run


def markdown(doc: dict) -> str:
    prov = doc["provenance"]
    runs = doc["runs"]
    lines = [f"# The first run: ./scripts/demo.sh from nothing, {len(runs)} runs", "",
             f"Commit {prov['commit']}{' (dirty)' if prov['dirty'] else ''}, CPU {prov['cpu']} ({prov['cores']} cores), "
             f"recorded {prov['recorded']}. Command: `{prov['commands'][0]}`. Before each run: "
             f"{'; '.join(runs[0]['wiped']) or 'nothing to remove'}. Seconds, from the demo's start.", "",
             "| run | answers right | installs and model | deploy | status and questions | demo in all |", "|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['run']} | {'yes' if r['correct'] else 'NO'} | {r.get('installs_s', '-')} | "
                     f"{r.get('deploy_s', '-')} | {r.get('after_deploy_s', '-')} | {r['wall_s']} |")
    med = doc["medians"]
    lines.append(f"| median | | {med.get('installs_s', '-')} | {med.get('deploy_s', '-')} | "
                 f"{med.get('after_deploy_s', '-')} | **{med.get('wall_s', '-')}** |")
    lines += ["", "Each run's phase lines and deploy steps of a second or more, as the demo printed them:", ""]
    for r in runs:
        parts = r["phases"] + [f"deploy: {s['step']}: {s['s']} s" for s in r["steps"]]
        lines.append(f"- run {r['run']}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/yrpd-first-run"))
    parser.add_argument("--purge", nargs="*", default=[],
                        help="apt packages removed before each run, where a new machine lacks them and the demo "
                             "installs them (none today)")
    parser.add_argument("--no-drop-caches", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("first_run.py: run it as root (it removes /opt/yrpd/venvs and apt packages, as a new machine has none)",
              file=sys.stderr)
        return 2
    code = git_state()
    command = " ".join(shlex.quote(a) for a in ["python3", "benchmarks/first_run.py", *sys.argv[1:]])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for n in range(1, args.repeat + 1):
        run = one(n, args.purge, not args.no_drop_caches, args.out_dir)
        runs.append(run)
        print(f"run {n}: exit {run['exit']}, {run['wall_s']} s, answers {'right' if run['correct'] else 'WRONG'}"
              f" (installs {run.get('installs_s')}, deploy {run.get('deploy_s')}, then {run.get('after_deploy_s')})",
              flush=True)
    if (REPO / ".venv/bin/yrpd").exists():
        subprocess.run([str(REPO / ".venv/bin/yrpd"), "down"], capture_output=True, stdin=subprocess.DEVNULL,
                       timeout=600)
    ok = [r for r in runs if r["exit"] == 0 and r["correct"]]
    medians = {k: statistics.median(r[k] for r in ok) for k in ("installs_s", "deploy_s", "after_deploy_s", "wall_s")
               if ok and all(k in r for r in ok)}
    doc = {"repeat": args.repeat, "runs": runs, "medians": medians,
           "provenance": record([command], vllm_venv=ENV_ROOT / "vllm", code=code)}
    (args.out_dir / "first-run.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out_dir / "first-run.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0 if len(ok) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
