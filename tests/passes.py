"""The two pytest passes of scripts/test.sh, from the arguments it was given.

Tests marked `torch` need torch in the interpreter, so they run in a second pass inside the vLLM venv; everything
else runs in the first, in two lanes at once (LANES). A user's `-m EXPR` narrows both passes (`(EXPR) and not torch`, then `(EXPR) and torch`)
instead of being appended after the pass's own `-m`, where pytest would keep only the last one and the second pass
would run what EXPR selects a second time, in the wrong interpreter.

    python -m tests.passes ARG...   prints bash assignments: MARK_EXPR, PASS_NOT_TORCH=(...), PASS_TORCH=(...)
"""

from __future__ import annotations

import shlex
import sys

TORCH = "torch"
#: the first pass in two pytest-xdist workers: each lane of heavy tests in one of them, one test after another, the
#: light tests wherever a worker is free (tests/conftest.py `lane`); a user's own `-n 0` comes after and wins
LANES = ["-n", "2", "--dist", "loadgroup"]


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


def passes(args: list[str]) -> tuple[str | None, list[str], list[str]]:
    """(the user's expression, the first pass's pytest arguments, the second's)."""
    expr, rest = split_marks(args)
    narrow = f"({expr}) and " if expr else ""
    first = ["tests", "-m", f"{narrow}not {TORCH}", *LANES, *rest]
    second = ["tests/connector", "-m", f"{narrow}{TORCH}", "-p", "no:cacheprovider", *rest]
    return expr, first, second


def main(argv: list[str]) -> int:
    expr, first, second = passes(argv)
    print(f"MARK_EXPR={shlex.quote(expr or '')}")
    print(f"PASS_NOT_TORCH=({' '.join(map(shlex.quote, first))})")
    print(f"PASS_TORCH=({' '.join(map(shlex.quote, second))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
