"""Cache-aware (prefix) routing against load-only routing, 2 prefill instances, one run each (benchmark, not a test;
issue 17).

    .venv/bin/python benchmarks/routing.py [--decode 1|2] [--workload short|long] [--bound N]
                                           [--datasystem-mb MB] [--out-dir DIR] [-- extra `yrpd bench run` options]

Fake hosts (root needed), one instance each, the 2 shared cores alternating: prefill-0 on h1 (core 0), prefill-1
on h2 (core 1), decode-0 on h3 (core 0) and, with --decode 2, decode-1 on h4 (core 1); the real SmolLM2,
max-model-len 2048, `routing: prefix` with `routing_bound` from --bound. Then one `yrpd bench run --targets
pd,pd-load`: `pd` routes by prefix (as the spec says), `pd-load` by requests in flight alone; everything else is
the same deployment. The workload is one where routing matters: 8 groups of 4 prompts sharing a prefix, and each
instance's own KV pool holds about half the groups' prefixes: an instance that gets every group evicts and
reloads them from the data system; one that gets half keeps them. `short`: 768-token prefixes, 64-token suffixes,
160 MB pools (28 blocks, 3,584 tokens); `long`: 1,536-token prefixes, 16-token suffixes, 300 MB pools (52 blocks),
where a reload costs more next to the work left after a hit. With one decode instance it gets every group under
both policies, so only the prefill leg differs. The data system gets --datasystem-mb per host (512: it holds
every prefix; 64: about 10 blocks, it evicts, and a prefix an instance's own pool lost may have to be computed
again: then keeping each group on one instance saves whole prefills). The report (markdown and JSON) lands in
--out-dir.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.lab.fakehosts import FakeHostLab  # noqa: E402

ENV_ROOT = os.environ.get("YRPD_TEST_ENV_ROOT", "/opt/yrpd/venvs")
COMMON = ["--groups", "8", "--prompts-per-group", "4", "--output-len", "4", "--max-concurrency", "2"]
# Pool sizes for float32 KV (a CPU without AVX512-BF16: 46 KB per token, 5.9 MB per 128-token block): a pool holds
# about half the groups' prefixes plus the blocks of the requests running. Where `auto` picks bfloat16 (23 KB a
# token) the same pools hold twice that: pass `-- --kv-cache-mb 80` (or 150 for `long`) for the same shape.
WORKLOADS = {
    "short": ["--prefix-len", "768", "--suffix-len", "64", "--kv-cache-mb", "160"],
    "long": ["--prefix-len", "1536", "--suffix-len", "16", "--kv-cache-mb", "300"],
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", type=Path, default=Path("bench-routing"))
    parser.add_argument("--bound", type=int, default=2, help="routing_bound of the pd target [%(default)s]")
    parser.add_argument("--decode", type=int, choices=(1, 2), default=1, help="decode instances [%(default)s]")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="short", help="[%(default)s]")
    parser.add_argument("--datasystem-mb", type=int, default=512,
                        help="data system memory per host; below the working set it evicts [%(default)s]")
    parser.add_argument("--keep-logs", type=Path, metavar="DIR",
                        help="copy every host's session logs (proxy, instances, data system) here at the end")
    parser.add_argument("extra", nargs="*", help="more `yrpd bench run` options (after --)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="yrpd-route-"))
    try:
        return run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # after the lab is gone; the reports were copied out


def run(args: argparse.Namespace, work: Path) -> int:
    hosts = [f"h{i}" for i in range(1, 3 + args.decode)]
    with FakeHostLab(len(hosts), work / "lab") as lab:
        ssh = lab.cli_ssh_args
        env = {**os.environ, "YRPD_HOME": str(work / "home")}
        config = work / "yrpd.yaml"
        config.write_text("hosts:\n" + "".join(f"  - {{address: {h}, devices: [{i % 2}]}}\n"
                                                 for i, h in enumerate(hosts))
                          + f"device_kind: cpu\nmodel: builtin:smollm2\nenv_path: {ENV_ROOT}\n"
                          f"datasystem_memory_mb: {args.datasystem_mb}\ncluster_mode: ds_only\n"
                          "engine_args: ['--max-model-len', '2048']\nrouting: prefix\n"
                          f"routing_bound: {args.bound}\n")

        def yrpd(*argv: str) -> int:
            return subprocess.run([sys.executable, "-m", "yrpd", *argv], env=env, cwd=REPO,
                                  stdin=subprocess.DEVNULL).returncode

        try:
            if yrpd("deploy", "--hosts", ",".join(hosts), "--config", str(config), "--prefill", "2",
                     "--decode", str(args.decode), *ssh):
                return 1
            code = yrpd("bench", "run", "--targets", "pd,pd-load", *COMMON, *WORKLOADS[args.workload],
                        "--datasystem-mb", str(args.datasystem_mb), "--no-restore", *args.extra)
            reports = sorted((work / "home" / "sessions").glob("*/bench/*"))
            args.out_dir.mkdir(parents=True, exist_ok=True)
            for path in reports:
                if path.is_dir():
                    shutil.copytree(path, args.out_dir / path.name, dirs_exist_ok=True)
                else:
                    shutil.copy(path, args.out_dir)
            print(f"reports copied to {args.out_dir}: {[p.name for p in reports]}")
            return code
        finally:
            yrpd("down", *ssh)
            if args.keep_logs:
                for host in hosts:  # a fake host's /tmp is its own directory in the lab (tests/lab/fakehosts.py)
                    for logs in (lab[host].dir / "tmp/yrpd_sessions").glob("*/logs"):
                        shutil.copytree(logs, args.keep_logs / host / logs.parent.name, dirs_exist_ok=True)


if __name__ == "__main__":
    sys.exit(main())
