"""Requests through a deployment's proxy, and a 2-host deployment to send them to: what the host-fault tests and the
soak benchmark share. The tiny model: the subject is the processes and the network, not the language."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

from lab.cli import run_yrpd
from lab.cluster import ENV_ROOT

MODEL = "tiny-qwen2"
#: a prompt of about 1,000 tokens of the tiny model (several KV blocks to hand over)
LONG = "def handover(block, key, value):\n    return store.put(key, block[value])\n" * 60


def body(prompt: str, max_tokens: int, stream: bool = False, **more) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **more}


class Call(threading.Thread):
    """One request through the proxy in a thread of its own; records how it ended and when."""

    def __init__(self, base: str, body: dict, timeout: float = 120, request_id: str | None = None) -> None:
        super().__init__(daemon=True)
        self.base, self.body, self.timeout = base, body, timeout
        self.request_id = request_id  # sent as X-Request-Id: `yrpd logs --request` follows it across hosts
        self.status: int | None = None
        self.chunks = 0  # SSE data events with text, for a stream
        self.error_event = False  # a stream that ended with an error event
        self.text = ""
        self.raw = ""
        self.failure: str | None = None  # no HTTP answer at all (refused, reset, the client's own timeout)
        self.started: float | None = None
        self.ended: float | None = None
        self.max_gap = 0.0  # a stream: the longest wait between two of its events (a migration shows as one)

    def run(self) -> None:
        self.started = time.monotonic()
        host, port = self.base.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=self.timeout)
        try:
            headers = {"Content-Type": "application/json"}
            if self.request_id:
                headers["X-Request-Id"] = self.request_id
            conn.request("POST", "/v1/completions", json.dumps(self.body), headers)
            resp = conn.getresponse()
            self.status = resp.status
            if self.body.get("stream") and resp.status == 200:
                last = time.monotonic()
                for line in resp:
                    line = line.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.monotonic()
                    self.max_gap, last = max(self.max_gap, now - last), now
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error_event = True
                    else:
                        self.chunks += 1
                        self.text += event["choices"][0]["text"]
            else:
                self.raw = resp.read().decode()
                if resp.status == 200:
                    self.text = json.loads(self.raw)["choices"][0]["text"]
        except Exception as exc:  # noqa: BLE001 - what the client saw is the finding
            self.failure = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended = time.monotonic()
            conn.close()

    def clean(self) -> bool:
        """A 200 with its text, a 5xx with a JSON error, or a stream that ended with an error event."""
        if self.failure or self.status is None:
            return False
        if self.status == 200:
            return self.error_event or bool(self.text)
        return 500 <= self.status < 600 and "error" in json.loads(self.raw or "{}")


class TwoHosts:
    """A deployment on the lab's first `n` hosts (2 by default), one CPU core each (this machine's two, in turn):
    prefill on h1 with the proxy and etcd, decode on h2, and what `yrpd scale` adds on h3 and beyond."""

    def __init__(self, lab, tmp_path: Path, n: int = 2) -> None:
        self.lab = lab
        self.names = [f"h{i + 1}" for i in range(n)]
        self.config = tmp_path / "yrpd.yaml"
        self.config.write_text(
            "hosts:\n" + "".join(f"  - {{address: {h}, devices: [{i % 2}]}}\n" for i, h in enumerate(self.names)) +
            f"device_kind: cpu\nmodel: builtin:{MODEL}\nenv_path: {ENV_ROOT}\ndatasystem_memory_mb: 256\n"
            "cluster_mode: ds_only\n")
        self.env = {"YRPD_HOME": str(tmp_path / "home")}
        self.proxy = ""

    def cli(self, *args, check=0, timeout=900):
        return run_yrpd(*args, *self.lab.cli_ssh_args, env=self.env, check=check, timeout=timeout)

    def deploy(self, on: int | None = None) -> float:
        """Deploy on every host of the config, or on its first `on` (the others can join with `yrpd scale --hosts`)."""
        started = time.monotonic()
        out = self.cli("deploy", "--hosts", ",".join(self.names[:on]), "--config", str(self.config), timeout=1500)
        self.proxy = out.stdout.strip().splitlines()[-1]
        return time.monotonic() - started

    def spec_now(self, path: Path, **changes) -> Path:
        """The spec the deployment runs now (its latest session's, as the commands before changed it: a host that
        joined by `yrpd scale --hosts` has the devices detected there, not the ones `config` names) with `changes`,
        written to `path` as a config a later `yrpd deploy` takes."""
        import yaml

        spec = json.loads((Path(self.env["YRPD_HOME"]) / "sessions" / "latest" / "spec.json").read_text())
        path.write_text(yaml.safe_dump({**spec, **changes}, sort_keys=False))
        return path

    def status(self) -> tuple[dict, float]:
        started = time.monotonic()
        report = json.loads(self.cli("status", "--json", check=None, timeout=120).stdout)
        return report, time.monotonic() - started

    def healthy(self, within: float = 120) -> tuple[dict, float]:
        started = time.monotonic()
        while True:
            report, _ = self.status()
            if report["healthy"]:
                return report, time.monotonic() - started
            assert time.monotonic() - started < within, report["problems"]
            # a status costs half a CPU-second here and over ssh on every host, taken from the restart it waits for
            time.sleep(3)

    def ask(self, prompt: str, max_tokens: int = 16, timeout: float = 60, request_id: str | None = None) -> Call:
        call = Call(self.proxy, body(prompt, max_tokens), timeout, request_id)
        call.run()
        return call

    def first_good(self, expected: dict[str, str], within: float) -> float:
        """Seconds until every prompt of `expected` is answered right again; meanwhile only clean refusals."""
        started = time.monotonic()
        while True:
            calls = [self.ask(p, timeout=30) for p in expected]
            for call in calls:
                assert call.status != 200 or call.text == expected[call.body["prompt"]], call.text
                assert call.status == 200 or call.clean() or call.failure, (call.status, call.raw[:300])
            if all(c.status == 200 for c in calls):
                return time.monotonic() - started
            assert time.monotonic() - started < within, [(c.status, c.failure, c.raw[:200]) for c in calls]
            time.sleep(0.5)


def restarts(report: dict) -> dict[tuple[str, str], int]:
    out = {(c["host"], c["component"]): c["restarts"] for c in report["cluster"]["components"]}
    out.update({(i["host"], i["name"]): i["restarts"] for i in report["instances"]})
    out[(report["proxy"]["host"], "proxy")] = report["proxy"]["restarts"]
    return out
