"""Several instances of each role behind the one proxy, on four fake hosts with the real model: every request is
answered as one plain instance answers it, both prefill and both decode instances serve, and a prefix one prefill
instance computed is loaded from the data system by the other (issue 17)."""

import json
import os
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lab.hosts import leftovers, session_processes
from tests.conftest import run_yrpd
from tests.lab import real_model as rm
from yrpd import credentials
from yrpd.connector import keys as K
from yrpd.credentials import instance_token
from yrpd.layout import HostSessionLayout
from yrpd.spec import RuntimeSection

pytestmark = [pytest.mark.lab, pytest.mark.e2e]

_WORDS = Path(os.__file__).read_text().split()
PROMPTS = rm.GROUPED  # 8 groups of 5 prompts sharing a prefix each (tests/lab/real_model.py)


def complete(base: str, prompt: str, key: str | None = None) -> str:
    return rm.completion(base, prompt, max_tokens=rm.GROUPED_TOKENS, key=key)


def lab_cli(lab, tmp_path, n: int, extra: str = ""):
    """The config (host k gets core (k - 1) % 2: the fake hosts share this machine's two cores, so no core runs more
    than two instances) and a `yrpd` runner for the lab's `n` hosts."""
    missing = [v for v in ("ds", "vllm") if not Path(rm.ENV_ROOT, v, "bin", "python").exists()]
    if missing:
        pytest.fail(f"venvs {missing} missing under {rm.ENV_ROOT}: run scripts/test.sh")
    config = tmp_path / "yrpd.yaml"
    config.write_text(
        "hosts:\n" + "".join(f"  - {{address: h{k}, devices: [{(k - 1) % 2}]}}\n" for k in range(1, n + 1)) +
        f"device_kind: cpu\nmodel: builtin:smollm2\nenv_path: {rm.ENV_ROOT}\ndatasystem_memory_mb: 256\n"
        f"cluster_mode: ds_only\n{extra}")
    ssh = lab.cli_ssh_args
    env = {"YRPD_HOME": str(tmp_path / "home")}

    def cli(*args, check=None, timeout=600):
        return run_yrpd(*args, *ssh, env=env, check=check, timeout=timeout)

    rm.ensure_model()
    return cli, config


def host_layout(session_id: str) -> HostSessionLayout:
    return HostSessionLayout(RuntimeSection.model_fields["remote_session_root"].default, session_id)


def ring_state(host, session_id: str) -> str:
    """The last hash-ring state the host's data-system worker logged ("RUNNING at 13:29:27.96"), or that it logged
    none: openYuanrong 0.8.1's worker logs each change of its own state as "Convert hash ring local state from A to
    B" (its log directory: yrpd.cluster.dsconfig.worker_args)."""
    log = f"{host_layout(session_id).dir}/yr/logs/data_system/worker/datasystem_worker.INFO.log"
    line = host.exec(f"grep -ah 'hash ring local state from' {log} | tail -n 1", check=False).stdout.strip()
    if " to " not in line:
        return f"no state logged ({line[:200]!r})"
    return f"{line.rsplit(' to ', 1)[1].rstrip('. ')} at {line.split(' | ', 1)[0][11:]}"


def visible_from(host, session_id: str, reader: str, instance_url: str, token: str, prompt: str,
                 within_s: float = 60) -> dict:
    """Wait until the data-system worker that instance `reader` (on `host`) asks answers that every full block of
    `prompt` exists, keyed as `reader`'s lookup keys them (its namespaces and worker from its connector's stats file,
    the prompt's ids from an instance's /tokenize); the helper's answer (tests/lab/scripts/ds_visible.py)."""
    layout = host_layout(session_id)
    stats = json.loads(host.exec(f"cat {layout.kv_stats(reader).format(side='scheduler', dp=0, rank=0)}").stdout)
    status, body = rm.http("POST", f"{instance_url}/tokenize", {"model": rm.MODEL, "prompt": prompt}, key=token)
    assert status == 200, body[:300]
    ids = json.loads(body)["tokens"]
    digests = K.prefix_digests(ids, stats["block_size"], K.loadable_blocks(len(ids), stats["block_size"]),
                               K.request_extra())
    keys = [K.key_for(ns, d) for ns in stats["namespace"].split(",") for d in digests]
    script = (Path(__file__).parent / "scripts" / "ds_visible.py").read_text()
    env_file = layout.env_file(credentials.DATASYSTEM)
    logs = layout.client_logs
    out = host.exec(f"mkdir -p {logs} && env -u LD_LIBRARY_PATH DATASYSTEM_CLIENT_LOG_DIR={logs} "
                    f"{rm.ENV_ROOT}/ds/bin/python - {stats['ds_address']} {env_file} {within_s} "
                    f"{shlex.quote(json.dumps(keys))} <<'EOF'\n{script}\nEOF\n", timeout=within_s + 60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def down_leaves_nothing(cli, lab) -> None:
    assert "is down" in cli("down", check=0).stderr
    for host in lab.hosts:
        assert session_processes(host) == [], host.name
        procs, ports = leftovers(host)
        assert procs == [] and ports == [], (host.name, procs)


def test_two_prefill_and_two_decode_instances_on_four_hosts_share_load_and_cache(fake_lab, tmp_path,
                                                                                 reference_answers):
    lab = fake_lab(4)
    home = tmp_path / "home"
    # float32: in bfloat16 2 of the 40 answers, batched 8 at a time, differed in a late greedy token from the plain
    # instance's answers one at a time; float32 leaves batch shapes much less rounding to disagree on
    cli, config = lab_cli(lab, tmp_path, 4, "dtype: float32\nrouting: prefix\n")
    hosts = "h1,h2,h3,h4"
    plan = json.loads(cli("plan", "--hosts", hosts, "--config", str(config), "--prefill", "2", "--decode", "2",
                          "--json", check=0).stdout)
    want = reference_answers.grouped(plan["dtype"]["dtype"], PROMPTS)  # before the deploy: the cores alone
    try:
        started = time.monotonic()
        deploy = cli("deploy", "--hosts", hosts, "--config", str(config), "--prefill", "2", "--decode", "2",
                     check=0, timeout=1500)
        print(f"measured: 4-host 2P+2D deploy {time.monotonic() - started:.1f}s")
        proxy = deploy.stdout.strip().splitlines()[-1]
        report = json.loads(cli("status", "--json", check=0).stdout)
        placed = {i["name"]: i["host"] for i in report["instances"]}
        assert placed == {"prefill-0": "h1", "prefill-1": "h2", "decode-0": "h3", "decode-1": "h4"}, placed
        assert report["healthy"], report["problems"]
        # every data-system worker is in the hash ring when the deploy says ready: one still waiting to join moves
        # the keys' owners under the first requests (a block saved on h1 unseen from h2 for seconds)
        session_dir = next((home / "sessions").glob("2*"))
        states = {h.name: ring_state(h, session_dir.name) for h in lab.hosts}
        print(f"measured: the workers' hash-ring states when the deploy said ready {states}")
        assert all(s.startswith("RUNNING") for s in states.values()), states
        urls = {i["name"]: i["url"] for i in report["instances"]}

        # a prefix prefill-0 computed is loaded from the data system by prefill-1, on another host
        token = instance_token(session_dir)
        shared = " ".join(_WORDS[4100:4480])  # 782 tokens: 6 full KV blocks
        complete(urls["prefill-0"], shared + " first", token)
        answered = time.monotonic()
        # its writer saves after the answer (off the request's path): a prefix still being written is not there yet
        deadline = time.monotonic() + 60
        while True:
            report = json.loads(cli("status", "--json", check=0).stdout)
            p0 = next(i for i in report["instances"] if i["name"] == "prefill-0")
            if (p0.get("connector") or {}).get("saved_blocks", 0) >= 6 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert p0["connector"]["saved_blocks"] >= 6, p0["connector"]
        print(f"measured: prefill-0's prefix counted saved {time.monotonic() - answered:.1f}s after its answer")
        # ... and h2's worker may see it a few seconds after h1's counted it (the lookup below asks h2's)
        seen = visible_from(lab.hosts[1], session_dir.name, "prefill-1", urls["prefill-0"], token, shared + " second")
        print(f"measured: h2's worker saw the prefix {seen['after_s']}s after prefill-0 counted it saved")
        assert seen["all"], f"h2's data-system worker sees {sum(seen['exist'])} of the prefix's {len(seen['exist'])} keys: {seen}"
        before = next(i for i in report["instances"] if i["name"] == "prefill-1")["prompt_tokens_loaded"] or 0
        complete(urls["prefill-1"], shared + " second", token)
        time.sleep(6)  # connector stats files are rewritten every 5 s
        report = json.loads(cli("status", "--json", check=0).stdout)
        p1 = next(i for i in report["instances"] if i["name"] == "prefill-1")
        assert p1["prompt_tokens_loaded"] - before >= 4 * 128, p1
        assert p1["connector"]["loaded_blocks"] >= 4, p1["connector"]

        # 40 requests at concurrency 8 through the proxy: each answered as the plain instance answers it
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: complete(proxy, p), PROMPTS))
        assert got == want, [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w][:3]
        assert all(got)

        report = json.loads(cli("status", "--json", check=0).stdout)
        served = {i["name"]: i["routed"]["requests"] for i in report["instances"]}
        print(f"measured: requests per instance {served}; "
              f"sent for their prefix {[i['routed']['prefix_routed'] for i in report['instances']]}")
        assert all(n > 0 for n in served.values()), served
        assert sum(i["routed"]["prefix_routed"] for i in report["instances"] if i["role"] == "prefill") > 0
        assert served["prefill-0"] + served["prefill-1"] == 40 and served["decode-0"] + served["decode-1"] == 40

        started = time.monotonic()
        down_leaves_nothing(cli, lab)
        print(f"measured: 4-host down {time.monotonic() - started:.1f}s")
    finally:
        cli("down", timeout=300)
