"""Report this host's accelerator devices and CPU cores as one JSON line (run by yrpd, stdlib only)."""
import fcntl
import glob
import json
import os
import re
import shutil
import socket
import struct

from hostlib import cpu_info


def ids(pattern, regex):
    found = []
    for path in glob.glob(pattern):
        m = re.fullmatch(regex, os.path.basename(path))
        if m:
            found.append(int(m.group(1)))
    return sorted(found)


def cpu_features():
    """(bf16 that vLLM's CPU build computes right here, model name) from /proc/cpuinfo: AVX512-BF16 makes bf16 math
    native; on a CPU with AMX, vLLM routes bf16 attention to its AMX kernels, which failed on every AMX machine
    measured (wrong greedy answers; an illegal instruction in decode attention over cached KV): not there."""
    flags, model = cpu_info()
    if flags is None:
        return None, ""
    return "avx512_bf16" in flags and "amx_bf16" not in flags, model


def nics():
    """Interface name -> its IPv4 address (SIOCGIFADDR): which one an address belongs to is what gloo, HCCL and
    NCCL are told when an instance spans hosts."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


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
    "arch": os.uname().machine,
    "cpu_bf16": cpu_features()[0],
    "cpu_model": cpu_features()[1],
    "npu_smi": shutil.which("npu-smi"),
    "hostname": os.uname().nodename,
    "nics": nics(),
}))
