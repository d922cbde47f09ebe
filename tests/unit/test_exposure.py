"""yrpd/exposure.py: who may reach each port of a deployment, as `yrpd plan` shows it."""

from yrpd.exposure import Guard, exposure
from yrpd.placement import HostInventory, make_plan
from yrpd.spec import DeviceKind, build_spec


def rows_for(hosts=("h1", "h2"), kind=DeviceKind.npu, **over):
    spec = build_spec({}, {"hosts": ",".join(hosts), "model": "/models/m", "device_kind": kind.value, **over})
    ips = {h: ("127.0.0.1" if h == "localhost" else f"10.0.0.{i + 1}") for i, h in enumerate(hosts)}
    plan = make_plan(spec, {h: HostInventory(kind, tuple(range(8)), ips[h]) for h in hosts})
    return {(r.host, r.port): r for r in exposure(spec, plan)}


def test_the_proxy_and_the_instances_check_callers_and_what_does_not_is_named(monkeypatch):
    monkeypatch.setenv("YRPD_TEST_KEY", "k")
    rows = rows_for(api_key_env="YRPD_TEST_KEY", ptp=4, dtp=4)
    assert rows[("h1", "8000")].guard is Guard.api_key and rows[("h1", "8000")].callers == "clients"
    assert rows[("h1", "8100")].guard is Guard.token and rows[("h2", "8100")].guard is Guard.token
    assert {rows[k].guard for k in (("h1", "31501"), ("h2", "31501"))} == {Guard.curve}
    # the dscli launcher (the default) runs no data system master; the yr launcher's is CURVE-keyed too
    assert ("h1", "12123") not in rows
    yr = rows_for(api_key_env="YRPD_TEST_KEY", ptp=4, dtp=4, cluster_launcher="yr", runtime="host")
    assert yr[("h1", "12123")].guard is Guard.curve and ("h2", "12123") not in yr
    assert {rows[k].guard for k in (("h1", "32379"), ("h1", "32380"))} == {Guard.certificate}
    row = rows[("h2", "61000-61015")]
    assert row.guard is Guard.nothing and row.listens_on == "10.0.0.2", row  # never 0.0.0.0
    assert not any(port == "8300" for _, port in rows)  # instances on one host open no coordination port
    assert rows[("h2", "31501")].listens_on == "10.0.0.2"
    # without a key the proxy is open to whoever reaches its address, and the plan says so
    assert rows_for(ptp=4, dtp=4)[("h1", "8000")].guard is Guard.nothing


def test_a_dp_group_spanning_hosts_names_its_unprotected_coordination_port_on_its_head():
    rows = rows_for(ptp=4, pdp=3, dtp=4)  # prefill-0: two ranks on h1, one on h2; decode-0 on h2
    row = rows[("h1", "8300")]
    assert row.guard is Guard.nothing and row.listens_on == "10.0.0.1" and "h2" in row.callers
    assert ("h2", "8300") not in rows


def test_on_one_host_the_unchecked_ports_listen_on_loopback_only():
    rows = rows_for(hosts=("localhost",), kind=DeviceKind.cpu, devices="0-1")
    assert rows[("localhost", "8000")].guard is Guard.loopback
    assert rows[("localhost", "31501")].guard is Guard.curve
    assert not any(key[1].startswith("61000") for key in rows)  # no HCCL on CPU hosts
    lmcache = rows_for(hosts=("localhost",), kind=DeviceKind.cpu, devices="0-1", kv_connector="lmcache",
                       disaggregated=False)
    assert lmcache[("localhost", "32600")].listens_on == "127.0.0.1" and ("localhost", "8000") not in lmcache
