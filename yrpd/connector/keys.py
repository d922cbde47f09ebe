"""Content-addressed, namespaced keys for KV cache blocks (pure Python, no vLLM needed).

A block key names the KV of one full block of one layer group on one TP rank:

    yrpd_<namespace digest, 16 hex>@cache_family:yrpd@<prefix digest, 32 hex>

The `@cache_family:<family>@<hex>` part is the form openYuanrong's data-system worker (0.8.1) reads when it
publishes KV events of its own (`kv_events_config`): it names the block in them by the last 16 hex digits of the
digest as an unsigned 64-bit number (`event_hash`) and publishes nothing for a key of any other form. So what the
data system holds of ours can be followed by what it says, the way each instance's own cache is followed by vLLM's
events (docs/dev/kv-events.md, "The data system's tiers").

* The prefix digest chains over the token ids of every block up to and including this one,
  seeded with the request's extra identity (LoRA adapter, cache salt), so equal keys mean
  equal token prefixes, and a block's key never depends on how prefill was chunked.
* The namespace digest covers everything that changes the bytes stored for a block: model
  identity, KV dtype, memory layout, block size, block shape, TP rank/size and layer group.
  Two models or layouts sharing one data system can never read each other's blocks.

Full blocks are what any request with the same prefix can reuse. A request of n prompt tokens
exposes at most `loadable_blocks(n, block_size)` = floor((n - 1) / block_size) of them to a loader,
because the engine must compute at least the last prompt token itself to get logits; for
n = k * block_size + 1 that is all k full blocks (no off-by-one).

A prefill-to-decode hand-over also carries the block after those (`handover_tail`): decode takes
all but the last prompt token from it and computes one token, not up to a block of them. When
that block is a full one it is stored under its prefix key already; a partial last block gets a
key of its own (`tail_digest`), made so that it can never equal a full block's.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

KEY_PREFIX = "yrpd"
NS_HEX = 16
PREFIX_HEX = 32
#: what the data system's event publisher finds between a key's namespace and its digest
FAMILY = "@cache_family:yrpd@"
#: the digest's hex digits the data system's events carry (as an unsigned 64-bit number)
EVENT_HEX = 16
_KEY_RE = re.compile(rf"^{KEY_PREFIX}_[0-9a-f]{{{NS_HEX}}}{FAMILY}[0-9a-f]{{{PREFIX_HEX}}}$")


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two engines to share a stored block."""

    model: str  # model identity (explicit model_id, or name + config digest)
    kv_dtype: str  # e.g. "bfloat16"
    layout: str  # e.g. "cpu-kt-v" (CPU tile layout), "npu-kv-split"
    block_size: int
    block_shape: tuple = ()  # per-layer block tile shape, e.g. (2, 128, 64)
    num_layers: int = 0  # layers stored under one key
    tp_rank: int = 0
    tp_size: int = 1
    layer_group: int = 0
    extra: dict = field(default_factory=dict)  # pp rank, version, user-defined partition

    def canonical(self) -> str:
        data = asdict(self)
        data["block_shape"] = list(self.block_shape)
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()[:NS_HEX]


def model_identity(name_or_path: str, hf_config: dict | None = None, model_id: str | None = None) -> str:
    """Model identity used in the namespace.

    An explicit `model_id` (set by the deployer, e.g. name plus weights digest) wins. Otherwise the
    last path component of the model plus a digest of its architecture config, so the same model
    mounted at different paths on prefill and decode hosts still matches.
    """
    if model_id:
        return str(model_id)
    base = name_or_path.rstrip("/").split("/")[-1] or name_or_path
    if not hf_config:
        return base
    blob = json.dumps(hf_config, sort_keys=True, default=str, separators=(",", ":"))
    return f"{base}#{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def chain_seed(extra: Sequence[object] | None = None) -> bytes:
    """Seed of the prefix chain: identity of the request beyond its token ids."""
    h = hashlib.sha256(b"yrpd-kv-chain-v1")
    for item in extra or ():
        piece = repr(item).encode()
        h.update(struct.pack("<I", len(piece)))
        h.update(piece)
    return h.digest()


def request_extra(lora: str | None = None, cache_salt: object = None, mm_ids: Sequence[object] = ()) -> tuple:
    """What a request's block keys chain from beyond its token ids (`chain_seed`): its LoRA adapter's name, its
    cache salt and its multimodal inputs' identities. The connector and the proxy (which names the blocks the data
    system says it holds) both take it from here."""
    extra: list = []
    if lora is not None:
        extra.append(("lora", lora))
    if cache_salt:
        extra.append(("salt", str(cache_salt)))
    extra.extend(("mm", str(ident)) for ident in mm_ids)
    return tuple(extra)


def prefix_digests(token_ids: Sequence[int], block_size: int, num_blocks: int | None = None,
                   extra: Sequence[object] | None = None) -> list[str]:
    """Chained digests of the first `num_blocks` full blocks (default: all full blocks)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    full = len(token_ids) // block_size
    n = full if num_blocks is None else min(num_blocks, full)
    out: list[str] = []
    prev = chain_seed(extra)
    for b in range(n):
        chunk = token_ids[b * block_size:(b + 1) * block_size]
        h = hashlib.sha256(prev)
        h.update(struct.pack(f"<{block_size}q", *chunk))
        prev = h.digest()
        out.append(prev.hex()[:PREFIX_HEX])
    return out


def key_for(ns_digest: str, prefix_digest: str) -> str:
    return f"{KEY_PREFIX}_{ns_digest}{FAMILY}{prefix_digest}"


def event_hash(prefix_digest: str) -> int:
    """How the data system's KV events name the block of `prefix_digest` (every namespace's key of it alike: TP
    ranks and layer groups of one block share the number)."""
    return int(prefix_digest[-EVENT_HEX:], 16)


def block_keys(ns: Namespace | str, token_ids: Sequence[int], block_size: int, num_blocks: int | None = None,
               extra: Sequence[object] | None = None) -> list[str]:
    ns_digest = ns if isinstance(ns, str) else ns.digest
    return [key_for(ns_digest, d) for d in prefix_digests(token_ids, block_size, num_blocks, extra)]


def is_block_key(key: str) -> bool:
    return bool(_KEY_RE.match(key))


def full_blocks(num_tokens: int, block_size: int) -> int:
    """Number of complete blocks covered by num_tokens tokens."""
    return max(0, num_tokens) // block_size


def loadable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Most leading blocks a loader may take: the last prompt token is always computed locally."""
    if num_prompt_tokens <= 1:
        return 0
    return (num_prompt_tokens - 1) // block_size


def saveable_range(num_prompt_tokens: int, computed_before: int, computed_after: int,
                   block_size: int) -> range:
    """Block indices that become complete (and belong to the prompt) in a step that takes the
    request from `computed_before` to `computed_after` computed tokens.

    Used by producers under chunked prefill: each chunk saves exactly the prompt blocks it
    completed, and a block is never saved twice by the same request.
    """
    lo = full_blocks(min(computed_before, num_prompt_tokens), block_size)
    hi = full_blocks(min(computed_after, num_prompt_tokens), block_size)
    return range(lo, max(lo, hi))


def handover_tail(num_prompt_tokens: int, block_size: int) -> int:
    """Tokens a hand-over takes from the block after the `loadable_blocks`: every prompt token but the last,
    so the receiving engine computes exactly one. 0 when the loadable blocks already end one token short."""
    if num_prompt_tokens <= 1:
        return 0
    return (num_prompt_tokens - 1) % block_size


def tail_digest(token_ids: Sequence[int], block_size: int, prev_digest: str | None = None,
                extra: Sequence[object] | None = None) -> str:
    """Digest of the block holding the prompt's last token, where it is a partial block (len % block_size != 0).

    Chained from the last full block's digest (`prev_digest`, hex; the chain seed when the prompt has none) over
    the partial block's tokens, behind a domain tag and the token count: a full block's digest hashes exactly
    block_size token ids behind no tag, so the two never collide, and two prompts share a tail key only if they
    are equal token for token."""
    full = len(token_ids) // block_size
    count = len(token_ids) - full * block_size
    if count == 0:
        raise ValueError("the prompt ends on a block boundary: its last block is a full block with a prefix key")
    prev = bytes.fromhex(prev_digest) if prev_digest is not None else chain_seed(extra)
    h = hashlib.sha256(b"yrpd-kv-tail-v1")
    h.update(prev)
    h.update(struct.pack("<I", count))
    h.update(struct.pack(f"<{count}q", *token_ids[full * block_size:]))
    return h.hexdigest()[:PREFIX_HEX]


def handover_digest(token_ids: Sequence[int], block_size: int, full_digests: Sequence[str],
                     extra: Sequence[object] | None = None) -> str | None:
    """The key digest of the hand-over's last block (see `handover_tail`), or None when it carries none.

    `full_digests`: the prompt's full-block digests so far (at least up to the tail block when it is full)."""
    n = len(token_ids)
    if handover_tail(n, block_size) == 0:
        return None
    index = (n - 1) // block_size
    if (index + 1) * block_size <= n:  # the prompt ends on a block boundary: that block is a full one
        return full_digests[index]
    return tail_digest(token_ids, block_size, full_digests[index - 1] if index else None, extra)


def leading_hits(exists: Iterable[bool]) -> int:
    """Length of the leading run of True values (only a contiguous prefix can be used)."""
    n = 0
    for e in exists:
        if not e:
            break
        n += 1
    return n
