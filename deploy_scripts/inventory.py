"""Report this host's accelerator devices and CPU cores as one JSON line (run by yrpd, stdlib only)."""
import glob
import json
import os
import re
import shutil


def ids(pattern, regex):
    found = []
    for path in glob.glob(pattern):
        m = re.fullmatch(regex, os.path.basename(path))
        if m:
            found.append(int(m.group(1)))
    return sorted(found)


npus = ids("/dev/davinci*", r"davinci(\d+)")
gpus = ids("/dev/nvidia*", r"nvidia(\d+)")
cores = sorted(os.sched_getaffinity(0))
if npus:
    kind, devices = "npu", npus
elif gpus:
    kind, devices = "gpu", gpus
else:
    kind, devices = "cpu", cores
print(json.dumps({
    "kind": kind,
    "devices": devices,
    "npus": npus,
    "gpus": gpus,
    "cores": cores,
    "npu_smi": shutil.which("npu-smi"),
    "hostname": os.uname().nodename,
}))
