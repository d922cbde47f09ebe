"""How exactly a continuation by token ids repeats an unbroken greedy answer on vLLM (what the proxy's request
migration sends, yrpd/proxy/resume.py): one plain vLLM instance on 127.0.0.1, each prompt streamed once whole
(`return_token_ids`), then continued from several break points on /v1/completions with the prompt's ids and the
answer's first K ids; the continuation's ids and text are compared with the rest of the unbroken answer.

    .venv/bin/python benchmarks/continuation.py [--model DIR] [--name NAME] [--tokens N] --out FILE.json

A break point whose continuation differs is reported with the token where it first does: vLLM computes the carried
tokens' KV in one prefill pass, not step by step, and a greedy near-tie can then go the other way.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from yrpd.provenance import record  # noqa: E402

VENV = Path(os.environ.get("YRPD_VLLM_VENV", "/opt/yrpd/venvs/vllm"))
CHAT = [
    "Write a short poem about a café crème, with one emoji.",
    "Explain in three sentences why the sky is blue.",
    "List five prime numbers and say what they have in common.",
]
COMPLETION = [
    "Un café crème coûte 3 € à Paris, and in Tokyo it",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The history of the printing press begins",
]


def stream(url: str, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def ids_and_text(events: list[dict], chat: bool) -> tuple[list[int] | None, list[list[int]], list[str]]:
    """(the prompt's ids, each event's token ids, each event's text) of a stream with return_token_ids."""
    prompt, ids, texts = None, [], []
    for e in events:
        if chat and e.get("prompt_token_ids"):
            prompt = e["prompt_token_ids"]
        for c in e.get("choices", []):
            if not chat and c.get("prompt_token_ids"):
                prompt = c["prompt_token_ids"]
            if c.get("token_ids"):
                ids.append(c["token_ids"])
                texts.append(c["delta"].get("content") or "" if chat else c["text"])
    return prompt, ids, texts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/opt/yrpd/venvs/models/smollm2")
    ap.add_argument("--name", default="smollm2")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(Path(args.out).with_suffix(".vllm.log"), "w")  # noqa: SIM115 - held for the server's life
    server = subprocess.Popen([str(VENV / "bin" / "vllm"), "serve", args.model, "--served-model-name", args.name,
                               "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
                               "--max-model-len", "2048"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    cases = []
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "vLLM did not start: see its log"
                time.sleep(1)
        n = args.tokens
        breaks = sorted({0, 1, n // 8, n // 4, n // 2, 3 * n // 4, n - 1})
        for chat, prompts in ((True, CHAT), (False, COMPLETION)):
            path = "/v1/chat/completions" if chat else "/v1/completions"
            for prompt in prompts:
                body = {"model": args.name, "max_tokens": n, "temperature": 0, "stream": True,
                        "return_token_ids": True, "ignore_eos": True}
                body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
                prompt_ids, per_event, texts = ids_and_text(stream(url, path, body), chat)
                flat = [t for ids in per_event for t in ids]
                for k in breaks:
                    sent = sum(1 for _ in per_event[:k])  # one token per event: the break after k events
                    carried = [t for ids in per_event[:sent] for t in ids]
                    cont = {"model": args.name, "prompt": prompt_ids + carried, "max_tokens": n - len(carried),
                            "temperature": 0, "stream": True, "return_token_ids": True, "ignore_eos": True}
                    _, c_ids, c_texts = ids_and_text(stream(url, "/v1/completions", cont), False)
                    got = carried + [t for ids in c_ids for t in ids]
                    first_diff = next((i for i, (a, b) in enumerate(zip(got, flat)) if a != b), None)
                    same_text = "".join(texts[:sent]) + "".join(c_texts) == "".join(texts)
                    cases.append({"endpoint": path, "prompt": prompt, "break_after_tokens": len(carried),
                                  "identical": got == flat and same_text, "first_different_token": first_diff})
    finally:
        os.killpg(server.pid, 15)
        server.wait(60)
        log.close()
    same = sum(c["identical"] for c in cases)
    report = {"provenance": record([" ".join(["benchmarks/continuation.py", *sys.argv[1:]])], vllm_venv=VENV),
              "model": args.name, "tokens": args.tokens, "break_points": len(cases), "identical": same,
              "cases": cases}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"{same} of {len(cases)} continuations identical to the unbroken greedy answer "
          f"({args.name}, {args.tokens} tokens); report: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
