"""python -m yrpd.proxy --prefill URL --decode URL --served-model-name NAME [...]: serve until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from urllib.parse import urlsplit

from yrpd.credentials import KV_PROXY_PUBLIC_ENV, KV_PROXY_SECRET_ENV, KV_RELAY_PUBLIC_ENV, PROXY_TOKEN_ENV

from .routing import Routing


def _url(text: str) -> str:
    parts = urlsplit(text)
    # A path would end up in front of /v1/..., which is never what was meant.
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path.strip("/") or parts.query:
        raise argparse.ArgumentTypeError(f"want http://HOST:PORT, got {text!r}")
    return text.rstrip("/")


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m yrpd.proxy",
                                description="OpenAI-compatible proxy for prefill/decode-disaggregated vLLM: "
                                            "prefill with max_tokens=1, then decode with the KV prefill left.")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on [%(default)s]")
    p.add_argument("--port", type=int, default=8000, help="port to listen on [%(default)s]")
    p.add_argument("--prefill", action="append", default=[], type=_url, metavar="URL",
                   help="a prefill instance, e.g. http://10.0.0.1:8100 (repeat for more)")
    p.add_argument("--decode", action="append", default=[], type=_url, metavar="URL",
                   help="a decode instance (repeat for more)")
    p.add_argument("--instances-file", metavar="FILE",
                   help='the membership, read again every probe round where it exists, in place of --prefill and '
                        '--decode: {"instances": [{"url": URL, "role": "prefill"|"decode", "draining": false}]}; '
                        'a draining instance gets no new request, one left out goes once its requests have ended')
    p.add_argument("--served-model-name", required=True, metavar="NAME", help="model name the instances serve")
    p.add_argument("--api-key-env", metavar="VAR",
                   help="environment variable holding the API key; when it is set and non-empty, /v1/* needs "
                        "'Authorization: Bearer KEY'")
    p.add_argument("--request-timeout", type=_positive, default=600.0, metavar="S",
                   help="longest an instance may stay silent (before answering, or between stream chunks) "
                        "[%(default)g]")
    p.add_argument("--probe-interval", type=_positive, default=2.0, metavar="S",
                   help="seconds between /health probes of every instance [%(default)g]")
    p.add_argument("--routing", choices=[r.value for r in Routing], default=Routing.prefix.value,
                   help="how an instance is chosen: load (fewest requests in flight) or prefix (cache-aware: a prefill "
                        "leg goes where the prompt's unseen part plus the work queued there is least) [%(default)s]")
    p.add_argument("--routing-bound", type=int, default=2, metavar="N",
                   help="no leg goes to an instance with N more requests in flight than the least busy one "
                        "[%(default)s]")
    p.add_argument("--kv-hash-seed", metavar="SEED",
                   help="the PYTHONHASHSEED the instances run with, where they have one: prefix routing hashes prompt "
                        "blocks as they do, to match what their KV-cache events say they hold")
    p.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                   help="do not follow the instances' KV-cache events: prefix routing estimates what each holds")
    p.add_argument("--kv-relay-port", type=int, metavar="PORT",
                   help="where the KV-event relay of each other host listens (yrpd.proxy.kvrelay; its CURVE keys from "
                        "YRPD_KV_RELAY_PUBLIC, YRPD_KV_PROXY_PUBLIC, YRPD_KV_PROXY_SECRET): the events of instances "
                        "on other hosts come through it")
    p.add_argument("--store-memory-mb", type=int, metavar="MB",
                   help="each data-system worker's shared memory, where a disk tier is behind it: prefix routing "
                        "takes its older blocks for spilled to disk, whose loads cost more")
    p.add_argument("--kv-exact", action="store_true",
                   help="before routing each leg, fetch what the instances' KV-cache events have not delivered yet "
                        "from the replay socket of each instance whose copy lacks the last block of a leg that ended "
                        "there (exact caches: a benchmark's oracle)")
    args = p.parse_args(argv)
    if not args.instances_file and not (args.prefill and args.decode):
        p.error("give --prefill and --decode, or --instances-file")
    return args


async def _serve(config, host: str, port: int) -> None:
    from .app import log, start  # aiohttp: only once the arguments are good (see main)

    runner = await start(config, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("listening on %s (event loop: %s)", ", ".join(f"http://{a[0]}:{a[1]}" for a in runner.addresses),
             type(loop).__module__.split(".")[0])
    try:
        await stop.wait()
        log.info("stopping")
    finally:
        await runner.cleanup()


def _run(coro) -> None:
    """On uvloop where it is installed, which is wherever vLLM is (its API server runs on it). asyncio's own loop
    reads every socket into a new 256 KiB bytes object and shrinks it to what arrived; under a proxy that runs for
    weeks those buffers come from glibc's heap and split it into holes too small for the next one: the deployed
    proxy's heap grew about 270 KB a minute with what it held in use flat (issue 32's soak). uvloop reads into one
    buffer it keeps and copies out only what arrived."""
    try:
        import uvloop

        run = uvloop.run  # uvloop 0.18 and later
    except (ImportError, AttributeError):
        run = asyncio.run
    run(coro)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # before importing aiohttp: --help and usage errors work without it
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .app import ProxyConfig, log

    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env) or None
        if api_key is None:
            log.warning("%s is not set or empty: /v1/* is open to anyone who can reach the proxy", args.api_key_env)

    keys = tuple(os.environ.get(k) or "" for k in (KV_RELAY_PUBLIC_ENV, KV_PROXY_PUBLIC_ENV, KV_PROXY_SECRET_ENV))
    relay_keys = keys if all(keys) else None
    config = ProxyConfig(prefill=args.prefill, decode=args.decode, served_model_name=args.served_model_name,
                         api_key=api_key, instance_token=os.environ.get(PROXY_TOKEN_ENV) or None,
                         request_timeout=args.request_timeout, probe_interval=args.probe_interval,
                         routing=Routing(args.routing), routing_bound=max(1, args.routing_bound),
                         instances_file=args.instances_file, kv_events=args.kv_events, kv_hash_seed=args.kv_hash_seed,
                         kv_exact=args.kv_exact, kv_relay_port=args.kv_relay_port, kv_relay_keys=relay_keys,
                         store_memory_mb=args.store_memory_mb)
    try:
        _run(_serve(config, args.host, args.port))
    except OSError as exc:  # typically the port is taken
        log.error("cannot serve on %s:%s: %s", args.host, args.port, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
