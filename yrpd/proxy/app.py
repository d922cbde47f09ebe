"""The proxy server: each generation request runs a prefill leg, then a decode leg whose answer goes to the client."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from . import resume
from .kvfeed import Curve, Feeds
from .kvindex import Sight, host_of
from .metrics import LATENCY_KEPT_S, Metrics
from .pool import ROLES, Instance, Lease, Pool
from .resume import MAX_MIGRATIONS
from .routing import Prompt, Routing

log = logging.getLogger("yrpd.proxy")

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
MONITOR_PATHS = ("/health", "/metrics", "/yrpd/status")
KNOWN_PATHS = (*GENERATE_PATHS, "/v1/models", *MONITOR_PATHS)
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False}
# Long prompts and inline images are well beyond aiohttp's 1 MiB default.
MAX_BODY = 64 * 1024 * 1024
# Shorter than uvicorn's 5 s keep-alive (vLLM's default), so a pooled connection is never one vLLM is closing.
KEEPALIVE_S = 4.0
HEARTBEAT_S = 10.0
HEARTBEAT = b": keep-alive\n\n"
#: the most a break waits for an instance to say which tokens' text the client has (resume.Stream.settle)
SETTLE_S = 5.0
#: a client's connection whose link died ends on the proxy's side within these bounds (set on the listening socket,
#: which the accepted ones inherit): data not acknowledged for TCP_USER_TIMEOUT_MS (a stream, with its heartbeats),
#: or an idle connection that misses TCP_KEEPCNT probes, one every TCP_KEEPINTVL after TCP_KEEPIDLE s: 60 s either
#: way. A link that comes back sooner keeps its streams (30 s ended the lab's 30 s cut of the proxy's own host)
TCP_USER_TIMEOUT_MS = 60_000
TCP_KEEPALIVE = (30, 10, 3)  # idle, interval (s), probes
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 502: "bad_gateway",
                503: "service_unavailable", 504: "timeout"}
_UPSTREAM_ERRORS = (aiohttp.ClientError, OSError, asyncio.TimeoutError)
#: what of a request its prompt's token ids depend on, as vLLM's /tokenize takes it (completions and chat alike)
TOKENIZE_KEYS = ("model", "prompt", "messages", "add_generation_prompt", "continue_final_message",
                 "add_special_tokens", "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")


def _is_local(host: str) -> bool:
    """Whether `host` is an address of the machine (network namespace) the proxy runs in: an instance there shares
    its filesystem, so its ipc sockets too."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((host, 0))
        return True
    except OSError:
        return False
# aiohttp >= 3.10 tells a connect timeout (instance unreachable) from a read timeout (instance slow).
_CONNECT_TIMEOUT = getattr(aiohttp, "ConnectionTimeoutError", ())


@dataclass
class _Call:
    """Per-request bookkeeping: `note` is what the log line tells besides method, path, status and time."""
    started: float
    note: dict = field(default_factory=dict)
    client_gone: bool = False
    upstream_s: float = 0.0  # spent waiting for instances, up to the first token: the rest is the proxy's own
    prompt: Prompt | None = None  # what prefix routing knows of the prompt (yrpd.proxy.routing)
    prefill_lease: Lease | None = None  # the prefill leg's instance and what routing expected of it there
    #: the model groups its next leg may go to (one, once the prefill leg has its instance)
    groups: set[str] | None = None
    model: object = None  # the request's "model"
    group: str | None = None  # the model group of the instance that answers it: a try after a break stays with it
    migrations: list[str] = field(default_factory=list)  # why each time it was sent again or carried over
    first_at: float = 0.0  # when its first event went out (streamed)
    heartbeat: asyncio.Task | None = None  # a stream's, from its first event on

    @contextlib.contextmanager
    def waiting(self):
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.upstream_s += time.monotonic() - t0

    def own_s(self, now: float) -> float:
        return max(0.0, now - self.started - self.upstream_s)


# aiohttp >= 3.13 wants typed keys for request storage (a warning otherwise); older ones take a string.
_CALL = web.RequestKey("call", _Call) if hasattr(web, "RequestKey") else "yrpd_call"
#: when a client's stream was last written to (the heartbeat writes only into silence)
_LAST_WRITE = web.ResponseKey("last_write", float) if hasattr(web, "ResponseKey") else "yrpd_last_write"


@dataclass
class ProxyConfig:
    prefill: list[str]
    decode: list[str]
    served_model_name: str
    api_key: str | None = None
    #: the token the instances require (yrpd.credentials); sent on both legs in place of the client's credentials
    instance_token: str | None = None
    request_timeout: float = 600.0
    probe_interval: float = 2.0
    routing: Routing = Routing.prefix
    #: routing never picks an instance with this many more requests in flight than the least busy one
    routing_bound: int = 2
    #: the membership, where it exists: {"instances": [{"url", "role", "draining", "group"}]}, written by the controller
    #: (yrpd scale, rolling changes) and read again every probe round; it replaces `prefill`/`decode`
    instances_file: str | None = None
    #: a stream whose head is out and that sent nothing for this long gets an SSE comment (`: keep-alive`): a client's
    #: read timeout does not fire while it waits (a migration, a slow instance), and a dead client link shows
    heartbeat_s: float = HEARTBEAT_S
    #: follow the instances' KV-cache events (where they publish them) to route on what each cache holds
    kv_events: bool = True
    #: the PYTHONHASHSEED the instances run with (None: unset): the first block hash starts from it
    kv_hash_seed: str | None = None
    #: before each leg is routed, fetch what the instances' events have not delivered yet from the replay socket of
    #: each instance whose copy lacks the last block of a leg that ended there: the caches exactly as they are (the
    #: oracle of `yrpd bench`)
    kv_exact: bool = False
    #: the port of each other host's KV-event relay, and the CURVE keys to reach it (its public key, the proxy's pair)
    kv_relay_port: int | None = None
    kv_relay_keys: tuple[str, str, str] | None = None
    #: each data-system worker's shared memory in MB, where a disk tier is behind it (None: none): what of the
    #: workers' holdings is on disk is inferred from it (yrpd.proxy.kvindex.StoreBlocks)
    store_memory_mb: int | None = None


def parse_members(data) -> list[tuple[str, str, bool, str]]:
    """The membership file's content as (url, role, draining, group) each; ValueError naming what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("instances"), list):
        raise ValueError('want {"instances": [{"url": ..., "role": "prefill"|"decode", "draining": false, '
                         '"group": "MODEL#DIGEST"}, ...]}')
    out = []
    for n, entry in enumerate(data["instances"]):
        url, role = (entry.get("url"), entry.get("role")) if isinstance(entry, dict) else (None, None)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")) or role not in ROLES:
            raise ValueError(f"instances[{n}]: want a url http://HOST:PORT and a role prefill or decode, got {entry!r}")
        group = entry.get("group", "")
        if not isinstance(group, str):
            raise ValueError(f"instances[{n}]: group must be a string, got {group!r}")
        out.append((url.rstrip("/"), role, bool(entry.get("draining", False)), group))
    return out


class InstanceDown(Exception):
    """The health probe declared a leg's instance down while the leg waited on it (a hung or cut-off instance)."""

    def __init__(self, inst: Instance):
        super().__init__(f"{inst.role} instance {inst.url} was declared down by its health probe while this request "
                         "waited on it")
        self.inst = inst


class ProxyError(Exception):
    """Ends a request with an OpenAI-style JSON error."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status

    def payload(self) -> dict:
        return {"error": {"message": str(self), "type": _ERROR_TYPES.get(self.status, "server_error"),
                          "code": self.status}}

    def response(self) -> web.StreamResponse:
        return web.json_response(self.payload(), status=self.status)


class NoInstance(ProxyError):
    """No instance of the leg's role is up right now (the probe or another request's failure took the last out)."""

    def __init__(self, role: str):
        super().__init__(503, f"no {role} instance is up")


class UpstreamAnswer(ProxyError):
    """An instance's own error answer (4xx, e.g. a prompt that is too long), handed to the client unchanged."""

    def __init__(self, resp: aiohttp.ClientResponse, body: bytes):
        super().__init__(resp.status, body.decode(errors="replace"))
        self.body, self.content_type = body, resp.headers.get("Content-Type", "application/json")

    def response(self) -> web.StreamResponse:
        return web.Response(status=self.status, body=self.body, headers={"Content-Type": self.content_type})


def _connector_says(kv: object) -> dict:
    """What yrpd's connector on prefill says of this request in the kv_transfer_params it answers with (`loaded`,
    `cached`, `block_size`...); empty from a connector that says nothing."""
    info = kv.get("yrpd") if isinstance(kv, dict) else None
    return info if isinstance(info, dict) else {}


def _said_count(info: dict, key: str) -> int | None:
    """A count the connector said (`loaded`: blocks it took from the data system, `cached`: prompt tokens in the
    instance's own prefix cache, `block_size`, `block_bytes`: what a block takes in the data system); None where it
    did not say one."""
    value = info.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, asyncio.TimeoutError) and not isinstance(exc, _CONNECT_TIMEOUT)


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _write(out: web.StreamResponse, data: bytes) -> None:
    """Write to a client's stream, noting when (the heartbeat writes only into silence)."""
    out[_LAST_WRITE] = time.monotonic()
    await out.write(data)


def _as_error(exc: Exception) -> ProxyError:
    """What the client is answered for a leg that failed with `exc`, when nothing is sent again."""
    return exc if isinstance(exc, ProxyError) else ProxyError(502, str(exc))


def _sse_error(message: str, status: int) -> bytes:
    # vLLM ends its own failed streams the same way: an error event, then [DONE].
    return f"data: {json.dumps(ProxyError(status, message).payload())}\n\ndata: [DONE]\n\n".encode()


class Proxy:
    def __init__(self, config: ProxyConfig):
        self.config = config
        self.pool = Pool(config.prefill, config.decode, config.routing, config.routing_bound)
        self.metrics = Metrics()
        self.session: aiohttp.ClientSession | None = None
        self.in_flight = 0
        self.started = time.time()
        self._prober: asyncio.Task | None = None
        #: per instance, set when its probe declares it down: every leg waiting on it then stops waiting (a new
        #: event for the next time it is up)
        self._down: dict[str, asyncio.Event] = {}
        wait = config.request_timeout
        # No total limit: a long generation may stream for longer than any sane timeout. What is bounded is
        # silence: waiting for an answer to start, or for the next chunk.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(10.0, wait), sock_read=wait)
        self._probe_timeout = aiohttp.ClientTimeout(total=max(5.0, config.probe_interval))
        self._members_seen: tuple[int, int] | None = None  # (mtime_ns, size) of the file last read
        self.members_error: str | None = None  # why the file's last version was not taken
        self.members_version = 0  # versions of the file taken
        self.degraded_since: float | None = None  # time.time() since when one role answers alone (PD degraded)
        self.missing: list[str] = []  # the roles with no instance up, as of the last probe round
        #: the instances' KV-cache events (prefix routing): a batch is due within one probe round of a leg storing
        self.feeds = Feeds(lag_s=config.probe_interval, relay_port=config.kv_relay_port,
                           curve=Curve(*config.kv_relay_keys) if config.kv_relay_keys else None, exact=config.kv_exact,
                           store_memory_mb=config.store_memory_mb)
        if self._follows_events():
            self.pool.store = self.feeds.store

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._middleware])
        for path in GENERATE_PATHS:
            app.router.add_post(path, self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/yrpd/status", self.status)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    # -- lifecycle and health probes

    async def _start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S))
        await self._read_members()
        # One round before serving, so the first requests do not meet instances that are all still "unknown".
        await self._probe_all(announce=False)
        listing = "; ".join(f"{role}: " + ", ".join(f"{i.url} ({'up' if i.up else 'down'})" for i in self.pool.of(role))
                            for role in ROLES)
        log.info("proxy for model %s started; %s", self.config.served_model_name, listing)
        self._prober = asyncio.create_task(self._probe_loop())

    async def _stop(self, app: web.Application) -> None:
        if self._prober:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        await self.feeds.close()
        if self.session:
            await self.session.close()

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.probe_interval)
            try:
                await self._read_members()
                await self._probe_all()
            except Exception:  # the prober must outlive any surprise
                log.exception("health probe round failed")

    async def _read_members(self) -> None:
        """Take the membership file's new version, if it changed; a version that cannot be read or makes no sense
        is named in /yrpd/status and the log, and the last good membership stays. The instances it adds are probed
        before it takes effect: a version that adds a decode instance and drains the old one (a change written
        twice within one probe round) would otherwise leave no decode routable until the next probe."""
        path = self.config.instances_file
        if not path:
            return
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            self._members_refused(f"cannot stat {path}: {exc}")
            return
        seen = (st.st_mtime_ns, st.st_size)
        if seen == self._members_seen:
            return
        try:
            with open(path) as f:
                members = parse_members(json.load(f))
        except (OSError, ValueError) as exc:
            self._members_seen = seen  # named once; the next version is read again
            self._members_refused(f"{path}: {exc}")
            return
        known = {(i.url, i.role, i.group) for i in self.pool.instances if not i.leaving}
        fresh = list(dict.fromkeys(url.rstrip("/") for url, role, _, group in members
                                   if (url.rstrip("/"), role, group) not in known))
        answered = dict(zip(fresh, await asyncio.gather(*(self._health_of(url) for url in fresh))))
        joined, left = self.pool.sync(members)
        for inst in left:
            if inst.url not in {i.url for i in self.pool.instances if not i.leaving}:
                self.feeds.forget(inst.url)
        self._members_seen = seen  # only now: a round that failed before this reads the same version again
        for inst in joined:
            self.pool.probed(inst, *answered.get(inst.url, (False, None)))
        self.members_error = None
        up = [i.url for i in joined if i.up]
        # An instance that only changed role or group leaves and joins at once (the first version does that to the
        # command line's instances, which have no group): name it once, as joined.
        gone = [i.url for i in left if i.url not in {j.url for j in joined}]
        self.members_version += 1
        draining = [u for u, _, d, _ in members if d]
        log.info("membership from %s (version %d): %d instances%s%s%s%s", path, self.members_version, len(members),
                 f"; joined up: {', '.join(up)}" if up else "",
                 f"; joining (once up): {', '.join(i.url for i in joined if not i.up)}" if len(up) < len(joined)
                 else "",
                 f"; leaving: {', '.join(gone)}" if gone else "",
                 f"; draining: {', '.join(draining)}" if draining else "")

    def _members_refused(self, why: str) -> None:
        if why != self.members_error:
            log.warning("membership file not taken, keeping the last one: %s", why)
        self.members_error = why

    async def _probe_all(self, announce: bool = True) -> None:
        await asyncio.gather(*(self._probe(i, announce) for i in self.pool.instances))
        self._judge_degraded()
        for url in self.feeds.check():
            log.warning("KV index blind for %s: %s; routed on the estimate until its events are back", url,
                        self.feeds.state(url).get("why"))
        for host, sight, why in self.feeds.store_news():
            if sight is Sight.blind:
                log.warning("data-system index blind for %s: %s; loads from it are routed on the estimate", host, why)
            else:
                log.info("data-system index of %s: %s", host, sight.value)

    async def _health_of(self, url: str) -> tuple[bool, str]:
        try:
            async with self.session.get(url + "/health", timeout=self._probe_timeout) as resp:
                return resp.status == 200, f"/health answered {resp.status}"
        except _UPSTREAM_ERRORS as exc:
            return False, f"/health: {_text(exc)}"

    async def _probe(self, inst: Instance, announce: bool) -> None:
        ok, why = await self._health_of(inst.url)
        changed = self.pool.probed(inst, ok, why)
        if self._follows_events() and ok and (changed or inst.url not in self.feeds.watches):
            await self._watch_events(inst)
        if changed:
            if not ok:
                self._down.pop(inst.url, asyncio.Event()).set()
            if announce:
                if ok:
                    log.info("%s instance %s is up", inst.role, inst.url)
                else:
                    log.warning("%s instance %s is down (%s)", inst.role, inst.url, why)

    # -- the instances' KV-cache events (yrpd.proxy.kvfeed)

    def _follows_events(self) -> bool:
        return self.config.kv_events and self.config.routing is Routing.prefix

    async def _watch_events(self, inst: Instance) -> None:
        """Ask an instance that came up where it publishes its KV-cache events (vLLM's /kv_event_sources) and
        subscribe; why not, where it cannot, in /yrpd/status and the log."""
        try:
            async with self.session.get(inst.url + "/kv_event_sources", timeout=self._probe_timeout,
                                        headers=self._instance_headers()) as resp:
                sources = await resp.json(content_type=None) if resp.status == 200 else {}
        except (*_UPSTREAM_ERRORS, ValueError):
            sources = {}
        host = host_of(inst.url)
        why = await self.feeds.attach(inst.url, sources, host, _is_local(host))
        inst.blocks = self.feeds.watch(inst.url).blocks
        if why is None:
            log.info("%s instance %s: following its KV-cache events", inst.role, inst.url)
        else:
            log.info("%s instance %s: routed on the estimate, %s", inst.role, inst.url, why)

    def _kv_index(self) -> dict[str, dict] | None:
        """Each instance's KV index state by URL; None where the proxy follows no events (load routing, off)."""
        if not self._follows_events():
            return None
        return {i.url: self.feeds.state(i.url) for i in self.pool.instances}

    def _instance_headers(self) -> dict:
        return {"Authorization": f"Bearer {self.config.instance_token}"} if self.config.instance_token else {}

    async def _tokens(self, body: dict, headers: dict) -> list[int] | None:
        """The prompt's token ids as the instances make them (a prefill instance's /tokenize, chat template
        applied), where some instance's events are followed; None otherwise or where it does not answer."""
        if not any(i.blocks is not None and i.blocks.sight is Sight.seeing for i in self.pool.instances):
            return None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt  # sent as token ids: vLLM uses them as they are
        asker = next(iter(self.pool.up("prefill") or self.pool.up("decode")), None)
        if asker is None:
            return None
        ask = {k: body[k] for k in TOKENIZE_KEYS if k in body}
        if "messages" in ask:
            ask.setdefault("add_generation_prompt", True)
        try:
            async with self.session.post(asker.url + "/tokenize", json=ask, headers=headers,
                                         timeout=self._probe_timeout) as resp:
                tokens = (await resp.json(content_type=None)).get("tokens") if resp.status == 200 else None
        except (*_UPSTREAM_ERRORS, ValueError, AttributeError):
            return None
        return tokens if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens) else None

    # -- every request: auth, errors as JSON, metrics, one log line

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        call = request[_CALL] = _Call(time.monotonic())
        generating = request.path in GENERATE_PATHS
        self.in_flight += generating
        status = 500
        try:
            response = await self._answer(request, handler)
            status = 499 if call.client_gone else response.status
            return response
        except asyncio.CancelledError:
            status = 499  # the client went away (nginx's code for it)
            raise
        finally:
            self.in_flight -= generating
            self._record(request, status)

    async def _answer(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            if request.path.startswith("/v1/") and not self._authorized(request):
                raise ProxyError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')")
            return await handler(request)
        except ProxyError as exc:
            return exc.response()
        except web.HTTPException as exc:  # the router's 404/405, an oversized body
            detail = exc.text if exc.text and not exc.text.startswith(str(exc.status)) else exc.reason
            return ProxyError(exc.status, f"{detail} ({request.method} {request.path})").response()
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return ProxyError(500, "internal proxy error, see the proxy log").response()

    def _authorized(self, request: web.Request) -> bool:
        key = self.config.api_key
        if not key:
            return True
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    def _record(self, request: web.Request, status: int) -> None:
        endpoint = request.path if request.path in KNOWN_PATHS else "other"
        self.metrics.requests[(endpoint, status)] += 1
        call = request[_CALL]
        ms = (time.monotonic() - call.started) * 1000
        # Monitoring polls would drown the request lines.
        level = logging.DEBUG if endpoint in MONITOR_PATHS else logging.INFO
        extra = "".join(f" {k}={v}" for k, v in call.note.items())
        log.log(level, "%s %s %s %.0fms%s", request.method, request.path, status, ms, extra)

    # -- /v1

    async def generate(self, request: web.Request) -> web.StreamResponse:
        headers = self._forward_headers(request)
        try:
            body = await request.json()
        except ValueError:
            raise ProxyError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ProxyError(400, "the request body must be a JSON object")
        body.pop("kv_transfer_params", None)  # the proxy owns this field on both legs
        if self.config.routing is Routing.prefix:
            prompt = Prompt.of(body, self.config.served_model_name)
            if self._follows_events() and (tokens := await self._tokens(body, headers)) is not None:
                prompt = prompt.with_tokens(tokens, self.config.kv_hash_seed)
            request[_CALL].prompt = prompt
        request[_CALL].model = body.get("model")
        self._route(request)  # a 503 at once when no instance of either role is up
        if body.get("stream"):
            return await self._stream(request, body, headers)
        return await self._whole(request, body, headers)

    async def models(self, request: web.Request) -> web.StreamResponse:
        async with self._leg("decode", "GET", "/v1/models", request, None, self._forward_headers(request)) as (i, r, d):
            return web.Response(status=r.status, body=await self._read(i, r, d),
                                headers={"Content-Type": r.headers.get("Content-Type", "application/json")})

    def _forward_headers(self, request: web.Request) -> dict:
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        request[_CALL].note["id"] = rid
        headers = {"X-Request-Id": rid}
        # the client's key is for the proxy alone; the instances take the deployment's own token
        if self.config.instance_token:
            headers["Authorization"] = f"Bearer {self.config.instance_token}"
        elif "Authorization" in request.headers:  # instances started by hand with the proxy's --api-key
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    def _route(self, request: web.Request) -> tuple[bool, str]:
        """How the request's next try is served: (whether a prefill leg comes first, the role whose instance
        answers), with the model groups its legs may go to set on the call. PD where a model group has an instance
        of each role up; else PD degrades: the role that is up answers whole requests (decode computing the prompt
        itself, or prefill generating the answer). A 503 when no instance is up (of the call's model group, once a
        leg of it had an instance: an answer never mixes two models)."""
        call = request[_CALL]

        def within(groups: set[str]) -> set[str]:
            return groups & {call.group} if call.group is not None else groups

        both = within(self.pool.groups(call.model))
        if both:
            call.groups = both
            return True, "decode"
        for role in ("decode", "prefill"):
            alone = within(self.pool.groups(call.model, (role,)))
            if alone:
                call.groups = alone
                return False, role
        raise ProxyError(503, "no prefill or decode instance is up" if call.group is None else
                         f"no instance of model {call.group} is up")

    async def _answering_leg(self, request: web.Request, path: str, body: dict, headers: dict,
                             stack: contextlib.AsyncExitStack
                             ) -> tuple[Instance, aiohttp.ClientResponse, asyncio.Event]:
        """The prefill leg where there is one, then the leg whose answer goes to the client, entered into `stack`
        (which ends it)."""
        call = request[_CALL]
        pd, role = self._route(request)
        kv = None
        if pd:
            try:
                kv = await self._prefill_leg(request, path, body, headers)
            except UpstreamAnswer:
                raise
            except (InstanceDown, ProxyError) as exc:
                if isinstance(exc, ProxyError) and exc.status != 502:
                    raise
                # the prefill instances tried failed: decode computes the prompt itself (slower, still right)
                log.warning("%s %s: %s; decode computes the prompt itself", request.method, request.path, exc)
                call.note["prefill"] = "failed"
                self.metrics.degraded_answers["prefill leg failed"] += 1
                pd, role = self._route(request)
                if pd:
                    role = "decode"
        else:
            call.note["degraded"] = f"{role} alone"
            self.metrics.degraded_answers[f"{role} alone"] += 1
        # Without kv_transfer_params from prefill, decode computes the prompt itself: slower, still right.
        leg = body if kv is None else {**body, "kv_transfer_params": kv}
        answer = await stack.enter_async_context(self._leg(role, "POST", path, request, leg, headers))
        call.group = answer[0].group  # every later leg of this answer: the same model
        return answer

    async def _prefill_leg(self, request: web.Request, path: str, body: dict, headers: dict) -> dict | None:
        # min_tokens > max_tokens and stream_options without stream are 400s in vLLM.
        leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "return_token_ids")}
        leg.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_KV))
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        t0 = time.monotonic()
        async with self._leg("prefill", "POST", path, request, leg, headers) as (inst, resp, down):
            with request[_CALL].waiting():
                data = await self._read(inst, resp, down)
        # the log line's split of a slow first token: the prefill leg against the rest (decode's queue and tail)
        took = time.monotonic() - t0
        request[_CALL].note["prefill_ms"] = round(took * 1000)
        if resp.status >= 400:
            raise UpstreamAnswer(resp, data)
        if request[_CALL].groups is not None:  # decode answers for the model whose KV this prefill computed
            request[_CALL].groups = {inst.group}
        try:
            kv = json.loads(data).get("kv_transfer_params")
        except (ValueError, AttributeError):
            message = f"prefill instance {inst.url} answered {resp.status} with a body that is not a JSON object"
            self._upstream_error(inst, message, down=False)
            raise ProxyError(502, message) from None
        self.metrics.prefill.observe(took)
        lease = request[_CALL].prefill_lease
        if lease is not None:
            info = _connector_says(kv)
            cached = _said_count(info, "cached")
            size = _said_count(info, "block_size")
            self.pool.observe(lease, _said_count(info, "loaded"), cached_tokens=cached,
                              block_bytes=_said_count(info, "block_bytes"), block_size=size)
            if check := self.pool.checked(lease, cached, size):
                request[_CALL].note["index"] = "%d/%d" % check  # the log line's: blocks claimed / found
            if lease.chunk_s is not None:
                # the log line's: why it went there (the chunks queued ahead of it, the time per chunk it was
                # reckoned with)
                request[_CALL].note["ahead"] = round(lease.ahead, 1)
                request[_CALL].note["chunk_ms"] = round(lease.chunk_s * 1000, 1)
            last = lease.prompt.last_block(inst.blocks) if lease.prompt is not None else None
            self.feeds.leg_stored(inst.url, t0, lease.new_blocks, last)
            if lease.store_new:
                self.feeds.store_saved(host_of(inst.url), t0)
        return kv

    def _goes_on(self, request: web.Request, exc: Exception, tries: int) -> bool:
        """Whether a request whose leg failed with `exc` is sent again (`tries` times so far): a lost instance or a
        broken answer is, up to MAX_MIGRATIONS; an instance's own answer (a 4xx), a timeout (the instance may still
        be working on it) and no instance up are not."""
        if isinstance(exc, InstanceDown):
            self.pool.failed(exc.inst, str(exc), down=False)  # the probe took it out of rotation already
        elif isinstance(exc, NoInstance):
            pass  # routed while one was up: routed again, to the role that is (PD degraded)
        elif not isinstance(exc, ProxyError) or exc.status != 502 or isinstance(exc, UpstreamAnswer):
            return False
        return tries < MAX_MIGRATIONS and self._can_serve(request)

    def _can_serve(self, request: web.Request) -> bool:
        """Whether another try has somewhere to go: an instance up for the call's model (group)."""
        try:
            self._route(request)
        except ProxyError:
            return False
        return True

    def _migrated(self, request: web.Request, why: str, how: str) -> None:
        call = request[_CALL]
        call.migrations.append(why)
        call.note["migrated"] = len(call.migrations)
        self.metrics.migrations[how] += 1
        log.warning("%s %s: %s; %s", request.method, request.path, why, how)

    async def _whole(self, request: web.Request, body: dict, headers: dict) -> web.StreamResponse:
        """A request answered in one piece: nothing reached the client before the answer, so a leg that breaks
        sends the whole request again (to other instances: the probe or the failure took the broken one out)."""
        call = request[_CALL]
        tries = 0
        while True:
            try:
                async with contextlib.AsyncExitStack() as stack:
                    inst, resp, down = await self._answering_leg(request, request.path, body, headers, stack)
                    content_type = resp.headers.get("Content-Type", "application/json")
                    with call.waiting():
                        data = await self._read(inst, resp, down)
            except (InstanceDown, ProxyError) as exc:
                if not self._goes_on(request, exc, tries):
                    raise _as_error(exc) from None
                tries += 1
                self._migrated(request, str(exc), "sent again")
                continue
            if resp.status == 200:
                own = call.own_s(time.monotonic())
                self.metrics.observe_own(own)
                call.note["own_ms"] = round(own * 1000, 1)  # the log line's split: the proxy's own part of it
            return web.Response(status=resp.status, body=data, headers={"Content-Type": content_type})

    async def _stream(self, request: web.Request, body: dict, headers: dict) -> web.StreamResponse:
        """A streamed answer. Until its first event reaches the client a broken leg sends the request again; after
        that it goes on as a continuation on another instance (yrpd.proxy.resume), and the client reads one stream.
        Where it cannot go on (resume.not_resumable, MAX_MIGRATIONS reached, no instance left) the stream ends with
        an error event: the 200 is already out."""
        call = request[_CALL]
        st = resume.Stream(request.path, body)
        out: web.StreamResponse | None = None
        path, leg = request.path, st.leg_body()
        leg_url = None  # the instance of the leg that answers now
        try:
            while True:
                try:
                    async with contextlib.AsyncExitStack() as stack:
                        inst, resp, down = await self._answering_leg(request, path, leg, headers, stack)
                        leg_url = inst.url
                        content_type = resp.headers.get("Content-Type", "application/json")
                        if resp.status != 200 or not content_type.startswith("text/event-stream"):
                            with call.waiting():
                                data = await self._read(inst, resp, down)
                            if out is None:  # the instance's own answer (a 4xx): the client's, as it is
                                return web.Response(status=resp.status, body=data,
                                                    headers={"Content-Type": content_type})
                            raise ProxyError(502, f"{inst.role} instance {inst.url} answered the continuation "
                                             f"with {resp.status}: {data[:300].decode(errors='replace')}")
                        out, broke = await self._pump(request, st, inst, resp, down, out, content_type)
                except (InstanceDown, ProxyError) as exc:
                    broke = exc
                if broke is None:
                    return out
                why = str(broke)
                if out is None:  # nothing reached the client: the same request again
                    if not self._goes_on(request, broke, st.migrations):
                        raise _as_error(broke)
                    st.migrations += 1
                    self._migrated(request, why, "sent again")
                    continue
                if st.complete or st.limit_reached():  # every token went out: what the break cost is the ending
                    self._migrated(request, why, "ended by the proxy")
                    await _write(out, st.ending())
                    await out.write_eof()
                    return out
                if isinstance(broke, InstanceDown):
                    self.pool.failed(broke.inst, str(broke), down=False)
                reason = st.why_not or (f"carried over {st.migrations} times already"
                                        if st.migrations >= MAX_MIGRATIONS else
                                        "no instance is up to go on" if not self._can_serve(request) else None)
                if not reason:
                    await self._settle(request, st, headers, broke.inst.url if isinstance(broke, InstanceDown) else
                                       leg_url)
                cont = None if reason else st.continuation()
                if cont is None:
                    reason = reason or "its instance gave no token ids"
                    call.note["error"] = "stream-broken"
                    self.metrics.migrations["not carried over"] += 1
                    log.warning("%s %s: %s; not carried over: %s", request.method, request.path, why, reason)
                    # The 200 is already out: an event in the stream is the only way left to tell the client.
                    await _write(out, _sse_error(why, broke.status if isinstance(broke, ProxyError) else 502))
                    await out.write_eof()
                    return out
                st.begin_continuation()
                self._migrated(request, why, "carried over")
                path, leg = cont
        except ConnectionResetError:  # the client left; aiohttp finishes the closed response quietly
            call.client_gone = True
            return out if out is not None else web.Response(status=499)
        finally:
            if call.heartbeat is not None:
                call.heartbeat.cancel()

    async def _settle(self, request: web.Request, st: resume.Stream, headers: dict, broke: str | None) -> None:
        """Where the continuation's prompt ends, from the text (resume.Stream.settle), decoded by an up instance of
        the answer's model, another than the one that broke off where there is one; where none answers within
        SETTLE_S, what the events tell stays."""
        group = request[_CALL].group
        up = [i for role in ("decode", "prefill") for i in self.pool.up(role) if group is None or i.group == group]
        inst = next((i for i in up if i.url != broke), up[0] if up else None)
        if inst is None:
            return

        async def decode(ids: list[int]) -> str:
            async with self.session.post(f"{inst.url}/detokenize", json={"model": st.body.get("model"), "tokens": ids},
                                         headers=headers, timeout=self._probe_timeout) as resp:
                if resp.status != 200:
                    raise ValueError(f"/detokenize answered {resp.status}")
                return (await resp.json())["prompt"]

        try:
            await asyncio.wait_for(st.settle(decode), SETTLE_S)
        except (*_UPSTREAM_ERRORS, ValueError, KeyError, TypeError) as exc:
            log.info("%s %s: cannot ask %s which tokens' text went out (%s); going on from the events", request.method,
                     request.path, inst.url, _text(exc))

    async def _heartbeat(self, out: web.StreamResponse) -> None:
        """An SSE comment whenever the stream sent nothing for `heartbeat_s` (clients skip comments)."""
        interval = self.config.heartbeat_s
        while True:  # cancelled when the stream ends
            idle = time.monotonic() - out.get(_LAST_WRITE, 0.0)
            if idle >= interval:
                try:
                    await _write(out, HEARTBEAT)
                except (ConnectionResetError, RuntimeError):
                    return
                idle = 0.0
            await asyncio.sleep(max(0.05, interval - idle))

    async def _pump(self, request: web.Request, st: resume.Stream, inst: Instance, resp: aiohttp.ClientResponse,
                    down: asyncio.Event, out: web.StreamResponse | None,
                    content_type: str) -> tuple[web.StreamResponse | None, Exception | None]:
        """Pass one leg's stream to the client, whole events only: (the client's response, prepared with the first
        event that goes out; what broke the leg, None once the stream ended with [DONE])."""
        call = request[_CALL]
        pending = b""
        while True:
            try:
                if out is None:
                    with call.waiting():
                        chunk = await self._read_chunk(inst, resp, down, "broke off the stream")
                else:
                    chunk = await self._read_chunk(inst, resp, down, "broke off the stream")
            except InstanceDown as exc:
                self._upstream_error(inst, str(exc), down=True)
                return out, exc
            except ProxyError as exc:
                return out, exc
            if not chunk:
                if st.done:
                    await out.write_eof()
                    return out, None
                what = "before its last token" if st.started else "without sending anything"
                message = f"{inst.role} instance {inst.url} ended its stream {what}"
                self._upstream_error(inst, message, down=False)
                return out, ProxyError(502, message)
            pending += chunk
            while (cut := pending.find(b"\n\n")) >= 0:
                raw, pending = pending[:cut + 2], pending[cut + 2:]
                try:
                    data = st.event(raw)
                except resume.Broken as exc:
                    message = f"{inst.role} instance {inst.url} ended its stream with an error: {exc}"
                    self._upstream_error(inst, message, down=False)
                    return out, ProxyError(502, message)
                if not data:
                    continue
                if out is None:
                    out = web.StreamResponse(status=200, headers={"Content-Type": content_type,
                                                                  "Cache-Control": "no-cache"})
                    await out.prepare(request)
                    self._first_token(call)
                    # the head is out: from now on the stream must not fall silent
                    call.heartbeat = asyncio.ensure_future(self._heartbeat(out))
                await _write(out, data)
                if st.done:
                    await out.write_eof()
                    self._stream_ended(call, st)
                    return out, None

    def _first_token(self, call: _Call) -> None:
        now = time.monotonic()
        ttft = now - call.started
        self.metrics.ttft.observe(ttft)
        self.metrics.observe_stream(now, ttft=ttft)
        call.first_at = now
        own = call.own_s(now)
        self.metrics.observe_own(own)
        call.note["ttft_ms"] = round(ttft * 1000)
        call.note["own_ms"] = round(own * 1000, 1)

    def _stream_ended(self, call: _Call, st: resume.Stream) -> None:
        tokens = st.token_events
        if tokens > 1 and not call.migrations:  # a carried-over stream's gaps are not the instances' pace
            now = time.monotonic()
            self.metrics.observe_stream(now, itl=(now - call.first_at) / (tokens - 1))

    # -- one leg to one instance of a role

    @contextlib.asynccontextmanager
    async def _leg(self, role: str, method: str, path: str, request: web.Request, body: dict | None, headers: dict):
        lease, resp, down = await self._send(role, method, path, request, body, headers)
        watch = asyncio.ensure_future(self._end_when_down(lease.instance, resp, down))
        try:
            yield lease.instance, resp, down
        except BaseException:
            resp.close()  # an unfinished answer must not go back to the pool; closing also aborts it upstream
            raise
        else:
            resp.release()
        finally:
            watch.cancel()
            self.pool.release(lease)

    @staticmethod
    async def _end_when_down(inst: Instance, resp: aiohttp.ClientResponse, down: asyncio.Event) -> None:
        """Once the probe declares the leg's instance down, a read waiting on its answer raises InstanceDown (the
        answer's reader wakes with it; chunks it already holds are not lost before that)."""
        await down.wait()
        resp.content.set_exception(InstanceDown(inst))
        resp.close()

    async def _send(self, role: str, method: str, path: str, request: web.Request, body: dict | None,
                    headers: dict) -> tuple[Lease, aiohttp.ClientResponse, asyncio.Event]:
        """Send to the best up instance; on a connection error, a 5xx, or its probe declaring it down while this
        waits for the answer to start, once more to another one. Also returns the instance's down event."""
        tried: list[Instance] = []
        problem = None
        if self.config.kv_exact and request[_CALL].prompt is not None and self._follows_events():
            await self.feeds.catch_up(i.url for i in self.pool.up(role))
        while len(tried) < 2:
            call = request[_CALL]
            lease = self.pool.acquire(role, exclude=tried, prompt=call.prompt, groups=call.groups)
            if lease is None:
                break
            inst = lease.instance
            tried.append(inst)
            seen = call.note.get(role)  # every instance a leg of the role went to, in order (a migration: several)
            call.note[role] = inst.url if not seen or seen.endswith(inst.url) else f"{seen}>{inst.url}"
            if role == "prefill":
                call.prefill_lease = lease
            down = self._down.setdefault(inst.url, asyncio.Event())
            try:
                with request[_CALL].waiting():
                    resp = await self._unless_down(inst, down, self.session.request(
                        method, inst.url + path, json=body, headers=headers, timeout=self._timeout))
            except InstanceDown as lost:
                self.pool.release(lease)
                problem = str(lost)
                self.pool.failed(inst, problem, down=False)  # the probe took it out of rotation already
                continue
            except BaseException as exc:
                self.pool.release(lease)
                if not isinstance(exc, _UPSTREAM_ERRORS):
                    raise
                if _is_timeout(exc):
                    # No retry: the instance may still be working on it, a second copy would only add load.
                    problem = f"{role} instance {inst.url} sent no answer within {self.config.request_timeout:g} s"
                    self._upstream_error(inst, problem, down=False)
                    raise ProxyError(504, problem) from None
                problem = f"{role} instance {inst.url} unreachable: {_text(exc)}"
                self._upstream_error(inst, problem, down=True)
                continue
            if resp.status >= 500:
                detail = b""
                try:
                    with contextlib.suppress(*_UPSTREAM_ERRORS):
                        detail = await asyncio.wait_for(resp.read(), 5)
                finally:  # also when the client hangs up meanwhile (cancelled)
                    resp.close()
                    self.pool.release(lease)
                problem = f"{role} instance {inst.url} answered {resp.status} {resp.reason}"
                if detail:
                    problem += f": {detail[:300].decode(errors='replace')}"
                self._upstream_error(inst, problem, down=True)
                continue
            return lease, resp, down
        if problem is None:
            raise NoInstance(role)
        raise ProxyError(502, problem)

    async def _read(self, inst: Instance, resp: aiohttp.ClientResponse, down: asyncio.Event) -> bytes:
        return await self._read_chunk(inst, resp, down, "broke off its answer", whole=True)

    async def _read_chunk(self, inst: Instance, resp: aiohttp.ClientResponse, down: asyncio.Event, broke: str,
                          whole: bool = False) -> bytes:
        """The answer (whole) or its next chunk; ProxyError when the instance broke it off or fell silent,
        InstanceDown when its probe declared it down meanwhile (_end_when_down)."""
        if down.is_set():
            raise InstanceDown(inst)
        try:
            return await (resp.read() if whole else resp.content.readany())
        except _UPSTREAM_ERRORS as exc:
            message = f"{inst.role} instance {inst.url} {broke}: {_text(exc)}"
            self._upstream_error(inst, message, down=not _is_timeout(exc))
            raise ProxyError(504 if _is_timeout(exc) else 502, message) from None

    @staticmethod
    async def _unless_down(inst: Instance, down: asyncio.Event, awaitable):
        """`awaitable`'s result, or InstanceDown as soon as `down` is set (the wait is then abandoned): for the wait
        for an answer to start, before there is a response whose reader could be woken."""
        if down.is_set():
            raise InstanceDown(inst)
        work = asyncio.ensure_future(awaitable)
        watch = asyncio.ensure_future(down.wait())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, watch):
                if not task.done():
                    task.cancel()
        if work.done() and not work.cancelled():
            return work.result()
        with contextlib.suppress(BaseException):
            await work
        raise InstanceDown(inst)

    def _upstream_error(self, inst: Instance, message: str, *, down: bool) -> None:
        was_up = inst.up
        self.pool.failed(inst, message, down=down)
        log.warning("%s%s", message, "; out of rotation until /health answers 200" if down and was_up else "")

    # -- monitoring

    async def health(self, request: web.Request) -> web.StreamResponse:
        """200 while requests are answered: "ok" in PD, "degraded" while one role answers alone; 503 with none up."""
        up = {role: len(self.pool.up(role)) for role in ROLES}
        missing = self.pool.missing()
        down = len(missing) == len(ROLES)
        body = {"status": "unavailable" if down else "degraded" if missing else "ok",
                "model": self.config.served_model_name, "prefill_up": up["prefill"], "decode_up": up["decode"]}
        if missing:
            body.update(missing=missing, message=self._degraded_message(missing))
        if self.degraded_since is not None:
            body["degraded_since"] = self.degraded_since
        return web.json_response(body, status=503 if down else 200)

    @staticmethod
    def _degraded_message(missing: list[str]) -> str:
        if len(missing) == len(ROLES):
            return f"no {' and no '.join(missing)} instance is up"
        other = next(r for r in ROLES if r not in missing)
        return (f"no {missing[0]} instance is up: {other} instances answer whole requests "
                f"({'computing the prompt themselves' if other == 'decode' else 'generating the answer'})")

    def _judge_degraded(self) -> None:
        """After each probe round: note when PD degrades (one role with no instance up, the other serving) and
        when it resumes, in the log, /health, /yrpd/status and the metrics."""
        missing = self.pool.missing()
        degraded = len(missing) == 1
        now = time.time()
        if degraded and self.degraded_since is None:
            self.degraded_since = now
            log.warning("serving degraded: %s", self._degraded_message(missing))
        elif not degraded and self.degraded_since is not None:
            took = now - self.degraded_since
            self.metrics.degraded_s += took
            self.degraded_since = None
            log.info("PD serving resumed after %.1f s degraded" if not missing else
                     "degraded serving ended after %.1f s: no instance is up at all", took)
        self.missing = missing

    async def metrics_page(self, request: web.Request) -> web.StreamResponse:
        store = self.feeds.store.state() if self._follows_events() else None
        return web.Response(body=self.metrics.render(self.pool, self.degraded_since, self._kv_index(), store).encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def status(self, request: web.Request) -> web.StreamResponse:
        try:
            window = min(LATENCY_KEPT_S, max(1.0, float(request.query.get("window", 30))))
        except ValueError:
            raise ProxyError(400, "window must be a number of seconds") from None
        kv = self._kv_index()
        answered = [(e, s, n) for (e, s), n in self.metrics.requests.items() if e in GENERATE_PATHS]
        totals = {"requests": sum(n for _, _, n in answered), "failed": sum(n for _, s, n in answered if s >= 400),
                  "in_flight": self.in_flight, "upstream_errors": sum(i.errors for i in self.pool.instances),
                  **{f"{role}_up": len(self.pool.up(role)) for role in ROLES},
                  **{f"{role}_total": len(self.pool.of(role)) for role in ROLES}}
        return web.json_response({"model": self.config.served_model_name, "started": self.started,
                                  "uptime_s": round(time.time() - self.started, 1),
                                  "probe_interval_s": self.config.probe_interval,
                                  "request_timeout_s": self.config.request_timeout,
                                  "instances": [{**i.as_dict(), **({"kv_index": kv[i.url]} if kv else {})}
                                                for i in self.pool.instances], "totals": totals,
                                  "routing": self.pool.routing_state(),
                                  **({"kv_store_index": self.feeds.store.state()} if kv is not None else {}),
                                  "membership": {"file": self.config.instances_file,
                                                 "version": self.members_version, "error": self.members_error},
                                  "own_overhead_ms": self.metrics.own_percentiles(),
                                  # PD degraded: one role answers whole requests (null while PD serves)
                                  "degraded": None if self.degraded_since is None else {
                                      "since": self.degraded_since, "missing": self.missing,
                                      "message": self._degraded_message(self.missing)},
                                  "migrations": dict(self.metrics.migrations),
                                  # streamed requests of the last `window` s (?window=S): the SLA planner's input
                                  "latency": self.metrics.latency(window, time.monotonic())})


def create_app(config: ProxyConfig) -> web.Application:
    return Proxy(config).app()


async def start(config: ProxyConfig, host: str, port: int, shutdown_timeout: float = 5.0) -> web.AppRunner:
    """Serve until `await runner.cleanup()`; `runner.addresses` tells the port when `port` is 0."""
    # handler_cancellation: a client that hangs up cancels its handler, which closes the upstream requests,
    # which makes vLLM abort them instead of generating for nobody.
    runner = web.AppRunner(create_app(config), handler_cancellation=True, access_log=None,
                           shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        await web.SockSite(runner, listening_socket(host, port)).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


def listening_socket(host: str, port: int) -> socket.socket:
    """The proxy's listening socket, with the bounds on a dead client link (TCP_USER_TIMEOUT_MS, TCP_KEEPALIVE) that
    every accepted connection inherits."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        idle, interval, probes = TCP_KEEPALIVE
        for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", probes),
                            ("TCP_USER_TIMEOUT", TCP_USER_TIMEOUT_MS)):
            if hasattr(socket, name):  # Linux has all four
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
        sock.bind((host, port))
        sock.listen(1024)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
