"""An instance of two data-parallel engines on one host (`--data-parallel-size 2`, as vllm-ascend's decode instances
often run): each engine's connector writes its own stats file under the name yrpd's layout gives it, so that the
host probe of `yrpd status` sums the work of both and the deploy's readiness wait sees each engine's link to the
data system. Before the engine's DP rank was in the name, both engines' connectors (TP rank 0 each) rewrote one file
in turn, and status showed whichever had written last. Real vLLM (the tiny model), a real data-system worker.
(Pipeline stages, the same case, are told apart in tests/connector/test_worker.py: vLLM 0.32's CPU backend cannot
run a pipeline.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.connector.harness import BLOCK_SIZE, Stack, make_prompts
from yrpd.assets import asset_dir
from yrpd.layout import HostSessionLayout

pytestmark = pytest.mark.e2e

ENGINES = 2
PROMPTS = 6
BLOCKS = 2  # full blocks of each prompt: what a kv_both instance saves of it


def probe(layout: HostSessionLayout, name: str) -> dict:
    """The connector part of deploy_scripts/serving_status.py's answer for `name`, as `yrpd status` runs it."""
    args = {"dir": layout.dir, "proxy": None, "kv_stats": layout.for_scripts()["kv_stats"],
            "instances": [{"name": name, "url": "http://127.0.0.1:9"}]}
    out = subprocess.run([sys.executable, str(asset_dir("deploy_scripts") / "serving_status.py"), json.dumps(args)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return json.loads(out)["instances"][0]["connector"]


def test_each_dp_engine_keeps_its_own_stats_and_status_sums_them(vllm_venv, tiny_model, session_stack, e2e_root):
    stack = Stack(e2e_root / "dp", venv=vllm_venv, ports=session_stack.ports)
    try:
        ds = stack.start_ds()
        layout = HostSessionLayout(str(e2e_root / "dp"), "session")
        Path(layout.run_dir).mkdir(parents=True)
        server = stack.start_vllm("dp2", tiny_model, core=0, kv_role="kv_both", dp=ENGINES, extra_config={
            "ds_address": ds.address, "stats_file": layout.kv_stats("dp2")})
        stack.wait_healthy([server])
        prompts = make_prompts([BLOCKS * BLOCK_SIZE + 17] * PROMPTS, seed=46)
        with ThreadPoolExecutor(PROMPTS) as pool:  # at once: vLLM's balancer spreads them over both engines
            list(pool.map(lambda p: server.complete(p, 4), prompts))
        expected = PROMPTS * BLOCKS
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the stats are rewritten every 0.5 s; a save lands after its answer
            seen = probe(layout, "dp2")
            if seen["counters"].get("saved_blocks") == expected:
                break
            time.sleep(0.5)
        docs = {}
        for path in Path(layout.run_dir).glob("kv-dp2-*.json"):
            doc = json.loads(path.read_text())
            docs[doc["side"], doc["dp"], doc["rank"]] = doc
        assert set(docs) == {(side, dp, 0) for side in ("scheduler", "worker") for dp in range(ENGINES)}, sorted(docs)
        assert all(d["ds_healthy"] for d in docs.values())
        saved = [docs["worker", dp, 0]["counters"]["saved_blocks"] for dp in range(ENGINES)]
        assert all(saved), f"one engine took every prompt, so there is nothing to sum: {saved} blocks saved"
        assert (seen["counters"].get("saved_blocks"), seen["files"]) == (expected, 2 * ENGINES), (seen, saved)
    finally:
        stack.close()
