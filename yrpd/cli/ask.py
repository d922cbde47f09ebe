"""Ask the latest deployment two questions that share a long context, the way the demo ends.

    yrpd ask [--session ID]

Each question goes to the endpoint as a streamed chat request and its answer is printed as it arrives. After each,
one line says where the prompt's KV came from, from the instances' own counters (vLLM's
`prompt_tokens_by_source`, read through `yrpd status` before and after): what prefill computed, what it took from
its prefix cache, and what decode loaded from the openYuanrong data system instead of computing it. The second
question repeats the first one's context, so its shared prefix is reused, and brings a paragraph of its own that
decode loads from the data system. Runs where yrpd runs (not on the hosts); exit 1 if a request fails.
"""

from __future__ import annotations

# the library is imported inside the command: `yrpd ask --help` and usage errors load none of it (yrpd.api: ~0.2 s)

import json
import sys
import urllib.error
import urllib.request
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from yrpd.status import StatusReport

CONTEXT = (
    "You are a helpful assistant. Answer in one short sentence. Some background you may use. Paris is the capital "
    "and largest city of France, on the river Seine. Berlin is the capital of Germany. Madrid is the capital of "
    "Spain and Rome is the capital of Italy. Gold is a chemical element with the symbol Au and atomic number 79. "
    "Silver has the symbol Ag. Water boils at 100 degrees Celsius at sea level and freezes at 0 degrees. The Earth "
    "orbits the Sun once a year, and the Moon orbits the Earth about once a month. Mars is called the Red Planet "
    "because of the iron oxide on its surface. Jupiter is the largest planet in the solar system. A week has seven "
    "days, a year has twelve months, and a day has twenty-four hours. The Pacific is the largest ocean on Earth. "
    "Mount Everest is the highest mountain above sea level."
)
FIRST = "What is the capital of France?"
SECOND = (
    "Here is a note from a museum visitor: 'The old coins in the last room shone yellow under the lamps. The guide "
    "said they were made of the same metal as the crowns next to them, a metal that does not rust, that jewellers "
    "have loved for thousands of years, and that central banks still keep in their vaults. She told us its atomic "
    "number and showed the two-letter symbol chemists write for it on the periodic table by the door.' "
    "What is the chemical symbol of gold?"
)
#: (what the demo prints, what it sends)
QUESTIONS = [(FIRST, FIRST), ("[a museum visitor's note about yellow coins] What is the chemical symbol of gold?", SECOND)]
SOURCES = ("prompt_tokens_computed", "prompt_tokens_local_cache", "prompt_tokens_loaded")


def stream_chat(url: str, model: str, question: str, api_key: str | None, max_tokens: int = 48) -> tuple[str, int]:
    """Stream one chat answer to stdout; (answer, prompt tokens)."""
    body = {"model": model, "messages": [{"role": "system", "content": CONTEXT}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(), headers=headers)
    answer, prompt_tokens = [], 0
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", chunk["error"]))
            for choice in chunk.get("choices") or ():
                piece = choice.get("delta", {}).get("content") or ""
                answer.append(piece)
                print(piece, end="", flush=True)
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    print()
    return "".join(answer), prompt_tokens


def by_role(report: StatusReport) -> dict[str, dict[str, float]]:
    """Prompt tokens per source, summed over the instances of each role."""
    out: dict[str, dict[str, float]] = {}
    for inst in report.instances:
        role = out.setdefault(inst.role, {k: 0.0 for k in SOURCES})
        for key in SOURCES:
            role[key] += inst.probe.get(key) or 0
    return out


def kv_line(before: dict, after: dict, prompt_tokens: int) -> str:
    delta = {role: {k: int(after[role][k] - before.get(role, {}).get(k, 0)) for k in SOURCES} for role in after}
    p, d = delta.get("prefill"), delta.get("decode")
    if p is None or d is None:
        return "KV: not a PD deployment: no hand-over"
    return (f"KV of this {prompt_tokens}-token prompt: prefill computed {p['prompt_tokens_computed']} and took "
            f"{p['prompt_tokens_local_cache']} from its prefix cache; decode loaded {d['prompt_tokens_loaded']} from "
            f"the openYuanrong data system, took {d['prompt_tokens_local_cache']} from its prefix cache, computed "
            f"{d['prompt_tokens_computed']}")


@click.command(help=__doc__.splitlines()[0])
@click.option("--session", help="session to ask [latest]")
def ask(session: str | None) -> None:
    from yrpd import api

    deployment = api.open_deployment(session)
    url, model = deployment.url, deployment.spec.model_name
    key = deployment.endpoint_key()
    counters = by_role(api.status(deployment))
    for shown, question in QUESTIONS:
        print(f"Q: {shown}")
        print("A: ", end="", flush=True)
        try:
            _, prompt_tokens = stream_chat(url, model, question, key)
        except (OSError, urllib.error.URLError, RuntimeError, ValueError) as exc:
            print(f"\nerror: the request to {url} failed: {exc}", file=sys.stderr)
            raise click.exceptions.Exit(1)
        now = by_role(api.status(deployment))
        print(kv_line(counters, now, prompt_tokens))
        counters = now
