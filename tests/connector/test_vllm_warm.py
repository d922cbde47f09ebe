"""yrpd.demo.vllm_warm against the real vLLM: what it caches is what an instance's start reads instead of inspecting
the model class in a subprocess of its own (the built-in model's builder runs it beside its conversion)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.connector.harness import REPO

pytestmark = pytest.mark.e2e

# an instance resolves its model exactly so (vllm serve builds this config first), here with vLLM's inspection in a
# subprocess of its own made to fail: it resolves only where the answer was cached
RESOLVE = """
import sys
import vllm.model_executor.models.registry as registry
def refuse(*args, **kwargs):
    raise SystemExit("inspected in a subprocess")
registry._run_in_subprocess = refuse
from vllm.config import ModelConfig
print(ModelConfig(model=sys.argv[1]).architecture)
"""


def run(python, args, env):
    return subprocess.run([str(python), *args], capture_output=True, text=True, timeout=600, env=env, cwd=str(REPO),
                          stdin=subprocess.DEVNULL)


def test_a_warmed_cache_is_what_the_instance_start_reads(vllm_venv, tiny_model, tmp_path):
    arch = json.loads((tiny_model / "config.json").read_text())["architectures"][0]
    cache = tmp_path / "vllm-cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update({"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(cache)})
    python = vllm_venv / "bin/python"

    # an architecture vLLM lacks: one line naming it, exit 1
    bad = run(python, ["-m", "yrpd.demo.vllm_warm", "NoSuchModelForCausalLM"], env)
    assert bad.returncode == 1 and "vLLM has no model class for NoSuchModelForCausalLM" in bad.stderr

    assert not list(cache.glob("modelinfos/*.json"))
    warmed = run(python, ["-m", "yrpd.demo.vllm_warm", arch], env)
    assert warmed.returncode == 0, warmed.stderr[-2000:]
    said = re.search(rf"vLLM's model info for {arch} cached: (\S+)$", warmed.stdout.strip())
    assert said and Path(said[1]).parent == cache / "modelinfos" and Path(said[1]).is_file()

    started = run(python, ["-c", RESOLVE, str(tiny_model)], env)
    assert started.returncode == 0 and started.stdout.strip().endswith(arch), started.stderr[-2000:]
    # the control: the same start against a cache nobody warmed inspects the class
    cold = run(python, ["-c", RESOLVE, str(tiny_model)], {**env, "VLLM_CACHE_ROOT": str(tmp_path / "cold")})
    assert cold.returncode != 0 and "inspected in a subprocess" in cold.stderr
