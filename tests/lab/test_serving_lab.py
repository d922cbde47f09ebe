"""The whole product on two fake hosts with the real model (builtin:smollm2): real sshd, real openYuanrong data
system, real vLLM CPU instances with our connector, the proxy. Prefill on h1, decode on h2: the KV cache crosses
hosts through the data system, and the answers are those of one plain instance."""

import json
import os
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import run_yrpd
from tests.lab import real_model as rm
from tests.lab.prometheus import scraping
from lab.hosts import leftovers, session_processes
from tests.prereq import missing as prerequisite

pytestmark = [pytest.mark.lab, pytest.mark.e2e]


@pytest.fixture(autouse=True)
def _need_venvs():
    missing = [v for v in ("ds", "vllm") if not Path(rm.ENV_ROOT, v, "bin", "python").exists()]
    if missing:
        prerequisite(f"venvs {missing} missing under {rm.ENV_ROOT}: run scripts/test.sh (it installs them)")


def test_pd_across_two_hosts_answers_like_one_instance_and_tears_down_clean(fake_lab, tmp_path,
                                                                          reference_answers):
    lab = fake_lab(3)  # h3 is not part of the deployment: it is where an outsider on the cluster network stands
    home = tmp_path / "home"
    config = tmp_path / "yrpd.yaml"
    # each fake host gets its own core: they share this machine's CPUs
    config.write_text(
        "hosts:\n  - {address: h1, devices: [0]}\n  - {address: h2, devices: [1]}\n"
        f"device_kind: cpu\nmodel: builtin:smollm2\nenv_path: {rm.ENV_ROOT}\ndatasystem_memory_mb: 256\n"
        "cluster_mode: ds_only\napi_key_env: YRPD_LAB_KEY\n")
    key = "lab-key-" + os.urandom(8).hex()
    ssh = lab.cli_ssh_args
    env = {"YRPD_HOME": str(home), "YRPD_LAB_KEY": key}

    def cli(*args, check=None, timeout=600):
        return run_yrpd(*args, *ssh, env=env, check=check, timeout=timeout)

    rm.ensure_model()  # the lab's hosts have no package index: the deploy finds it made
    # the dtype the deploy will use, chosen from the hosts' CPUs: the reference computes in the same one
    plan = json.loads(cli("plan", "--hosts", "h1,h2", "--config", str(config), "--json", check=0).stdout)
    assert plan["dtype"]["dtype"] in ("float32", "bfloat16") and plan["dtype"]["reason"].startswith("auto: ")
    want = reference_answers.answers(plan["dtype"]["dtype"])  # before the deploy: the reference has the cores alone
    try:
        started = time.monotonic()
        deploy = cli("deploy", "--hosts", "h1,h2", "--ptp", "1", "--dtp", "1", "--config", str(config), check=0,
                     timeout=1500)
        print(f"measured: 2-host deploy {time.monotonic() - started:.1f}s\n{deploy.stderr}")
        proxy = deploy.stdout.strip().splitlines()[-1]
        assert proxy == f"http://{lab['h1'].address}:8000", deploy.stdout
        assert f"try: curl -s {proxy}/v1/completions" in deploy.stderr

        report = json.loads(cli("status", "--json", check=0).stdout)
        placed = {i["name"]: (i["role"], i["host"]) for i in report["instances"]}
        assert placed == {"prefill-0": ("prefill", "h1"), "decode-0": ("decode", "h2")}
        assert report["healthy"] and report["proxy"]["healthy"] and report["proxy"]["url"] == proxy

        # from h3: the proxy's key is the only way in; each instance answers 401 without the deployment's token,
        # and 200 with it (the keyed control: the instance is reachable from h3, the 401 is the token's doing)
        secrets = next((home / "sessions").glob("2*")) / "secrets"
        token = (secrets / "instance.token").read_text().strip()

        def from_h3(url, auth=None):
            header = f"-H 'Authorization: Bearer {auth}' " if auth else ""
            return lab["h3"].exec(f"curl -s -o /dev/null -w '%{{http_code}}' {header}{url}", check=False).stdout
        for instance in report["instances"]:
            assert from_h3(f"{instance['url']}/v1/models") == "401", instance["name"]
            assert from_h3(f"{instance['url']}/v1/models", key) == "401"  # the client's key is not the token
            assert from_h3(f"{instance['url']}/v1/models", token) == "200", instance["name"]
        assert from_h3(f"{proxy}/v1/models") == "401" and from_h3(f"{proxy}/v1/models", key) == "200"

        def put_on_h3(name: str, text: str) -> str:  # a fake host's /tmp is its own: copy through the shell
            path = f"/tmp/yrpd-lab-keys/{name}"
            lab["h3"].exec(f"mkdir -p /tmp/yrpd-lab-keys && cat > {path} <<'YRPD_LAB_END'\n{text}YRPD_LAB_END")
            return path
        # ... the data system workers of both hosts refuse a client without the deployment's CURVE keys, and serve
        # one with them from the same host (the script travels in the command, for the same reason)
        script = (Path(__file__).parents[2] / "deploy_scripts" / "ds_kv_check.py").read_text()
        keys = put_on_h3("datasystem.env", (secrets / "datasystem.env").read_text())

        def ds_from_h3(worker: str, *more: str) -> dict:
            run = lab["h3"].exec(f"env -u LD_LIBRARY_PATH {rm.ENV_ROOT}/ds/bin/python - --write {worker}:31501 "
                                 f"--read {worker}:31501 {' '.join(more)} <<'EOF'\n{script}\nEOF",
                                 check=False, timeout=90)
            return json.loads(run.stdout.strip().splitlines()[-1])
        for worker in (lab["h1"].address, lab["h2"].address):
            refused = ds_from_h3(worker, "--timeout-ms", "3000", "--attempts", "1")
            # refused by the data system itself (not a client that failed to import or a bad argument)
            assert refused["ok"] is False and refused.get("attempts") == 1, refused
            assert not refused["error"].startswith(("ImportError", "ModuleNotFoundError")), refused
            served = ds_from_h3(worker, "--env-file", keys)
            assert served["ok"] is True, served
        # ... and etcd on h1 refuses a client without the deployment's certificate at the TLS handshake, and lists
        # the data system's keys for one with it, from the same host
        etcdctl = Path(rm.ENV_ROOT, "etcd", "etcdctl")
        ca, cert, client_key = (put_on_h3(n, (secrets / "etcd" / n).read_text())
                                for n in ("ca.crt", "client.crt", "client.key"))
        get = "--dial-timeout 3s --command-timeout 5s get / --prefix --keys-only"
        endpoint = f"https://{lab['h1'].address}:32379"
        listed = lab["h3"].exec(f"{etcdctl} --endpoints {endpoint} --cacert {ca} {get}", check=False, timeout=60)
        assert listed.returncode != 0 and "/datasystem/" not in listed.stdout, listed.stdout
        # refused in the handshake, not unreachable: etcd drops a client that shows no certificate, which the client
        # reads as a certificate/TLS error or, when it was still writing, as the server closing on it (seen in CI)
        refusal = ("certificate", "tls", "broken pipe", "connection reset by peer")
        assert any(r in listed.stderr.lower() for r in refusal), listed.stderr[-500:]
        assert not any(r in listed.stderr.lower() for r in ("connection refused", "no route to host")), listed.stderr
        keyed = lab["h3"].exec(f"{etcdctl} --endpoints {endpoint} --cacert {ca} --cert {cert} --key {client_key} "
                               f"{get}", check=False, timeout=60)
        assert keyed.returncode == 0 and "/datasystem/" in keyed.stdout, keyed.stderr[-500:]

        got = rm.answers(proxy, key)
        rm.assert_known_answers(got)
        assert got == want

        # decode on h2 took the prompts' KV from the cache prefill on h1 wrote (the long prompt alone: 11 blocks)
        report = json.loads(cli("status", "--json", check=0).stdout)
        decode = next(i for i in report["instances"] if i["name"] == "decode-0")
        prefill = next(i for i in report["instances"] if i["name"] == "prefill-0")
        assert decode["prompt_tokens_loaded"] >= 11 * 128 and decode["external_cache_hit_tokens"] >= 11 * 128
        assert prefill["prompt_tokens_local_cache"] >= 5 * 128  # the second prefixed prompt reused the first's blocks
        time.sleep(6)  # connector stats files are rewritten every 5 s
        report = json.loads(cli("status", "--json", check=0).stdout)
        decode = next(i for i in report["instances"] if i["name"] == "decode-0")
        prefill = next(i for i in report["instances"] if i["name"] == "prefill-0")
        assert prefill["connector"]["saved_blocks"] >= 11 and decode["connector"]["loaded_blocks"] >= 11

        logs = cli("logs", "-n", "50", check=0).stdout
        assert "prefill-0" in logs and "decode-0" in logs and "Application startup complete" in logs

        # one request followed across hosts: the proxy's line on h1, prefill's hand-over on h1, decode's load on h2
        rid = "lab-trace-" + os.urandom(4).hex()
        traced = urllib.request.Request(
            f"{proxy}/v1/completions", method="POST",
            data=json.dumps({"model": rm.MODEL, "prompt": "Count the blocks, one by one. " * 60 + rid,
                             "max_tokens": 4, "temperature": 0}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}", "X-Request-Id": rid})
        with urllib.request.urlopen(traced, timeout=120) as resp:
            assert resp.status == 200
        trace = cli("logs", "--request", rid, check=0).stdout.splitlines()
        where = [line.split(" | ", 1)[0].split()[-2:] for line in trace]  # host, log
        assert ["h1", "proxy"] in where and ["h1", "prefill-0"] in where and ["h2", "decode-0"] in where, trace
        assert any("hands over" in line for line in trace if " h1 prefill-0 | " in line), trace
        assert any("loads" in line for line in trace if " h2 decode-0 | " in line), trace
        assert trace[0].startswith("+  0.000s"), trace  # times relative to the first line
        assert cli("logs", "--request", "lab-trace-none", check=1).stderr.startswith("no log line")  # the control

        # a real Prometheus scraping what `yrpd metrics targets` lists: the acceptance's series, then every query of
        # the dashboard `yrpd metrics dashboard` prints, return data once streamed requests went through
        targets = tmp_path / "targets.json"
        run_yrpd("metrics", "targets", "--out", targets, env=env, check=0)  # the session alone: no ssh options
        with scraping(targets, tmp_path / "prometheus") as prom:
            ups = prom.until_data(["up == 1"])["up == 1"]
            assert {u["metric"]["job"] for u in ups} == {"yrpd_proxy", "yrpd_host", "yrpd_vllm"} and len(ups) == 5
            for n in range(6):
                rm.streamed_chat(proxy, "Count the blocks, one by one. " * 40 + f"prom {n}", max_tokens=8, key=key)
            series = prom.until_data([
                "histogram_quantile(0.9, sum by (le) (rate(yrpd_proxy_ttft_seconds_bucket[1m])))",
                'sum by (yrpd_instance) (yrpd_connector_loaded_blocks_total{side="worker"}) > 0',
                "yrpd_ds_memory_used_bytes", "sum by (exported_instance) (yrpd_proxy_upstream_errors_total)"])
            assert {s["metric"]["host"] for s in series["yrpd_ds_memory_used_bytes"]} == {"h1", "h2"}
            board = json.loads(run_yrpd("metrics", "dashboard", env=env, check=0).stdout)
            queries = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
            assert len(queries) >= 12
            prom.until_data(queries, within=30)
            # the exporters' cost while Prometheus scrapes them every second (figure, not a bound: docs/benchmarks.md)
            procs = json.loads(cli("status", "--json", check=0).stdout)["processes"]
            cost = {}
            for p in (p for p in procs if p["name"] == "exporter"):
                ticks = lambda: sum(int(x) for x in lab[p["host"]].exec(f"cat /proc/{p['pid']}/stat").stdout
                                    .rsplit(")", 1)[1].split()[11:13])  # noqa: E731 - utime, stime
                first, t0 = ticks(), time.monotonic()
                time.sleep(10)
                cost[p["host"]] = round((ticks() - first) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - t0) * 100, 2)
            assert set(cost) == {"h1", "h2"}, procs
            print(f"measured: exporter CPU % of a core, scraped every 1 s: {json.dumps(cost)}")

        # decode dies: status says so within 10 s
        hello = {"model": rm.MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0}
        status, body = rm.http("POST", f"{proxy}/v1/completions", hello, key=key)
        assert status == 200, body[:300]
        before = json.loads(body)["choices"][0]["text"]
        lab["h2"].exec(f"kill -9 {decode['pid']}")
        killed = time.monotonic()
        while True:
            report = json.loads(cli("status", "--json").stdout)
            decode = next(i for i in report["instances"] if i["name"] == "decode-0")
            if not decode["healthy"]:
                break
            assert time.monotonic() - killed < 10, "status still reports the killed decode healthy"
        print(f"measured: killed decode reported after {time.monotonic() - killed:.1f}s")
        assert not report["healthy"] and any("decode-0" in p for p in report["problems"])
        # PD degrades: the prefill instance answers whole requests, the same greedy answer, and status says so
        status, body = rm.http("POST", f"{proxy}/v1/completions", hello, key=key)
        assert status == 200 and json.loads(body)["choices"][0]["text"] == before, (status, body[:300])
        report = json.loads(cli("status", "--json").stdout)
        assert any(p.startswith("serving degraded since") and "no decode instance is up" in p
                   for p in report["problems"]), report["problems"]

        started = time.monotonic()
        down = cli("down", check=0)
        print(f"measured: 2-host down {time.monotonic() - started:.1f}s\n{down.stderr}")
        assert "is down" in down.stderr
        sid = next((home / "sessions").glob("2*")).name
        for host in lab.hosts[:2]:  # the deployment's secrets went with it
            assert host.exec(f"test -e /tmp/yrpd_sessions/{sid}/secrets", check=False).returncode == 1
        for host in lab.hosts:
            assert session_processes(host) == [], host.name
            procs, ports = leftovers(host)
            assert procs == [] and ports == [], (host.name, procs, host.exec("ss -ltnpH").stdout)
    finally:
        run_yrpd("down", *ssh, env=env, timeout=300)
