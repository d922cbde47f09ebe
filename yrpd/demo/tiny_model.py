"""Build a tiny Qwen2 causal LM plus tokenizer offline, deterministically.

    python -m yrpd.demo.tiny_model OUT_DIR [--force]

Runs in the vLLM venv (needs torch, transformers, tokenizers). The result serves with
`vllm serve OUT_DIR`. Nothing is downloaded: the tokenizer is a byte-level BPE trained on
Python standard-library sources of the running interpreter, the weights are random but
seeded. A recipe hash (recipe parameters + a digest of the training text) is written to
OUT_DIR/yrpd_recipe.json; a second run with the same recipe leaves the directory alone.

The weights are drawn wider than a trained model's (hidden layers and especially the output
layer) so that attention is peaked and greedy output depends strongly on the prompt's KV:
the connector's tests rely on corrupted KV changing the output.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

RECIPE_VERSION = 1
RECIPE = {
    "version": RECIPE_VERSION,
    "seed": 1234,
    "arch": "Qwen2ForCausalLM",
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "dtype": "bfloat16",
    "tie_word_embeddings": False,
    "init_std": 0.08,
    "lm_head_std": 0.6,
    "embed_std": 1.0,
    # tokenizer corpus: top-level stdlib modules, sorted by name, until this many bytes
    "corpus_bytes": 3_000_000,
}
#: builtin model name -> recipe. bench-qwen2 is the CPU benchmark profile: about 44 M parameters, so that
#: prefill compute (about 2 s for 1.8 k tokens on one core) dominates moving its KV (768 KiB per block).
RECIPES = {
    "tiny-qwen2": RECIPE,
    "bench-qwen2": {**RECIPE, "num_hidden_layers": 6, "hidden_size": 768, "intermediate_size": 2048,
                    "num_attention_heads": 12, "num_key_value_heads": 4, "init_std": 0.02, "lm_head_std": 0.05},
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
RECIPE_FILE = "yrpd_recipe.json"


def corpus_files(limit_bytes: int) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        size = path.stat().st_size
        out.append(path)
        total += size
        if total >= limit_bytes:
            break
    return out


def corpus_digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode())
        h.update(b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def recipe_hash(digest: str, recipe: dict = RECIPE) -> str:
    payload = json.dumps({"recipe": recipe, "corpus": digest, "special": SPECIAL_TOKENS,
                          "chat_template": CHAT_TEMPLATE}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def is_built(out_dir: Path, want_hash: str) -> bool:
    try:
        data = json.loads((out_dir / RECIPE_FILE).read_text())
    except (OSError, ValueError):
        return False
    if data.get("recipe_hash") != want_hash:
        return False
    return all((out_dir / name).exists() for name in ("config.json", "tokenizer.json", "model.safetensors"))


def train_tokenizer(files: list[Path], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def lines():
        for path in files:
            yield path.read_text(encoding="utf-8", errors="replace")

    tok.train_from_iterator(lines(), trainer=trainer, length=len(files))
    return tok


def build(out_dir: Path, force: bool = False, recipe: dict = RECIPE) -> Path:
    files = corpus_files(recipe["corpus_bytes"])
    digest = corpus_digest(files)
    want = recipe_hash(digest, recipe)
    if not force and is_built(out_dir, want):
        print(f"tiny model already built at {out_dir} (recipe {want[:12]})")
        return out_dir

    # Single-threaded, seeded: the same recipe gives the same bytes.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=out_dir.parent))
    try:
        tok = train_tokenizer(files, recipe["vocab_size"])
        eos = SPECIAL_TOKENS[0]
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token=eos, pad_token=eos, unk_token=None,
            model_max_length=recipe["max_position_embeddings"],
        )
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(tmp)
        eos_id = tok.token_to_id(eos)

        config = Qwen2Config(
            vocab_size=recipe["vocab_size"],
            hidden_size=recipe["hidden_size"],
            intermediate_size=recipe["intermediate_size"],
            num_hidden_layers=recipe["num_hidden_layers"],
            num_attention_heads=recipe["num_attention_heads"],
            num_key_value_heads=recipe["num_key_value_heads"],
            max_position_embeddings=recipe["max_position_embeddings"],
            rope_theta=recipe["rope_theta"],
            tie_word_embeddings=recipe["tie_word_embeddings"],
            initializer_range=recipe["init_std"],
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
            use_sliding_window=False,
        )
        config.architectures = [recipe["arch"]]
        torch.manual_seed(recipe["seed"])
        model = Qwen2ForCausalLM(config)
        gen = torch.Generator().manual_seed(recipe["seed"])
        with torch.no_grad():
            for name, param in sorted(model.named_parameters()):
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                    continue
                if name.endswith(".bias"):
                    param.normal_(0.0, recipe["init_std"], generator=gen)
                    continue
                if name == "lm_head.weight":
                    std = recipe["lm_head_std"]
                elif name == "model.embed_tokens.weight":
                    std = recipe["embed_std"]
                else:
                    std = recipe["init_std"]
                param.normal_(0.0, std, generator=gen)
        model = model.to(torch.bfloat16)
        model.config.dtype = torch.bfloat16
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / RECIPE_FILE).write_text(json.dumps(
            {"recipe_hash": want, "recipe": recipe, "corpus_digest": digest, "corpus_files": len(files)},
            indent=2, sort_keys=True) + "\n")
        tmp.chmod(0o755)
        if is_built(out_dir, want):
            # another builder (a second host on a shared env root) finished first with the same recipe
            print(f"tiny model already built at {out_dir} (recipe {want[:12]})")
            return out_dir
        if out_dir.exists():
            shutil.rmtree(out_dir)
        try:
            tmp.rename(out_dir)
        except OSError:
            if not is_built(out_dir, want):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"tiny model built at {out_dir} (recipe {want[:12]})")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m yrpd.demo.tiny_model", description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--force", action="store_true", help="rebuild even if the recipe hash matches")
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="tiny-qwen2")
    args = ap.parse_args(argv)
    build(args.out_dir.resolve(), force=args.force, recipe=RECIPES[args.recipe])
    return 0


if __name__ == "__main__":
    sys.exit(main())
