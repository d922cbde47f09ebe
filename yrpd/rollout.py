"""A changed spec against a running deployment: what changed, whether it can roll, and in what order.

Pure: `yrpd plan` shows the same diff and steps `yrpd deploy` then takes. Fields fall in four kinds: an instance's
own settings (INSTANCE_FIELDS) roll, instance by instance (the new one starts and joins before the old one drains and
stops, or the other way round where no device is spare); the instance counts scale (`yrpd scale`'s removal and
addition); a few settings take effect without restarting anything; everything else (the cluster, the data system,
ports, the runtime, a host taken away) cannot change under a running deployment and needs `--recreate` (down, then
deploy). Hosts added at the end of the list join: their data system workers join the cluster, and instances go
there where a count change or a later scale places them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from yrpd.errors import SpecError
from yrpd.placement import HostInventory, InstancePlan, Plan, make_plan
from yrpd.spec import INSTANCE_FIELDS, DeploySpec


class ChangeKind(str, Enum):
    roll = "roll"  # instances are replaced one by one
    scale = "scale"  # instances are added or removed
    free = "free"  # read by yrpd itself: nothing restarts
    join = "join"  # hosts added after the others: they join the cluster, nothing that runs restarts
    recreate = "recreate"  # cannot change under a running deployment


COUNT_FIELDS = ("prefill", "decode")
#: read where yrpd runs (how to reach the hosts, how long to wait), never by a running process
FREE_FIELDS = ("ssh", "startup_timeout_s", "min_free_disk_gb", "planner")


@dataclass(frozen=True)
class Change:
    field: str
    old: object
    new: object
    kind: ChangeKind

    def line(self) -> str:
        return f"{self.field}: {self.old!r} -> {self.new!r} ({self.kind.value})"


def kind_of(name: str) -> ChangeKind:
    if name in INSTANCE_FIELDS:
        return ChangeKind.roll
    if name in COUNT_FIELDS:
        return ChangeKind.scale
    if name in FREE_FIELDS:
        return ChangeKind.free
    return ChangeKind.recreate


def diff(old: DeploySpec, new: DeploySpec) -> list[Change]:
    """Every top-level spec field whose value differs, in the spec's field order (hosts by name)."""
    a, b = old.model_dump(mode="json"), new.model_dump(mode="json")
    changes = []
    for k in b:
        if a.get(k) == b.get(k):
            continue
        if k == "hosts":
            names = [h.name for h in old.hosts], [h.name for h in new.hosts]
            if joined_hosts(old, new):
                changes.append(Change(k, *names, ChangeKind.join))
            elif names[0] != names[1]:
                changes.append(Change(k, *names, ChangeKind.recreate))
            else:  # the same hosts with other settings: show those
                was, now = _set(a[k]), _set(b[k])
                changes.append(Change(k, [h for h in was if h not in now], [h for h in now if h not in was],
                                      ChangeKind.recreate))
        else:
            changes.append(Change(k, a.get(k), b.get(k), kind_of(k)))
    return changes


def _set(hosts: list[dict]) -> list[dict]:
    """Host entries with only the settings given (None left out), for a readable diff line."""
    return [{k: v for k, v in h.items() if v is not None} for h in hosts]


def joined_hosts(old: DeploySpec, new: DeploySpec) -> list[str]:
    """The hosts `new` adds after all of `old`'s, each of those unchanged and in its place (so the master stays);
    [] where the lists differ any other way."""
    before, after = old.model_dump(mode="json")["hosts"], new.model_dump(mode="json")["hosts"]
    if len(after) <= len(before) or after[:len(before)] != before:
        return []
    return [h.name for h in new.hosts[len(before):]]


def stale(plan: Plan, spec: DeploySpec, evacuate=()) -> list[InstancePlan]:
    """The instances of `plan` started with other settings than `spec` gives them, or on a host of `evacuate` (a
    drain's), prefill first."""
    leaving = set(evacuate)
    return sorted((i for i in plan.instances if i.config != spec.instance_config(i.role) or leaving & set(i.hosts)),
                  key=lambda i: (i.role != "prefill", i.index))


def refuse_unrollable(changes: list[Change], session_id: str) -> None:
    blocked = [c.field for c in changes if c.kind is ChangeKind.recreate]
    if blocked:
        raise SpecError("deploy", f"session {session_id} is running and {', '.join(blocked)} cannot change under it "
                        "(only instance settings roll, instance counts scale and hosts added after the others join)",
                        "pass --recreate to tear it down and deploy anew (requests fail meanwhile), or undo that change")


def counts(plan: Plan) -> dict[str, int]:
    return counts_of(plan.instances)


def counts_of(instances) -> dict[str, int]:
    return {role: sum(1 for i in instances if i.role == role) for role in COUNT_FIELDS}


def with_counts(spec: DeploySpec, plan: Plan, **change: int) -> DeploySpec:
    """`spec` asking for the instances `plan` runs, `change` added per role."""
    now = counts(plan)
    return spec.model_copy(update={role: now[role] + change.get(role, 0) for role in COUNT_FIELDS})


def replan(spec: DeploySpec, inventory: dict[str, HostInventory], instances, cordoned=(), **change: int) -> Plan:
    """The plan of `instances` as they run, with `change` more (or fewer) per role placed on free devices of hosts
    not `cordoned`: what a change's next step runs (SpecError where it does not fit)."""
    now = counts_of(instances)
    wanted = spec.model_copy(update={role: now[role] + change.get(role, 0) for role in COUNT_FIELDS})
    return make_plan(wanted, inventory, keep=instances, cordoned=cordoned)


def surge(plan: Plan, spec: DeploySpec) -> dict[str, int]:
    """What a rolling change starts before it retires: one instance of the first replaced role, or, where the model
    changes (an old instance's group differs), one of each replaced role at once, so a complete pair of the new model
    serves before the old pair drains (the proxy never pairs two models)."""
    old = stale(plan, spec)
    if not old:
        return {}
    if any(i.group != spec.model_group for i in old):
        return {i.role: 1 for i in old}
    return {old[0].role: 1}


def default_max_unavailable(spec: DeploySpec, inventory: dict[str, HostInventory], plan: Plan,
                            cordoned: list[str] = ()) -> int:
    """0 where the surge (above) fits beside everything `plan` runs (each new instance then starts before its old
    one drains), else 1."""
    try:
        make_plan(with_counts(spec, plan, **surge(plan, spec)), inventory, keep=plan.instances, cordoned=cordoned)
    except SpecError:
        return 1
    return 0


def describe(changes: list[Change], plan: Plan, spec: DeploySpec, max_unavailable: int) -> list[str]:
    """What a deploy of `spec` does to the running `plan`, line by line (shown before it acts, and by `yrpd plan`)."""
    lines = [c.line() for c in changes]
    for c in changes:
        if c.kind is ChangeKind.join:
            added = c.new[len(c.old):]
            lines.append(f"join {', '.join(added)}: {'its' if len(added) == 1 else 'their'} data system worker joins "
                         "the cluster, nothing that runs restarts")
    replaced = stale(plan, spec)
    if replaced:
        how = ("start each new instance, then drain and stop the old one" if max_unavailable == 0 else
               f"drain and stop up to {max_unavailable} old instance(s) at a time, then start their replacements")
        lines.append(f"replace {', '.join(i.name for i in replaced)} one by one ({how})")
    now = counts(plan)
    for role in COUNT_FIELDS:
        target = getattr(spec, role)
        if target != now[role]:
            lines.append(f"{role}: {now[role]} -> {target} instances")
    return lines
