"""One reconciler for every change to a deployment, its first deploy included: a desired state (the spec, the hosts
no new instance goes to, how many instances a roll may take down at once, whether every step of the deploy playbook
must be checked) against what runs, and the next step that brings one closer to the other.

`next_step` is pure: given `Desired` and `Observed` it names one `Step` or None once they agree. `reconcile` asks
for a step, has it carried out, observes again and repeats; yrpd.live carries steps out on the hosts, tests on
scripted hosts. Deploy, scale, drain, undrain and the planner only say what they want (`Desired`).

The order it takes, one step at a time:
1. `anew` (a change that cannot roll, deployed with --recreate): what runs is torn down first (`TearDown`);
2. nothing placed yet, a deploy that stopped half-way, or `whole` not yet checked in this command: the deploy
   playbook runs on every host of the spec's plan (`BringUp`; its per-step checks are what observes the hosts there,
   so what holds is skipped and what died is started again);
3. hosts the spec names and the deployment lacks join the cluster (before anything may be placed there);
4. instances that are down (a start that failed or was cut short, or found dead on their hosts) start again where
   they were, before anything drains;
5. stale instances (started with other settings than the spec's, or on a host being evacuated) are replaced, prefill
   first, at the counts `roll_counts` gives (the running ones, when the change began: a roll never needs room for
   more than one instance beyond what ran, nor leaves a role short while it also scales down): where
   `max_unavailable` is 0 a new one starts before an old one drains (for a model change a new prefill and decode at
   once, since the proxy never pairs two models), else up to `max_unavailable` old ones drain first and their
   replacements start after. Where the spec wants fewer than run (a drain that finds no room for a replacement),
   old ones retire without one;
6. counts: the highest-indexed instances beyond the spec's counts retire, then what is missing starts.

Each instance's life is in InstanceState (yrpd/tags.py) with the allowed moves in TRANSITIONS; `Lifecycle` keeps
them and refuses any other move, loudly: an illegal move is a bug in the reconciler or what carries its steps out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from yrpd import placement
from yrpd.placement import Plan
from yrpd.spec import COUNT_FIELDS, DeploySpec
from yrpd.tags import InstanceState as S

ROLES = COUNT_FIELDS

#: every allowed move of an instance's life
TRANSITIONS: dict[S, frozenset[S]] = {
    S.planned: frozenset({S.starting}),
    S.starting: frozenset({S.serving, S.failed}),
    S.failed: frozenset({S.starting, S.stopping}),  # started again, or retired (it never served: no drain)
    S.serving: frozenset({S.draining, S.dead}),
    S.draining: frozenset({S.stopping, S.serving}),  # back: its drain did not end in time, nothing was stopped
    S.stopping: frozenset({S.gone}),
    S.dead: frozenset({S.starting, S.stopping}),
    S.gone: frozenset(),
}
#: the states of an instance that should serve and does not: the reconciler starts it again first
DOWN = frozenset({S.failed, S.dead})


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
    #: hosts no new instance goes to (the drained ones)
    cordoned: tuple[str, ...] = ()
    #: hosts whose instances are replaced elsewhere (a drain's)
    evacuate: tuple[str, ...] = ()
    #: old instances a roll may take down before their replacements start (0: start first)
    max_unavailable: int = 0
    #: the counts per role a roll is taken at, the spec's after it (None: the spec's throughout)
    roll_counts: tuple[tuple[str, int], ...] | None = None
    #: every step of the deploy playbook holds on every host (`yrpd deploy` of a spec that changes nothing that
    #: runs): only the playbook's own checks can say so, so it runs once in the command that asks
    whole: bool = False
    #: what runs goes first and the spec deploys in a new session (`yrpd deploy --recreate`: a change that cannot
    #: roll)
    anew: bool = False


@dataclass(frozen=True)
class Observed:
    """What runs, as the hosts and the session say."""

    #: None: nothing is placed (no session, or one that stopped before it had a plan)
    plan: Plan | None
    #: hosts that began to join and did not finish (the session remembers them)
    joining: tuple[str, ...] = ()
    #: instances that should serve and do not (DOWN: a start that failed or was cut short, found dead)
    down: frozenset[str] = frozenset()
    #: the deploy playbook ran to its end on `plan` (False: it stopped half-way, the session says)
    up: bool = True
    #: it did so in this command, on every host of the plan
    checked: bool = False
    #: the session is this command's own: nothing of it ran before the command began
    new: bool = False


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


@dataclass(frozen=True)
class BringUp:
    def line(self) -> str:
        return "run the deploy playbook on every host (each step's check skips what holds)"


@dataclass(frozen=True)
class TearDown:
    def line(self) -> str:
        return "tear what runs down (requests fail until the new session serves)"


Step = TearDown | BringUp | Join | Start | Retire | Restart


def _start(counts: Mapping[str, int]) -> Start:
    return Start(tuple((role, counts[role]) for role in ROLES if counts.get(role, 0) > 0))


def next_step(desired: Desired, observed: Observed) -> Step | None:
    """The next step towards `desired` from `observed` (None: they agree)."""
    spec, plan = desired.spec, observed.plan
    if desired.anew and plan is not None and not observed.new:
        return TearDown()
    if plan is None or not observed.up or (desired.whole and not observed.checked):
        return BringUp()
    if not spec.disaggregated:
        # plain instances (role single): nothing but the playbook places them, and nothing changes them live (no
        # proxy routes around an instance while it changes: yrpd.live refuses)
        return None
    have = {h.name for h in plan.hosts}
    joining = tuple(dict.fromkeys([*observed.joining, *(h.name for h in spec.hosts if h.name not in have)]))
    if joining:
        return Join(joining)
    down = tuple(i.name for i in plan.instances if i.name in observed.down)
    if down:
        return Restart(down)
    counts = placement.counts(plan)
    want = {role: getattr(spec, role) for role in ROLES}
    old = placement.stale(plan, spec, desired.evacuate)
    if old:
        # the roll's own counts: the spec's may differ (a change that also scales), which step 4 then takes
        base = {**want, **dict(desired.roll_counts or ())}
        roles = list(dict.fromkeys(i.role for i in old))
        # a model change replaces a prefill and a decode instance together: the proxy pairs one model's only
        active = roles if any(i.group != spec.model_group for i in old) else roles[:1]
        if desired.max_unavailable == 0:
            # a replacement started (or the spec wants fewer): an old one drains next, one at a time, prefill first
            over = [role for role in active if counts[role] > base[role]]
            if over:
                return Retire((next(i.name for i in old if i.role == over[0]),))
            return _start({role: 1 for role in active})
        # the replacements of what was drained first, then the next batch of old ones
        short = {role: base[role] - counts[role] for role in ROLES if counts[role] < base[role]}
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
              limit: int = 200, only: tuple[type, ...] | None = None) -> list[Step]:
    """Take steps until what runs is what is desired (with `only`: until the next step is of another kind); the
    steps taken. A step that leaves the observed state as it was, or more than `limit` steps, is a bug: it raises
    rather than loop."""
    taken: list[Step] = []
    seen = None
    while (step := next_step(desired, now := observe())) is not None:
        if only is not None and not isinstance(step, only):
            break
        if len(taken) >= limit or (taken and step == taken[-1] and now == seen):
            raise RuntimeError(f"the reconciler does not converge: {step.line()} again after {len(taken)} steps "
                               f"({'; '.join(s.line() for s in taken[-5:])})")
        act(step)
        taken.append(step)
        seen = now
    return taken
