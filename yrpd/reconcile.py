"""One reconciler for every change to a running deployment: a desired state (the spec, the hosts no new instance
goes to, how many instances a roll may take down at once) against what runs, and the next step that brings one
closer to the other.

`next_step` is pure: given `Desired` and `Observed` it names one `Step` (join hosts, start instances, retire
instances, restart dead ones) or None once they agree. `reconcile` asks for a step, has it carried out, observes
again and repeats; yrpd.live carries steps out on the hosts, tests on scripted hosts. Deploy, scale, drain, undrain
and the planner only say what they want (`Desired`).

The order it takes, one step at a time:
1. hosts the spec names and the deployment lacks join the cluster (before anything may be placed there);
2. dead instances start again where they were;
3. stale instances (started with other settings than the spec's, or on a host no new instance may use) are replaced,
   prefill first: where `max_unavailable` is 0 a new one starts before an old one drains (for a model change a new
   prefill and decode at once, since the proxy never pairs two models), else up to `max_unavailable` old ones drain
   first and their replacements start after;
4. counts: the highest-indexed instances beyond the spec's counts retire, then what is missing starts.

Each instance's life is in InstanceState (yrpd/tags.py) with the allowed moves in TRANSITIONS; `Lifecycle` keeps
them and refuses any other move, loudly: an illegal move is a bug in the reconciler or what carries its steps out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from yrpd.placement import InstancePlan, Plan
from yrpd.spec import DeploySpec
from yrpd.tags import InstanceState as S

ROLES = ("prefill", "decode")

#: every allowed move of an instance's life
TRANSITIONS: dict[S, frozenset[S]] = {
    S.planned: frozenset({S.starting}),
    S.starting: frozenset({S.serving, S.failed}),
    S.failed: frozenset({S.starting, S.stopping}),
    S.serving: frozenset({S.draining, S.dead}),
    S.draining: frozenset({S.stopping, S.serving}),  # back: its drain did not end in time, nothing was stopped
    S.stopping: frozenset({S.gone}),
    S.dead: frozenset({S.starting, S.stopping}),
    S.gone: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A move TRANSITIONS does not allow: a bug, never bad input."""


class Lifecycle:
    """Each instance's InstanceState, kept where `load` and `save` say (the session's state.json in yrpd.live)."""

    def __init__(self, states: Mapping[str, str] | None = None,
                 save: Callable[[dict[str, str]], None] | None = None):
        self.states = {name: S(state) for name, state in (states or {}).items()}
        self._save = save

    def state(self, name: str, default: S = S.serving) -> S:
        return self.states.get(name, default)

    def move(self, names: Iterable[str], to: S, default: S = S.serving) -> None:
        """Move each of `names` to `to` (one not kept yet is in `default`: an instance the first deploy started
        serves, one a step is about to start is planned)."""
        names = list(names)
        for name in names:
            now = self.state(name, default)
            if to not in TRANSITIONS[now]:
                raise IllegalTransition(f"instance {name}: {now.value} -> {to.value} is not a move of its life "
                                        f"(from {now.value}: {', '.join(sorted(s.value for s in TRANSITIONS[now])) or 'none'})")
        for name in names:
            if to is S.gone:
                self.states.pop(name, None)
            else:
                self.states[name] = to
        if self._save is not None and names:
            self._save({name: state.value for name, state in self.states.items()})


@dataclass(frozen=True)
class Desired:
    """What the deployment should be: written by deploy, scale, drain, undrain and the planner."""

    spec: DeploySpec
    #: hosts no new instance goes to; an instance on one is replaced (a drain)
    cordoned: tuple[str, ...] = ()
    #: old instances a roll may take down before their replacements start (0: start first)
    max_unavailable: int = 0


@dataclass(frozen=True)
class Observed:
    """What runs, as the hosts and the session say."""

    plan: Plan
    #: hosts that began to join and did not finish (the session remembers them)
    joining: tuple[str, ...] = ()
    #: instances found not running with nothing to restart them
    dead: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Join:
    hosts: tuple[str, ...]

    def line(self) -> str:
        return f"join {', '.join(self.hosts)}"


@dataclass(frozen=True)
class Start:
    #: instances to add, per role
    add: tuple[tuple[str, int], ...]

    @property
    def counts(self) -> dict[str, int]:
        return dict(self.add)

    def line(self) -> str:
        return "start " + ", ".join(f"{n} {role}" for role, n in self.add)


@dataclass(frozen=True)
class Retire:
    names: tuple[str, ...]

    def line(self) -> str:
        return f"drain and stop {', '.join(self.names)}"


@dataclass(frozen=True)
class Restart:
    names: tuple[str, ...]

    def line(self) -> str:
        return f"start {', '.join(self.names)} again"


Step = Join | Start | Retire | Restart


def _start(counts: Mapping[str, int]) -> Start:
    return Start(tuple((role, counts[role]) for role in ROLES if counts.get(role, 0) > 0))


def stale(plan: Plan, desired: Desired) -> list[InstancePlan]:
    """The instances to replace, prefill first: started with other settings than the spec gives them, or on a
    cordoned host."""
    spec, cordoned = desired.spec, set(desired.cordoned)
    return sorted((i for i in plan.instances if i.config != spec.instance_config(i.role) or cordoned & set(i.hosts)),
                  key=lambda i: (i.role != "prefill", i.index))


def next_step(desired: Desired, observed: Observed) -> Step | None:
    """The next step towards `desired` from `observed` (None: they agree)."""
    spec, plan = desired.spec, observed.plan
    have = {h.name for h in plan.hosts}
    joining = tuple(dict.fromkeys([*observed.joining, *(h.name for h in spec.hosts if h.name not in have)]))
    if joining:
        return Join(joining)
    dead = tuple(i.name for i in plan.instances if i.name in observed.dead)
    if dead:
        return Restart(dead)
    counts = {role: sum(1 for i in plan.instances if i.role == role) for role in ROLES}
    want = {role: getattr(spec, role) for role in ROLES}
    old = stale(plan, desired)
    if old:
        roles = list(dict.fromkeys(i.role for i in old))
        # a model change replaces a prefill and a decode instance together: the proxy pairs one model's only
        active = roles if any(i.group != spec.model_group for i in old) else roles[:1]
        if desired.max_unavailable == 0:
            # a replacement started: the old one it replaces drains next, one at a time, prefill first
            over = [role for role in active if counts[role] > want[role]]
            if over:
                return Retire((next(i.name for i in old if i.role == over[0]),))
            return _start({role: 1 for role in active})
        # the replacements of what was drained first, then the next batch of old ones
        short = {role: want[role] - counts[role] for role in ROLES if counts[role] < want[role]}
        if short:
            return _start(short)
        role = active[0]
        return Retire(tuple(i.name for i in old if i.role == role)[:desired.max_unavailable])
    extra = []
    for role in ROLES:
        mine = sorted((i for i in plan.instances if i.role == role), key=lambda i: i.index)
        extra += [i.name for i in mine[want[role]:]]
    if extra:
        return Retire(tuple(extra))
    missing = {role: want[role] - counts[role] for role in ROLES}
    if any(n > 0 for n in missing.values()):
        return _start(missing)
    return None


def reconcile(desired: Desired, observe: Callable[[], Observed], act: Callable[[Step], None],
              limit: int = 200) -> list[Step]:
    """Take steps until what runs is what is desired; the steps taken. A step that leaves the observed state as it
    was, or more than `limit` steps, is a bug: it raises rather than loop."""
    taken: list[Step] = []
    seen = None
    while (step := next_step(desired, now := observe())) is not None:
        if len(taken) >= limit or (taken and step == taken[-1] and now == seen):
            raise RuntimeError(f"the reconciler does not converge: {step.line()} again after {len(taken)} steps "
                               f"({'; '.join(s.line() for s in taken[-5:])})")
        act(step)
        taken.append(step)
        seen = now
    return taken
