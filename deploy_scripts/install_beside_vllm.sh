#!/usr/bin/env bash
# Install a bench peer's packages beside an existing vLLM venv, in a venv of its own (idempotent).
#
#   install_beside_vllm.sh [--wheels DIR] [--no-deps] VLLM_VENV VENV PROBE REQUIREMENT...
#
# For `yrpd bench`'s peers (yrpd.steps.vllm_env.PEER_VENVS): LMCache pins numpy, protobuf and grpcio below what the
# vLLM venv has, NIXL's packages are CUDA builds; neither goes into the vLLM venv. VENV sees the vLLM venv's
# packages through a .pth file placed after its own site-packages: what is installed there wins inside this venv,
# and the vLLM venv is left as it was. PROBE is Python that exits 0 once the peer is installed and importable
# beside vLLM; it runs first (nothing to do) and after the install. --no-deps installs the requirements alone
# (their dependencies are the vLLM venv's); --wheels DIR installs offline from the wheel files in DIR.
set -euo pipefail

WHEELS=""
NODEPS=()
POSITIONAL=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --wheels) WHEELS="$2"; shift 2 ;;
        --no-deps) NODEPS=(--no-deps); shift ;;
        -*) echo "unknown option: $1" >&2; exit 2 ;;
        *) POSITIONAL+=("$1"); shift ;;
    esac
done
[[ ${#POSITIONAL[@]} -ge 4 ]] || {
    echo "usage: install_beside_vllm.sh [--wheels DIR] [--no-deps] VLLM_VENV VENV PROBE REQUIREMENT..." >&2; exit 2; }
VLLM_VENV="${POSITIONAL[0]}"
VENV="${POSITIONAL[1]}"
PROBE="${POSITIONAL[2]}"
REQUIREMENTS=("${POSITIONAL[@]:3}")
PY="$VENV/bin/python"

log() { echo "[install_beside_vllm $(basename "$VENV")] $*" >&2; }

[[ -x "$VLLM_VENV/bin/python" ]] || { log "$VLLM_VENV has no python: install vLLM first"; exit 1; }

self_check() {
    [[ -x "$PY" ]] && "$PY" -c "$PROBE" >/dev/null 2>&1
}

if self_check; then
    log "$VENV already has ${REQUIREMENTS[*]} beside $VLLM_VENV"
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
log "installing ${REQUIREMENTS[*]} into $VENV (vLLM from $VLLM_VENV)"
"$PY" -m pip install --disable-pip-version-check --no-input -q "${where[@]}" "${NODEPS[@]}" "${REQUIREMENTS[@]}"
self_check || { log "the peer or vLLM does not import in $VENV after the install: $("$PY" -c "$PROBE" 2>&1 | tail -n 3)"
                exit 1; }
log "done"
