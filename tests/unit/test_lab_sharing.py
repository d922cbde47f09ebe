"""The lab tests share their deployments (tests/lab/fixtures.py): a module that starts fake hosts or a namespace of its
own is listed in OWN_HOSTS with the reason, and every shared deployment's users are modules that ask for it."""

import ast
from pathlib import Path
from types import SimpleNamespace

from tests.lab.fixtures import OWN_HOSTS, SHARED, order_shared_users

LAB = Path(__file__).parents[1] / "lab"
#: what starts hosts of a test's own: the fake-host factory, the localhost namespace, the lab class itself
OWN = {"fake_lab", "netns", "standin", "standin312", "docker_hosts"}


def uses(path: Path) -> tuple[set[str], bool]:
    """(fixture names the module's tests and fixtures ask for, whether it constructs a FakeHostLab itself)."""
    tree = ast.parse(path.read_text())
    asked = {a.arg for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
             for a in node.args.args}
    builds = any(isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "FakeHostLab"
                 for node in ast.walk(tree))
    return asked, builds


def modules() -> dict[str, tuple[set[str], bool]]:
    return {p.stem: uses(p) for p in sorted(LAB.glob("test_*.py"))}


def test_a_module_with_hosts_of_its_own_says_why():
    own = {name for name, (asked, builds) in modules().items() if asked & OWN or builds}
    assert own - set(OWN_HOSTS) == set(), "start hosts of their own without a reason in OWN_HOSTS"
    assert set(OWN_HOSTS) - own == set(), "listed in OWN_HOSTS but start no hosts of their own (remove them)"
    assert all(reason.strip() for reason in OWN_HOSTS.values())


def test_the_scan_sees_a_module_that_starts_its_own_hosts(tmp_path):
    """The control: a new lab module asking for fake_lab is found (and would fail the test above)."""
    path = tmp_path / "test_new_lab.py"
    path.write_text("def test_it(fake_lab):\n    lab = fake_lab(2)\n")
    asked, builds = uses(path)
    assert asked & OWN == {"fake_lab"} and not builds


def test_every_user_of_a_shared_deployment_asks_for_it_and_is_listed():
    found = modules()
    for name, spec in SHARED.items():
        askers = {m for m, (asked, _) in found.items() if name in asked}
        assert askers == set(spec.users), (name, askers, spec.users)


class Item:
    def __init__(self, module: str, fixtures: tuple[str, ...]) -> None:
        self.module = SimpleNamespace(__name__=f"tests.lab.{module}")
        self.fixturenames = fixtures
        self.nodeid = f"{module}::t"


def test_users_of_a_shared_deployment_run_together_in_its_order():
    items = [Item("test_a", ()), Item("test_planner_lab", ("three_hosts",)), Item("test_b", ()),
             Item("test_rollout_lab", ("three_hosts",)), Item("test_host_faults", ("two_hosts",)),
             Item("test_scale_lab", ("three_hosts",)), Item("test_c", ())]
    order = [i.module.__name__.rsplit(".", 1)[-1] for i in order_shared_users(items)]
    assert order == ["test_a", "test_scale_lab", "test_rollout_lab", "test_planner_lab", "test_b",
                     "test_host_faults", "test_c"]


def test_the_tests_of_a_shared_fixture_share_a_lane():
    from tests.conftest import OWN_LANE, SHARED_LANE, lane

    assert lane(Item("test_host_faults", ("two_hosts",))) == SHARED_LANE
    assert lane(Item("test_self_healing", ("two_hosts",))) == SHARED_LANE
    assert lane(Item("test_serving_lab", ("fake_lab", "reference_answers"))) == SHARED_LANE
    assert lane(Item("test_model_change_lab", ("fake_lab",))) == SHARED_LANE
    # the same module's localhost tests, the connector's, the unit tests: the other lane
    assert lane(Item("test_self_healing", ("netns",))) == OWN_LANE
    assert lane(Item("test_e2e_pd", ("pd",))) == OWN_LANE
    assert lane(Item("test_proxy", ())) == OWN_LANE
