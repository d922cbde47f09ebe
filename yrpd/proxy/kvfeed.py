"""One instance's KV-cache events into the proxy's index: a ZMQ subscriber on its publisher that asks the replay
socket for what it missed (docs/dev/kv-events.md)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from .kvindex import InstanceBlocks, Sight, Store, decode_batch, events_of, host_of
from .kvrelay import topic as relay_topic
from ..layout import DATASYSTEM_EVENTS, KV_EVENTS_SOCKET

#: the replay socket's end marker: a batch number of -1
END = -1
#: how long a replay may take to answer before the feed gives up on it (the publisher serves replays between
#: batches, from the engine's own process)
REPLAY_TIMEOUT_S = 2.0
#: the replayed batches kept to recognise when the subscription delivers them too: its backlog at most
AHEAD_KEPT = 1024


def _seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


@dataclass(frozen=True)
class Curve:
    """The keys (Z85) of a CURVE client: the server's public key, and the client's own pair."""

    server_public: str
    public: str
    secret: str

    def apply(self, sock) -> None:
        sock.curve_serverkey = self.server_public.encode()
        sock.curve_publickey = self.public.encode()
        sock.curve_secretkey = self.secret.encode()


class Feed:
    """Subscribes to one publisher (`endpoint`, e.g. tcp://10.0.0.1:5557) and applies its batches to `blocks`;
    `replay` is its replay socket's address (None: gaps are not filled). Through a host's relay (yrpd.proxy.kvrelay):
    `relayed` names the instance (its topic there, and what a replay request asks for), `curve` the keys."""

    def __init__(self, blocks: InstanceBlocks, endpoint: str, replay: str | None = None, topic: bytes = b"",
                 context=None, curve: Curve | None = None, relayed: str | None = None) -> None:
        import zmq.asyncio

        self.blocks, self.endpoint, self.replay, self.topic = blocks, endpoint, replay, topic
        self.curve, self.relayed = curve, relayed
        self.ctx = context or zmq.asyncio.Context.instance()
        self.replays = 0  # replays asked for
        self.replay_s = 0.0  # and the seconds they took, answered or not
        self.last_batch_at: float | None = None  # time.monotonic() of the last batch received
        #: batches a replay applied before the subscription delivered them (seq -> payload): the same batch coming
        #: again is skipped; the same number with another payload is a new run of the publisher
        self._ahead: dict[int, bytes] = {}
        self._applying = asyncio.Lock()  # a batch from the subscription and a sync never interleave

    async def run(self) -> None:
        """Receive until cancelled."""
        import zmq

        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.apply(sub)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                try:
                    await self.receive(_seq(frames[1]), frames[2])
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a batch that cannot be read must not end the feed
                    self.blocks.go_blind(f"batch {_seq(frames[1])} could not be read: {exc}")
        finally:
            sub.close()

    async def sync(self) -> bool:
        """Make the copy exact from everything the publisher still has, from its first batch (a new subscription, an
        instance back up): its replay socket answering, even with nothing, shows it alive and what it holds. False
        where it does not answer or no longer has its first batch (the copy stays as it was)."""
        if self.replay is None:
            return False
        async with self._applying:
            everything = await self._replayed(0, None)
            if everything is None:
                return False
            self._rebuild(everything)
            return True

    async def catch_up(self) -> bool:
        """Apply now what the publisher sent after the copy's last batch and the subscription has not delivered yet
        (its replay socket): the copy is exact as of this moment, at the cost of a round trip. False where the
        replay does not answer or no longer has those batches (the subscription still delivers them)."""
        if self.replay is None:
            return False
        async with self._applying:
            missed = await self._replayed(self.blocks.next_seq, None)
            if missed is None:
                return False
            try:
                self._apply(missed, replayed=True)
            except Exception as exc:  # noqa: BLE001 - as a batch the subscription cannot read: blind, the leg routed
                self.blocks.go_blind(f"a replayed batch could not be read: {exc}", lagging=True)
                return False
            return True

    async def receive(self, seq: int, payload: bytes) -> None:
        """One batch from the subscription, after whatever was missed before it, where the publisher still has it."""
        async with self._applying:
            await self._receive(seq, payload)

    async def _receive(self, seq: int, payload: bytes) -> None:
        self.last_batch_at = time.monotonic()
        last, expected = self.blocks.last_seq, self.blocks.next_seq
        early = self._ahead.pop(seq, None)
        for older in [s for s in self._ahead if s < seq]:
            del self._ahead[older]
        if early == payload:
            return  # a replay (a sync, a catch-up) applied it already
        if self.replay is not None and seq not in (expected, 0):
            restarted = last is not None and seq < expected  # a new run of the publisher, its first batches missed
            if not restarted:
                self._apply(await self._replayed(expected, seq) or ())
            if self.blocks.last_seq != seq - 1:
                # the gap is gone from the publisher's buffer, or the new run's beginning is: all it still has,
                # from its first batch, makes the copy exact again
                everything = await self._replayed(0, seq)
                if everything is not None:
                    self.blocks.restarts += restarted
                    self._rebuild(everything)
        self._apply([(seq, payload)])

    def _apply(self, batches, replayed: bool = False) -> None:
        """Apply batches in order; `replayed`: they came by a replay, and the subscription may deliver them too."""
        for n, (seq, payload) in enumerate(batches):
            try:
                self.blocks.apply(seq, events_of(decode_batch(payload)))
            except Exception:
                if replayed:  # those applied before it are known, so their late delivery is no restart
                    self._ahead.update(batches[max(0, n - AHEAD_KEPT):n])
                raise
        if replayed:
            self._ahead.update(batches[-AHEAD_KEPT:])
            if len(self._ahead) > AHEAD_KEPT:
                self._ahead = dict(sorted(self._ahead.items())[-AHEAD_KEPT:])

    def _rebuild(self, everything: list[tuple[int, bytes]]) -> None:
        """The copy from the publisher's batches since its first: exact."""
        self.blocks.rebuild()
        self._ahead.clear()
        self._apply(everything, replayed=True)
        self.blocks.resync()

    async def _replayed(self, start: int, upto: int | None) -> list[tuple[int, bytes]] | None:
        """The publisher's batches start .. upto-1 (None: all it has from `start`) from its replay socket, or None if
        it no longer has them all or does not answer."""
        import zmq

        self.replays += 1
        asked_at = time.monotonic()
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.apply(dealer)
        dealer.connect(self.replay)
        got: list[tuple[int, bytes]] = []
        ask = [b"", *([self.relayed.encode()] if self.relayed else []), start.to_bytes(8, "big")]
        try:
            await dealer.send_multipart(ask)
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                if len(frames) != 4:
                    continue
                seq = _seq(frames[2])
                if seq == END:
                    break
                if seq >= start and (upto is None or seq < upto):
                    got.append((seq, frames[3]))
        except asyncio.TimeoutError:
            return None
        finally:
            dealer.close()
            self.replay_s += time.monotonic() - asked_at
        last = upto if upto is not None else start + len(got)
        return got if [s for s, _ in got] == list(range(start, last)) else None


def usable_endpoint(endpoint: str, instance_host: str, local: bool) -> tuple[str | None, str]:
    """(the address to subscribe to, "") or (None, why not) for an endpoint an instance says it publishes on:
    an ipc socket only where the proxy shares the instance's host (`local`), a wildcard tcp one at the instance's
    own address."""
    if endpoint.startswith("ipc://"):
        return (endpoint, "") if local else (None, "its events go to a socket on its own host, not the proxy's")
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        if host in ("*", "0.0.0.0", "::", "[::]"):
            host = f"[{instance_host}]" if ":" in instance_host else instance_host
        return f"tcp://{host}:{port}", ""
    return None, f"its events go to {endpoint}, which the proxy cannot subscribe to"


def endpoint_of(config: dict) -> str:
    return str(config.get("endpoint") or "")


def relayed_name(endpoint: str) -> str | None:
    """The instance an events socket in a session's run directory is named for (what its host's relay calls it),
    None for any other endpoint."""
    head, tail = KV_EVENTS_SOCKET.split("{name}")
    base = endpoint.rsplit("/", 1)[-1]
    if not endpoint.startswith("ipc://") or not (base.startswith(head) and base.endswith(tail)):
        return None
    return base[len(head):len(base) - len(tail)] or None


@dataclass
class Watch:
    """The proxy's view of one instance's KV-cache events."""

    blocks: InstanceBlocks
    feed: Feed | None = None
    task: asyncio.Task | None = None
    #: why there is no feed (shown while `feed` is None)
    unseen: str = "not asked yet"
    #: a prefill leg that should have stored blocks ended: (when it started, by when a batch must have come)
    expect: tuple[float, float] | None = None
    #: the last block of each prefill leg that ended there while the copy lacked it (the exact mode asks the replay
    #: socket while any is missing, and only then)
    awaited: set[int] = field(default_factory=set)
    #: the exact mode's catch-up in flight: concurrent legs wait on the one round trip
    catching: asyncio.Future | None = None


class Feeds:
    """Every instance's KV-cache events, by instance URL: the feeds that keep each one's InstanceBlocks, and the
    rules that say when the proxy cannot see a cache exactly (docs/dev/kv-events.md "No silent blindness")."""

    def __init__(self, lag_s: float, context=None, curve: Curve | None = None, relay_port: int | None = None,
                 exact: bool = False, store_memory_mb: int | None = None) -> None:
        """`relay_port`: where a host's relay (yrpd.proxy.kvrelay) listens, at the address its instances have, with
        `curve` the keys to reach it; None: instances on other hosts are routed on the estimate. `exact`: the exact
        mode (`catch_up` before routing), which alone keeps the blocks legs left awaited. `store_memory_mb`: each
        data-system worker's shared memory where a disk tier is behind it (None: none)."""
        self.lag_s, self.ctx, self.curve, self.relay_port = lag_s, context, curve, relay_port
        self.exact = exact
        self.watches: dict[str, Watch] = {}
        #: the data system's holdings, from the workers' own events: one feed per host whose instances are followed
        self.store = Store(None if store_memory_mb is None else store_memory_mb << 20)
        self._store_feeds: dict[str, tuple[Feed, asyncio.Task]] = {}
        self._store_said: dict[str, Sight] = {}  # each worker's sight as last logged
        #: a prefill leg on the host saved blocks its worker lacked: (when it started, by when a batch must have come)
        self._store_expect: dict[str, tuple[float, float]] = {}

    def watch(self, url: str) -> Watch:
        if url not in self.watches:
            self.watches[url] = Watch(InstanceBlocks())
        return self.watches[url]

    async def attach(self, url: str, sources: object, instance_host: str, local: bool) -> str | None:
        """Subscribe to what an instance's /kv_event_sources answered ({dp_rank: its KVEventsConfig}), or where
        already subscribed (the instance back up), sync: the copy is exact from the publisher's replay. None when
        following its events, else why not."""
        w = self.watch(url)
        if w.task is None or w.task.done():
            w.feed = None
            why = self._subscribe(url, w, sources, instance_host, local)
            w.unseen = why or ""
            if why is not None:
                return why
        if not await w.feed.sync():
            w.blocks.go_blind("its replay socket does not answer from its first batch", lagging=True)
        return None

    def _subscribe(self, url: str, w: Watch, sources: object, instance_host: str, local: bool) -> str | None:
        configs = [c for c in sources.values() if isinstance(c, dict)] if isinstance(sources, dict) else []
        configs = [c for c in configs if c.get("enable_kv_cache_events") and c.get("publisher") in (None, "zmq")]
        if not configs:
            return "it publishes no KV-cache events"
        if len(configs) > 1:
            return f"it has {len(configs)} data-parallel publishers; the index follows one-rank instances"
        config = configs[0]
        endpoint, why = usable_endpoint(endpoint_of(config), instance_host, local)
        name = relayed_name(endpoint_of(config)) if endpoint is None and self.relay_port else None
        try:
            if name is not None:  # its host's relay republishes its unix sockets (yrpd.proxy.kvrelay)
                if self.curve is None:
                    return "its host's relay needs keys the proxy was not given (its proxy.env)"
                host = f"[{instance_host}]" if ":" in instance_host else instance_host
                w.feed = Feed(w.blocks, f"tcp://{host}:{self.relay_port}", f"tcp://{host}:{self.relay_port + 1}",
                              relay_topic(name), self.ctx, self.curve, name)
            elif endpoint is None:
                return why
            else:
                replay = None
                if config.get("replay_endpoint"):
                    replay, _ = usable_endpoint(str(config["replay_endpoint"]), instance_host, local)
                w.feed = Feed(w.blocks, endpoint, replay, str(config.get("topic") or "").encode(), self.ctx)
        except ImportError as exc:
            return f"this Python cannot subscribe ({exc})"
        w.task = asyncio.get_running_loop().create_task(w.feed.run())
        self._follow_store(instance_host, endpoint_of(config), local)
        return None

    def _follow_store(self, host: str, endpoint: str, local: bool) -> None:
        """Follow the data-system worker of a host whose instance is followed: it publishes beside the instance's
        socket, under the name the relay carries as an instance's (yrpd.steps.cluster.store_events). A worker that
        publishes nothing (another connector, an older deployment) stays `never`: loads are routed on the
        estimate."""
        old = self._store_feeds.get(host)
        if old is not None and not old[1].done():
            return
        if old is not None and not old[1].cancelled():
            old[1].exception()  # retrieved: a feed that ended is followed anew below
        name = relayed_name(endpoint)
        if name is None:
            return
        blocks = self.store.worker(host)
        if local:
            socket = endpoint.rsplit("/", 1)[0] + "/" + KV_EVENTS_SOCKET.format(name=DATASYSTEM_EVENTS)
            feed = Feed(blocks, socket, None, b"", self.ctx)
        elif self.relay_port and self.curve is not None:
            address = f"[{host}]" if ":" in host else host
            feed = Feed(blocks, f"tcp://{address}:{self.relay_port}", None, relay_topic(DATASYSTEM_EVENTS), self.ctx,
                        self.curve, DATASYSTEM_EVENTS)
        else:
            return
        self._store_feeds[host] = (feed, asyncio.get_running_loop().create_task(feed.run()))

    async def catch_up(self, urls) -> int:
        """Bring the copies of these instances (URLs) that are seeing up to this moment, all at once (the exact
        mode: `--kv-exact`). Only a copy that lacks the last block of a leg that ended there asks its replay socket
        (a round trip costs up to vLLM's 0.1 s wait, docs/dev/kv-events.md); a catch-up in flight is shared.
        Returns the round trips this call waited on."""
        waits = []
        for url in urls:
            w = self.watches.get(url)
            if w is None or w.feed is None or w.feed.replay is None or w.blocks.sight is not Sight.seeing:
                continue
            w.awaited = {h for h in w.awaited if h not in w.blocks.held}  # the subscription delivered the others
            if not w.awaited:
                continue
            if w.catching is None or w.catching.done():
                w.catching = asyncio.ensure_future(self._catch_up(w, set(w.awaited)))
            waits.append(w.catching)
        await asyncio.gather(*waits)
        return len(waits)

    @staticmethod
    async def _catch_up(w: Watch, asked: set[int]) -> None:
        if await w.feed.catch_up():
            # what the replay did not bring is gone (evicted) or never was: not asked again. A leg ended while this
            # was on its way stays awaited.
            w.awaited -= asked

    def leg_stored(self, url: str, started: float, blocks: int, last: int | None = None) -> None:
        """A prefill leg that began at `started` (time.monotonic()) ended, after which the instance holds `blocks`
        more full blocks, the prompt's last one `last` (its hash, where known): a batch must come within lag_s."""
        w = self.watches.get(url)
        if w is None or w.feed is None or blocks <= 0:
            return
        if w.expect is None:
            w.expect = (started, time.monotonic() + self.lag_s)
        if self.exact and last is not None and last not in w.blocks.held:
            w.awaited.add(last)

    def store_saved(self, host: str, started: float) -> None:
        """A prefill leg on `host` that began at `started` (time.monotonic()) ended, and its connector saved blocks
        the host's worker did not hold: a batch of the worker's must come within lag_s."""
        if host in self._store_feeds and host not in self._store_expect:
            self._store_expect[host] = (started, time.monotonic() + self.lag_s)

    def check(self, now: float | None = None) -> list[str]:
        """Each probe round: the instances whose events stayed away after a leg that stored blocks go blind, and so
        do the workers whose events stayed away after a leg that saved blocks there. Returns the instances' URLs
        (newly blind; the workers' changes come by `store_news`)."""
        now = time.monotonic() if now is None else now
        for host, (started, deadline) in list(self._store_expect.items()):
            feed = self._store_feeds.get(host, (None,))[0]
            if feed is None or (feed.last_batch_at is not None and feed.last_batch_at >= started):
                del self._store_expect[host]
            elif now >= deadline:
                del self._store_expect[host]
                self.store.worker(host).go_blind(
                    f"no event of the data system's within {self.lag_s:g} s of a prefill leg that saved blocks",
                    lagging=True)
        newly = []
        for url, w in self.watches.items():
            if w.expect is None or w.feed is None:
                continue
            started, deadline = w.expect
            if w.feed.last_batch_at is not None and w.feed.last_batch_at >= started:
                w.expect = None
            elif now >= deadline:
                w.expect = None
                if w.blocks.sight is not Sight.blind:
                    newly.append(url)
                w.blocks.go_blind(f"no KV-cache event within {self.lag_s:g} s of a prefill leg that stored blocks",
                                  lagging=True)
        return newly

    def store_news(self) -> list[tuple[str, Sight, str]]:
        """Each probe round: the workers whose sight changed since the last round, (host, sight, why) each, for the
        proxy's log."""
        news = []
        for host, w in sorted(self.store.workers.items()):
            if self._store_said.get(host, Sight.never) is not w.sight:
                news.append((host, w.sight, w.why))
            self._store_said[host] = w.sight
        return news

    def forget(self, url: str) -> None:
        w = self.watches.pop(url, None)
        if w is not None and w.task is not None:
            w.task.cancel()
        host = host_of(url)
        if host in self._store_feeds and not any(host_of(u) == host for u in self.watches):
            # no instance there is followed any more: what its worker held is no longer looked at, nor kept
            self._store_feeds.pop(host)[1].cancel()
            self.store.forget(host)
            self._store_said.pop(host, None)
            self._store_expect.pop(host, None)

    async def close(self) -> None:
        tasks = [w.task for w in self.watches.values() if w.task is not None]
        tasks += [task for _, task in self._store_feeds.values()]
        self.watches.clear()
        self._store_feeds.clear()
        for task in tasks:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    def state(self, url: str) -> dict:
        """What /yrpd/status and /metrics say of one instance's index."""
        w = self.watches.get(url)
        if w is None:
            return {"sight": Sight.never.value, "why": "not asked yet"}
        b = w.blocks
        out = {"sight": b.sight.value, "blocks": len(b.held), "block_size": b.block_size, "gaps": b.gaps,
               "restarts": b.restarts}
        if w.feed is None:
            out["why"] = w.unseen
        elif b.sight is Sight.blind:
            out.update(why=b.why, blind_since=b.blind_since)
        if w.feed is not None:
            out.update(replays=w.feed.replays, replay_s=round(w.feed.replay_s, 3))
        return out
