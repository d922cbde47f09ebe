"""One instance's KV-cache events into the proxy's index: a ZMQ subscriber on its publisher that asks the replay
socket for what it missed (docs/dev/kv-events.md)."""

from __future__ import annotations

import asyncio
import time

from .kvindex import InstanceBlocks, decode_batch, events_of

#: the replay socket's end marker: a batch number of -1
END = -1
#: how long a replay may take to answer before the feed gives up on it (the publisher serves replays between
#: batches, from the engine's own process)
REPLAY_TIMEOUT_S = 2.0


def _seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


class Feed:
    """Subscribes to one publisher (`endpoint`, e.g. tcp://10.0.0.1:5557) and applies its batches to `blocks`;
    `replay` is its replay socket's address (None: gaps are not filled)."""

    def __init__(self, blocks: InstanceBlocks, endpoint: str, replay: str | None = None, topic: bytes = b"",
                 context=None) -> None:
        import zmq.asyncio

        self.blocks, self.endpoint, self.replay, self.topic = blocks, endpoint, replay, topic
        self.ctx = context or zmq.asyncio.Context.instance()
        self.replays = 0  # replays asked for
        self.last_batch_at: float | None = None  # time.monotonic() of the last batch received

    async def run(self) -> None:
        """Receive until cancelled."""
        import zmq

        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                await self.receive(_seq(frames[1]), frames[2])
        finally:
            sub.close()

    async def receive(self, seq: int, payload: bytes) -> None:
        """One batch from the subscription, after whatever was missed before it, where the publisher still has it."""
        self.last_batch_at = time.monotonic()
        last, expected = self.blocks.last_seq, self.blocks.next_seq
        if self.replay is not None and seq not in (expected, 0):
            restarted = last is not None and seq < expected  # a new run of the publisher, its first batches missed
            if not restarted:
                for s, p in await self._replayed(expected, seq) or ():
                    self.blocks.apply(s, events_of(decode_batch(p)))
            if self.blocks.last_seq != seq - 1:
                # the gap is gone from the publisher's buffer, or the new run's beginning is: all it still has,
                # from its first batch, makes the copy exact again
                everything = await self._replayed(0, seq)
                if everything is not None:
                    self.blocks.restarts += restarted
                    self.blocks.rebuild()
                    for s, p in everything:
                        self.blocks.apply(s, events_of(decode_batch(p)))
                    self.blocks.resync()
        self.blocks.apply(seq, events_of(decode_batch(payload)))

    async def _replayed(self, start: int, upto: int) -> list[tuple[int, bytes]] | None:
        """The publisher's batches start .. upto-1 from its replay socket, or None if it no longer has them all."""
        import zmq

        self.replays += 1
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay)
        got: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                if len(frames) != 4:
                    continue
                seq = _seq(frames[2])
                if seq == END:
                    break
                if start <= seq < upto:
                    got.append((seq, frames[3]))
        except asyncio.TimeoutError:
            return None
        finally:
            dealer.close()
        return got if [s for s, _ in got] == list(range(start, upto)) else None
