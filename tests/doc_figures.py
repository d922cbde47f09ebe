"""The measured figures of README.md, docs/reliability.md and docs/benchmarks.md, and the reports they rest on.

A figure is a number with a unit of time, size, rate, share or ratio (`1.2 s`, `41.5 MB`, `0.52-0.67x`, `8 %`),
written in prose or a table; a number in `code` is a setting or a command's argument, not a measurement. A figure's
evidence is a report under docs/bench/ linked from the same place: its paragraph, its list item (or the paragraph that
introduces the list), its table row (or the paragraph right above the table). tests/unit/test_docs.py holds every
figure to a linked report that says where it came from: its commit, its CPU and the command that produced it (in a
JSON report's `provenance` object, yrpd/provenance.py, or at its top level in reports older than that; in the first
lines of a text report).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the documents whose figures are held to reports
FIGURE_DOCS = ("README.md", "docs/reliability.md", "docs/benchmarks.md")

_NUMBER = r"\d[\d,]*(?:\.\d+)?"
#: a number (or a range of two) and its unit; `x` and `%` may follow the number directly
FIGURE = re.compile(rf"(?<![\w.\-/])({_NUMBER})(?:\s?(?:-|to)\s?({_NUMBER}))?"
                    r"(?:\s?(ms|s|min|h|KB|MB|GB|GiB|MiB|GB/s|MB/s|MB/h|KB/h|tok/s)\b|\s?(%)|(x)\b)")
LINK = re.compile(r"\]\(((?:docs/)?bench/[^)#\s]+)\)")
CODE = re.compile(r"`[^`]*`")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # 1-based, of the block's first line
    text: str  # the block itself (a paragraph, a list item, a table row)
    context: str  # what introduces it: the paragraph above a list or a table ("" for a paragraph)

    def figures(self) -> list[str]:
        prose = LINK.sub("", CODE.sub("", self.text))
        return [m.group(0) for m in FIGURE.finditer(prose)]

    def reports(self) -> list[str]:
        """The linked reports, as paths from the repository's root."""
        out = []
        for target in LINK.findall(self.text + "\n" + self.context):
            base = Path(self.doc).parent
            path = (base / target).as_posix() if not target.startswith("docs/") else target
            if path not in out and not path.endswith("/"):
                out.append(path)
        return out


def blocks(doc: str, text: str | None = None) -> list[Block]:
    """The doc's paragraphs, list items and table rows outside fenced code, each with what introduces it (`text`: the
    doc's text where it is not the file's)."""
    lines = (REPO / doc).read_text().splitlines() if text is None else text.splitlines()
    out: list[Block] = []
    fenced = False
    para: list[str] = []
    para_line = 0
    last_para = ""  # the paragraph just before the current list or table
    item: list[str] = []
    item_line = 0

    def flush_para():
        nonlocal para, last_para
        if para:
            text = "\n".join(para)
            out.append(Block(doc, para_line, text, ""))
            last_para = text
            para = []

    def flush_item():
        nonlocal item
        if item:
            out.append(Block(doc, item_line, "\n".join(item), last_para))
            item = []

    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            flush_para()
            flush_item()
            fenced = not fenced
            continue
        if fenced:
            continue
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            flush_para()
            flush_item()
            if stripped.startswith("#"):
                last_para = ""
            continue
        if stripped.startswith("|"):
            flush_para()
            flush_item()
            if not re.fullmatch(r"\|[\s:|-]+\|", stripped):
                out.append(Block(doc, n, stripped, last_para))
            continue
        if re.match(r"\s*([-*]|\d+\.)\s", line):
            flush_para()
            flush_item()
            item, item_line = [line], n
            continue
        if item and line.startswith((" ", "\t")):
            item.append(line)
            continue
        flush_item()
        if not para:
            para_line = n
        para.append(line)
    flush_para()
    flush_item()
    return out


def unsupported(block: Block, root: Path = REPO) -> str | None:
    """Why a block's figures rest on no report that says where it came from, None when they do."""
    figures = block.figures()
    if not figures:
        return None
    reports = block.reports()
    if not reports:
        return f"{block.doc}:{block.line}: {', '.join(figures[:4])}: no report linked"
    lacking = {r: provenance_missing(r, root) for r in reports}
    lacking = {r: m for r, m in lacking.items() if m}
    if lacking:
        return f"{block.doc}:{block.line}: {', '.join(figures[:4])}: reports without provenance {lacking}"
    return None


def provenance_missing(report: str, root: Path = REPO) -> list[str]:
    """What a report lacks of where it came from: [] when it names its commit, CPU and command."""
    path = root / report
    if not path.is_file():
        return ["the file"]
    if path.suffix == ".json":
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict):
            return ["commit", "cpu", "command"]  # a bare list of figures
        # yrpd.provenance.record's object, or (reports written before it) the same facts at the top
        prov = doc["provenance"] if isinstance(doc.get("provenance"), dict) else doc
        named = {"commit": prov.get("commit"), "cpu": prov.get("cpu"),
                 "command": prov.get("commands") or prov.get("command")}
        return [name for name, value in named.items() if not value]
    head = "\n".join(path.read_text(errors="replace").splitlines()[:12]).lower()
    wanted = {"commit": r"commit:?\s+[0-9a-f]{7,}", "cpu": r"\bcpu\b", "command": r"\bcommand:?\s"}
    return [name for name, pattern in wanted.items() if not re.search(pattern, head)]


def numbers(report: str, root: Path = REPO) -> list[float]:
    """Every number a report holds (JSON values, or the numbers of a text report)."""
    text = (root / report).read_text(errors="replace")
    return [float(x.replace(",", "")) for x in re.findall(_NUMBER, text)]


def found_in(value: str, candidates: list[float]) -> bool:
    """A figure as written (`0.52`, `31,394`) is one of the report's numbers, rounded to the figure's precision."""
    digits = len(value.split(".", 1)[1]) if "." in value else 0
    want = float(value.replace(",", ""))
    half = 0.5 * 10 ** -digits + 1e-9  # 1.25 written as 1.3 (or as 1.2: either way of rounding a half)
    return any(abs(c - want) <= half for c in candidates)
