"""Plain shell steps for playbooks: `run` a script, and `check` one whose success means done."""

from __future__ import annotations

from yrpd.hostgroup import Command
from yrpd.placement import HostPlan
from yrpd.steps import StepContext


def _render(ctx: StepContext, script: str) -> str:
    return script.replace("{session_dir}", ctx.host_session_dir).replace("{session_id}", ctx.session_id)


def run(ctx: StepContext, host: HostPlan, script: str, timeout: float = 120, **_: object) -> Command:
    return Command(_render(ctx, script), timeout=timeout)


def check(ctx: StepContext, host: HostPlan, check: str, **_: object) -> Command:
    return Command(_render(ctx, check), timeout=60)
