"""Serving checks on the real model (builtin:smollm2): known answers, and PD output equal to one plain instance.

A deployment is correct when, greedy, it answers what one plain vLLM instance of the same model with the same
engine flags and dtype answers, for prompts short and long (many KV blocks handed over), prompts that share a
prefix (so KV is reused, from the data system and from the instances' own caches), chat and streamed chat; and
when it knows what SmolLM2 knows (the capital of France, 2 + 3).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV_ROOT = Path(os.environ.get("YRPD_TEST_ENV_ROOT", "/opt/yrpd/venvs"))
VLLM = ENV_ROOT / "vllm"
MODEL = "smollm2"
MODEL_DIR = ENV_ROOT / "models" / MODEL

_WORDS = Path(os.__file__).read_text().split()
#: ~1500 tokens: 11 full KV blocks of 128
LONG = " ".join(_WORDS[:600])
#: two prompts sharing their first ~700 tokens (5 blocks), each with a suffix of its own that fills more blocks
SHARED = " ".join(_WORDS[600:900])
PREFIXED = [f"{SHARED} {' '.join(_WORDS[900 + 150 * i:1050 + 150 * i])}" for i in range(2)]
COMPLETIONS = ["The capital of France is", LONG, *PREFIXED]
#: 8 groups of 5 prompts; the members of a group share a 200-word prefix (about three 128-token KV blocks): the
#: many-instances lab's load, answered 8 tokens each
GROUPS = [" ".join(_WORDS[2000 + 260 * g:2200 + 260 * g]) for g in range(8)]
GROUPED = [f"{prefix} {' '.join(_WORDS[2200 + 260 * g + 10 * n:2210 + 260 * g + 10 * n])}"
           for g, prefix in enumerate(GROUPS) for n in range(5)]
GROUPED_TOKENS = 8
CHATS = ["What is the capital of France?", "What is 2 + 3?"]
#: question -> what the answer must contain
KNOWN = {"What is the capital of France?": "Paris", "What is 2 + 3?": "5"}


def headers(key: str | None = None) -> dict:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


def http(method: str, url: str, body: dict | None = None, timeout: float = 300,
         key: str | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers(key))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def completion(base: str, prompt: str, max_tokens: int = 16, key: str | None = None) -> str:
    status, body = http("POST", f"{base}/v1/completions",
                        {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}, key=key)
    assert status == 200, body[:500]
    return json.loads(body)["choices"][0]["text"]


def chat(base: str, question: str, max_tokens: int = 24, key: str | None = None) -> str:
    status, body = http("POST", f"{base}/v1/chat/completions",
                        {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                         "temperature": 0}, key=key)
    assert status == 200, body[:500]
    return json.loads(body)["choices"][0]["message"]["content"]


def streamed_chat(base: str, question: str, max_tokens: int = 24, key: str | None = None) -> str:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=body, headers=headers(key))
    text, done = [], False
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["delta"].get("content") or "")
    assert done, "stream ended without [DONE]"
    return "".join(text)


def answers(base: str, key: str | None = None) -> dict[str, str]:
    """Every checked prompt's greedy answer from one endpoint, in a fixed order."""
    out = {f"completion {i}": completion(base, p, key=key) for i, p in enumerate(COMPLETIONS)}
    out.update({f"chat {q}": chat(base, q, key=key) for q in CHATS})
    out["streamed chat"] = streamed_chat(base, CHATS[0], key=key)
    return out


def assert_known_answers(got: dict[str, str]) -> None:
    for question, wanted in KNOWN.items():
        assert wanted in got[f"chat {question}"], (question, got[f"chat {question}"])
    assert "Paris" in got["completion 0"] and "Paris" in got["streamed chat"], got


def ensure_model() -> None:
    """The model as the deploy step makes it (scripts/test.sh prepares it; a developer's run may not have)."""
    if (MODEL_DIR / "yrpd_recipe.json").is_file():
        return
    argv = subprocess.run([sys.executable, "-m", "yrpd.steps.model", MODEL, str(ENV_ROOT)], capture_output=True,
                          text=True, check=True, cwd=REPO).stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    subprocess.run([str(VLLM / "bin/python"), *shlex.split(argv)], check=True, env=env, capture_output=True,
                   timeout=900, stdin=subprocess.DEVNULL)


class Reference:
    """One plain vLLM instance (no connector, no proxy) with the deployment's engine flags and dtype."""

    def __init__(self, dtype: str | None, port: int | None = None, core: int = 1):
        from yrpd.serving import BASE_ENV, KIND_ENGINE_ARGS
        from yrpd.spec import DeviceKind

        if port is None:  # a free one: tests in the other lane start servers on loopback too
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]

        # short: vLLM puts IPC sockets under TMPDIR and a socket path must stay under 108 bytes
        workdir = self.workdir = Path(tempfile.mkdtemp(prefix="yrpd-ref-", dir="/tmp"))
        (workdir / "tmp").mkdir()
        self.url = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        env.update(BASE_ENV, VLLM_CACHE_ROOT=str(workdir / "cache"), TMPDIR=str(workdir / "tmp"),
                   VLLM_CPU_OMP_THREADS_BIND=str(core), VLLM_HOST_IP="127.0.0.1")
        argv = [str(VLLM / "bin/vllm"), "serve", str(MODEL_DIR), "--served-model-name", MODEL, "--host", "127.0.0.1",
                "--port", str(port), *KIND_ENGINE_ARGS[DeviceKind.cpu], *(["--dtype", dtype] if dtype else [])]
        self.log = workdir / "reference.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)

    def wait(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"reference vLLM exited:\n{self.log.read_text()[-3000:]}"
            try:
                if http("GET", f"{self.url}/health", timeout=3)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(2)
        raise AssertionError(f"reference vLLM not healthy after {timeout}s:\n{self.log.read_text()[-3000:]}")

    def close(self) -> None:
        """Kill its process group, and remove the shared-memory segments it mapped, as yrpd's supervisor does for
        what it owns: killed with -9, vLLM cannot unlink its own (167 and 251 MB apparent each on CPU)."""
        sys.path.insert(0, str(REPO / "deploy_scripts"))
        from hostlib import proc_table, shm_mapped, unlink_unheld

        segments = shm_mapped([pid for pid, _, _, pgid, _ in proc_table() if pgid == self.proc.pid])
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        deadline = time.monotonic() + 10  # the group's other members die a moment after its leader
        while any(pgid == self.proc.pid for _, _, _, pgid, _ in proc_table()) and time.monotonic() < deadline:
            time.sleep(0.1)
        unlink_unheld(sorted(segments))
        shutil.rmtree(self.workdir, ignore_errors=True)


class ReferenceAnswers:
    """What one plain instance answers to every prompt the lab tests compare with (`answers`, and GROUPED with
    GROUPED_TOKENS each), asked once per dtype in a session and kept: the reference starts, answers everything and
    stops, so no reference vLLM competes with a deployment for the lab's two cores (tests/lab/fixtures.py
    `reference_answers`)."""

    def __init__(self) -> None:
        self._by_dtype: dict[str | None, dict[str, str]] = {}

    def __call__(self, dtype: str | None) -> dict[str, str]:
        if dtype not in self._by_dtype:
            ensure_model()
            reference = Reference(dtype)
            try:
                reference.wait()
                got = answers(reference.url)
                got.update({grouped_key(i): completion(reference.url, p, GROUPED_TOKENS) for i, p in enumerate(GROUPED)})
            finally:
                reference.close()
            self._by_dtype[dtype] = got
        return self._by_dtype[dtype]

    def answers(self, dtype: str | None) -> dict[str, str]:
        """The reference's `answers` (what `answers(url)` of a deployment is compared with)."""
        return {k: v for k, v in self(dtype).items() if not k.startswith("grouped ")}

    def grouped(self, dtype: str | None, prompts: list[str]) -> list[str]:
        return [self(dtype)[grouped_key(GROUPED.index(p))] for p in prompts]


def grouped_key(i: int) -> str:
    return f"grouped {i}"
