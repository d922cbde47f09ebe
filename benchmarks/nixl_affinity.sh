#!/bin/bash
# Which cores a CPU vLLM instance's threads may run on, plain and with vLLM's NixlConnector (issue 36: why the
# peer-nixl-pd target is slow on CPU hosts). Needs the vLLM venv and the NIXL peer venv under ENV_ROOT, and the
# built-in tiny model (scripts/test.sh prepares all three).
#
#     benchmarks/nixl_affinity.sh [ENV_ROOT] > docs/bench/nixl-affinity.txt
set -u
ROOT=${1:-/opt/yrpd/venvs}
MODEL=$ROOT/models/tiny-qwen2
cd "$(dirname "$0")/.."
echo "commit: $(git rev-parse --short=12 HEAD)$(git diff --quiet HEAD || echo ' (dirty)')"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'); cores: $(nproc)"
echo "vllm: $($ROOT/vllm/bin/python -c 'from importlib.metadata import version; print(version("vllm"))');" \
     "nixl: $($ROOT/nixl/bin/python -c 'from importlib.metadata import version; print(version("nixl-cu12"))')"
echo "command: $0 $ROOT"

descendants() { for c in $(pgrep -P "$1"); do echo "$c"; descendants "$c"; done; }

serve() {  # NAME PYTHON PORT [vllm serve args...]: start, wait for /health, list each process's threads' cores, stop
    local name=$1 python=$2 port=$3
    shift 3
    "$python" -m vllm.entrypoints.cli.main serve "$MODEL" --host 127.0.0.1 --port "$port" --enforce-eager \
        --dtype float32 --kv-cache-memory-bytes 268435456 --max-model-len 2048 "$@" > "/tmp/affinity-$name.log" 2>&1 &
    local pid=$!
    for _ in $(seq 1 300); do curl -sf "127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
    curl -sf "127.0.0.1:$port/health" > /dev/null || { echo "$name did not answer; see /tmp/affinity-$name.log"; }
    echo
    echo "== $name: threads per allowed-core list, for each process"
    for p in $pid $(descendants "$pid"); do
        [ -d "/proc/$p" ] || continue
        echo "$(cat "/proc/$p/comm") (pid $p): main thread on $(awk '/Cpus_allowed_list/ {print $2}' "/proc/$p/status");" \
             "$(for t in /proc/"$p"/task/*; do awk '/Cpus_allowed_list/ {print $2}' "$t/status"; done | sort | uniq -c |
                awk '{printf "%s%d on %s", (NR > 1 ? ", " : ""), $1, $2}')"
    done
    kill "$pid"
    sleep 5
    for p in $(descendants "$pid") "$pid"; do kill -9 "$p" 2> /dev/null; done
    wait "$pid" 2> /dev/null
}

serve plain "$ROOT/vllm/bin/python" 41501
serve nixl "$ROOT/nixl/bin/python" 41502 \
    --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}'
