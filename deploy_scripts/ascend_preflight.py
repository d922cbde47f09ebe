"""Check what an Ascend host (and its container engine) must have before anything is started. Stdlib only.

Args: one JSON object {"npu": {...} or null, "container": {...} or null} (see yrpd/steps/container.py).
Prints one JSON line with the facts found; every problem goes to stderr as one line naming this host and the
missing piece; exit 1 if any. Users lost days to a missing mount that only showed as garbage output later.
"""
import json
import os
import re
import shutil
import stat
import subprocess
import sys

HOST = os.uname().nodename
ARGS = json.loads(sys.argv[1])
problems = []
facts = {"hostname": HOST}
#: a device row of `npu-smi info`: "| 0     910B3    | OK    | ..." (the chip row below it starts "| 0   |")
NPU_ROW = re.compile(r"^\|\s*(\d+)\s+([^\s|]+)\s*\|\s*([A-Za-z]+)\s*\|")


def problem(text):
    problems.append(f"{HOST}: {text}")


def run(argv, timeout=30):
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return None
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"no answer within {timeout}s")


def first_line(proc):
    lines = (proc.stderr or proc.stdout or "").strip().splitlines()
    return lines[0] if lines else f"exit {proc.returncode}"


def check_npu(npu):
    devices = npu["devices"]
    for path in [npu["npu_device"].format(id=i) for i in devices] + npu["nodes"]:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            problem(f"device node {path} is missing")
            continue
        if not stat.S_ISCHR(mode):
            problem(f"{path} is not a character device")
    smi = shutil.which("npu-smi") or npu["npu_smi"]
    proc = run([smi, "info"]) if os.path.exists(smi) else None
    if proc is None:
        problem(f"npu-smi not found (PATH or {npu['npu_smi']}): the NPU driver's tools are not installed")
    elif proc.returncode != 0:
        problem(f"`npu-smi info` fails (exit {proc.returncode}): {first_line(proc)}")
    else:
        rows = {int(m.group(1)): (m.group(2), m.group(3)) for m in map(NPU_ROW.match, proc.stdout.splitlines()) if m}
        facts["npu_smi"] = {str(i): {"name": n, "health": h} for i, (n, h) in sorted(rows.items())}
        absent = [i for i in devices if i not in rows]
        if absent:
            listed = ",".join(map(str, sorted(rows))) or "none"
            problem(f"`npu-smi info` does not list NPU {','.join(map(str, absent))} (it lists {listed})")
        for i in devices:
            if i in rows and rows[i][1] not in ("OK", "Warning"):
                problem(f"NPU {i} health is {rows[i][1]} in `npu-smi info`")
    try:
        with open(npu["version_file"]) as fh:
            text = fh.read()
        found = re.search(r"^\s*Version\s*=\s*(\S+)", text, re.M)
        facts["driver_version"] = found.group(1) if found else text.strip()[:80]
    except OSError as exc:
        problem(f"driver version file {npu['version_file']} is not readable ({exc.strerror}): is the NPU driver installed?")
    conf = npu.get("hccn_conf")
    if conf:  # only asked for when the deployment spans hosts
        try:
            with open(conf) as fh:
                text = fh.read()
        except OSError as exc:
            problem(f"{conf} is not readable ({exc.strerror}): HCCL between hosts needs each NPU's network "
                    f"address (configure them with hccn_tool)")
        else:
            addresses = set(int(i) for i in re.findall(r"^\s*address_(\d+)\s*=", text, re.M))
            lacking = [i for i in devices if i not in addresses]
            if lacking:
                problem(f"{conf} has no address_N line for NPU {','.join(map(str, lacking))}: HCCL between hosts "
                        f"cannot use it (configure it with hccn_tool)")


def check_container(box):
    engine = box["engine"]
    if shutil.which(engine) is None:
        problem(f"{engine} not found on PATH: install it, or pick the engine with container_engine in the spec")
        return
    proc = run([engine, "version", "--format", "{{.Server.Version}}" if engine == "docker" else "{{.Version}}"])
    if proc.returncode != 0:
        problem(f"{engine} does not answer (daemon not running, or this user may not use it): {first_line(proc)}")
        return
    version = proc.stdout.strip()
    facts["engine"] = f"{engine} {version}"
    parts = re.match(r"(\d+)\.(\d+)", version)
    if engine == "docker" and parts and (int(parts.group(1)), int(parts.group(2))) < (20, 10):
        problem(f"docker {version} is older than 20.10, which `docker run --pull never` needs")
    have = {name: run([engine, "image", "inspect", name]).returncode == 0 for name in (box["image"], box["derived"])}
    facts["images"] = have
    if not any(have.values()):
        if box["pull"] == "never":
            problem(f"image {box['image']} is not on this host and --pull is never: load it there "
                    f"(docker load -i FILE, or docker pull) or deploy with --pull missing")
        else:
            facts["pull"] = f"{box['image']} will be pulled (--pull {box['pull']})"
    for source, purpose in box["mounts"]:
        if not os.path.exists(source):
            problem(f"mount source {source} is missing ({purpose}); the container needs it")


if ARGS.get("npu"):
    check_npu(ARGS["npu"])
if ARGS.get("container"):
    check_container(ARGS["container"])
print(json.dumps({"facts": facts, "problems": problems}))
for line in problems:
    print(line, file=sys.stderr)
sys.exit(1 if problems else 0)
