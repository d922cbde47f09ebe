"""Stacks of a stalled step: the soak's load on 2 fake hosts, and whenever a request has been in flight longer than
`--after` seconds, py-spy dumps every vLLM and yrpd process on both hosts (a diagnosis, not a benchmark; issue 43
found the soak's 5 s tail with it).

    .venv/bin/python benchmarks/stall_stacks.py --py-spy /path/to/py-spy [--after 1.5] [--dumps 3] --out DIR

py-spy is not among yrpd's dependencies: install it anywhere the fake hosts can read (their /tmp is their own, so
not under /tmp). DIR gets one file per dump and host, then the session's logs (benchmarks/soak.py `copy_logs`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from lab.fakehosts import FakeHostLab  # noqa: E402
from lab.traffic import Call, TwoHosts, body  # noqa: E402
from soak import PROMPTS, copy_logs  # noqa: E402
from yrpd.provenance import record  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--py-spy", required=True)
    ap.add_argument("--after", type=float, default=1.5, help="seconds in flight that count as a stall")
    ap.add_argument("--dumps", type=int, default=3)
    ap.add_argument("--minutes", type=float, default=5)
    ap.add_argument("--out", required=True)
    opts = ap.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "provenance.txt").write_text(repr(record([" ".join(["benchmarks/stall_stacks.py", *sys.argv[1:]])])) + "\n")
    with tempfile.TemporaryDirectory(prefix="yrpd-stall-") as tmp, FakeHostLab(2, Path(tmp) / "lab") as lab:
        d = TwoHosts(lab, Path(tmp))
        d.deploy()
        inflight: dict[int, float] = {}
        stop = threading.Event()

        def client(n: int) -> None:
            i = n
            while not stop.is_set():
                inflight[n] = time.monotonic()
                Call(d.proxy, body(PROMPTS[i % len(PROMPTS)], 16), timeout=120, request_id=f"stall-{n}-{i}").run()
                inflight.pop(n, None)
                i += 1

        clients = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(8)]
        for c in clients:
            c.start()
        end, dumps = time.monotonic() + opts.minutes * 60, 0
        while time.monotonic() < end and dumps < opts.dumps:
            if any(time.monotonic() - s > opts.after for s in list(inflight.values())):
                stamp = time.strftime("%H%M%S")
                for host in (lab["h2"], lab["h1"]):
                    pids = host.exec("pgrep -f 'vllm|VLLM|EngineCor|yrpd' || true").stdout.split()
                    text = [f"===== pid {pid}\n" + host.exec(f"{opts.py_spy} dump --pid {pid} 2>&1 || true",
                                                              check=False, timeout=60).stdout for pid in pids]
                    (out / f"{stamp}-{host.name}.txt").write_text("\n".join(text))
                print(f"{stamp}: dumped", file=sys.stderr, flush=True)
                dumps += 1
                time.sleep(8)  # past this stall
            time.sleep(0.2)
        stop.set()
        for c in clients:
            c.join(150)
        copy_logs(lab, d.status()[0]["session"], out / "logs")
        d.cli("down", timeout=300)


if __name__ == "__main__":
    main()
