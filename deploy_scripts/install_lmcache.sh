#!/usr/bin/env bash
# Install LMCache beside an existing vLLM venv, in a venv of its own (idempotent).
#
#   install_lmcache.sh [--wheels DIR] VLLM_VENV LMCACHE_VENV
#
# For `yrpd bench`'s peer-lmcache target only. LMCache's package pins numpy, protobuf and grpcio below what the
# vLLM venv has and pulls CUDA packages, so it never goes into the vLLM venv. LMCACHE_VENV sees the vLLM venv's
# packages through a .pth file placed after its own site-packages: what LMCache installs there wins inside this
# venv, and the vLLM venv is left as it was. LMCACHE_VERSION (environment) picks the version.
# --wheels DIR installs offline from the wheel files in DIR.
set -euo pipefail

LMCACHE_VERSION="${LMCACHE_VERSION:?set LMCACHE_VERSION}"
WHEELS=""
POSITIONAL=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --wheels) WHEELS="$2"; shift 2 ;;
        -*) echo "unknown option: $1" >&2; exit 2 ;;
        *) POSITIONAL+=("$1"); shift ;;
    esac
done
[[ ${#POSITIONAL[@]} -eq 2 ]] || { echo "usage: install_lmcache.sh [--wheels DIR] VLLM_VENV LMCACHE_VENV" >&2; exit 2; }
VLLM_VENV="${POSITIONAL[0]}"
VENV="${POSITIONAL[1]}"
PY="$VENV/bin/python"

log() { echo "[install_lmcache] $*" >&2; }

[[ -x "$VLLM_VENV/bin/python" ]] || { log "$VLLM_VENV has no python: install vLLM first"; exit 1; }

self_check() {
    [[ -x "$PY" && -x "$VENV/bin/lmcache" ]] || return 1
    LMCACHE_TRACK_USAGE=false "$PY" - "$LMCACHE_VERSION" <<'EOF' >/dev/null 2>&1
import sys
from importlib import metadata
assert metadata.version("lmcache") == sys.argv[1]
import vllm  # from the vLLM venv, through the .pth file
from vllm.distributed.kv_transfer.kv_connector.v1 import lmcache_mp_connector  # noqa: F401
from lmcache.v1.multiprocess import http_server  # noqa: F401
EOF
}

if self_check; then
    log "$VENV already has lmcache $LMCACHE_VERSION beside $VLLM_VENV"
    exit 0
fi

# same interpreter as the vLLM venv: its compiled packages must load here too
base="$("$VLLM_VENV/bin/python" -c 'import sys; print(sys._base_executable)')"
[[ -x "$PY" ]] || "$base" -m venv "$VENV"
site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
vllm_site="$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# .pth files are read in name order and their paths appended after site-packages itself
echo "$vllm_site" > "$site/zz-yrpd-vllm-venv.pth"

where=()
[[ -n "$WHEELS" ]] && where=(--no-index --find-links "$WHEELS")
log "installing lmcache $LMCACHE_VERSION into $VENV (vLLM from $VLLM_VENV)"
"$PY" -m pip install --disable-pip-version-check --no-input -q "${where[@]}" "lmcache==$LMCACHE_VERSION"
self_check || { log "lmcache or vLLM does not import in $VENV after the install"; exit 1; }
log "done"
