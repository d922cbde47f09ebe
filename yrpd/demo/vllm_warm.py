"""Fill vLLM's model-info cache for one architecture before any instance starts.

    VLLM_CACHE_ROOT=DIR python -m yrpd.demo.vllm_warm ARCHITECTURE

The first time vLLM serves an architecture it learns what the model class supports by importing it in a fresh Python
of its own, then keeps the answer in DIR/modelinfos, keyed by the hash of the model's source file; later starts read
the file. On a new host every instance pays that import at its first start, all of them at once: in the demo's first
deploy (two instances on 2 cores) it was 26 s between vLLM's start and "Resolved architecture". A built-in model's
builder knows the architecture before the model exists, so it runs this beside its conversion, and the instances find
the answer cached. Runs in the host's vLLM Python; prints one line, exits 1 where vLLM could not inspect the class.
"""

from __future__ import annotations

import sys


def warm(architecture: str) -> str:
    """One line naming the file cached; raises RuntimeError where vLLM cannot inspect the class or wrote nothing
    (vLLM logs a failed write and goes on)."""
    # the pinned vLLM keeps this lookup (cached file first, else the subprocess, then the file written) and the
    # file's place behind private names; an instance makes exactly this call while resolving its model config
    from vllm.model_executor.models.registry import ModelRegistry

    if architecture not in ModelRegistry.get_supported_archs():
        raise RuntimeError(f"vLLM has no model class for {architecture}")
    if ModelRegistry._try_inspect_model_cls(architecture) is None:
        raise RuntimeError(f"vLLM could not inspect {architecture} (its log above says why)")
    model = ModelRegistry.models[architecture]
    cached = model._get_cache_dir() / model._get_cache_filename()
    if not cached.is_file():
        raise RuntimeError(f"vLLM inspected {architecture} but wrote no {cached} (its log above says why)")
    return f"vLLM's model info for {architecture} cached: {cached}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m yrpd.demo.vllm_warm ARCHITECTURE", file=sys.stderr)
        return 2
    try:
        print(warm(args[0]))
    except (RuntimeError, ImportError, AttributeError) as exc:
        print(f"vllm_warm: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
