"""The prefix-shared long-sequence dataset: G groups x P prompts; every prompt of a group starts with the same
A-token prefix and ends with its own B-token suffix, lengths counted in the deployed model's tokenizer.

Deterministic for a seed: token ids are drawn from the tokenizer's ordinary vocabulary, decoded to text, and
cut so the text re-encodes to the wanted length; the prompts are shuffled with the same seed, so requests of a
group arrive interleaved with other groups as the guide's set does. Written as the JSONL (`{"prompt": ...}` per
line) that `vllm bench serve --dataset-name custom` reads, with a `.meta.json` beside it.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class DatasetSpec:
    groups: int
    prompts_per_group: int
    prefix_len: int
    suffix_len: int
    seed: int = 0


def load_tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass --tokenizer DIR with the deployed model's tokenizer.json")
    return Tokenizer.from_file(str(path))


def ordinary_ids(tokenizer) -> list[int]:
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    return sorted(i for tok, i in tokenizer.get_vocab().items() if tok not in special)


def text_of_length(tokenizer, ids: list[int], rng: random.Random, n: int) -> str:
    """Text that encodes to exactly n tokens (re-encoding merges some pieces: draw more, cut, re-check)."""
    if n == 0:
        return ""
    draw = n
    while True:
        text = tokenizer.decode([rng.choice(ids) for _ in range(draw + 8)])
        encoded = tokenizer.encode(text, add_special_tokens=False).ids
        if len(encoded) >= n:
            for cut in (n, n - 1, n + 1):  # a cut inside a merged piece can shift the count by one
                candidate = tokenizer.decode(encoded[:cut])
                if len(tokenizer.encode(candidate, add_special_tokens=False).ids) == n:
                    return candidate
        draw += max(8, n // 8)


def generate(spec: DatasetSpec, tokenizer) -> tuple[list[str], dict]:
    rng = random.Random(spec.seed)
    ids = ordinary_ids(tokenizer)
    prompts = []
    for _ in range(spec.groups):
        prefix = text_of_length(tokenizer, ids, rng, spec.prefix_len)
        for _ in range(spec.prompts_per_group):
            # a space keeps the suffix's first piece from merging with the prefix's last one
            prompts.append(prefix + " " + text_of_length(tokenizer, ids, rng, spec.suffix_len))
    rng.shuffle(prompts)
    lengths = [len(tokenizer.encode(p, add_special_tokens=False).ids) for p in prompts]
    meta = {**asdict(spec), "prompts": len(prompts), "prompt_tokens_min": min(lengths),
            "prompt_tokens_max": max(lengths), "prompt_tokens_mean": round(sum(lengths) / len(lengths), 1)}
    return prompts, meta


# `yrpd bench run --preset NAME`: the guide's benchmark (30 groups x 100 prompts, 2 k prefix + 6 k suffix tokens,
# concurrency 8, 2 output tokens), for NPU hosts; and the same shape scaled to a 2-core CPU.
PRESETS = {
    "guide": {"groups": 30, "prompts_per_group": 100, "prefix_len": 2048, "suffix_len": 6144, "output_len": 2,
              "max_concurrency": 8},
    "cpu": {"groups": 4, "prompts_per_group": 4, "prefix_len": 1536, "suffix_len": 256, "output_len": 2,
            "max_concurrency": 2},
}


def apply_preset(params: dict, name: str | None, explicit: set[str]) -> dict:
    """`params` with the preset's values, except where the user gave an option on the command line."""
    if not name:
        return params
    return {**params, **{k: v for k, v in PRESETS[name].items() if k not in explicit}}


@dataclass(frozen=True)
class MixedSpec:
    """Long prompts arriving while other requests stream long answers: what PD promises to keep steady is the
    streams' time per output token, which on one instance stalls behind every long prefill."""
    streams: int  # short prompts that each stream a long answer
    stream_prompt_len: int
    stream_output_len: int
    long_prompts: int  # unique long prompts (nothing to reuse), 2 output tokens each
    long_len: int
    seed: int = 0


def generate_mixed(spec: MixedSpec, tokenizer) -> tuple[list[dict], dict]:
    rng = random.Random(spec.seed)
    ids = ordinary_ids(tokenizer)
    streams = [{"prompt": text_of_length(tokenizer, ids, rng, spec.stream_prompt_len),
                "output_tokens": spec.stream_output_len} for _ in range(spec.streams)]
    longs = [{"prompt": text_of_length(tokenizer, ids, rng, spec.long_len), "output_tokens": 2}
             for _ in range(spec.long_prompts)]
    # streams first, then long prompts spread among the rest: each long prefill meets streams already decoding
    head = streams[: max(1, len(streams) // 2)]
    rest = streams[len(head):] + longs
    rng.shuffle(rest)
    items = head + rest
    meta = {"workload": "mixed", **asdict(spec), "prompts": len(items)}
    return items, meta


@dataclass(frozen=True)
class MultiTurnSpec:
    """Chat conversations that grow turn by turn, in the shape of vLLM's benchmarks/multi_turn: every conversation
    opens with one system prompt all share, then its own opening; each turn sends the whole history so far (every
    earlier question with its answer) plus a new question. Turns are interleaved across conversations (turn 1 of
    each, then turn 2 of each, ...), so with fewer clients than conversations a turn's history was answered
    before it is asked, as between a user's messages. The answers are fixed text of `answer_len` tokens, not the
    model's (the history must not depend on the target under test)."""
    conversations: int
    turns: int
    common_prefix_len: int  # the system prompt, the same in every conversation
    opening_len: int  # each conversation's own opening (a document, a task)
    question_len: int
    answer_len: int
    output_len: int  # tokens asked for at each turn
    seed: int = 0


def generate_multi_turn(spec: MultiTurnSpec, tokenizer) -> tuple[list[dict], dict]:
    rng = random.Random(spec.seed)
    ids = ordinary_ids(tokenizer)
    system = text_of_length(tokenizer, ids, rng, spec.common_prefix_len)
    histories = [system + "\n\n" + text_of_length(tokenizer, ids, rng, spec.opening_len)
                 for _ in range(spec.conversations)]
    items = []
    for turn in range(spec.turns):
        for c in range(spec.conversations):
            question = text_of_length(tokenizer, ids, rng, spec.question_len)
            prompt = f"{histories[c]}\n\nUser: {question}\nAssistant:"
            items.append({"prompt": prompt, "output_tokens": spec.output_len})
            histories[c] = f"{prompt} {text_of_length(tokenizer, ids, rng, spec.answer_len)}"
    lengths = [len(tokenizer.encode(i["prompt"], add_special_tokens=False).ids) for i in items]
    meta = {"workload": "multi-turn", **asdict(spec), "prompts": len(items), "prompt_tokens_min": min(lengths),
            "prompt_tokens_max": max(lengths), "prompt_tokens_mean": round(sum(lengths) / len(lengths), 1)}
    return items, meta


def write(prompts: list, meta: dict, out: Path) -> None:
    """JSONL for `vllm bench serve --dataset-name custom`: each item a prompt, or a dict with its output_tokens."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(p if isinstance(p, dict) else {"prompt": p}) + "\n" for p in prompts))
    out.with_name(out.name + ".meta.json").write_text(json.dumps(meta, indent=2) + "\n")


@dataclass(frozen=True)
class DatasetOptions:
    """What `yrpd bench dataset` and `yrpd bench run` generate: a prefix-shared workload (groups of prompts that share
    a prefix), a mixed one (long unique prompts arriving while short prompts stream long answers), or multi-turn
    chat (conversations that grow turn by turn; `prefix_len` is their shared system prompt, `suffix_len` each
    one's own opening)."""
    workload: str = "prefix"  # prefix | mixed | multi-turn
    groups: int = 4
    prompts_per_group: int = 4
    prefix_len: int = 1536
    suffix_len: int = 256
    streams: int = 8
    stream_prompt_len: int = 64
    stream_output_len: int = 128
    long_prompts: int = 8
    conversations: int = 6
    turns: int = 4
    question_len: int = 48
    answer_len: int = 32
    seed: int = 0

    @classmethod
    def from_params(cls, params: dict) -> "DatasetOptions":
        return cls(**{f: params[f] for f in cls.__dataclass_fields__ if f in params})


def make(options: DatasetOptions, tokenizer_dir: Path, out: Path, output_len: int = 32) -> dict:
    """Generate the workload the options describe with the model's tokenizer, write it to `out`; its metadata."""
    if options.workload == "mixed":
        mixed = MixedSpec(options.streams, options.stream_prompt_len, options.stream_output_len,
                          options.long_prompts, options.prefix_len + options.suffix_len, options.seed)
        prompts, meta = generate_mixed(mixed, load_tokenizer(tokenizer_dir))
    elif options.workload == "multi-turn":
        chat = MultiTurnSpec(options.conversations, options.turns, options.prefix_len, options.suffix_len,
                             options.question_len, options.answer_len, output_len, options.seed)
        prompts, meta = generate_multi_turn(chat, load_tokenizer(tokenizer_dir))
    else:
        spec = DatasetSpec(options.groups, options.prompts_per_group, options.prefix_len, options.suffix_len,
                           options.seed)
        prompts, meta = generate(spec, load_tokenizer(tokenizer_dir))
    write(prompts, meta, out)
    return meta
