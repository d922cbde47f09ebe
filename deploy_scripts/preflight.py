"""Check that this host can take its part of a deployment. Args: one JSON object (see yrpd/steps/preflight.py).

Prints one JSON line with the facts found; every problem goes to stderr as one line, exit 1 if any.
"""
import json
import os
import shutil
import socket
import sys

from hostlib import listening_sockets, proc_cmdline, proc_environ, proc_fd_targets, proc_table

args = json.loads(sys.argv[1])
problems = []
facts = {"hostname": os.uname().nodename, "python": sys.version.split()[0]}

if sys.version_info < (3, 8):
    problems.append(f"python3 is {facts['python']}; yrpd's host scripts need 3.8 or newer")

for tool in ("bash", "timeout", "setsid", "nohup", "tail"):
    if shutil.which(tool) is None:
        problems.append(f"{tool} not found on PATH; install coreutils/util-linux")

# disk: the nearest existing parent of the session root is where the session will grow
where = args["session_root"]
while not os.path.exists(where):
    where = os.path.dirname(where) or "/"
usage = shutil.disk_usage(where)
facts["free_disk_gb"] = round(usage.free / 2**30, 1)
if usage.free < args["min_free_disk_gb"] * 2**30:
    problems.append(f"only {facts['free_disk_gb']} GB free under {where}; need {args['min_free_disk_gb']} GB (min_free_disk_gb)")


def owner(inode):
    """(pid, how to name it) of the process listening on the socket; (None, ...) when none is found."""
    target = f"socket:[{inode}]"
    for pid, *_ in proc_table():
        if target in proc_fd_targets(pid):
            cmd = proc_cmdline(pid)
            return pid, f"pid {pid} ({cmd if len(cmd) <= 100 else cmd[:99] + '…'})"
    return None, "another process"


# a port held by a process of this very session is its own service, still running while the session changes
# (yrpd scale deploys the session again with another plan): not a conflict
ours = f"YRPD_SESSION={args['session']}".encode() if args.get("session") else None
listening = listening_sockets()
for port, what in args["ports"]:
    if port in listening:
        pid, named = owner(listening[port])
        if ours and pid is not None and ours in (proc_environ(pid) or []):
            continue
        problems.append(f"port {port} ({what}) is already in use by {named}; free it or change the port")
        continue
    with socket.socket() as probe:
        # as servers do: connections of a just-stopped deployment in TIME_WAIT must not count as "in use"
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as exc:
            problems.append(f"port {port} ({what}) cannot be bound: {exc.strerror}")

kind, devices = args["device_kind"], args["devices"]
if kind == "npu":
    missing = [d for d in devices if not os.path.exists(f"/dev/davinci{d}")]
    if missing:
        problems.append(f"NPU device nodes missing: {', '.join(f'/dev/davinci{d}' for d in missing)}")
elif kind == "gpu":
    missing = [d for d in devices if not os.path.exists(f"/dev/nvidia{d}")]
    if missing:
        problems.append(f"GPU device nodes missing: {', '.join(f'/dev/nvidia{d}' for d in missing)}")
elif kind == "cpu":
    cores = os.sched_getaffinity(0)
    missing = [d for d in devices if d not in cores]
    if missing:
        problems.append(f"CPU cores not available to us: {','.join(map(str, missing))} (have {len(cores)})")

model = args.get("model")
if model:
    if not os.path.isdir(model):
        problems.append(f"model directory {model} does not exist on this host; copy it there or fix --model")
    elif not os.path.isfile(os.path.join(model, "config.json")):
        problems.append(f"model directory {model} has no config.json; point --model at a Hugging Face model directory")

print(json.dumps({"facts": facts, "problems": problems}))
for problem in problems:
    print(problem, file=sys.stderr)
sys.exit(1 if problems else 0)
