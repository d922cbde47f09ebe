"""Fixtures for the connector's end-to-end tests.

The e2e tests need the vLLM CPU venv (deploy_scripts/install_vllm_cpu.sh); its path comes from
YRPD_VLLM_VENV (default /opt/yrpd/venvs/vllm). Without it they are skipped with the reason.
The session keeps one reference vLLM instance (no connector, same engine flags) alive for all
e2e modules and caches its greedy outputs per prompt.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from tests.connector.harness import Stack, build_tiny_model, venv_path, venv_ready
from tests.prereq import missing

MAX_TOKENS = 12


@pytest.fixture(scope="session")
def vllm_venv():
    venv = venv_path()
    reason = venv_ready(venv)
    if reason:
        missing(f"vLLM CPU venv not usable: {reason}")
    return venv


# vLLM 0.10.0, as the vllm-ascend v0.10.0rc1 image runs it: its sdist's classes are what the connector's
# compatibility checks are built from (the sdist cannot be installed here: its build needs a CUDA torch)
VLLM_010 = ("vllm", "0.10.0", "a44e9013db26082a82c3931ed8772ac884d6d60566d36ecdb0e8dc01c65b241a")


@pytest.fixture(scope="session")
def vllm_010_src() -> Path:
    import subprocess
    import sys

    dest = os.environ.get("YRPD_VLLM_SRC", "/var/cache/yrpd/vllm-src")
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "scripts" / "fetch_sdist.py"),
                           *VLLM_010, dest], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"cannot fetch vLLM 0.10.0's sdist: {proc.stderr.strip()[-2000:]}"
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def tiny_model(vllm_venv, tmp_path_factory):
    return build_tiny_model(vllm_venv, tmp_path_factory.mktemp("tiny-model") / "tiny")


class Reference:
    """Single instance, same flags, no connector: the expected greedy output per prompt."""

    def __init__(self, server) -> None:
        self.server = server
        self._cache: dict[tuple, list[int]] = {}
        self._lock = threading.Lock()

    def tokens(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        key = (tuple(prompt), max_tokens)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        out = self.server.generate(prompt, max_tokens)
        with self._lock:
            self._cache[key] = out
        return out


@pytest.fixture(scope="session")
def e2e_root(tmp_path_factory):
    """Where process logs go: YRPD_E2E_WORKDIR (kept after the run, for debugging) or pytest's tmp."""
    keep = os.environ.get("YRPD_E2E_WORKDIR")
    if keep:
        root = Path(keep) / time.strftime("run-%Y%m%d-%H%M%S")
        root.mkdir(parents=True, exist_ok=True)
        return root
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def session_stack(vllm_venv, e2e_root):
    stack = Stack(e2e_root / "session", venv=vllm_venv)
    yield stack
    stack.close()


@pytest.fixture(scope="session")
def reference_server(session_stack, tiny_model):
    """Started lazily by the first module that needs it; modules start theirs in parallel."""
    return session_stack.start_vllm("reference", tiny_model, core=0)


@pytest.fixture(scope="session")
def reference(session_stack, reference_server):
    session_stack.wait_healthy([reference_server])
    return Reference(reference_server)


@pytest.fixture
def ds(monkeypatch):
    """The in-memory data system (tests/connector/fakes.py) the connector's halves connect to in the unit tests of
    the scheduler and the worker: both open their connections through `transport.kv_connection`, which makes its
    clients with `transport.kvclient_factory`."""
    from tests.connector.fakes import FakeKVClient
    from yrpd.connector import transport

    client = FakeKVClient()
    monkeypatch.setattr(transport, "kvclient_factory", lambda *a, **k: (lambda: client))
    return client

