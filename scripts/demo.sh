#!/usr/bin/env bash
# The main job on the embedded default: deploy onto this machine (CPU), then show its status.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
.venv/bin/yrpd deploy --hosts localhost
.venv/bin/yrpd status
