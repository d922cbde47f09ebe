"""A recorded trace in Mooncake's format (one JSON object per request: `timestamp` in ms, `input_length`,
`output_length`, `hash_ids` of 512-token blocks), scaled to a small machine, for `vllm bench serve --dataset-name
timed_trace` (vLLM >= 0.32), which turns every hash id into one fixed run of tokens and sends each request at its
timestamp.

The factors, each written into the scaled file's sidecar (`<out>.meta.json`) and the bench report: a window of the
trace (`start` request, `requests` of them), `tokens_per_id` tokens in place of each 512-token block (input lengths
scale with it, so the last, partial block stays partial), output lengths times `output_scale` (at least 1, at most
`max_output`), and time stretched by `time_scale` (2: arrivals half as often), or in its place by whatever makes the
window's input tokens arrive at `load` times the machine's `capacity` (input tokens a second, measured on the
deployment: a trace scaled for one machine overloads a slower one, where every routing only queues); optionally a
share of the conversations (`conversations`, chosen by a hash of their id and `seed`) with every turn of each, which
keeps the trace's reuse in a replay of minutes (its turns come minutes apart: a window of consecutive requests sees
little). Shared leading ids stay shared prefixes: that, and the arrival pattern, is what the trace brings.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from yrpd.errors import SpecError

#: tokens behind each hash id of Mooncake's traces
TRACE_BLOCK = 512


@dataclass(frozen=True)
class TraceScale:
    start: int = 0
    requests: int = 200
    tokens_per_id: int = 16
    output_scale: float = 1 / 32
    max_output: int = 64
    time_scale: float = 1.0
    #: keep this share of the trace's conversations (requests sharing their second block id: the turns of one chat,
    #: minutes apart), all their turns, instead of every request: a short replay with the trace's reuse (1.0: all)
    conversations: float = 1.0
    seed: int = 0
    #: in place of time_scale: the share of `capacity` (input tokens a second the deployment computes) the window's
    #: input tokens arrive at, on average over its span
    load: float | None = None
    capacity: float | None = None

    def check(self) -> None:
        for name, ok, fix in (("--start", self.start >= 0, "0 or more"), ("--requests", self.requests >= 1, "1 or more"),
                              ("--tokens-per-id", 1 <= self.tokens_per_id <= TRACE_BLOCK, f"1 to {TRACE_BLOCK}"),
                              ("--output-scale", self.output_scale > 0, "above 0"),
                              ("--max-output", self.max_output >= 1, "1 or more"),
                              ("--time-scale", self.time_scale > 0, "above 0"),
                              ("--conversations", 0 < self.conversations <= 1, "a share above 0, at most 1"),
                              ("--load", self.load is None or self.load > 0, "a share of capacity above 0"),
                              ("--capacity", self.capacity is None or self.capacity > 0,
                               "input tokens a second above 0")):
            if not ok:
                raise SpecError(name, "out of range", f"give {fix}")
        if (self.load is None) != (self.capacity is None):
            given, missing = ("--load", "--capacity") if self.capacity is None else ("--capacity", "--load")
            raise SpecError(given, f"given without {missing}", "give both, or --time-scale alone")
        if self.load is not None and self.time_scale != 1.0:
            raise SpecError("--time-scale", "given with --load", "give one: --time-scale, or --load with --capacity")


def time_scale_for(scale: TraceScale, span_ms: float, input_tokens: int) -> float:
    """The factor on arrival times that makes `input_tokens` over `span_ms` (the window, scaled lengths) arrive at
    scale.load x scale.capacity tokens a second; scale.time_scale where no load is asked."""
    if scale.load is None or scale.capacity is None:
        return scale.time_scale
    if span_ms <= 0:
        raise SpecError("--load", "the window's requests all arrive at once",
                        "give a larger --requests, or --time-scale")
    return input_tokens / (scale.load * scale.capacity) / (span_ms / 1000)


def _sampled(ids: list, scale: TraceScale) -> bool:
    """Whether the request's conversation (its second block id; a one-block prompt is its own) is in the sample."""
    key = f"{scale.seed}:{ids[1] if len(ids) > 1 else ids[:1]}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") < scale.conversations * 2**64


def scale_trace(source: Path, out: Path, scale: TraceScale) -> dict:
    """Write the scaled window of `source` to `out` (and its sidecar); what was written, in figures."""
    scale.check()
    rows = []
    kept = 0
    with open(source) as f:
        for n, line in enumerate(f):
            if len(rows) == scale.requests:
                break
            try:
                entry = json.loads(line)
                ts, ids = float(entry["timestamp"]), list(entry["hash_ids"])
                inp, outp = int(entry["input_length"]), int(entry["output_length"])
            except (ValueError, KeyError, TypeError) as exc:
                raise SpecError("--trace", f"{source} line {n + 1} is not a Mooncake trace entry ({exc})",
                                "give a JSONL of timestamp, input_length, output_length, hash_ids") from None
            if scale.conversations < 1 and not _sampled(ids, scale):
                continue
            kept += 1
            if kept > scale.start:
                rows.append((ts, ids, inp, outp))
    if not rows:
        sample = " in the sample" if scale.conversations < 1 else ""
        raise SpecError("--start", f"{source} has no request from number {scale.start} on{sample}",
                        "give a smaller --start" + (" or a larger --conversations" if sample else ""))
    t0 = rows[0][0]
    inputs = [max(1, math.ceil(inp * scale.tokens_per_id / TRACE_BLOCK)) for _, _, inp, _ in rows]
    time_scale = time_scale_for(scale, rows[-1][0] - t0, sum(inputs))
    scaled = [{"timestamp": round((ts - t0) * time_scale, 3), "input_length": n,
               "output_length": min(scale.max_output, max(1, round(outp * scale.output_scale))), "hash_ids": ids}
              for (ts, ids, _, outp), n in zip(rows, inputs)]
    out.write_text("".join(json.dumps(r) + "\n" for r in scaled))
    seen: set[int] = set()
    shared = total = 0
    for r in scaled:
        for i in r["hash_ids"]:
            total += 1
            shared += i in seen
            seen.add(i)
    inputs.sort()
    meta = {"source": str(source), **asdict(scale), "time_scale": round(time_scale, 6), "written": len(scaled),
            "span_s": round(scaled[-1]["timestamp"] / 1000, 1),
            "input_tokens": {"min": inputs[0], "median": inputs[len(inputs) // 2], "max": inputs[-1],
                             "total": sum(inputs)},
            "output_tokens_total": sum(r["output_length"] for r in scaled),
            "ids_seen_before": round(shared / total, 3) if total else 0.0,
            "bench_args": ["--timed-trace-chunk-hash-size", str(scale.tokens_per_id),
                           "--timed-trace-sec-multiplier", "0.001"]}
    Path(f"{out}.meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta
