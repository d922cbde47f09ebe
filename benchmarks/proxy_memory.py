"""Does the proxy's memory grow with the requests it has served? (benchmark, not a test; issue 32)

    .venv/bin/python benchmarks/proxy_memory.py [--requests 60000] [--minutes M] [--latency S] [--concurrency 8]
                                                [--every 2000] [--out FILE.json]

The 30-minute soak saw the proxy's RSS rise about 4 MB over 20 minutes (about 16,000 requests), too few to tell a
leak from the allocator settling. This drives many more requests through the real proxy (`python -m yrpd.proxy`, a
process of its own, as deployed) in front of stand-in instances (tests/unit/proxy_fakes.py: they answer at once, so
the proxy is the only thing being exercised, or after `--latency` seconds, so that as many
connections stay open as under the soak) and samples the proxy's RSS every `--every` requests.

The load is the soak's: its 8 prompts (half sharing a long prefix), greedy, 16 tokens; a quarter streamed, a quarter
chat; and, as in the soak, faults: in every 10 sample windows the decode instance answers 503 to /health for a few
probe rounds once (the proxy refuses with 503 meanwhile) and drops its connections mid-answer for 2 s once (as a
killed instance does), and 1 request in 50 is cut by the client before it ends.

Reported: RSS per sample, the slope per 10,000 requests over the first and over the second half of the run (a leak
keeps its slope; a settling allocator's second-half slope is near zero), errors by status. Provenance: commit,
CPU, cores, the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from lab.traffic import LONG  # noqa: E402
from yrpd.provenance import record  # noqa: E402
from tests.unit.proxy_fakes import FakeVLLM  # noqa: E402

PROMPTS = [f"{LONG}\n# question {i}" for i in range(4)] + [f"import module_{i}\n" * (i + 2) for i in range(4)]


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def slope(points: list[tuple[int, int]]) -> float | None:
    """Least-squares KB per 10,000 requests."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return round(sum((x - mx) * (y - my) for x, y in points) / var * 10_000, 1) if var else None


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run(args) -> dict:
    prefill = await FakeVLLM("p0", "prefill", chunks=16, delay=args.latency).start()
    decode = await FakeVLLM("d0", "decode", chunks=16, delay=args.latency).start()
    port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "yrpd.proxy", "--host", "127.0.0.1", "--port", str(port),
                              "--prefill", prefill.url, "--decode", decode.url, "--served-model-name", "tiny",
                              "--probe-interval", "0.5"], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    statuses: dict[str, int] = {}
    samples: list[tuple[int, int]] = []
    done = 0
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client:
            for _ in range(100):
                try:
                    async with client.get(base + "/health") as r:
                        if r.status < 500:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            samples.append((0, rss_kb(proxy.pid)))
            lock = asyncio.Lock()

            async def one(i: int) -> None:
                prompt = PROMPTS[i % len(PROMPTS)]
                chat = i % 4 == 1
                body = {"model": "tiny", "max_tokens": 16, "temperature": 0, "stream": i % 4 == 2}
                body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
                path = "/v1/chat/completions" if chat else "/v1/completions"
                try:
                    async with client.post(base + path, json=body) as r:
                        key = str(r.status)
                        if i % 50 == 7 and body["stream"]:
                            await r.content.readany()  # the client hangs up mid-stream
                            key += "-cut"
                        else:
                            await r.read()
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    key = type(exc).__name__
                statuses[key] = statuses.get(key, 0) + 1

            async def client_loop(n: int) -> None:
                nonlocal done
                while True:
                    async with lock:
                        if done >= args.requests or (args.minutes and time.monotonic() - started > args.minutes * 60):
                            return
                        i = done
                        done += 1
                    if i and i % args.every == 0:
                        samples.append((i, rss_kb(proxy.pid)))
                        print(f"{i} requests: proxy RSS {samples[-1][1]} KB", file=sys.stderr, flush=True)
                        for fake in (prefill, decode):  # the stand-ins record every body; not what is measured
                            fake.bodies.clear()
                            fake.auth.clear()
                        loop = asyncio.get_running_loop()
                        if (i // args.every) % 10 == 5:  # decode looks down for a few probe rounds
                            decode.health_status = 503
                            loop.call_later(2.0, setattr, decode, "health_status", 200)
                        elif (i // args.every) % 10 == 8:  # decode drops its connections mid-answer, as if killed
                            decode.break_after = 1
                            loop.call_later(2.0, setattr, decode, "break_after", None)
                    await one(i)

            started = time.monotonic()
            await asyncio.gather(*(client_loop(n) for n in range(args.concurrency)))
            elapsed = time.monotonic() - started
            samples.append((done, rss_kb(proxy.pid)))
    finally:
        proxy.terminate()
        proxy.wait(10)
        await prefill.stop()
        await decode.stop()
    half = len(samples) // 2
    return {"requests": done, "seconds": round(elapsed, 1), "statuses": statuses,
            "rss_kb": samples, "slope_kb_per_10k": {"first_half": slope(samples[:half + 1]),
                                                    "second_half": slope(samples[half:])}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=60_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--every", type=int, default=2000)
    p.add_argument("--minutes", type=float, default=0.0,
                   help="stop after this long even if --requests are not all sent (0: no limit)")
    p.add_argument("--latency", type=float, default=0.0,
                   help="seconds each stand-in takes before it answers (0: at once; the soak's instances took ~0.1)")
    p.add_argument("--out")
    args = p.parse_args()
    # SIGTERM ends the run through its `finally`, which stops the proxy it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = asyncio.run(run(args))
    report = {"provenance": record(["benchmarks/proxy_memory.py " + " ".join(sys.argv[1:])]), **result}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
