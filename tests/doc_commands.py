"""The `yrpd` command lines the docs show, and which test runs each of them.

Each test that runs documented commands selects them from the docs with one of the predicates below, so a
changed doc line reaches the test that runs it; tests/unit/test_docs.py checks that every documented command is
selected by at least one of them.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def documented_commands() -> list[tuple[str, str]]:
    """(file name, command) for every `yrpd ...` line inside a fenced block of README.md and docs/*.md."""
    found = []
    for path in DOC_FILES:
        in_block = False
        for line in path.read_text().splitlines():
            if line.startswith("```"):
                in_block = not in_block
                continue
            text = line.split("#", 1)[0].strip()
            text = re.sub(r"^(\.venv/bin/|url=\$\()", "", text)
            if in_block and text.startswith("yrpd "):
                found.append((path.name, " ".join(text.rstrip(")").split())))
    return found


def words(command: str) -> list[str]:
    """The argv after `yrpd`."""
    return shlex.split(command)[1:]


def _verb(command: str) -> str:
    argv = words(command)
    return " ".join(argv[:2]) if argv[0] in ("bench", "patch") else argv[0]


def as_run_without_changes(command: str) -> list[str]:
    """The argv of a documented plan/deploy, deploy with --dry-run added: what a test may run on any host."""
    return words(command) + (["--dry-run"] if words(command)[0] == "deploy" else [])


def needs_no_host(command: str) -> bool:
    """plan/deploy whose placement is fully given (local host, or device kind and ids named): deploy runs as
    --dry-run. Run by tests/unit/test_docs.py."""
    return _verb(command) in ("plan", "deploy") and ("--hosts localhost" in command or "--device-kind" in command)


def detects_npus_on_h1_h2(command: str) -> bool:
    """plan/deploy on hosts h1,h2 whose NPUs are detected over SSH: deploy runs as --dry-run. Run by
    tests/lab/test_docker_lab.py, whose fake hosts h1,h2 carry FAKE NPUs."""
    return _verb(command) in ("plan", "deploy") and "--hosts h1,h2" in command and "--device-kind" not in command


def acts_on_a_deployment(command: str) -> bool:
    """status, logs, metrics targets, down of the latest session. Run by tests/lab/test_embedded_default.py after
    `yrpd deploy --hosts localhost`."""
    return _verb(command) in ("status", "logs", "down") or words(command)[:2] == ["metrics", "targets"]


def is_the_tiny_bench(command: str) -> bool:
    """`bench dataset` and `bench run --dataset`. Run by tests/lab/test_bench.py on the embedded default."""
    return _verb(command) == "bench dataset" or (_verb(command) == "bench run" and "--dataset" in command)


def is_the_published_benchmark(command: str) -> bool:
    """`bench run` generating its own set: the benchmark whose results are committed in docs/bench/. Checked by
    tests/unit/test_docs.py against those results (a run takes 15 min on our CPU machines)."""
    return _verb(command) == "bench run" and "--dataset" not in command


def acts_on_a_source_tree(command: str) -> bool:
    """`patch ...` on the guide's tree path. Run by tests/lab/test_patch_sources.py on each downloaded
    vllm-ascend source tree in place of /vllm-workspace/vllm-ascend."""
    return _verb(command).startswith("patch ")


def scales_a_deployment(command: str) -> bool:
    """`scale` of the latest session. Run by tests/lab/test_scale_lab.py under load on 3 fake hosts (its scale-out
    is the documented command)."""
    return _verb(command) == "scale"


def moves_a_host(command: str) -> bool:
    """`drain HOST` / `undrain HOST` of the latest session. Run by tests/lab/test_rollout_lab.py under load on 3 fake
    hosts."""
    return _verb(command).split(" ")[0] in ("drain", "undrain")


def plans_a_deployment(command: str) -> bool:
    """`planner` of the latest session. Run by tests/lab/test_planner_lab.py under a load step on 3 fake hosts."""
    return _verb(command) == "planner"


RUNNERS = [needs_no_host, detects_npus_on_h1_h2, acts_on_a_deployment, is_the_tiny_bench,
           is_the_published_benchmark, acts_on_a_source_tree, scales_a_deployment, moves_a_host, plans_a_deployment]


def commands(selected_by) -> list[str]:
    """The distinct documented commands a predicate selects, in doc order."""
    out: list[str] = []
    for _, command in documented_commands():
        if selected_by(command) and command not in out:
            out.append(command)
    return out


def documented_shell(file_name: str, starts_with: str) -> str:
    """One shell command from a fenced block of a doc, its backslash-continued lines joined."""
    text = next(p for p in DOC_FILES if p.name == file_name).read_text()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(starts_with):
            command = [line]
            while command[-1].endswith("\\"):
                i += 1
                command.append(lines[i])
            return "\n".join(command)
    raise LookupError(f"{file_name} shows no command starting with {starts_with!r}")
