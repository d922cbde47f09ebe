"""The configuration reference (docs/configuration-reference.md), generated from the spec model itself.

    python -m yrpd.config_reference > docs/configuration-reference.md

Field descriptions are the `#:` comments above each field in yrpd/spec.py, so the reference cannot drift
from the code: a unit test compares the committed file with this output.
"""

from __future__ import annotations

import inspect
import re
from enum import Enum

from pydantic import BaseModel

from yrpd.hostgroup import SshOptions
from yrpd.spec import DataSystemSection, HostSpec, PlannerSettings, Ports, RestartPolicy, RuntimeSection, ServingSection, \
    TopologySection

#: DeploySpec's own sections are all top-level keys of yrpd.yaml, one flat mapping
SECTIONS = [("top level (`yrpd.yaml`): topology", TopologySection, ""),
            ("top level: runtime", RuntimeSection, ""),
            ("top level: data system", DataSystemSection, ""),
            ("top level: serving", ServingSection, ""),
            ("hosts[] entries", HostSpec, "hosts[]."), ("ports", Ports, "ports."), ("restart", RestartPolicy, "restart."),
            ("planner", PlannerSettings, "planner."), ("ssh", SshOptions, "ssh.")]


def field_comments(model: type[BaseModel]) -> dict[str, str]:
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(model).splitlines():
        stripped = line.strip()
        if stripped.startswith("#:"):
            pending.append(stripped[2:].strip())
            continue
        match = re.match(r"^\s{4}([a-z][a-z_0-9]*): ", line)  # a field (a long one's Field(...) may run on)
        if match:
            trailing = line.split("#", 1)[1].strip() if "  # " in line else ""
            text = " ".join(pending) or trailing
            if text:
                comments[match.group(1)] = text
        pending = []
    return comments


def type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    if text is None:
        text = str(annotation).replace("typing.", "")
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return " \\| ".join(m.value for m in annotation)
    return re.sub(r"yrpd\.spec\.", "", text).replace("NoneType", "None").replace("|", "\\|")


def default_text(field) -> str:
    if field.is_required():
        return "required"
    value = field.default
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, BaseModel):
        return "see below"
    return "-" if value is None else f"`{value!r}`" if not isinstance(value, str) else f"`{value}`"


def bounds(field) -> str:
    parts = []
    for meta in field.metadata:
        for attr, sign in (("ge", ">="), ("le", "<=")):
            if getattr(meta, attr, None) is not None:
                parts.append(f"{sign} {getattr(meta, attr)}")
    return ", ".join(parts)


def render() -> str:
    out = ["# Configuration reference", "",
           "Generated from `yrpd/spec.py` by `python -m yrpd.config_reference`; do not edit by hand.",
           "docs/configuration.md explains precedence (defaults < yrpd.yaml < flags) and shows an example.", ""]
    for title, model, prefix in SECTIONS:
        comments = field_comments(model)
        out += [f"## {title}", "", "| key | type | default | limits | meaning |", "|---|---|---|---|---|"]
        for name, field in model.model_fields.items():
            short = [a for a in getattr(field.validation_alias, "choices", []) if a != name]
            key = f"`{prefix}{name}`" + "".join(f" (or `{a}`)" for a in short)
            out.append(f"| {key} | {type_name(field.annotation)} | {default_text(field)} | "
                       f"{bounds(field) or '-'} | {comments.get(name, '')} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
