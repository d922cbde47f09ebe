"""Which instance a request goes to: by load alone, or by the work it would cost there (cache-aware).

The proxy has no tokenizer, so a prompt's prefix is approximated by its text cut into fixed chunks, each hashed
together with everything before it (a chain, as the connector's block keys are). An instance remembers the
chains it was sent (bounded, least recently used out), since its own KV pool likely still holds their KV.

`prefix` routing sends a prefill leg to the instance where it costs least: the chunks of the prompt that
instance has not seen (what it must compute, counted WORK_WEIGHT times) plus the chunks its prefill legs in flight
still have to compute (its queue). Chunks another prefill instance has finished computing are in the data
system, from which this one can load them for a fraction of computing them, as long as the data system still
holds them: they count `Pool.load_weight()`, between LOAD_WEIGHT and WORK_WEIGHT by how often such loads were
found there lately (the connector tells, in the `kv_transfer_params` prefill answers with, how many blocks it
loaded). A prompt whose prefix one instance holds goes there unless that instance is
busy with more work than the prefix saves; a prompt matching nothing goes to the instance with the least work
queued and, among idle ones, to the one given the least work lately (a decaying sum over the last RECENT_LEGS
prefill legs), so that the prefixes each instance ends up holding are spread evenly. No instance is
chosen with `bound` more requests in flight than the least busy one, so one popular prefix cannot pile
everything onto one instance. Decode legs go by requests in flight, the prefix breaking ties. Once prefill legs
have been timed (yrpd.proxy.pool), the chunks are weighed by the seconds each instance takes per chunk and a load
by the seconds loads took, so the cost is an expected time.

Where the instances publish their KV-cache events (yrpd.proxy.kvindex, kvfeed), what an instance holds is known
rather than estimated: the prompt's token ids (the instances' own /tokenize) hashed as vLLM hashes blocks, matched
against what that instance's events say it holds. An instance whose events the proxy does not see exactly (none
published, a gap, silence, down) is routed on the estimate above.

Standard library only (see yrpd.proxy).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from ..connector.keys import event_hash, loadable_blocks, prefix_digests, request_extra
from .kvindex import InstanceBlocks, Sight, Store, block_hashes


class Routing(str, Enum):
    round_robin = "round-robin"  # each leg to the next instance in turn, whatever it holds or has in flight
    load = "load"  # fewest requests in flight, ties round robin
    prefix = "prefix"  # least work: prompt chunks not seen there plus the chunks queued there, bounded by load


#: characters per chunk: about one 16-token KV block of English text
CHUNK_CHARS = 64
#: chunks of a prompt that are hashed (16 K characters, about 4 K tokens); past them all prompts look alike
MAX_CHUNKS = 256
#: what a chunk of new work costs against a chunk already queued: the queue delays this request only, while the
#: work it adds also delays every request that comes after it there (and, where instances share cores or a
#: host's memory bandwidth, elsewhere). So a request waits behind its own prefix being computed rather than
#: computing it a second time elsewhere.
WORK_WEIGHT = 2.0
#: what a chunk costs that another prefill instance computed and saved, where the data system holds it: a load.
#: Measured on the CPU lab (SmolLM2, float32): a 768-token prefix loaded from the data system in 150-300 ms
#: against 1.2-1.5 s to compute it, about a sixth; a quarter of WORK_WEIGHT leaves room for slower networks.
LOAD_WEIGHT = 0.5
#: what a load from the data system's disk tier costs against one from its memory: a spilled block read from the
#: device took 7.3 times as long per block as one in memory, 3.7 times where the kernel still had the file cached
#: (benchmarks/connector/bench_tiers.py, SmolLM2's 2.9 MB blocks: docs/bench/connector-tiers-cold.json and
#: -pagecache.json). The device's figure, since the page cache keeps a spilled file only while nothing needs the
#: memory. What a memory load costs is measured on the prefill legs (Pool.load_chunk_s); a disk load counts this
#: many of those.
DISK_LOAD_RATIO = 7.3
#: prefill legs that expected to load at least this many chunks teach how often the data system had them
LEARN_CHUNKS = 8
#: how much one such leg moves that estimate (an exponential moving average), and where it starts: trusting the
#: data system, since only legs sent to load teach anything (a data system that evicts costs a few recomputes
#: before the estimate falls: 0.8, 0.64, 0.51 after one, two, three misses)
LEARN_RATE = 0.2
LOADABLE_PRIOR = 1.0
#: prefill legs over which an instance's recent work decays (by 1/e): the horizon of "lately" above
RECENT_LEGS = 32
#: chains an instance remembers (a chain is 8 bytes of digest), about 1,000 prompts of 4 K characters
MEMORY = 65536


def prompt_text(body: dict) -> str:
    """The part of an OpenAI request that becomes the prompt, as one string (token ids as their decimal text)."""
    if "messages" in body:
        parts = []
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                content = m.get("content")
                if not isinstance(content, str):  # a list of parts: their text pieces in order
                    content = json.dumps(content, sort_keys=True, default=str)
                parts.append(f"{m.get('role')}\x1f{content}\x1e")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return json.dumps(prompt, default=str)


def chain(text: str, chunk: int = CHUNK_CHARS, limit: int = MAX_CHUNKS) -> list[bytes]:
    """Digests of the full leading chunks of `text`; the i-th covers the first (i + 1) * chunk characters."""
    out, h = [], hashlib.blake2b(digest_size=8)
    for start in range(0, min(len(text) // chunk, limit) * chunk, chunk):
        h.update(text[start:start + chunk].encode())
        out.append(h.copy().digest())
    return out


@dataclass(frozen=True)
class Prompt:
    """What routing knows of a request's prompt: its chunk chain and its whole length in chunks; where the
    instances publish their KV-cache events, also its token ids (as the instances tokenize it) and the seed their
    block hashes start from."""

    chain: list[bytes]
    chunks: float
    tokens: tuple[int, ...] | None = None
    seed: str | None = None
    #: what the connector chains its block keys from beyond the token ids: the request's cache salt
    salt: str | None = None
    #: the request names another model than the deployment's (a LoRA adapter, whose name the connector's keys also
    #: chain from and the proxy cannot tell apart): what the data system holds of it is not looked up
    foreign: bool = False
    #: block size -> block_hashes, and ("store", block size) -> store_hashes
    _hashes: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, body: dict, served: str | None = None) -> Prompt:
        """`served`: the deployment's model name, where known (a request for another is `foreign`)."""
        text = prompt_text(body)
        salt = body.get("cache_salt")
        foreign = served is not None and body.get("model") not in (None, served)
        return cls(chain(text), len(text) / CHUNK_CHARS, salt=str(salt) if salt else None, foreign=foreign)

    def with_tokens(self, tokens: list[int], seed: str | None) -> Prompt:
        return Prompt(self.chain, self.chunks, tuple(tokens), seed, self.salt, self.foreign)

    def work(self, matched: float) -> float:
        """Chunks left to compute where the first `matched` chunks are cached (at least a part of one)."""
        return max(self.chunks - matched, 0.5)

    def hashes(self, block_size: int) -> list[int]:
        if block_size not in self._hashes:
            self._hashes[block_size] = block_hashes(self.tokens or (), block_size, self.seed)
        return self._hashes[block_size]

    def store_hashes(self, block_size: int) -> list[int]:
        """The numbers the data system's events name the prompt's full blocks by (the connector's prefix digests,
        yrpd.connector.keys.event_hash)."""
        key = ("store", block_size)
        if key not in self._hashes:
            extra = request_extra(cache_salt=self.salt)
            self._hashes[key] = [event_hash(d) for d in prefix_digests(self.tokens or (), block_size, extra=extra)]
        return self._hashes[key]

    def in_store(self, store: Store | None, block_size: int, hosts: Iterable[str]) -> int | None:
        """Leading blocks of the prompt a leg could load from the data system as its workers' events tell, where
        they tell it exactly for every host in `hosts` (Store.sees); None where not (no events, a worker blind or
        silent so far, no token ids or block size, a foreign model): routing estimates then. A connector loads at
        most every block but the one holding the last prompt token (keys.loadable_blocks)."""
        if (store is None or self.foreign or not self.tokens or block_size < 1 or not store.sees(hosts)):
            return None
        return min(store.matched(self.store_hashes(block_size)), loadable_blocks(len(self.tokens), block_size))

    def block_chunks(self, blocks: float, block_size: int) -> float:
        """The prompt chunks `blocks` blocks of `block_size` tokens cover (its token ids known)."""
        return blocks * block_size * self.chunks / len(self.tokens) if self.tokens else 0.0

    def store_on_disk(self, store: Store, block_size: int, blocks: int) -> tuple[bool, ...]:
        """For each of the prompt's first `blocks` blocks (those `in_store` counted): whether the data system holds it
        on its disk tier only, as far as its index infers (StoreBlocks.on_disk)."""
        return tuple(store.on_disk(h) for h in self.store_hashes(block_size)[:blocks])

    def store_lacks(self, store: Store, block_size: int) -> int:
        """Full blocks of the prompt the data system does not hold, as its workers' events tell: what a prefill leg's
        connector saves there."""
        return sum(not store.holds(h) for h in self.store_hashes(block_size))

    def held(self, blocks: InstanceBlocks | None) -> tuple[float, int] | None:
        """(leading chunks, leading blocks) of the prompt an instance's prefix cache holds, as its KV-cache events
        tell; None where they tell nothing exact (no events, blind, no token ids): routing estimates then."""
        if self.tokens is None or blocks is None or blocks.sight is not Sight.seeing:
            return None
        if not blocks.block_size:  # it never stored a block: it holds nothing
            return 0.0, 0
        n = blocks.matched(self.hashes(blocks.block_size))
        return n * blocks.block_size * self.chunks / max(len(self.tokens), 1), n

    def loaded_chunks(self, loaded_blocks: int, blocks: InstanceBlocks | None, expected: float) -> float | None:
        """The chunks of the prompt `loaded_blocks` blocks loaded from the data system cover: by the block size
        the instance's events tell, else the chunks the leg was `expected` to load (any load: all of them); None
        where neither tells (a load nobody expected, blocks of unknown size)."""
        if loaded_blocks <= 0:
            return 0.0
        if self.tokens and blocks is not None and blocks.block_size:
            return min(loaded_blocks * blocks.block_size, len(self.tokens)) * self.chunks / len(self.tokens)
        return expected or None

    def blocks_at(self, blocks: InstanceBlocks | None) -> tuple[int | None, int]:
        """(leading full blocks of the prompt an instance's events say it holds, None where they tell nothing exact;
        full blocks it would store that its cache does not hold, 0 where not known)."""
        held = self.held(blocks)
        if held is None:
            return None, 0
        if not blocks.block_size:  # (block size unknown until its first stored block)
            return held[1], 0
        return held[1], len(self.hashes(blocks.block_size)) - held[1]

    def last_block(self, blocks: InstanceBlocks | None) -> int | None:
        """The hash of the prompt's last full block by an instance's block size (None where not known): a leg there
        has stored it by the time it answers."""
        if self.tokens is None or blocks is None or not blocks.block_size:
            return None
        hashes = self.hashes(blocks.block_size)
        return hashes[-1] if hashes else None


class PrefixMemory:
    """The chains one instance was sent, most recent last."""

    def __init__(self, capacity: int = MEMORY):
        self.capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def matched(self, digests: list[bytes]) -> int:
        """How many leading chunks of a prompt this instance has seen (a chain: the first miss ends it)."""
        n = 0
        for d in digests:
            if d not in self._seen:
                break
            n += 1
        return n

    def remember(self, digests: list[bytes]) -> None:
        for d in digests:
            self._seen[d] = None
            self._seen.move_to_end(d)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def forget(self) -> None:
        self._seen.clear()

    def __len__(self) -> int:
        return len(self._seen)
