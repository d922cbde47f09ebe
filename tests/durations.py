"""Where the suite's time goes: the per-phase lines tests/conftest.py appends to $YRPD_TEST_TIMES, summed per test and
per test module.

    python -m tests.durations TIMES.jsonl [--slowest 30] [--wall SECONDS] [--markdown]

scripts/test.sh prints this after both passes (`.ci/run` therefore shows it); `--markdown` prints the module table
as docs/testing.md keeps it.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Timed:
    name: str
    tests: int
    seconds: float


def per_test(lines: list[dict]) -> dict[str, float]:
    """Seconds per test id: set-up, call and tear-down together (a module- or session-scoped fixture is paid by the
    test that sets it up, or tears it down)."""
    out: dict[str, float] = defaultdict(float)
    for line in lines:
        out[line["test"]] += line["s"]
    return dict(out)


def module_of(test_id: str) -> str:
    return test_id.split("::", 1)[0]


def per_module(tests: dict[str, float]) -> list[Timed]:
    """Modules, slowest first."""
    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for test, s in tests.items():
        seconds[module_of(test)] += s
        counts[module_of(test)] += 1
    return sorted((Timed(m, counts[m], seconds[m]) for m in seconds), key=lambda t: (-t.seconds, t.name))


def slowest(tests: dict[str, float], n: int) -> list[Timed]:
    return sorted((Timed(t, 1, s) for t, s in tests.items()), key=lambda t: (-t.seconds, t.name))[:n]


def failed(lines: list[dict]) -> set[str]:
    return {line["test"] for line in lines if line["outcome"] == "failed"}


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _clock(seconds: float) -> str:
    # rounded to tenths first: 719.96 s is 12:00.0, not 11:60.0
    minutes, tenths = divmod(round(seconds * 10), 600)
    return f"{minutes}:{tenths / 10:04.1f}"


def text_report(lines: list[dict], n: int, wall: float | None) -> str:
    tests = per_test(lines)
    total = sum(tests.values())
    out = [f"The {min(n, len(tests))} slowest tests (set-up, call and tear-down; min:s):"]
    out += [f"  {_clock(t.seconds):>8}  {t.name}" for t in slowest(tests, n)]
    out += ["", "Time per test module (min:s, tests):"]
    out += [f"  {_clock(t.seconds):>8}  {t.tests:4d}  {t.name}" for t in per_module(tests)]
    bad = failed(lines)
    out += ["", f"total: {len(tests)} tests ({len(bad)} failed) in {_clock(total)} of test time"
            + (f", {_clock(wall)} wall for the whole command (installs included)" if wall is not None else "")]
    return "\n".join(out)


def markdown(lines: list[dict]) -> str:
    tests = per_test(lines)
    rows = ["| test module | tests | min:s |", "|---|---:|---:|"]
    rows += [f"| {t.name} | {t.tests} | {_clock(t.seconds)} |" for t in per_module(tests)]
    rows.append(f"| **all** | **{len(tests)}** | **{_clock(sum(tests.values()))}** |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("times", type=Path)
    parser.add_argument("--slowest", type=int, default=30)
    parser.add_argument("--wall", type=float, help="the whole command's wall time, seconds")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    lines = read(args.times)
    print(markdown(lines) if args.markdown else text_report(lines, args.slowest, args.wall))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
