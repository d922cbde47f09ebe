#!/usr/bin/env bash
# The main job on the embedded default: deploy onto this machine (CPU: openYuanrong data system, one prefill
# and one decode vLLM instance with yrpd's KV connector, the proxy), show its status, send one request.
# Leaves the deployment running; `.venv/bin/yrpd down` removes it.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
ENV_ROOT=/opt/yrpd/venvs
# what the deploy installs on a CPU host anyway, done here first so its progress is visible
eval "$(.venv/bin/python -m yrpd.versions)"
./deploy_scripts/install_openyuanrong.sh "$ENV_ROOT/yr" "$ENV_ROOT/ds"
./deploy_scripts/install_vllm_cpu.sh "$ENV_ROOT/vllm"
url=$(.venv/bin/yrpd deploy --hosts localhost)
.venv/bin/yrpd status
echo "request: POST $url/v1/completions"
curl -sS --fail-with-body "$url/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "tiny-qwen2", "prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0}'
echo
