"""Where a prompt's KV blocks are: each instance's prefix cache as its vLLM KV-cache events tell it, keyed as vLLM
keys blocks (a SHA-256 chain over token ids from a seed; events carry its low 64 bits). docs/dev/kv-events.md has
vLLM's side and what this index does with it (issue 46)."""

from __future__ import annotations

import hashlib
import pickle
import time
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar
from enum import Enum

#: the first block's parent is the hash of this where the instance has no PYTHONHASHSEED (vLLM 0.32, sha256)
DEFAULT_SEED = "vllm-none-hash"
#: the part of a block hash vLLM's events carry
EVENT_HASH_BITS = 64


def host_of(url: str) -> str:
    """The host an instance's URL names: what its data-system worker is known by (`Store.workers`)."""
    return urllib.parse.urlsplit(url).hostname or ""


def _sha256(obj) -> bytes:
    # the interpreter's highest pickle protocol, as vLLM's own sha256 uses: the proxy runs in the instances' venv
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def block_hashes(token_ids: Sequence[int], block_size: int, seed: str | None = None) -> list[int]:
    """The event hash of each full block of `token_ids` (a partial last block has none), as an instance started with
    PYTHONHASHSEED=`seed` (None: without it) names it."""
    if block_size < 1:
        raise ValueError(f"block_size {block_size} must be at least 1")
    parent = _sha256(DEFAULT_SEED if seed is None else seed)
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _sha256((parent, tuple(token_ids[start:start + block_size]), None))
        out.append(int.from_bytes(parent, "big") & ((1 << EVENT_HASH_BITS) - 1))
    return out


class Sight(str, Enum):
    """How well the index sees an instance's cache."""

    never = "never"  # no event received yet: nothing known
    seeing = "seeing"  # every batch since the last resync applied in order
    blind = "blind"  # a batch is missing: what is held is a guess until resynced


@dataclass(frozen=True)
class Stored:
    hashes: tuple[int, ...]
    block_size: int = 0  # tokens per block, as the instance hashes them (0: not said)


@dataclass(frozen=True)
class Removed:
    hashes: tuple[int, ...]


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


def decode_batch(payload: bytes) -> list:
    """One published batch's payload (msgpack, from vLLM's msgspec encoder) as plain values."""
    import msgspec

    return msgspec.msgpack.decode(payload)


def events_of(batch: Sequence) -> list[Event]:
    """The events of one decoded batch (`[ts, [event, ...], dp_rank]`, each a map with its "type"); others dropped."""
    out: list[Event] = []
    for event in batch[1] if len(batch) > 1 else ():
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "BlockStored":
            size = event.get("block_size")
            out.append(Stored(tuple(event.get("block_hashes") or ()), size if isinstance(size, int) else 0))
        elif kind == "BlockRemoved":
            out.append(Removed(tuple(event.get("block_hashes") or ())))
        elif kind == "AllBlocksCleared":
            out.append(Cleared())
    return out


@dataclass
class Numbered:
    """How well an index sees one publisher by the numbers of its batches: in order, it is seeing; a number that
    skips means batches were lost (blind); one that goes back means a new run of the publisher, whose cache started
    empty (exact again if it is the run's first batch, blind if batches of the new run were missed). Subclasses say
    what the first number is, what a new run empties, and how the two blind cases read."""

    sight: Sight = Sight.never
    #: the sequence number of the last batch applied; None before the first
    last_seq: int | None = None
    #: when the index went blind (time.time()), and why; None while seeing
    blind_since: float | None = None
    why: str = ""
    gaps: int = 0  # how many times it went blind
    restarts: int = 0  # how many times the numbering began again
    #: blind for want of news only (events late, the publisher down): nothing known lost, so the next batch in order
    #: makes it exact again
    lagging: bool = False

    #: the number a publisher run's first batch carries
    FIRST: ClassVar[int] = 0
    #: how a new run whose first batches were missed reads, and what a first batch seen late adds
    RESTARTED: ClassVar[str] = "the publisher restarted"
    JOINED_LATE: ClassVar[str] = ""

    @property
    def next_seq(self) -> int:
        """The number the next batch of the same publisher run carries."""
        return self.FIRST if self.last_seq is None else self.last_seq + 1

    def _number(self, seq: int, now: float | None) -> None:
        """Take batch `seq`'s number, before its events are applied (they are either way: what they say is true)."""
        expected = self.next_seq
        if self.last_seq is not None and seq < expected:
            self._new_run()
            self.restarts += 1
            if seq > self.FIRST:
                self.go_blind(f"{self.RESTARTED}; its batches before {seq} were missed", now)
            else:  # its whole new run is here: exact
                self.resync()
        elif seq > expected:
            self.go_blind(f"batch {seq} came after {self.last_seq}" if self.last_seq is not None
                          else f"the first batch seen was {seq}{self.JOINED_LATE}", now)
        elif self.sight is Sight.blind and self.lagging:
            self.resync()  # late, not lost
        if self.sight is Sight.never:
            self.sight = Sight.seeing
        self.last_seq = seq

    def _new_run(self) -> None:
        """A new run of the publisher began: its cache started empty."""
        raise NotImplementedError

    def go_blind(self, why: str, now: float | None = None, lagging: bool = False) -> None:
        """Blind from now (`lagging`: for want of news, nothing known lost; a lost batch overrides that)."""
        if self.sight is not Sight.blind:
            self.blind_since = time.time() if now is None else now
            self.gaps += 1
            self.lagging = lagging
        else:
            self.lagging = self.lagging and lagging
        self.sight, self.why = Sight.blind, why

    def resync(self) -> None:
        """Seeing again: everything the publisher still holds has been applied in order."""
        self.sight, self.blind_since, self.why, self.lagging = Sight.seeing, None, "", False


@dataclass
class InstanceBlocks(Numbered):
    """One instance's prefix cache as its events tell it (vLLM numbers its batches from 0)."""

    #: block hash -> the copies of it the instance holds. Two requests that miss the same prefix in one step each
    #: compute and store it: vLLM then holds two blocks under one hash, announces each, and announces the removal
    #: of each when it is evicted, so one hash is held until its last copy goes.
    copies: dict[int, int] = field(default_factory=dict)
    #: tokens per block, from the instance's own events (0 until its first stored block)
    block_size: int = 0
    #: blocks held now (copies counted), the most it ever held, and how many it evicted: once it has evicted, its
    #: cache was full, and the most it held is its size (what routing discounts a claim by; yrpd.proxy.pool)
    count: int = 0
    peak: int = 0
    evicted: int = 0

    RESTARTED: ClassVar[str] = "the instance restarted"

    @property
    def held(self):
        """The hashes of the blocks held (a set-like view)."""
        return self.copies.keys()

    def apply(self, seq: int, events: Iterable[Event], now: float | None = None) -> None:
        """Apply one batch numbered `seq` (Numbered: blind until `resync` where batches were lost)."""
        self._number(seq, now)
        for event in events:
            if isinstance(event, Stored):
                for h in event.hashes:
                    self.copies[h] = self.copies.get(h, 0) + 1
                self.count += len(event.hashes)
                self.peak = max(self.peak, self.count)
                # a partial block's entry (vLLM caches one where its hash unit is finer than a block) says fewer
                # tokens: the block size is the largest any event said since the instance's cache began
                self.block_size = max(self.block_size, event.block_size)
            elif isinstance(event, Removed):
                for h in event.hashes:
                    had = self.copies.pop(h, 0)
                    if had:
                        self.count -= 1
                        self.evicted += 1
                    if had > 1:
                        self.copies[h] = had - 1
            else:
                self._forget()

    def _new_run(self) -> None:
        self._forget()
        self.block_size = 0

    def _forget(self) -> None:
        """Its cache emptied (cleared, or the instance restarted): its size, as learnt, stays."""
        self.copies.clear()
        self.count = 0

    def survival(self, ahead_blocks: float) -> float:
        """The share of what it holds that is likely still held after `ahead_blocks` new blocks are computed there
        first: 1 until it has ever evicted (room left, nothing goes), else what its size leaves free is taken first,
        then each new block evicts one, uniformly over what it holds as far as is known (vLLM evicts the least
        recently used)."""
        if not self.evicted or self.count <= 0 or ahead_blocks <= 0:
            return 1.0
        evicting = ahead_blocks - max(self.peak - self.count, 0)
        return 1.0 if evicting <= 0 else max(0.0, 1.0 - evicting / self.count)

    def rebuild(self) -> None:
        """Forget everything, to apply the instance's batches again from its first (a replay from 0)."""
        self._new_run()
        self.last_seq = None

    def matched(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its `block_hashes`) this instance holds: the first miss ends the
        prefix, as vLLM's own lookup does."""
        n = 0
        for h in hashes:
            if h not in self.held:
                break
            n += 1
        return n


#: how much of a worker's shared memory our blocks fill before its disk tier takes the older ones. It spills from 90 %
#: full down to 80 %, and a value takes more room there than its bytes (1 MiB took about 1.25 MiB), so what stays
#: in memory swings with where the last spill ended: the newest 44-46 of 1 MiB blocks in 64 MiB
#: (tests/connector/test_ds_events.py), 66-68 of 2.8 MiB blocks in 256 MiB (benchmarks/connector/bench_tiers.py:
#: docs/bench/connector-tiers-*.json). A little under the least seen, so that a block at the edge counts as on disk;
#: a spill that ran right down to the 80 % mark leaves fewer (about 41 of those 1 MiB blocks), and then the oldest
#: few taken for in memory are on disk already.
MEMORY_REACH = 0.68


@dataclass
class StoreBlocks(Numbered):
    """What one data-system worker holds of the connector's blocks, as its own KV events tell (openYuanrong's
    `kv_events_config`): the numbers `yrpd.connector.keys.event_hash` gives the blocks' prefix digests, in memory or
    spilled to disk alike (a spill says nothing; docs/dev/kv-events.md, "The data system's tiers").

    A set, not a count: the worker says "stored" again on every overwrite, and one TP rank's key removed takes the
    block out (its load would miss), which errs towards computing. Its batches are numbered from 1 and it has no
    replay: a subscriber that joined late, or missed a batch, cannot learn what it missed, so it stays blind (what it
    holds is then at least what the index says) until the worker starts anew, empty; blind for want of news ends
    with the next batch in order.

    Which tier a block is in, the worker never says. Where it has a disk tier (`memory` set) the index infers it:
    the worker spills the blocks written or read longest ago (its eviction is CLOCK, second chance, close to least
    recently used), so the index keeps the newest `memory` blocks, by when each was last stored or loaded (`touch`),
    as those in memory, and moves the oldest of them to `disk` as newer ones come. A block removed from memory makes
    room without reading one back from disk, as in the worker."""

    #: what it holds in memory as far as inferred, least recently stored or loaded first (a dict as an ordered set)
    in_memory: dict[int, None] = field(default_factory=dict)
    #: what it holds on its disk tier as far as inferred, spilled longest ago first
    on_disk_blocks: dict[int, None] = field(default_factory=dict)
    #: how many of our blocks its memory holds before it spills (Store.memory_blocks); None: no disk tier behind it,
    #: or the blocks' size not known yet: all it holds is taken for in memory
    memory: int | None = None

    FIRST: ClassVar[int] = 1
    RESTARTED: ClassVar[str] = "the worker started anew"
    JOINED_LATE: ClassVar[str] = ": the proxy joined after the worker had stored"

    @property
    def held(self) -> set[int]:
        """The numbers of the blocks it holds, both tiers (a copy: `holds` asks for one)."""
        return set(self.in_memory) | set(self.on_disk_blocks)

    def holds(self, h: int) -> bool:
        return h in self.in_memory or h in self.on_disk_blocks

    def apply(self, seq: int, events: Iterable[Event], now: float | None = None) -> None:
        self._number(seq, now)
        for event in events:
            if isinstance(event, Stored):
                self._to_memory(event.hashes)  # a write lands in memory, an overwrite too
            elif isinstance(event, Removed):
                for h in event.hashes:
                    self.in_memory.pop(h, None)
                    self.on_disk_blocks.pop(h, None)
            else:
                self._new_run()

    def touch(self, hashes: Iterable[int]) -> None:
        """A connector loaded these blocks: one read back from disk is in memory again, and one read is spilled
        after those read longer ago."""
        self._to_memory(h for h in hashes if self.holds(h))

    def set_memory(self, blocks: int | None) -> None:
        """What its memory holds, in blocks, once known: the oldest beyond it are taken for spilled."""
        self.memory = blocks
        self._spill()

    def on_disk(self, h: int) -> bool:
        """Whether the block numbered `h` is held, but on disk only (as inferred above)."""
        return h in self.on_disk_blocks

    def _to_memory(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self.on_disk_blocks.pop(h, None)
            self.in_memory.pop(h, None)
            self.in_memory[h] = None
        self._spill()

    def _spill(self) -> None:
        if self.memory is None:
            return
        while len(self.in_memory) > self.memory:
            oldest = next(iter(self.in_memory))
            del self.in_memory[oldest]
            self.on_disk_blocks[oldest] = None

    def _new_run(self) -> None:
        self.in_memory.clear()
        self.on_disk_blocks.clear()


class Store:
    """The data system's holdings of the connector's blocks: every followed worker's together (a connector loads a
    block from whichever worker holds it)."""

    def __init__(self, memory_bytes: int | None = None) -> None:
        self.workers: dict[str, StoreBlocks] = {}  # host -> its worker's index
        #: each worker's shared memory, where a disk tier is behind it (None: no disk tier, all it holds is in memory)
        self.memory_bytes = memory_bytes
        #: what one block of ours takes in a worker, all its keys together, as the prefill connectors say (None
        #: until one has)
        self.block_bytes: int | None = None

    def worker(self, host: str) -> StoreBlocks:
        if host not in self.workers:
            self.workers[host] = StoreBlocks(memory=self.memory_blocks)
        return self.workers[host]


    @property
    def memory_blocks(self) -> int | None:
        """How many of our blocks a worker's memory holds before it spills the older ones to its disk tier; None
        where it has none or the blocks' size is not known yet."""
        if self.memory_bytes is None or not self.block_bytes:
            return None
        return max(0, int(self.memory_bytes * MEMORY_REACH) // self.block_bytes)

    def learn_block_bytes(self, nbytes: int) -> None:
        """A prefill connector said what one block of ours takes (the largest said counts: an instance with more TP
        ranks writes more keys per block)."""
        if nbytes > (self.block_bytes or 0):
            self.block_bytes = nbytes
            for w in self.workers.values():
                w.set_memory(self.memory_blocks)

    def touch(self, hashes: Sequence[int]) -> None:
        """A connector loaded these blocks: read back, wherever they were (StoreBlocks.touch)."""
        for w in self.workers.values():
            w.touch(hashes)

    def on_disk(self, h: int) -> bool:
        """Whether every followed worker that holds the block numbered `h` has it on disk only: a load of it reads
        the disk (a connector reads whichever worker holds it)."""
        if self.memory_blocks is None:
            return False
        if any(h in w.in_memory for w in self.workers.values()):
            return False
        return any(h in w.on_disk_blocks for w in self.workers.values())

    def sees(self, hosts: Iterable[str]) -> bool:
        """Whether what the data system holds is known exactly where `hosts` (those of the prefill instances, whose
        connectors save to their own host's worker) keep it: every one's worker followed and seen. A worker that has
        said nothing yet is not taken for empty: its events may not reach the proxy at all."""
        hosts = set(hosts)
        return bool(hosts) and all(h in self.workers and self.workers[h].sight is Sight.seeing for h in hosts)

    def forget(self, host: str) -> None:
        self.workers.pop(host, None)

    @property
    def sight(self) -> Sight:
        """Seeing while every followed worker is; never until one has said anything."""
        sights = {w.sight for w in self.workers.values()}
        if not sights or sights == {Sight.never}:
            return Sight.never
        return Sight.blind if Sight.blind in sights else Sight.seeing

    def holds(self, h: int) -> bool:
        """Whether some followed worker holds the block numbered `h`."""
        return any(w.holds(h) for w in self.workers.values())

    def matched(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its store hashes) the data system holds, as far as the index knows:
        exactly while `sight` is seeing, at least that many otherwise."""
        n = 0
        for h in hashes:
            if not self.holds(h):
                break
            n += 1
        return n

    def state(self) -> dict:
        """What /yrpd/status and /metrics say of it."""
        return {"sight": self.sight.value, "blocks": len(set().union(*(w.held for w in self.workers.values()))),
                "workers": {host: {"sight": w.sight.value, "blocks": len(w.in_memory) + len(w.on_disk_blocks),
                                   "gaps": w.gaps,
                                   "restarts": w.restarts, **({"why": w.why} if w.why else {}),
                                   **({"memory_blocks": w.memory, "on_disk": len(w.on_disk_blocks)}
                                      if w.memory is not None else {})}
                            for host, w in sorted(self.workers.items())}}
