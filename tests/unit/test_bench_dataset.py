"""yrpd/bench/dataset.py: the multi-turn chat workload, with a real (word-level) tokenizer from `tokenizers`."""

from __future__ import annotations

import json

import pytest

from yrpd.bench.dataset import DatasetOptions, make

WORDS = [f"w{i}" for i in range(400)]


@pytest.fixture
def tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {w: i for i, w in enumerate(["[UNK]", *WORDS, "User", "Assistant", ":"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_multi_turn_conversations_grow_turn_by_turn_share_the_system_prompt_and_interleave(tokenizer_dir, tmp_path):
    opts = DatasetOptions(workload="multi-turn", conversations=3, turns=4, prefix_len=40, suffix_len=20,
                          question_len=8, answer_len=6, seed=5)
    out = tmp_path / "chat.jsonl"
    meta = make(opts, tokenizer_dir, out, output_len=6)
    items = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(items) == meta["prompts"] == 12 and {i["output_tokens"] for i in items} == {6}
    system = items[0]["prompt"].split("\n\n")[0]
    assert len(system.split()) == 40 and all(i["prompt"].startswith(system + "\n\n") for i in items)
    # turn t of conversation c is item t * 3 + c; it holds turn t-1 whole, then that turn's answer, then a question
    for c in range(3):
        turns = [items[t * 3 + c]["prompt"] for t in range(4)]
        for earlier, later in zip(turns, turns[1:]):
            assert later.startswith(earlier + " ") and len(later.split()) > len(earlier.split()) + 6
    openings = {items[c]["prompt"].split("\n\n")[1] for c in range(3)}
    assert len(openings) == 3  # each conversation its own opening
    assert meta["prompt_tokens_max"] > meta["prompt_tokens_min"]
    again = tmp_path / "again.jsonl"
    make(opts, tokenizer_dir, again, output_len=6)
    assert again.read_text() == out.read_text()  # the same seed, the same workload
