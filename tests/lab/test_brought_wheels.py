"""The wheels a docker deployment brings to hosts without a package index exist, for the image's Python (3.11: the
guide's image, 3.12: today's releases) on both architectures Ascend hosts have, and are fetched here with this
machine's pip as the deploy fetches them (yrpd.wheels.fetch; the package index must be reachable)."""

import platform
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from yrpd import versions, wheels
from yrpd.placement import HostInventory, make_plan
from yrpd.spec import ClusterLauncher, DeviceKind, build_spec
from yrpd.steps import StepContext
from yrpd.steps.brought import CLIENT, CLUSTER, ETCD, needed

pytestmark = pytest.mark.e2e

#: kept across runs on one machine (a set is fetched once); a fresh clone's CI fetches them anew
CACHE = Path("/var/cache/yrpd/brought-wheels")
IMAGES = {"3.11": "quay.io/ascend/vllm-ascend:v0.10.0rc1-openeuler", "3.12": "quay.io/ascend/vllm-ascend:v0.23.0"}


def sets_for(python: str, arch: str) -> dict[str, dict]:
    spec = build_spec({}, {"hosts": "h1,h2", "model": "/models/m", "device_kind": "npu", "devices": "0-7",
                           "image": IMAGES[python]})
    assert spec.launcher is ClusterLauncher.dscli
    plan = make_plan(spec, {h: HostInventory(DeviceKind.npu, tuple(range(8)), f"10.0.0.{i + 1}", arch=arch)
                            for i, h in enumerate(("h1", "h2"))})
    ctx = StepContext(spec, plan)
    return {h.name: needed(ctx, h) for h in plan.hosts}


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_every_wheel_a_container_needs_is_fetched_for_its_python_and_architecture(python, arch, tmp_path):
    per_host = sets_for(python, arch)
    # the master gets etcd, every host the data system; nothing brings the yr CLI's package to install
    assert set(per_host["h1"]) == {CLUSTER, ETCD, CLIENT} and set(per_host["h2"]) == {CLUSTER, CLIENT}
    tag = f"cp{python.replace('.', '')}"
    for name, ws in per_host["h1"].items():
        files = wheels.fetch(ws, CACHE)
        assert files, (name, ws)
        names = [f.name for f in files]
        for f in names:  # each wheel is for this platform, or pure Python
            assert f.endswith("-none-any.whl") or arch in f, (name, f)
        if name == ETCD:
            # the openyuanrong wheel is only unpacked for its static etcd: its cp311 tag binds no Python
            (wheel,) = files
            assert wheel.name.startswith(f"openyuanrong-{versions.OPENYUANRONG}-cp311") and not ws.deps
            with zipfile.ZipFile(wheel) as z:
                assert {"yr/third_party/etcd/etcd", "yr/third_party/etcd/etcdctl"} <= set(z.namelist())
        else:
            ds = [f for f in names if f.startswith(f"openyuanrong_datasystem-{versions.OPENYUANRONG_DATASYSTEM}-")]
            assert len(ds) == 1 and f"-{tag}-" in ds[0], names
            assert not any(f.startswith("openyuanrong-") for f in names), names  # no yr CLI
        if name == CLUSTER and (python, arch) == (f"{sys.version_info[0]}.{sys.version_info[1]}", platform.machine()):
            # the venv is made from these with no index, as install_openyuanrong.sh makes it in the container
            venv = tmp_path / "ds"
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            pip = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "--no-index", "--find-links",
                                  str(files[0].parent), f"openyuanrong-datasystem=={versions.OPENYUANRONG_DATASYSTEM}"],
                                 capture_output=True, text=True, stdin=subprocess.DEVNULL)
            assert pip.returncode == 0, pip.stderr[-2000:]
            assert (venv / "bin/dscli").exists()


def test_a_brought_data_system_is_read_from_the_real_wheel_and_fetched_from_where_the_user_put_it(tmp_path):
    """datasystem_wheels with the real openyuanrong-datasystem 0.8.1 wheel (the package index's, put in a directory of
    the user's): its version and HeteroClient's methods are read from the wheel, a release that needs newer calls is
    refused naming them, and the wheels a container gets are fetched with that directory as a source."""
    from yrpd import ascend_store, dswheels
    from yrpd.errors import SpecError
    from yrpd.steps import brought

    real = wheels.fetch(wheels.client_set("3.12", "aarch64"), CACHE)
    own = tmp_path / "my-wheels"
    own.mkdir()
    for f in real:
        (own / f.name).write_bytes(f.read_bytes())
    ds = dswheels.bring(str(own))
    assert ds.version == versions.OPENYUANRONG_DATASYSTEM and not ds.coordinator
    assert {"init", "exist", "mget_h2d", "mset_d2h"} <= ds.client_methods
    assert ds.lacks(ascend_store.MISSING_IN_DATASYSTEM) == list(ascend_store.MISSING_IN_DATASYSTEM)
    base = {"hosts": "h1,h2", "model": "/models/m", "device_kind": "npu", "devices": "0-7",
            "image": IMAGES["3.12"].replace("v0.23.0", "v0.30.0rc2"), "datasystem_wheels": str(own)}
    with pytest.raises(SpecError) as refused:
        build_spec({}, {**base, "kv_connector": "ascend-store"})
    assert f"which the openyuanrong-datasystem 0.8.1 brought in {own} lacks" in str(refused.value)
    assert all(m in str(refused.value) for m in ascend_store.MISSING_IN_DATASYSTEM)
    # control: yrpd's own connector serves with it, and the hosts' sets are fetched with that directory as a source
    spec = build_spec({}, base)
    plan = make_plan(spec, {h: HostInventory(DeviceKind.npu, tuple(range(8)), f"10.0.0.{i + 1}", arch="aarch64")
                            for i, h in enumerate(("h1", "h2"))})
    client = brought.needed(StepContext(spec, plan), plan.hosts[0])[brought.CLIENT]
    assert client.find_links == (str(own),)
    got = wheels.fetch(client, tmp_path / "cache")
    assert [f.name for f in got] == [f.name for f in real]
