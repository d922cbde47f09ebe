"""Where a measured figure came from: the code (commit, and whether the tree had changes), the versions, the machine,
the exact commands and the input's checksum. Every saved result (`yrpd bench run`'s results.json, the lab's and
benchmarks/' reports) carries it, so a figure in docs can be traced and two results are compared knowingly."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import yrpd
from yrpd.patches import file_sha256

#: what every result carries (tests/unit/test_provenance.py keeps results to it)
FIELDS = ("commit", "dirty", "yrpd", "vllm", "python", "cpu", "cpu_flags", "cores", "commands", "inputs", "recorded")
#: CPU features that change what a CPU build of vLLM computes with (bf16 natively, AMX tiles) or its speed
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")

_SOURCE = Path(yrpd.__file__).resolve().parents[1]


def git_state(where: Path = _SOURCE) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the git checkout yrpd runs from; (None, None) for an installed copy outside one."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return None, None
        return head.stdout.strip()[:12], bool(git("status", "--porcelain").stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        return None, None


def cpu() -> tuple[str, list[str]]:
    """(model name, the flags of CPU_FLAGS it has) from /proc/cpuinfo."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first CPU's
    except OSError:
        pass
    flags = set((fields.get("flags") or fields.get("Features") or "").split())  # x86 | aarch64
    return fields.get("model name") or platform.processor() or platform.machine(), [f for f in CPU_FLAGS if f in flags]


def vllm_version(venv: Path | None) -> str | None:
    """The version of vLLM installed in `venv` (read from its metadata, vLLM not imported); None where absent."""
    if venv is None or not (venv / "bin" / "python").exists():
        return None
    probe = "import importlib.metadata as m; print(m.version('vllm'))"
    try:
        out = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", probe], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def record(commands: list[str], inputs: dict[str, Path] | None = None, vllm_venv: Path | None = None,
           code: tuple[str | None, bool | None] | None = None) -> dict:
    """The provenance of a result produced by `commands` (each as typed) from `inputs` (name -> file, checksummed).
    `code`: the checkout's git_state() when the measuring began (a long run records at its end, and the tree may have
    moved meanwhile: then `dirty` is true, since the code measured is not the commit named alone)."""
    commit, dirty = git_state()
    if code is not None and code != (commit, dirty):
        commit, dirty = code[0], True
    model, flags = cpu()
    return {"commit": commit, "dirty": dirty, "yrpd": yrpd.__version__, "vllm": vllm_version(vllm_venv),
            "python": platform.python_version(), "cpu": model, "cpu_flags": flags, "cores": os.cpu_count(),
            "commands": list(commands),
            "inputs": {name: {"path": str(path), "sha256": file_sha256(path)} for name, path in (inputs or {}).items()},
            "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def missing(doc: dict) -> list[str]:
    """The provenance fields a saved result lacks (its `provenance` object), [] when complete."""
    prov = doc.get("provenance")
    if not isinstance(prov, dict):
        return list(FIELDS)
    return [f for f in FIELDS if f not in prov or (f in ("cpu", "commands") and not prov[f])]


def command_line() -> str:
    """How this process was started, as a user would type it again."""
    import shlex

    name = Path(sys.argv[0]).name
    return " ".join(shlex.quote(a) for a in ["yrpd" if name in ("yrpd", "__main__.py") else sys.argv[0],
                                             *sys.argv[1:]])
