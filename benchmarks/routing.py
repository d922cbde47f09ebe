"""Cache-aware (prefix) routing against load-only routing, 2 prefill instances, one run each (benchmark, not a test;
issue 17).

    .venv/bin/python benchmarks/routing.py [--decode 1|2] [--workload short|long] [--groups G] [--concurrency C]
                                           [--dtype auto|float32|bfloat16] [--bound N]
                                           [--datasystem-mb MB] [--out-dir DIR] [--keep-logs DIR]
                                           [-- extra `yrpd bench run` options]

Fake hosts (root needed), one instance each, the 2 shared cores alternating: prefill-0 on h1 (core 0), prefill-1
on h2 (core 1), decode-0 on h3 (core 0) and, with --decode 2 (the default), decode-1 on h4 (core 1); the real
SmolLM2, max-model-len 2048, `routing: prefix` with `routing_bound` from --bound. Then one `yrpd bench run
--targets pd,pd-load`: `pd` routes by prefix (as the spec says), `pd-load` by requests in flight alone; everything
else is the same deployment. The workload: G groups (16) of 4 prompts sharing a prefix, shuffled, --concurrency (2);
`short`: 768-token prefixes, 64-token suffixes; `long`: 1,536-token prefixes, 16-token suffixes. Each instance's
own KV pool is sized (for the dtype the plan picks) to hold half the groups' prefixes plus the requests running:
an instance that gets every group evicts; one that gets half keeps its half. The data system gets
--datasystem-mb per host: 1024 (yrpd's default) holds every prefix, so what load routing costs is a load from
it; 64 holds fewer prefixes than are reused (the `short` working set is 16 x 17.6 MB in bfloat16), so a prefix
an instance's own pool lost is often computed again. The report (markdown and JSON) lands in --out-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lab.fakehosts import FakeHostLab  # noqa: E402

ENV_ROOT = os.environ.get("YRPD_TEST_ENV_ROOT", "/opt/yrpd/venvs")
COMMON = ["--prompts-per-group", "4", "--output-len", "4"]
WORKLOADS = {"short": (768, 64), "long": (1536, 16)}  # prefix, suffix tokens
#: SmolLM2-135M's KV elements per token: 30 layers x 3 KV heads x 64 x 2 (K and V)
KV_ELEMENTS_PER_TOKEN = 30 * 3 * 64 * 2
BLOCK = 128  # vLLM CPU's default block size


def pool_mb(groups: int, prefix: int, suffix: int, dtype: str, concurrency: int = 2) -> int:
    """An instance's KV pool: half the groups' prefixes, plus the whole prompts of the requests running."""
    blocks = (groups // 2) * (prefix // BLOCK) + concurrency * -(-(prefix + suffix) // BLOCK)
    return -(-blocks * BLOCK * KV_ELEMENTS_PER_TOKEN * (4 if dtype == "float32" else 2) // (1 << 20))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, default=Path("bench-routing"))
    parser.add_argument("--bound", type=int, default=2, help="routing_bound of the pd target [%(default)s]")
    parser.add_argument("--decode", type=int, choices=(1, 2), default=2, help="decode instances [%(default)s]")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="short", help="[%(default)s]")
    parser.add_argument("--groups", type=int, default=16, help="prompt groups sharing a prefix [%(default)s]")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight [%(default)s]")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="the instances' dtype (auto: float32 for SmolLM2) [%(default)s]")
    parser.add_argument("--datasystem-mb", type=int, default=1024,
                        help="data system memory per host; below the working set it evicts [%(default)s]")
    parser.add_argument("--keep-logs", type=Path, metavar="DIR",
                        help="copy every host's session logs (proxy, instances, data system) here at the end")
    parser.add_argument("extra", nargs="*", help="more `yrpd bench run` options (after --)")
    return in_workdir("yrpd-route-", run, parser.parse_args())


def in_workdir(prefix: str, run, args: argparse.Namespace) -> int:
    """`run(args, work)` in a directory of its own, removed after (the lab is gone by then, the reports copied out)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        return run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> int:
    hosts = [f"h{i}" for i in range(1, 3 + args.decode)]
    with FakeHostLab(len(hosts), work / "lab") as lab:
        ssh = lab.cli_ssh_args
        env = {**os.environ, "YRPD_HOME": str(work / "home")}
        config = work / "yrpd.yaml"
        config.write_text("hosts:\n" + "".join(f"  - {{address: {h}, devices: [{i % 2}]}}\n"
                                                 for i, h in enumerate(hosts))
                          + f"device_kind: cpu\nmodel: builtin:smollm2\nenv_path: {ENV_ROOT}\ndtype: {args.dtype}\n"
                          f"datasystem_memory_mb: {args.datasystem_mb}\ncluster_mode: ds_only\n"
                          "engine_args: ['--max-model-len', '2048']\nrouting: prefix\n"
                          f"routing_bound: {args.bound}\n")

        def yrpd(*argv: str) -> int:
            return subprocess.run([sys.executable, "-m", "yrpd", *argv], env=env, cwd=REPO,
                                  stdin=subprocess.DEVNULL).returncode

        layout = ["--hosts", ",".join(hosts), "--config", str(config), "--prefill", "2", "--decode", str(args.decode)]
        plan = subprocess.run([sys.executable, "-m", "yrpd", "plan", *layout, "--json", *ssh], env=env, cwd=REPO,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True)
        dtype = json.loads(plan.stdout)["dtype"]["dtype"]
        prefix, suffix = WORKLOADS[args.workload]
        workload = ["--groups", str(args.groups), "--prefix-len", str(prefix), "--suffix-len", str(suffix),
                    "--max-concurrency", str(args.concurrency),
                    "--kv-cache-mb", str(pool_mb(args.groups, prefix, suffix, dtype, args.concurrency))]
        try:
            if yrpd("deploy", *layout, *ssh):
                return 1
            code = yrpd("bench", "run", "--targets", "pd,pd-load", *COMMON, *workload,
                        "--datasystem-mb", str(args.datasystem_mb), "--no-restore", *args.extra)
            copy_reports(work, args.out_dir)
            return code
        finally:
            yrpd("down", *ssh)
            keep_logs(lab, hosts, args.keep_logs)


def copy_reports(work: Path, out_dir: Path) -> None:
    """Every bench run's directory of the lab's sessions into out_dir."""
    reports = sorted((work / "home" / "sessions").glob("*/bench/*"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in reports:
        if path.is_dir():
            shutil.copytree(path, out_dir / path.name, dirs_exist_ok=True)
        else:
            shutil.copy(path, out_dir)
    print(f"reports copied to {out_dir}: {[p.name for p in reports]}")


def keep_logs(lab, hosts: list[str], into: Path | None) -> None:
    """Every host's session logs (proxy, instances, data system) into `into`/<host>/<session>."""
    if into is None:
        return
    for host in hosts:  # a fake host's /tmp is its own directory in the lab (lab/fakehosts.py)
        for logs in (lab[host].dir / "tmp/yrpd_sessions").glob("*/logs"):
            shutil.copytree(logs, into / host / logs.parent.name, dirs_exist_ok=True)


if __name__ == "__main__":
    sys.exit(main())
