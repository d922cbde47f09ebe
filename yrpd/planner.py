"""The SLA planner's decision: from the proxy's recent TTFT and ITL and what runs, add, remove or move one instance.

Pure: `decide` takes what the proxy measured (its `/yrpd/status` "latency" over the planner's window), the instance
counts, whether given counts would fit the hosts' devices (`fits`), and the time since the last change; `yrpd planner`
(yrpd.live.run_planner) feeds it every `interval_s` and carries out what it returns through the same moves as
`yrpd scale`. One change at a time, then `cooldown_s` for its effect to show in the window.

TTFT over its target asks for prefill (the prompt's computation is what a first token waits for), ITL over its
target for decode; where both are over, the role further over its target. Where the role cannot grow (at its
maximum, or no device is free), an instance of the other role moves over if that role is comfortably within its own
target. An instance is removed only while its role's figure stays under `scale_in_below` of the target.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Callable

from yrpd.spec import PlannerSettings


class Action(str, Enum):
    hold = "hold"
    add = "add"  # one more instance of `role`
    remove = "remove"  # one instance of `role` less
    move = "move"  # one instance of the other role becomes one of `role`


@dataclass(frozen=True)
class Observed:
    """What the proxy measured over the window: p90s in ms (None: no sample) and how many streamed requests."""

    ttft_p90_ms: float | None
    itl_p90_ms: float | None
    samples: int

    @classmethod
    def from_status(cls, latency: dict) -> "Observed":
        return cls(latency["ttft_ms"]["p90"], latency["itl_ms"]["p90"], latency["ttft_ms"]["n"])


@dataclass(frozen=True)
class Decision:
    action: Action
    role: str | None
    reason: str

    def counts(self, counts: dict[str, int]) -> dict[str, int]:
        """The instance counts after it."""
        out = dict(counts)
        if self.action is Action.add:
            out[self.role] += 1
        elif self.action is Action.remove:
            out[self.role] -= 1
        elif self.action is Action.move:
            out[self.role] += 1
            out[_other(self.role)] -= 1
        return out

    def to_dict(self) -> dict:
        return {**asdict(self), "action": self.action.value}


def _other(role: str) -> str:
    return "decode" if role == "prefill" else "prefill"


def decide(settings: PlannerSettings, seen: Observed, counts: dict[str, int], fits: Callable[[dict[str, int]], bool],
           since_change_s: float) -> Decision:
    if since_change_s < settings.cooldown_s:
        return Decision(Action.hold, None, f"cooling down: {since_change_s:.0f} of {settings.cooldown_s:g} s since "
                                           "the last change")
    if seen.samples < settings.min_samples or seen.ttft_p90_ms is None:
        return Decision(Action.hold, None, f"{seen.samples} streamed requests in the last {settings.window_s:g} s: "
                                           f"judged from {settings.min_samples}")
    # None: not judged (decode with an ITL target but no ITL sample in the window); without an ITL target decode
    # is judged by TTFT for giving instances back, never for asking for more
    ratio: dict[str, float | None] = {"prefill": seen.ttft_p90_ms / settings.ttft_p90_ms, "decode": None}
    if settings.itl_p90_ms and seen.itl_p90_ms is not None:
        ratio["decode"] = seen.itl_p90_ms / settings.itl_p90_ms
    figures = f"TTFT p90 {seen.ttft_p90_ms:.0f} ms (target {settings.ttft_p90_ms:g})"
    if settings.itl_p90_ms and seen.itl_p90_ms is not None:
        figures += f", ITL p90 {seen.itl_p90_ms:.0f} ms (target {settings.itl_p90_ms:g})"
    bounds = {role: (getattr(settings, f"min_{role}"), getattr(settings, f"max_{role}")) for role in ratio}
    judged = {**ratio, "decode": ratio["prefill"]} if not settings.itl_p90_ms else ratio
    comfortable = {role: r is not None and r < settings.scale_in_below for role, r in judged.items()}
    over = [role for role, r in ratio.items() if r is not None and r > 1]
    if over:
        role = max(over, key=lambda r: ratio[r])
        other = _other(role)
        grown = Decision(Action.add, role, f"{figures}: one more {role} instance")
        if counts[role] < bounds[role][1] and fits(grown.counts(counts)):
            return grown
        moved = Decision(Action.move, role, f"{figures}: no device free for one more {role} instance, one "
                                            f"{other} instance becomes one")
        if counts[role] < bounds[role][1] and counts[other] > bounds[other][0] and comfortable[other] \
                and fits(moved.counts(counts)):
            return moved
        why = "at its maximum" if counts[role] >= bounds[role][1] else "no device is free"
        return Decision(Action.hold, None, f"{figures}: over target, but {role} cannot grow ({why})")
    for role in ("prefill", "decode"):
        if counts[role] > bounds[role][0] and comfortable[role]:
            return Decision(Action.remove, role, f"{figures}: under {settings.scale_in_below:g} of the target, one "
                                                 f"{role} instance less")
    return Decision(Action.hold, None, f"{figures}: within target")
