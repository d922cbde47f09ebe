"""Which dtype the instances compute (and keep KV) in: pure, from the spec and the hosts' inventory.

One dtype per deployment: every prefill instance hands KV to every decode instance, and KV of another dtype is
useless to the receiver. On CPU hosts `auto` picks what their CPUs compute fastest. Measured with vLLM's CPU build
(SmolLM2-135M, one core, 2.5k-token prompt, prefix caching off; docs/dev/notes.md, issue 12):
- AMD EPYC without AVX512-BF16 (Zen 3): uncached prefill 72 s in bfloat16 vs 15 s in float32 (4.8x), decode
  1.2x faster in bfloat16 (memory-bound): float32 serves long prompts far better.
- AMD EPYC with AVX512-BF16 (Zen 4): prefill 6.3 s in bfloat16 vs 8.6 s in float32, decode 41 vs 64 ms per
  token: bfloat16 wins both.
- Intel Xeon with AMX: vLLM routes bfloat16 attention to its AMX kernels. On one such machine SmolLM2's greedy answers
  changed (session 11); on another the decode instance's worker died of an illegal instruction in
  `cpu_attention_with_kv_cache` on its first request over loaded KV (session 13, faulthandler). float32 there.
NPU and GPU hosts keep the model's own dtype (vLLM's `auto`).
"""

from __future__ import annotations

from dataclasses import dataclass

from yrpd.spec import DeviceKind, Dtype

BF16_FLAGS = "AVX512-BF16 (without AMX)"


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str | None  # what `vllm serve --dtype` gets; None = vLLM's own choice (the model's dtype)
    reason: str

    @property
    def shown(self) -> str:
        return self.dtype or "the model's"


def choose(requested: Dtype, kind: DeviceKind, cpu_bf16: dict[str, bool | None],
           pinned: tuple[str, str] | None = None) -> DtypeChoice:
    """`cpu_bf16`: for each host that runs an instance, whether its CPU has bf16 instructions (None: unknown);
    `pinned`: (dtype, why) of a model that must be served in that dtype on CPUs (yrpd.models.CPU_DTYPE)."""
    if requested is not Dtype.auto:
        return DtypeChoice(requested.value, "set with --dtype")
    if kind is not DeviceKind.cpu:
        return DtypeChoice(None, "auto: the model's own dtype (vLLM's auto)")
    if pinned is not None:
        return DtypeChoice(pinned[0], f"auto: the model is served in {pinned[0]} on every CPU: {pinned[1]}")
    lacking = sorted(h for h, has in cpu_bf16.items() if has is False)
    unknown = sorted(h for h, has in cpu_bf16.items() if has is None)
    if lacking:
        return DtypeChoice("float32", f"auto: the CPU of {', '.join(lacking)} has no AVX512-BF16, so bfloat16 is "
                                      "emulated there (prefill measured 4.8x slower than float32), or it has AMX, "
                                      "where vLLM's CPU build runs bfloat16 attention in AMX kernels that failed on "
                                      "every AMX machine measured (wrong answers; an illegal instruction)")
    if unknown:
        return DtypeChoice("float32", f"auto: the CPU features of {', '.join(unknown)} were not detected; float32 is "
                                      "right on every CPU")
    return DtypeChoice("bfloat16", f"auto: every CPU has {BF16_FLAGS}, where bfloat16 measured faster than "
                                   "float32 in prefill and decode")
