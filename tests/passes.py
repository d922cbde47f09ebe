"""The pytest runs of scripts/test.sh, from the arguments it was given.

Tests marked `torch` need torch in the interpreter, so they run in a last pass inside the vLLM venv. Everything else
runs first, as two pytest processes at once, one per lane (tests/conftest.py `lane`: the tests of the shared
deployments and the one reference vLLM in one, the rest in the other), each running its tests one after another.
A user's `-m EXPR` narrows every run (`(EXPR) and not torch`, then `(EXPR) and torch`) instead of being appended after
the run's own `-m`, where pytest would keep only the last one and the torch pass would run what EXPR selects a second
time, in the wrong interpreter.

    python -m tests.passes ARG...   prints bash assignments: MARK_EXPR, PASS_<LANE>=(...) per lane, PASS_TORCH=(...)
"""

from __future__ import annotations

import shlex
import sys

from tests.conftest import LANES

TORCH = "torch"


def split_marks(args: list[str]) -> tuple[str | None, list[str]]:
    """(the -m expression, the other arguments); several -m are joined with `and` (each narrows)."""
    exprs: list[str] = []
    rest: list[str] = []
    it = iter(args)
    for arg in it:
        if arg == "-m":
            value = next(it, None)
            if value is None:
                raise SystemExit("test.sh: -m needs a marker expression, e.g. -m 'not lab'")
            exprs.append(value)
        elif arg.startswith("-m") and not arg.startswith("--"):
            exprs.append(arg[2:])
        else:
            rest.append(arg)
    if not exprs:
        return None, rest
    return " and ".join(f"({e})" for e in exprs), rest


def passes(args: list[str]) -> tuple[str | None, dict[str, list[str]], list[str]]:
    """(the user's expression, each lane's pytest arguments, the torch pass's)."""
    expr, rest = split_marks(args)
    narrow = f"({expr}) and " if expr else ""
    # each lane its own cache directory: the two processes end at different times and would write one file
    lanes = {name: ["tests", "-m", f"{narrow}not {TORCH}", "--lane", name, "-o", f"cache_dir=.pytest_cache/{name}",
                    *rest] for name in LANES}
    torch = ["tests/connector", "-m", f"{narrow}{TORCH}", "-p", "no:cacheprovider", *rest]
    return expr, lanes, torch


def main(argv: list[str]) -> int:
    expr, lanes, torch = passes(argv)
    print(f"MARK_EXPR={shlex.quote(expr or '')}")
    print(f"LANES=({' '.join(lanes)})")
    for name, run in lanes.items():
        print(f"PASS_{name.upper()}=({' '.join(map(shlex.quote, run))})")
    print(f"PASS_TORCH=({' '.join(map(shlex.quote, torch))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
