"""The KV-event relay: one process on a host whose instances publish their KV-cache events on unix sockets
(yrpd.serving.kv_events_config), so a proxy on another host can follow them (docs/dev/kv-events.md "The relay").

It finds the instances' sockets in the session's run directory (`kv-events-<name>.sock`, `kv-replay-<name>.sock`;
instances come and go with scale and rolling changes, so it looks again every second) and serves two tcp ports:
- `--port`: a PUB socket that republishes every instance's batches with the topic `<name>/` (vLLM's frames
  otherwise unchanged: topic, sequence number, payload);
- `--port`+1: a ROUTER socket for replays; a request names the instance, `["", name, start]`, and the answer is
  that instance's replay, frame for frame as vLLM's publisher sends it (topic replaced), ended by its end marker.
Both are CURVE servers with the deployment's relay key pair; the ZAP handler lets in the one client key the proxy
holds (the events carry prompts' token ids). The keys come from the environment its supervisor reads from the
session's secrets (yrpd.credentials: `kv-relay.env`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

from yrpd.credentials import KV_PROXY_PUBLIC_ENV, KV_RELAY_PUBLIC_ENV, KV_RELAY_SECRET_ENV
from yrpd.layout import KV_EVENTS_SOCKET, KV_REPLAY_SOCKET

log = logging.getLogger("yrpd.kvrelay")

#: how often the run directory is looked at again for instances that came or went
RESCAN_S = 1.0
#: how long an instance's replay may take before the relay gives up on it (and answers the end marker alone)
REPLAY_TIMEOUT_S = 2.0
END = (-1).to_bytes(8, "big", signed=True)

#: the variables its keys come in: its own pair, and the public key of the one client it lets in (the proxy's)
SECRET_ENV, PUBLIC_ENV, CLIENT_ENV = KV_RELAY_SECRET_ENV, KV_RELAY_PUBLIC_ENV, KV_PROXY_PUBLIC_ENV


def topic(name: str) -> bytes:
    """An instance's topic on the relay: its name and a slash, so that no instance's is a prefix of another's."""
    return f"{name}/".encode()


def instances_in(run_dir: Path) -> dict[str, tuple[str, str]]:
    """The instances that publish in `run_dir`: name -> (events socket, replay socket), as ipc:// addresses."""
    head, tail = KV_EVENTS_SOCKET.split("{name}")
    found = {}
    for path in run_dir.glob(KV_EVENTS_SOCKET.format(name="*")):
        name = path.name[len(head):len(path.name) - len(tail)]
        replay = run_dir / KV_REPLAY_SOCKET.format(name=name)
        found[name] = (f"ipc://{path}", f"ipc://{replay}")
    return found


class Allow:
    """pyzmq's ZAP callback: the one client key that may connect."""

    def __init__(self, client_public: str) -> None:
        self.key = client_public.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.key


class Relay:
    def __init__(self, run_dir: Path, listen: str, port: int, keys: tuple[str, str, str], context=None) -> None:
        import zmq
        from zmq.auth.thread import ThreadAuthenticator

        self.run_dir = run_dir
        self.ctx = context or zmq.Context()
        secret, public, client = keys
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve_callback("*", credentials_provider=Allow(client))
        address = f"[{listen}]" if ":" in listen else listen
        self.pub = self._server(zmq.PUB, secret, public, f"tcp://{address}:{port}")
        self.replay = self._server(zmq.ROUTER, secret, public, f"tcp://{address}:{port + 1}")
        self.subs: dict[str, object] = {}  # name -> its SUB socket
        self.replays: dict[str, str] = {}  # name -> its replay socket's address
        self.poller = zmq.Poller()
        self.poller.register(self.replay, zmq.POLLIN)

    def _server(self, kind: int, secret: str, public: str, endpoint: str):
        import zmq

        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_server = True
        sock.curve_secretkey = secret.encode()
        sock.curve_publickey = public.encode()
        if ":" in endpoint.rsplit(":", 1)[0]:
            sock.setsockopt(zmq.IPV6, 1)
        sock.bind(endpoint)
        return sock

    def rescan(self) -> None:
        """Follow the instances whose sockets are there now; drop those whose sockets are gone."""
        import zmq

        found = instances_in(self.run_dir)
        for name in set(self.subs) - set(found):
            sock = self.subs.pop(name)
            self.poller.unregister(sock)
            sock.close()
            self.replays.pop(name, None)
            log.info("instance %s: its sockets are gone, no longer relayed", name)
        for name, (events, replay) in found.items():
            if name not in self.subs:
                sock = self.ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                try:
                    sock.connect(events)
                except zmq.ZMQError as exc:  # a path ZMQ refuses (too long): that one is not relayed, the rest are
                    sock.close()
                    log.warning("instance %s: cannot subscribe to %s (%s)", name, events, exc)
                    continue
                self.subs[name] = sock
                self.poller.register(sock, zmq.POLLIN)
                log.info("instance %s: relaying its KV-cache events", name)
            if Path(replay.removeprefix("ipc://")).exists():  # the data-system worker publishes with no replay socket
                self.replays[name] = replay
            else:
                self.replays.pop(name, None)

    def serve(self, until=lambda: False) -> None:
        import zmq

        names = {}
        scanned = 0.0
        while not until():
            if time.monotonic() - scanned >= RESCAN_S:
                self.rescan()
                names = {sock: name for name, sock in self.subs.items()}
                scanned = time.monotonic()
            for sock, _ in self.poller.poll(int(RESCAN_S * 1000)):
                if sock is self.replay:
                    self._serve_replay(self.replay.recv_multipart())
                    continue
                frames = sock.recv_multipart()
                if len(frames) == 3 and sock in names:
                    self.pub.send_multipart([topic(names[sock]), frames[1], frames[2]], flags=zmq.NOBLOCK)

    def _serve_replay(self, frames: list[bytes]) -> None:
        """[client, "", name, start] -> the instance's replay, as its publisher answers it, then its end marker."""
        import zmq

        if len(frames) != 4:
            return
        client, _, name, start = frames
        name = name.decode(errors="replace")
        answer = [client, b""]
        address = self.replays.get(name)
        if address is None:
            # no answer: an end marker alone would say "nothing published yet", and the proxy would take an instance
            # it cannot see (not found here yet, or gone) for one seen empty; silence leaves it blind until it is
            return
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        try:
            dealer.send_multipart([b"", start])
            while dealer.poll(int(REPLAY_TIMEOUT_S * 1000)):
                got = dealer.recv_multipart()
                if len(got) != 4:
                    continue
                if got[2] == END:
                    break
                self.replay.send_multipart([*answer, topic(name), got[2], got[3]])
            else:  # no end marker: the instance did not answer; the proxy sees an incomplete replay
                return
        finally:
            dealer.close()
        self.replay.send_multipart([*answer, b"", END, b""])

    def close(self) -> None:
        for sock in [*self.subs.values(), self.pub, self.replay]:
            sock.close()
        self.auth.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m yrpd.proxy.kvrelay", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=Path, required=True, help="the session's run directory on this host")
    p.add_argument("--listen", required=True, help="the address the proxy reaches this host at")
    p.add_argument("--port", type=int, required=True, help="the PUB port; the replay port is the next one")
    args = p.parse_args(argv)
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keys = tuple(os.environ.get(k, "") for k in (SECRET_ENV, PUBLIC_ENV, CLIENT_ENV))
    if not all(keys):
        missing = ", ".join(k for k, v in zip((SECRET_ENV, PUBLIC_ENV, CLIENT_ENV), keys) if not v)
        print(f"kvrelay: {missing} not set (the session's kv-relay.env, read by the supervisor)", file=sys.stderr)
        return 2
    relay = Relay(args.run_dir, args.listen, args.port, keys)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    log.info("relaying the KV-cache events of %s on %s:%d (replays on %d)", args.run_dir, args.listen, args.port,
             args.port + 1)
    try:
        relay.serve(until=lambda: bool(stop))
    finally:
        relay.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
