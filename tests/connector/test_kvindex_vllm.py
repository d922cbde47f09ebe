"""The proxy's KV index (yrpd/proxy/kvindex.py) against vLLM 0.32 itself, in its venv: the block hashes it computes
for real prompts (SmolLM2's tokenizer, the embedded default's model) are the ones vLLM's prefix cache computes and
its events publish, with and without PYTHONHASHSEED; and the batches vLLM's publisher encodes read back into what an
instance holds."""

from __future__ import annotations

import pytest

from tests.lab.real_model import MODEL_DIR
from tests.prereq import missing
from yrpd.proxy import kvindex

pytestmark = pytest.mark.torch

BLOCK = 16
PROMPTS = [
    "The capital of France is Paris. " * 12,
    "The capital of France is Paris. " * 12 + "And the capital of Italy is",
    "import os\nimport sys\n\ndef main():\n    print(sys.argv)\n" * 6,
]


@pytest.fixture(scope="module")
def tokenize():
    tokenizer_json = MODEL_DIR / "tokenizer.json"
    if not tokenizer_json.is_file():
        missing(f"{tokenizer_json} missing: run scripts/test.sh (it makes the built-in model)")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    return lambda text: tok.encode(text).ids


def vllm_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """What vLLM's prefix cache names each full block, as its events carry it, with the seed its environment gives."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as u

    u.init_none_hash(sha256)
    parent, out = None, []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = u.hash_block_tokens(sha256, parent, token_ids[start:start + block_size], None)
        out.append(u.maybe_convert_block_hash(parent))
    return out


@pytest.mark.parametrize("seed", [None, "0"])
def test_block_hashes_are_vllms_for_real_prompts(tokenize, monkeypatch, seed):
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    ids = [tokenize(p) for p in PROMPTS]
    for tokens in ids:
        want = vllm_hashes(tokens, BLOCK)
        assert len(want) == len(tokens) // BLOCK > 3
        assert kvindex.block_hashes(tokens, BLOCK, seed) == want
    # equal leading blocks, equal hashes; the first block that differs and every one after it, different
    first, second = (kvindex.block_hashes(t, BLOCK, seed) for t in ids[:2])
    same = next(i for i in range(len(ids[0])) if ids[0][i] != ids[1][i]) // BLOCK
    assert first[:same] == second[:same] and same > 0
    assert not set(first[same:]) & set(second[same:])
    # the control: the other seed names every block differently
    assert not set(kvindex.block_hashes(ids[0], BLOCK, "1" if seed is None else None)) & set(first)


def test_vllms_published_batches_tell_what_an_instance_holds(tokenize):
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    tokens = tokenize(PROMPTS[1])
    hashes = kvindex.block_hashes(tokens, BLOCK)
    encode = msgspec.msgpack.Encoder().encode
    stored = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens[:len(hashes) * BLOCK],
                         block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None)
    removed = BlockRemoved(block_hashes=hashes[-2:], medium="GPU")
    inst = kvindex.InstanceBlocks()
    inst.apply(0, kvindex.events_of(kvindex.decode_batch(encode(KVEventBatch(ts=1.0, events=[stored])))))
    assert inst.sight is kvindex.Sight.seeing and inst.matched(hashes) == len(hashes)
    inst.apply(1, kvindex.events_of(kvindex.decode_batch(encode(KVEventBatch(ts=2.0, events=[removed],
                                                                             data_parallel_rank=0)))))
    assert inst.matched(hashes) == len(hashes) - 2  # its tail evicted: the prefix ends there
    # the shorter prompt's blocks are the longer one's first five: the same blocks, so the same prefix left
    shorter = kvindex.block_hashes(tokenize(PROMPTS[0]), BLOCK)
    assert shorter == hashes[:len(shorter)] and inst.matched(shorter) == len(hashes) - 2
    inst.apply(2, kvindex.events_of(kvindex.decode_batch(encode(KVEventBatch(ts=3.0, events=[AllBlocksCleared()])))))
    assert inst.held == set() and inst.sight is kvindex.Sight.seeing
