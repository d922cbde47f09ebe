"""Instances spanning hosts both ways, on four fake hosts: decode's TP 2 group spans h1 and h2 (one core each, vLLM's
multi-node launcher over gloo; issue 45) and prefill's two DP ranks of TP 2 span h3 and h4 (two cores each, a
headless engine on h4). PD answers are one instance's, both prefill engines serve, both ranks of decode's group load
their KV shard from their own host's data system worker, a killed rank on h2 brings the whole decode instance back,
and `down` leaves nothing.

The model is builtin:tiny-qwen2 (random weights, 4 attention heads): SmolLM2 has 9 heads, which no TP 2 splits
(vLLM refuses it on one host as on two; `yrpd plan` says so first). Its answers are gibberish, so they are checked
against one instance's, not known answers."""

import json
import time

import pytest

from lab.hosts import leftovers, session_processes
from tests.conftest import run_yrpd
from tests.lab import real_model as rm
from yrpd.credentials import instance_token
from yrpd.serving import STATS_INTERVAL_S as STATS_S

pytestmark = [pytest.mark.lab, pytest.mark.e2e]

MODEL = "tiny-qwen2"
PROMPTS = [f"{rm.GROUPED[i]} {i}" for i in range(6)]
TOKENS = 24


def complete(base: str, prompt: str, key: str | None = None) -> str:
    status, body = rm.http("POST", f"{base}/v1/completions", {"model": MODEL, "prompt": prompt,
                                                               "max_tokens": TOKENS, "temperature": 0}, key=key)
    assert status == 200, (status, body[:300])
    text = json.loads(body)["choices"][0]["text"]
    assert text, f"an empty answer to {prompt!r}"
    return text


def wait_healthy(cli, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    report = {}
    while time.monotonic() < deadline:
        report = json.loads(cli("status", "--json").stdout)  # exits 1 while unhealthy
        if report["healthy"]:
            return report
        time.sleep(3)
    raise AssertionError(f"not healthy after {timeout} s: {report.get('problems')}")


def answers(url: str) -> bool:
    try:
        return rm.http("GET", url, timeout=5)[0] == 200
    except OSError:
        return False


def loaded_blocks(host, name: str) -> int:
    """What one rank's connector loaded, from the statistics file it writes on its own host."""
    found = host.exec(f"ls /tmp/yrpd_sessions/latest/run/kv-{name}-worker-*rank*.json").stdout.split()
    assert len(found) == 1, (host.name, found)  # one rank of the group on each host
    return int(json.loads(host.exec(f"cat {found[0]}").stdout)["counters"].get("loaded_blocks", 0))


def test_instances_spanning_hosts_by_tp_and_by_dp_answer_like_one_instance_and_heal_whole(
        fake_lab, tmp_path, lab_figures):
    lab = fake_lab(4, private_shm=True)  # as separate machines: else vLLM takes h1 and h2 for one node
    config = tmp_path / "yrpd.yaml"
    config.write_text(
        "hosts:\n  - {address: h1, devices: [0]}\n  - {address: h2, devices: [1]}\n"
        "  - {address: h3, devices: [0, 1]}\n  - {address: h4, devices: [0, 1]}\n"
        f"device_kind: cpu\nmodel: builtin:{MODEL}\ndtype: float32\nenv_path: {rm.ENV_ROOT}\n"
        "datasystem_memory_mb: 256\ncluster_mode: ds_only\nptp: 2\ndtp: 2\npdp: 2\n")
    hosts = "h1,h2,h3,h4"
    home = tmp_path / "home"

    def cli(*args, check=None, timeout=600):
        return run_yrpd(*args, "--config", str(config), *lab.cli_ssh_args, env={"YRPD_HOME": str(home)},
                        check=check, timeout=timeout) if args[0] in ("plan", "deploy") else \
            run_yrpd(*args, *lab.cli_ssh_args, env={"YRPD_HOME": str(home)}, check=check, timeout=timeout)

    # the refusal beside its control: SmolLM2's 9 heads take no TP 2, in one line before any host is touched
    refused = cli("plan", "--hosts", hosts, "--model", "builtin:smollm2")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "builtin:smollm2 has 9 attention heads, which 2 does not divide" in refused.stderr
    plan = json.loads(cli("plan", "--hosts", hosts, "--json", check=0).stdout)
    prefill, decode = plan["instances"]
    assert [(r["host"], r["dp_rank"], r["devices"]) for r in prefill["ranks"]] == [("h3", 0, [0, 1]), ("h4", 1, [0, 1])]
    assert [(r["host"], r["dp_rank"], r["devices"]) for r in decode["ranks"]] == [("h1", 0, [0]), ("h2", 0, [1])]
    try:
        started = time.monotonic()
        cli("deploy", "--hosts", hosts, check=0, timeout=1500)
        lab_figures["deploy_s"] = round(time.monotonic() - started, 1)
        report = wait_healthy(cli, 120)
        procs = {(p["host"], p["name"]): p for p in report["processes"]}
        assert {("h1", "decode-0"), ("h2", "decode-0-h2"), ("h3", "prefill-0"), ("h4", "prefill-0-h4")} <= set(procs)
        rows = {i["name"]: i for i in report["instances"]}
        assert (rows["decode-0"]["hosts"], rows["decode-0"]["tp"]) == (["h1", "h2"], 2)
        assert (rows["prefill-0"]["hosts"], rows["prefill-0"]["dp"]) == (["h3", "h4"], 2)

        key = instance_token(home / "sessions" / report["session"])
        prefill_url = next(i["url"] for i in report["instances"] if i["name"] == "prefill-0")
        proxy = report["proxy"]["url"]
        # one instance's answers: prefill's own (TP 2 on one host, either engine), asked directly, before PD hands KV over
        want = [complete(prefill_url, p, key) for p in PROMPTS]
        h2 = lab["h2"]
        before = {h: loaded_blocks(lab[h], "decode-0") for h in ("h1", "h2")}
        got = [complete(proxy, p) for p in PROMPTS]
        assert got == want, [(p, g, w) for p, g, w in zip(PROMPTS, got, want) if g != w][:2]
        time.sleep(STATS_S + 1)  # the connector writes its figures every STATS_S
        after = {h: loaded_blocks(lab[h], "decode-0") for h in ("h1", "h2")}
        # each rank loaded its shard of the prompts' KV, on its own host
        assert all(after[h] > before[h] for h in after), (before, after)
        lab_figures["decode_loaded_blocks_per_rank"] = {h: after[h] - before[h] for h in after}
        # vLLM's front end on h3 spread the prompts over both prefill engines: the one on h4 computed some too
        metrics = rm.http("GET", f"{prefill_url}/metrics")[1].decode()
        per_engine = {line.split('engine="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                      for line in metrics.splitlines() if line.startswith("vllm:prompt_tokens_total{")}
        assert set(per_engine) == {"0", "1"} and min(per_engine.values()) > 0, per_engine

        # kill -9 the rank on h2 (its worker process): the instance restarts whole, on both hosts, by itself
        worker = h2.exec("pgrep -f 'VLLM::Worker' | head -n 1").stdout.strip()
        assert worker, h2.exec("ps -eo pid,args").stdout
        head_restarts = procs[("h1", "decode-0")]["restarts"]
        health = f"{rows['decode-0']['url']}/health"
        killed = time.monotonic()
        h2.exec(f"kill -9 {worker}")
        # its head goes down (the gang restarts it), then answers again: asked of the head itself, each second,
        # rather than a `yrpd status` of four hosts every few seconds (the CI's two cores pay for every one)
        for up in (False, True):
            deadline = time.monotonic() + (120 if not up else 600)
            while answers(health) != up:
                assert time.monotonic() < deadline, f"decode-0's head never {'answered again' if up else 'went down'}"
                time.sleep(1)
        report = wait_healthy(cli, 120)
        now = {(p["host"], p["name"]): p for p in report["processes"]}
        assert now[("h1", "decode-0")]["restarts"] > head_restarts, now[("h1", "decode-0")]
        lab_figures["healed_after_kill_s"] = round(time.monotonic() - killed, 1)
        assert now[("h2", "decode-0-h2")]["pid"] != procs[("h2", "decode-0-h2")]["pid"] or \
            now[("h2", "decode-0-h2")]["restarts"] > procs[("h2", "decode-0-h2")]["restarts"]
        assert [complete(proxy, p) for p in PROMPTS] == want
        print(f"measured: {lab_figures}")

        assert "is down" in cli("down", check=0).stderr
        for host in lab.hosts:
            assert session_processes(host) == [], host.name
            procs_left, ports = leftovers(host)
            assert procs_left == [] and ports == [], (host.name, procs_left, ports)
    finally:
        cli("down", timeout=300)
