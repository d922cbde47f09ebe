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
CREATED = 1700000000


# -- a toy language model: its next token depends on every token before it, so an answer carried over by token ids
# goes on exactly as the unbroken one (what vLLM does for a greedy answer, but for a near-tie: docs/reliability.md)


def toy_tokens(text: str) -> list[int]:
    return [100 + sum(map(ord, word)) * 7 % 900 for word in text.split()]


def toy_chat_prompt(messages: list[dict]) -> list[int]:
    ids = [1]
    for m in messages:
        ids += [2, *toy_tokens(m["role"]), *toy_tokens(str(m["content"]))]
    return [*ids, 3]


def toy_next(context: list[int]) -> int:
    return 100 + sum(t * (i + 1) for i, t in enumerate(context)) * 2654435761 % 900


def toy_text(token: int) -> str:
    return f" w{token}"


#: what a held token and the one after it make together (`held` fakes): the held token ends inside this character,
#: so vLLM sends it with no text and the character with the next token's text
HELD = "\u00e9"


def toy_held(token: int) -> bool:
    return token % 7 == 0


def toy_pieces(ids: list[int], held: bool) -> list[str]:
    """The text each token's event carries, as vLLM's detokenizer streams it (`held`: with held tokens)."""
    out = []
    for k, t in enumerate(ids):
        before = HELD if held and k and toy_held(ids[k - 1]) else ""
        out.append(before + ("" if held and toy_held(t) else toy_text(t)))
    return out


def toy_decode(ids: list[int], held: bool) -> str:
    """`ids` decoded whole (what /detokenize answers): a held token at the end is an unfinished character."""
    return "".join(toy_pieces(ids, held)) + ("\ufffd" if held and ids and toy_held(ids[-1]) else "")


def toy_answer(prompt_ids: list[int], n: int) -> list[int]:
    context, out = list(prompt_ids), []
    for _ in range(n):
        out.append(toy_next(context))
        context.append(out[-1])
    return out


@dataclass
class Breaks:
    """How toy instances' streams break, shared by the instances it is given to: the first `times` streams (of any
    of them) break. kind: "between" (the connection drops after `after` token events), "inside" (half of event
    `after` is sent, then the connection drops), "error" (an error event after `after` token events, as an engine
    that died sends), "eof" (the stream just ends after `after` token events), "before_done" (after the last token
    and the usage, before [DONE]), "body" (a whole answer cut off mid-body), "merged" (tokens `after` - 1 and
    `after` in one event, then the connection drops)."""

    kind: str
    after: int = 3
    times: int = 1
    seen: int = 0
    pause_s: float = 0.0  # kind "pause": the stream falls silent this long after `after` token events, then goes on

    def now(self) -> bool:
        self.seen += 1
        return self.seen <= self.times


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
    toy: bool = False  # answer as vLLM does, from the toy model, token ids and all (what migration needs)
    held: bool = False  # toy: some tokens end inside a character (toy_held), their text held back as vLLM does
    breaks: Breaks | None = None  # toy: how its streams break
    paths: list = field(default_factory=list)  # the path of each generation request
    detokenized: list = field(default_factory=list)  # the ids of each /detokenize request
    detokenize_status: int = 200  # what /detokenize answers with (200: the toy's text)

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
        self.paths.append(request.path)
        try:
            await self.gate.wait()
            await asyncio.sleep(self.delay)
            if self.error:
                return web.json_response(self.error[1], status=self.error[0])
            if self.toy:
                return await self._toy(request, body, chat)
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

    async def _toy(self, request: web.Request, body: dict, chat: bool) -> web.StreamResponse:
        """The toy model's answer in vLLM 0.32's format (its OpenAI server, `model_dump_json(exclude_unset=True)`)."""
        if chat:
            prompt_ids = toy_chat_prompt(body["messages"])
            limit = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            prompt = body["prompt"]
            prompt_ids = list(prompt) if isinstance(prompt, list) else toy_tokens(prompt)
            limit = body.get("max_tokens")
        ids = toy_answer(prompt_ids, limit if limit is not None else 8)
        asked = bool(body.get("return_token_ids"))
        # vLLM names an answer after the request's X-Request-Id where it has one
        rid = request.headers.get("X-Request-Id") or f"{self.name}-{len(self.bodies)}"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                "object": "chat.completion.chunk" if chat else "text_completion", "created": CREATED,
                "model": body.get("model", "tiny")}
        usage = {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + len(ids),
                 "completion_tokens": len(ids)}
        pieces = toy_pieces(ids, self.held)
        if self.held and isinstance(body.get("prompt"), list) and prompt_ids and toy_held(prompt_ids[-1]):
            # vLLM 0.32 primes its detokenizer with the prompt: one that ends inside a character makes the first
            # token's text the whole prompt's and answer's (tests/connector/test_continuation_vllm.py)
            pieces[0] = toy_decode([*prompt_ids, ids[0]], True)
        if not body.get("stream"):
            text = "".join(pieces)
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else \
                {"index": 0, "text": text}
            answer = {**head, "object": "chat.completion" if chat else "text_completion",
                      "choices": [{**choice, "logprobs": None, "finish_reason": "length", "stop_reason": None,
                                   "token_ids": ids if asked else None}],
                      "usage": usage, "prompt_token_ids": prompt_ids if asked else None,
                      "kv_transfer_params": self.kv if self.role == "prefill" else None}
            data = json.dumps(answer).encode()
            if not (self.breaks and self.breaks.kind == "body" and self.breaks.now()):
                return web.Response(body=data, content_type="application/json")
            out = web.StreamResponse(headers={"Content-Type": "application/json"})
            out.content_length = len(data)
            await out.prepare(request)
            await out.write(data[:10])
            await asyncio.sleep(0.1)
            request.transport.close()
            return out
        events = []
        if chat:
            role = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                         "finish_reason": None}], "prompt_token_ids": prompt_ids if asked else None}
            events.append((role, False))
        merge = self.breaks is not None and self.breaks.kind == "merged" and self.breaks.seen < self.breaks.times
        for k, t in enumerate(ids):
            last = k == len(ids) - 1
            if chat:
                choice = {"index": 0, "delta": {"content": pieces[k]}, "logprobs": None,
                          "finish_reason": "length" if last else None}
            else:
                choice = {"index": 0, "text": pieces[k], "logprobs": None, "finish_reason": "length" if last else None,
                          "stop_reason": None, "prompt_token_ids": prompt_ids if asked and k == 0 else None}
            if chat and last:
                choice["stop_reason"] = None
            choice["token_ids"] = [t] if asked else None
            if merge and k == self.breaks.after - 1:  # this token in one event with the one before (a slow reader)
                before = events[-1][0]["choices"][0]
                if chat:
                    before["delta"]["content"] += pieces[k]
                else:
                    before["text"] += pieces[k]
                if asked:
                    before["token_ids"] = before["token_ids"] + [t]
                continue
            events.append(({**head, "choices": [choice]}, True))
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(({**head, "choices": [], "usage": usage}, False))
        wire = [f"data: {json.dumps(e, separators=(',', ':'))}\n\n".encode() for e, _ in events]
        wire.append(b"data: [DONE]\n\n")
        breaking = self.breaks is not None and self.breaks.now()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await out.prepare(request)
        tokens = 0
        for k, data in enumerate(wire):
            token = k < len(events) and events[k][1]
            if breaking:
                kind = self.breaks.kind
                if kind in ("between", "error", "eof", "merged") and token and \
                        tokens == self.breaks.after - (kind == "merged"):
                    if kind == "error":  # vLLM's own end of a stream whose engine died
                        err = {"error": {"message": "EngineCore encountered an issue", "type": "InternalServerError",
                                         "code": 500}}
                        await out.write(f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode())
                        await out.write_eof()
                        return out
                    if kind == "eof":
                        await out.write_eof()
                        return out
                    await asyncio.sleep(0.1)  # what was written leaves before the connection drops
                    request.transport.close()
                    return out
                if kind == "inside" and token and tokens == self.breaks.after:
                    await out.write(data[:len(data) // 2])
                    await asyncio.sleep(0.1)
                    request.transport.close()
                    return out
                if kind == "pause" and token and tokens == self.breaks.after:
                    await asyncio.sleep(self.breaks.pause_s)
                if kind == "before_done" and k == len(wire) - 1:
                    await asyncio.sleep(0.1)
                    request.transport.close()
                    return out
            await out.write(data)
            tokens += token
        await out.write_eof()
        return out

    async def _detokenize(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.detokenized.append(body["tokens"])
        if self.detokenize_status != 200:
            return web.json_response({"error": {"message": "no"}}, status=self.detokenize_status)
        return web.json_response({"prompt": toy_decode(body["tokens"], self.held)})

    async def _health(self, request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(self.health_delay)
        return web.json_response({}, status=self.health_status)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "owned_by": self.name}]})

    async def start(self) -> FakeVLLM:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/detokenize", self._detokenize)
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
async def running(prefill: int = 1, decode: int = 1, toy: bool = False, held: bool = False, **options):
    """Fake instances (`toy`: answering from the toy model, as vLLM does; `held`: with tokens whose text is held
    back), the real proxy in front of them (same runner settings as `python -m yrpd.proxy`), a client."""
    fakes = [await FakeVLLM(f"p{n}", "prefill", toy=toy, held=held).start() for n in range(prefill)]
    fakes += [await FakeVLLM(f"d{n}", "decode", toy=toy, held=held).start() for n in range(decode)]
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
