"""pytest fixtures for the fake-host lab (import them from a conftest.py).

A deployment costs minutes on the lab's two shared cores, so the lab tests share them: `two_hosts` (prefill, the
proxy and etcd on h1, decode on h2) for the host-fault and self-healing tests, `three_hosts` (deployed on h1 and h2,
h3 free to join) for the tests that change a running deployment, in the order SHARED names. Each test starts from a
health check and must leave the deployment healthy: one that does not fails at its tear-down, naming what is wrong,
and the next test gets a rebuilt deployment. A shared deployment is torn down (`yrpd down`, nothing left on any host)
after its last test, so no idle deployment runs beside the tests after it.

A test module that starts fake hosts (`fake_lab`) or a namespace (`netns`) of its own must be listed in OWN_HOSTS
with the reason; tests/unit/test_lab_sharing.py holds every module to it.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lab.fakehosts import SSHD, FakeHostLab, cleanup_stale
from lab.hosts import assert_nothing_left
from lab.report import write_report
from lab.traffic import TwoHosts
from tests.prereq import missing

__all__ = ["fake_lab", "two_hosts", "three_hosts", "shared_deployments", "lab_figures", "reference_answers",
           "OWN_HOSTS", "SHARED"]

_TOOLS = ("ip", "unshare", "nsenter", "ssh-keygen")

#: the lab test modules that start hosts of their own, and why they cannot use a shared deployment
OWN_HOSTS: dict[str, str] = {
    "test_fakehosts": "tests the fake hosts themselves: start, exec, close, a crashed lab's leftovers",
    "test_deploy_lab": "deploy's first run and its refusals: unreachable and unknown hosts, a failed preflight",
    "test_cluster_lab": "the cluster alone, once per launcher (dscli, yr), without vLLM",
    "test_spanning_lab": "instances spanning hosts: a topology no shared deployment has (decode's TP group over two "
                         "hosts of one core, prefill's DP ranks over two of two), and a rank killed to restart it whole",
    "test_docker_lab": "FAKE NPUs and a dockerd inside each host",
    "test_containers_pd": "a dockerd inside each host and the stand-in image, serving in containers",
    "test_containers_py312": "a dockerd inside each host and the Python 3.12 stand-in image",
    "test_serving_lab": "the real model (SmolLM2) with a client key, and h3 as an outsider on the cluster network",
    "test_many_instances_lab": "2 prefill and 2 decode instances of the real model on four hosts",
    "test_model_change_lab": "a model change needs a free host per role (4 hosts)",
    "test_host_faults": "the disk tier on a 2 MB tmpfs needs a deployment configured for it",
    "test_embedded_default": "`yrpd deploy --hosts localhost`, the demo's command, in a namespace as a user runs it",
    "test_self_healing": "the localhost kill matrix and restart settings (`restart: ...`) of their own",
    "test_bench": "`yrpd bench` redeploys its targets on localhost, in a namespace of its own",
}


def _lab_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "fake-host lab needs root"
    lacking = [t for t in _TOOLS if shutil.which(t) is None]
    if not os.access(SSHD, os.X_OK):
        lacking.append(SSHD)
    return f"fake-host lab needs {', '.join(lacking)}" if lacking else None


def _need_lab() -> None:
    reason = _lab_unavailable()
    if reason:
        missing(f"{reason} (scripts/bootstrap.sh installs what the lab tests need)")


def _own_hosts_allowed(request) -> None:
    module = request.node.module.__name__.rsplit(".", 1)[-1]
    if module not in OWN_HOSTS:
        pytest.fail(f"{module} starts fake hosts of its own: use a shared deployment (two_hosts, three_hosts in "
                    "tests/lab/fixtures.py), or list it in OWN_HOSTS there with the reason")


@pytest.fixture
def fake_lab(request, tmp_path):
    """Factory: ``make(n, prefix=None, **options)`` starts and returns a FakeHostLab of n hosts
    (options: fake_npus, overlays, docker; see lab/fakehosts.py).

    Every lab made is closed at teardown, whether the test passed or not.
    """
    _need_lab()
    _own_hosts_allowed(request)
    cleanup_stale()
    labs: list[FakeHostLab] = []

    def make(n: int, prefix: str | None = None, **options) -> FakeHostLab:
        lab = FakeHostLab(n, tmp_path / f"lab{len(labs)}", prefix=prefix, **options)
        labs.append(lab)
        return lab.start()

    yield make

    errors = []
    for lab in labs:
        try:
            lab.close()
        except Exception as exc:  # close the others anyway
            errors.append(exc)
    if errors:
        raise errors[0]


@dataclass(frozen=True)
class SharedSpec:
    """A deployment several test modules use in turn."""

    hosts: int  # fake hosts in the lab
    deployed_on: int  # the first n of them are in the deployment; the rest may join
    users: tuple[str, ...]  # the modules that use it, in the order they run (each may leave what the next needs)


#: fixture name -> what it deploys and who uses it (tests/lab/conftest.py runs the users in this order, together)
SHARED: dict[str, SharedSpec] = {
    "two_hosts": SharedSpec(hosts=2, deployed_on=2,
                            users=("test_host_faults", "test_self_healing", "test_migration_lab")),
    # the scale test joins h3 (its documented command), which the drain and the planner then use
    "three_hosts": SharedSpec(hosts=3, deployed_on=2,
                              users=("test_scale_lab", "test_rollout_lab", "test_planner_lab")),
}

#: how long a test may take to bring the deployment back to healthy after its last step (a restart it caused)
SETTLE_S = 180


@dataclass
class Shared:
    """One shared deployment's lab and its state across the tests that use it."""

    name: str
    spec: SharedSpec
    workdir: Path
    lab: FakeHostLab | None = None
    deployment: TwoHosts | None = None
    builds: int = 0
    broken: str = ""  # why the last test left it unusable: the next one rebuilds it
    uses: list[str] = field(default_factory=list)

    def acquire(self, test: str) -> TwoHosts:
        if self.deployment is None or self.broken:
            self.close(check=False)
            self._build()
        d = self.deployment
        report, _ = d.healthy(within=SETTLE_S)  # every test starts from a healthy deployment
        self.uses.append(test)
        return d

    def release(self, test: str) -> None:
        """After a test: the deployment must be healthy again (failing the test's tear-down if not)."""
        try:
            report, _ = self.deployment.healthy(within=SETTLE_S)
        except AssertionError as exc:
            self.broken = f"{test} left it unhealthy: {exc}"
            raise AssertionError(f"{test} left the shared deployment {self.name} unhealthy (rebuilt for the next "
                                 f"test): {exc}") from None

    def _build(self) -> None:
        _need_lab()
        cleanup_stale()
        self.builds += 1
        root = self.workdir / f"{self.name}-{self.builds}"
        self.lab = FakeHostLab(self.spec.hosts, root / "lab").start()
        self.deployment = TwoHosts(self.lab, root, n=self.spec.hosts)
        self.broken = ""
        try:
            self.deployment.deploy(on=self.spec.deployed_on)
        except BaseException:
            self.close(check=False)
            raise

    def close(self, check: bool = True) -> None:
        """`yrpd down`, then (check) nothing of the session left on any host, then the lab itself."""
        lab, d = self.lab, self.deployment
        self.lab = self.deployment = None
        if lab is None:
            return
        try:
            if d is not None:
                down = d.cli("down", check=None, timeout=300)
                if check:
                    assert down.returncode == 0 and "is down" in down.stderr, down.stderr[-2000:]
                    assert_nothing_left(lab)
        finally:
            lab.close()


class SharedDeployments:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.live: dict[str, Shared] = {}

    def get(self, name: str) -> Shared:
        if name not in self.live:
            self.live[name] = Shared(name, SHARED[name], self.workdir)
        return self.live[name]

    def close_all(self) -> None:
        errors = []
        for shared in self.live.values():
            try:
                shared.close(check=False)
            except Exception as exc:  # noqa: BLE001 - close the others anyway
                errors.append(exc)
        if errors:
            raise errors[0]


@pytest.fixture(scope="session")
def shared_deployments(tmp_path_factory):
    deployments = SharedDeployments(tmp_path_factory.mktemp("shared"))
    yield deployments
    deployments.close_all()  # what a last user did not close (a run stopped early, -x)


def _use_shared(request, name: str):
    module = request.node.module.__name__.rsplit(".", 1)[-1]
    if module not in SHARED[name].users:
        pytest.fail(f"{module} uses the shared deployment {name}: add it to SHARED[{name!r}].users "
                    "(tests/lab/fixtures.py), in the place it must run")
    shared = request.getfixturevalue("shared_deployments").get(name)
    deployment = shared.acquire(request.node.nodeid)
    yield deployment
    # the last test that uses it tears it down, checked; any other leaves it healthy for the next
    if request.node.nodeid == request.config.stash.get(LAST_USER, {}).get(name):
        shared.release(request.node.nodeid)
        shared.close()
    else:
        shared.release(request.node.nodeid)


@pytest.fixture
def two_hosts(request):
    """The shared 2-host deployment (SHARED["two_hosts"]): a lab.traffic.TwoHosts, deployed and healthy."""
    yield from _use_shared(request, "two_hosts")


@pytest.fixture
def three_hosts(request):
    """The shared 3-host deployment (SHARED["three_hosts"]): deployed on h1 and h2, h3 free to join."""
    yield from _use_shared(request, "three_hosts")


#: config.stash key: shared fixture name -> node id of the last test that uses it (set at collection)
LAST_USER = pytest.StashKey[dict]()


def order_shared_users(items: list) -> list:
    """The tests of each shared deployment run together, at the place of the first of them, in SHARED's module order
    (a test's order within its module kept); everything else keeps its place."""
    def users_of(item) -> str | None:
        for name in SHARED:
            if name in getattr(item, "fixturenames", ()):
                return name
        return None

    grouped: dict[str, list] = {}
    for item in items:
        name = users_of(item)
        if name:
            grouped.setdefault(name, []).append(item)
    for name, group in grouped.items():
        order = SHARED[name].users
        group.sort(key=lambda it: order.index(it.module.__name__.rsplit(".", 1)[-1])
                   if it.module.__name__.rsplit(".", 1)[-1] in order else len(order))
    out, placed = [], set()
    for item in items:
        name = users_of(item)
        if name is None:
            out.append(item)
        elif name not in placed:
            placed.add(name)
            out.extend(grouped[name])
    return out


def last_users(items: list) -> dict[str, str]:
    last: dict[str, str] = {}
    for item in items:
        for name in SHARED:
            if name in getattr(item, "fixturenames", ()):
                last[name] = item.nodeid
    return last


@pytest.fixture(scope="session")
def reference_answers():
    """One plain vLLM instance's greedy answers to every prompt the lab compares with, asked once per dtype in the
    session (tests/lab/real_model.py ReferenceAnswers): `reference_answers(dtype)` -> {prompt key: answer}."""
    from tests.lab.real_model import ReferenceAnswers

    return ReferenceAnswers()


#: item.stash key: the test's reports so far, by phase ("setup", "call"), for the figures' outcome
PHASES = pytest.StashKey[dict]()
#: report path -> {"figures": {...}, "tests": {node id: outcome}}: every test of a module writes one report
_REPORTS: dict[str, dict] = {}


@pytest.fixture
def lab_figures(request):
    """The figures a lab test measures (a dict it fills). Where the module names a REPORT_VARIABLE that is set in
    the environment, they are written to that file (lab/report.py, with provenance) with whether the test passed,
    passed or not, beside the figures of the module's other tests of this run."""
    figures: dict = {}
    yield figures
    variable = getattr(request.module, "REPORT_VARIABLE", None)
    path = os.environ.get(variable) if variable else None
    if not path:
        return
    phases = request.node.stash.get(PHASES, {})
    failed = any(r.failed for r in phases.values()) or "call" not in phases
    report = _REPORTS.setdefault(path, {"figures": {}, "tests": {}})
    report["figures"].update(figures)
    report["tests"][request.node.nodeid] = "failed" if failed else "passed"
    # the run as it was typed: the tests that ran before this one on a shared deployment are part of what it measured
    write_report(path, report["figures"], command=f"{variable}=... python -m pytest {' '.join(sys.argv[1:])}",
                 outcomes=report["tests"])
