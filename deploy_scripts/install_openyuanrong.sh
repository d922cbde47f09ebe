#!/usr/bin/env bash
# Install openYuanrong into two separate venvs (idempotent).
#
#   scripts/install_openyuanrong.sh [--wheels DIR] [--python PY] [YR_VENV] [DS_VENV]
#
#   YR_VENV  (default /opt/yrpd/venvs/yr): openyuanrong        -> the `yr` CLI, bundled etcd
#   DS_VENV  (default /opt/yrpd/venvs/ds): openyuanrong-datasystem -> dscli, datasystem_worker, KVClient
#
# The two packages cannot share one venv: `yr/__init__.py` preloads its own
# libdatasystem, so `import yr.datasystem` of the data-system package then fails.
# Versions can be overridden through the environment (YR_VERSION, DS_VERSION).
# --wheels DIR installs offline: pip install --no-index --find-links DIR.
# A venv whose package is already at the wanted version is left alone.
set -euo pipefail

YR_VERSION="${YR_VERSION:-9.9.9}"
DS_VERSION="${DS_VERSION:-0.8.1}"
YR_PACKAGE="openyuanrong"
DS_PACKAGE="openyuanrong-datasystem"

PYTHON="${PYTHON:-python3}"
WHEELS=""
POSITIONAL=()

usage() {
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --wheels) WHEELS="$2"; shift 2 ;;
        --wheels=*) WHEELS="${1#*=}"; shift ;;
        --python) PYTHON="$2"; shift 2 ;;
        --python=*) PYTHON="${1#*=}"; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
        *) POSITIONAL+=("$1"); shift ;;
    esac
done

YR_VENV="${POSITIONAL[0]:-/opt/yrpd/venvs/yr}"
DS_VENV="${POSITIONAL[1]:-/opt/yrpd/venvs/ds}"

if [[ -n "$WHEELS" && ! -d "$WHEELS" ]]; then
    echo "wheel dir not found: $WHEELS" >&2
    exit 2
fi

log() { echo "[install_openyuanrong] $*" >&2; }

# Both wheels are cp311-only (manylinux_2_34): any other interpreter gets "No matching distribution".
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    echo "need Python 3.11 for the openYuanrong wheels (cp311 only); '$PYTHON' is" \
        "$("$PYTHON" -V 2>/dev/null || echo missing). Pass --python python3.11." >&2
    exit 2
fi

# installed_version VENV DIST -> prints the version or nothing
installed_version() {
    local venv="$1" dist="$2"
    [[ -x "$venv/bin/python" ]] || return 0
    "$venv/bin/python" - "$dist" <<'EOF' 2>/dev/null || true
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    pass
EOF
}

# ensure_venv VENV DIST VERSION
ensure_venv() {
    local venv="$1" dist="$2" version="$3" have
    have="$(installed_version "$venv" "$dist")"
    if [[ "$have" == "$version" ]]; then
        log "$dist==$version already in $venv, skipping"
        return 0
    fi
    if [[ ! -x "$venv/bin/python" ]]; then
        log "creating venv $venv"
        mkdir -p "$(dirname "$venv")"
        "$PYTHON" -m venv "$venv"
    fi
    local pip_args=(install --disable-pip-version-check --no-input)
    if [[ -n "$WHEELS" ]]; then
        pip_args+=(--no-index --find-links "$WHEELS")
    fi
    log "installing $dist==$version into $venv${have:+ (had $have)}"
    "$venv/bin/python" -m pip "${pip_args[@]}" "$dist==$version"
    have="$(installed_version "$venv" "$dist")"
    if [[ "$have" != "$version" ]]; then
        echo "$dist in $venv is '${have:-missing}' after install, wanted $version" >&2
        exit 1
    fi
}

ensure_venv "$YR_VENV" "$YR_PACKAGE" "$YR_VERSION"
ensure_venv "$DS_VENV" "$DS_PACKAGE" "$DS_VERSION"

# Sanity checks: the entry points exist where yrpd expects them.
for f in "$YR_VENV/bin/yr" "$DS_VENV/bin/dscli"; do
    [[ -x "$f" ]] || { echo "missing after install: $f" >&2; exit 1; }
done
ds_worker="$(ls "$DS_VENV"/lib/python3*/site-packages/yr/datasystem/datasystem_worker 2>/dev/null | head -n1 || true)"
[[ -n "$ds_worker" && -x "$ds_worker" ]] || { echo "missing after install: datasystem_worker in $DS_VENV" >&2; exit 1; }

log "ok: yr=$YR_VENV/bin/yr dscli=$DS_VENV/bin/dscli datasystem_worker=$ds_worker"
