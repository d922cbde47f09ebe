"""Names that cross from the hosts to the controller, spelled once on this side. The host scripts spell them in
deploy_scripts/hostlib.py (they run without yrpd); tests/unit/test_tags.py checks that both say the same. Also the
controller's own names for an instance's life (InstanceState), which the session stores and `yrpd status` reads.
StrEnum: a member prints and compares as its value, as the JSON from the hosts holds it."""

from __future__ import annotations

from enum import StrEnum


class ProcessState(StrEnum):
    """A supervised process as its supervisor (deploy_scripts/supervise.py) writes it, or as session_processes.py
    reports it when nothing watches it any more."""

    starting = "starting"
    running = "running"
    backoff = "backoff"  # dead, to be started again after a pause
    failed = "failed"  # given up: too many restarts in the window
    exited = "exited"  # ended with automatic restart off
    stopped = "stopped"  # stopped by yrpd
    dead = "dead"  # nothing watches it and it does not run
    unsupervised = "unsupervised"  # runs, but its supervisor was killed: nothing would restart it


class Condition(StrEnum):
    """What `yrpd status` shows of a process, from its state and whether it is alive."""

    running = "running"
    restarting = "restarting"
    failed = "failed"
    dead = "dead"


class ComponentState(StrEnum):
    """A data-system component as deploy_scripts/yr_cluster.py reports it, in `yr health`'s words (a supervisor's
    state it does not map comes upper-cased)."""

    running = "RUNNING"
    starting = "STARTING"
    stopped = "STOPPED"


class InstanceState(StrEnum):
    """Where an instance is in its life, as the reconciler moves it (yrpd/reconcile.py: the allowed moves are its
    TRANSITIONS, and the session's state.json keeps each instance's). An instance of a deployed session with none
    stored serves."""

    planned = "planned"  # in the desired state, not started yet
    starting = "starting"  # started; the proxy routes to it once it answers and reaches the data system
    serving = "serving"  # routed to
    draining = "draining"  # out of routing, its requests in flight ending
    stopping = "stopping"  # drained, its processes being stopped
    gone = "gone"  # stopped and out of the plan
    failed = "failed"  # its start failed: the same command run again starts it again
    dead = "dead"  # found not running, with nothing to restart it (a host rebuilt, a container gone)
