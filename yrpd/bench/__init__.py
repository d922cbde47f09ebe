"""`yrpd bench`: the guide's prefix-shared long-sequence benchmark, driven through `vllm bench serve`."""
