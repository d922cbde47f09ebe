"""The whole product on two fake hosts: real sshd, real openYuanrong data system, real vLLM CPU instances with
our connector, the proxy. Prefill on h1, decode on h2: the KV cache crosses hosts through the data system."""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import run_yrpd
from tests.lab.test_cluster_lab import leftovers
from tests.lab.test_deploy_lab import session_processes

pytestmark = [pytest.mark.lab, pytest.mark.e2e]

ENV_ROOT = os.environ.get("YRPD_TEST_ENV_ROOT", "/opt/yrpd/venvs")
VLLM = Path(ENV_ROOT, "vllm")
MODEL_DIR = Path(ENV_ROOT, "models", "tiny-qwen2")
LONG_PROMPT = " ".join(Path(os.__file__).read_text().split()[:600])  # ~1500 tokens: 11 full KV blocks
CHAT = [{"role": "user", "content": " ".join(Path(json.__file__).read_text().split()[:300])}]


@pytest.fixture(autouse=True)
def _need_venvs():
    missing = [v for v in ("yr", "ds", "vllm") if not Path(ENV_ROOT, v, "bin", "python").exists()]
    if missing:
        message = f"venvs {missing} missing under {ENV_ROOT}: run scripts/test.sh (it installs them)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def http(method: str, url: str, body: dict | None = None, timeout: float = 300) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def completion(base: str, prompt: str, max_tokens: int = 16) -> str:
    status, body = http("POST", f"{base}/v1/completions",
                        {"model": "tiny-qwen2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body[:500]
    return json.loads(body)["choices"][0]["text"]


def chat(base: str, max_tokens: int = 16) -> str:
    status, body = http("POST", f"{base}/v1/chat/completions",
                        {"model": "tiny-qwen2", "messages": CHAT, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body[:500]
    return json.loads(body)["choices"][0]["message"]["content"]


def streamed_chat(base: str, max_tokens: int = 16) -> str:
    body = json.dumps({"model": "tiny-qwen2", "messages": CHAT, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
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


class Reference:
    """One vLLM instance with the deployment's engine flags and no connector: the expected greedy output."""

    def __init__(self, port: int = 41871):
        from yrpd.serving import BASE_ENV, KIND_ENGINE_ARGS
        from yrpd.spec import DeviceKind

        # short: vLLM puts IPC sockets under TMPDIR and a socket path must stay under 108 bytes
        workdir = self.workdir = Path(tempfile.mkdtemp(prefix="yrpd-ref-", dir="/tmp"))
        (workdir / "tmp").mkdir()
        self.url = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        env.update(BASE_ENV, VLLM_CACHE_ROOT=str(workdir / "cache"), TMPDIR=str(workdir / "tmp"),
                   VLLM_CPU_OMP_THREADS_BIND="1", VLLM_HOST_IP="127.0.0.1")
        self.log = workdir / "reference.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(VLLM / "bin/vllm"), "serve", str(MODEL_DIR), "--served-model-name", "tiny-qwen2",
                 "--host", "127.0.0.1", "--port", str(port), *KIND_ENGINE_ARGS[DeviceKind.cpu]],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)

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
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        shutil.rmtree(self.workdir, ignore_errors=True)


def build_model() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[2]), HF_HUB_OFFLINE="1")
    subprocess.run([str(VLLM / "bin/python"), "-m", "yrpd.demo.tiny_model", str(MODEL_DIR)], check=True, env=env,
                   capture_output=True, timeout=900, stdin=subprocess.DEVNULL)


def test_pd_across_two_hosts_serves_like_one_instance_and_tears_down_clean(fake_lab, tmp_path):
    lab = fake_lab(2)
    home = tmp_path / "home"
    config = tmp_path / "yrpd.yaml"
    # each fake host gets its own core: they share this machine's CPUs
    config.write_text(
        "hosts:\n  - {address: h1, devices: [0]}\n  - {address: h2, devices: [1]}\n"
        f"device_kind: cpu\nmodel: builtin:tiny-qwen2\nenv_path: {ENV_ROOT}\ndatasystem_memory_mb: 256\n"
        "cluster_mode: ds_only\n")
    ssh = ["--ssh-config", str(lab.ssh_config), "-i", str(lab.identity_file), "--known-hosts", str(lab.known_hosts)]
    env = {"YRPD_HOME": str(home)}

    def cli(*args, check=None, timeout=600):
        return run_yrpd(*args, *ssh, env=env, check=check, timeout=timeout)

    build_model()  # the deploy finds it built; meanwhile the reference can start
    reference = Reference()
    try:
        started = time.monotonic()
        deploy = cli("deploy", "--hosts", "h1,h2", "--ptp", "1", "--dtp", "1", "--config", str(config), check=0,
                     timeout=1500)
        print(f"measured: 2-host deploy {time.monotonic() - started:.1f}s\n{deploy.stderr}")
        proxy = deploy.stdout.strip().splitlines()[-1]
        assert proxy == f"http://{lab['h1'].address}:8000", deploy.stdout
        assert f"try: curl -s {proxy}/v1/completions" in deploy.stderr

        report = json.loads(cli("status", "--json", check=0).stdout)
        placed = {i["name"]: (i["role"], i["host"]) for i in report["instances"]}
        assert placed == {"prefill-0": ("prefill", "h1"), "decode-0": ("decode", "h2")}
        assert report["healthy"] and report["proxy"]["healthy"] and report["proxy"]["url"] == proxy

        reference.wait()
        assert completion(proxy, LONG_PROMPT) == completion(reference.url, LONG_PROMPT)
        assert streamed_chat(proxy) == chat(reference.url)

        # the decode instance on h2 took the prompt's KV from the cache prefill on h1 wrote
        time.sleep(6)  # connector stats files are rewritten every 5 s
        report = json.loads(cli("status", "--json", check=0).stdout)
        decode = next(i for i in report["instances"] if i["name"] == "decode-0")
        prefill = next(i for i in report["instances"] if i["name"] == "prefill-0")
        assert prefill["connector"]["saved_blocks"] >= 11
        assert decode["connector"]["loaded_blocks"] >= 11
        assert decode["external_cache_hit_tokens"] >= 11 * 128

        logs = cli("logs", "-n", "50", check=0).stdout
        assert "prefill-0" in logs and "decode-0" in logs and "Application startup complete" in logs

        # decode dies: status says so within 10 s, the proxy answers a clean 5xx with a JSON error
        lab["h2"].exec(f"kill -9 {decode['pid']}")
        killed = time.monotonic()
        while True:
            report = json.loads(cli("status", "--json").stdout)
            decode = next(i for i in report["instances"] if i["name"] == "decode-0")
            if not decode["healthy"]:
                break
            assert time.monotonic() - killed < 10, "status still reports the killed decode healthy"
        print(f"measured: killed decode reported after {time.monotonic() - killed:.1f}s")
        assert not report["healthy"] and any("decode-0" in p for p in report["problems"])
        status, body = http("POST", f"{proxy}/v1/completions",
                            {"model": "tiny-qwen2", "prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert 500 <= status < 600 and "message" in json.loads(body)["error"], (status, body[:300])

        started = time.monotonic()
        down = cli("down", check=0)
        print(f"measured: 2-host down {time.monotonic() - started:.1f}s\n{down.stderr}")
        assert "is down" in down.stderr
        for host in lab.hosts:
            assert session_processes(host) == [], host.name
            procs, ports = leftovers(host)
            assert procs == [] and ports == [], (host.name, procs, host.exec("ss -ltnpH").stdout)
    finally:
        reference.close()
        run_yrpd("down", *ssh, env=env, timeout=300)
