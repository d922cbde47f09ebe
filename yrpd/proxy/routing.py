"""Which prefill instance a request goes to: by load alone, or to where its prompt's prefix was sent before.

The proxy has no tokenizer, so a prompt's prefix is approximated by its text cut into fixed chunks, each hashed
together with everything before it (a chain, as the connector's block keys are). An instance remembers the
chains it was sent (bounded, least recently used out); a request goes to the instance that shares the most leading
chunks with it, unless that instance has `bound` more requests in flight than the least busy one: then load wins,
so one popular prefix cannot pile everything onto one instance. A request matching nothing goes by load.

Standard library only (see yrpd.proxy).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from enum import Enum


class Routing(str, Enum):
    load = "load"  # fewest requests in flight, ties round robin
    prefix = "prefix"  # most leading prompt chunks sent there before, bounded by load


#: characters per chunk: about one 16-token KV block of English text
CHUNK_CHARS = 64
#: chunks of a prompt that count; prefixes longer than this all look alike, which is fine for routing
MAX_CHUNKS = 64
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
