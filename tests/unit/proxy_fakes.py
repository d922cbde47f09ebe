"""Stand-ins for vLLM's OpenAI server and a running proxy, for tests/unit/test_proxy.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from yrpd.proxy.app import ProxyConfig, start

KV = {"yrpd": {"num_blocks": 3, "block_size": 128, "ns": "test"}}


@dataclass
class FakeVLLM:
    """Answers like one vLLM instance (prefill or decode) and records what it was sent."""

    name: str
    role: str
    kv: dict | None = field(default_factory=lambda: dict(KV))  # what a prefill hands back
    chunks: int = 3
    error: tuple[int, dict] | None = None  # answer this (status, JSON) instead
    health_status: int = 200
    health_delay: float = 0.0  # seconds before /health answers (a busy instance)
    hang_after: int | None = None  # stream: after this many events, go silent until cancelled
    break_after: int | None = None  # drop the connection after this many events (non-stream: mid-body)
    delay: float = 0.0  # seconds of "compute" before the answer (or the first event) starts
    bodies: list = field(default_factory=list)
    auth: list = field(default_factory=list)  # the Authorization header of each generation request (None: none)
    url: str = ""

    def __post_init__(self):
        self.gate = asyncio.Event()  # clear it to hold requests before they are answered
        self.gate.set()
        self.received = asyncio.Event()
        self.cancelled = asyncio.Event()  # a request's handler was cancelled: the proxy hung up on us
        self._runner: web.AppRunner | None = None

    def events(self, chat: bool) -> list[bytes]:
        """The SSE events a stream from this instance consists of."""
        out = []
        for n in range(self.chunks):
            choice = {"index": 0, "delta": {"content": f"{self.name}-{n} "}} if chat else \
                {"index": 0, "text": f"{self.name}-{n} "}
            out.append({"id": "x", "object": "chat.completion.chunk" if chat else "text_completion",
                        "model": "tiny", "choices": [choice]})
        return [f"data: {json.dumps(e)}\n\n".encode() for e in out] + [b"data: [DONE]\n\n"]

    def answer(self, chat: bool) -> dict:
        text = f"{self.name} says hi"
        choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
        return {"id": "x", "object": "chat.completion" if chat else "text_completion", "model": "tiny",
                "choices": [{**choice, "finish_reason": "length"}],
                "kv_transfer_params": self.kv if self.role == "prefill" else None}

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        self.received.set()
        chat = request.path.endswith("/chat/completions")
        try:
            await self.gate.wait()
            await asyncio.sleep(self.delay)
            if self.error:
                return web.json_response(self.error[1], status=self.error[0])
            if not body.get("stream"):
                data = json.dumps(self.answer(chat)).encode()
                if self.break_after is None:
                    return web.Response(body=data, content_type="application/json")
                out = web.StreamResponse(headers={"Content-Type": "application/json"})
                out.content_length = len(data)
                await out.prepare(request)
                await out.write(data[:10])
                request.transport.close()
                return out
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
            await out.prepare(request)
            for n, event in enumerate(self.events(chat)):
                if n == self.hang_after:
                    await asyncio.sleep(30)
                if n == self.break_after:
                    # what was written has left before the connection drops (a reader that comes to a dropped
                    # connection gets its error, not the data still buffered ahead of it)
                    await asyncio.sleep(0.2)
                    request.transport.close()
                    return out
                await out.write(event)
            await out.write_eof()
            return out
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def _health(self, request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(self.health_delay)
        return web.json_response({}, status=self.health_status)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "owned_by": self.name}]})

    async def start(self) -> FakeVLLM:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = "http://127.0.0.1:%d" % self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner:
            self.gate.set()
            await self._runner.cleanup()
            self._runner = None


@dataclass
class Setup:
    prefill: list[FakeVLLM]
    decode: list[FakeVLLM]
    url: str
    client: aiohttp.ClientSession

    async def status(self) -> dict:
        async with self.client.get(self.url + "/yrpd/status") as r:
            return await r.json()

    async def instance(self, fake: FakeVLLM) -> dict:
        return next(i for i in (await self.status())["instances"] if i["url"] == fake.url)

    async def metrics(self) -> str:
        async with self.client.get(self.url + "/metrics") as r:
            assert r.status == 200
            return await r.text()


@contextlib.asynccontextmanager
async def running(prefill: int = 1, decode: int = 1, **options):
    """Fake instances, the real proxy in front of them (same runner settings as `python -m yrpd.proxy`), a client."""
    fakes = [await FakeVLLM(f"p{n}", "prefill").start() for n in range(prefill)]
    fakes += [await FakeVLLM(f"d{n}", "decode").start() for n in range(decode)]
    runner = None
    try:
        options.setdefault("probe_interval", 60)  # tests that want the prober running ask for it
        config = ProxyConfig(prefill=[f.url for f in fakes[:prefill]], decode=[f.url for f in fakes[prefill:]],
                             served_model_name="tiny", **options)
        runner = await start(config, "127.0.0.1", 0, shutdown_timeout=0.5)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
            yield Setup(fakes[:prefill], fakes[prefill:], "http://127.0.0.1:%d" % runner.addresses[0][1], client)
    finally:
        if runner:
            await runner.cleanup()
        for fake in fakes:
            await fake.stop()


async def until(predicate, timeout: float = 3.0, step: float = 0.02) -> None:
    """Wait until `await predicate()` (or `predicate()`) is true; fail after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(step)
