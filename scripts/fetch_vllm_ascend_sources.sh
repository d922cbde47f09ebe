#!/usr/bin/env bash
# Download the vllm-ascend source distributions that yrpd's patch series target and unpack each into
# DEST/<version>/ (the sdist's top directory, PKG-INFO included).
#
#   scripts/fetch_vllm_ascend_sources.sh DEST [VERSION...]
#
# Without VERSION arguments the versions are the `source_version` of every series in
# patches/vllm-ascend/*/manifest.yaml (another series root: YRPD_SERIES_ROOT=DIR). When a manifest gives `source_sha256`, the downloaded sdist must
# match it (a changed upload fails loudly instead of silently testing other sources).
#
# Idempotent and cached: DEST/.sdist/ keeps the archives, an unpacked DEST/<version>/ is reused as is.
# Never patch DEST/<version> in place: copy it first (the tests do).
#
# How: `pip download --no-deps --no-binary vllm-ascend --no-build-isolation`. pip always prepares the
# metadata of an sdist it downloads; with build isolation that means installing the build requirements
# (torch-npu pinned to builds that are not published for this platform), so a small private venv
# (DEST/.tools) with setuptools and setuptools-scm prepares it instead. SOC_VERSION only satisfies
# vllm-ascend's setup.py, which wants a chip type even for metadata; nothing is compiled.
# pip uses whatever index configuration the machine has (pip.conf, PIP_INDEX_URL, ...).
set -euo pipefail

usage() { echo "usage: $0 DEST [VERSION...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
case "$1" in -h|--help) usage ;; esac

REPO="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$1"; shift
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
SERIES_ROOT="${YRPD_SERIES_ROOT:-$REPO/patches}/vllm-ascend"
PYTHON="${PYTHON:-python3}"

manifest_value() {  # manifest_value FILE KEY -> the top-level scalar KEY of a manifest, unquoted
    sed -n "s/^$2:[[:space:]]*//p" "$1" | head -n1 | sed -e 's/[[:space:]]*#.*$//' -e "s/^[\"']//" -e "s/[\"']\$//"
}

declare -A WANT_SHA=()
versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
    for manifest in "$SERIES_ROOT"/*/manifest.yaml; do
        [ -f "$manifest" ] || continue
        v="$(manifest_value "$manifest" source_version)"
        [ -n "$v" ] || { echo "fetch: $manifest has no source_version" >&2; exit 2; }
        versions+=("$v")
        WANT_SHA[$v]="$(manifest_value "$manifest" source_sha256)"
    done
    [ ${#versions[@]} -gt 0 ] || { echo "fetch: no series found under $SERIES_ROOT" >&2; exit 2; }
else
    for v in "${versions[@]}"; do
        for manifest in "$SERIES_ROOT"/*/manifest.yaml; do
            [ -f "$manifest" ] || continue
            if [ "$(manifest_value "$manifest" source_version)" = "$v" ]; then
                WANT_SHA[$v]="$(manifest_value "$manifest" source_sha256)"
            fi
        done
    done
fi

tools="$DEST/.tools"
ensure_tools() {
    if [ ! -x "$tools/bin/pip" ] || ! "$tools/bin/python" -c "import setuptools, setuptools_scm" 2>/dev/null; then
        echo "fetch: preparing $tools (setuptools, setuptools-scm for sdist metadata)"
        rm -rf "$tools"
        "$PYTHON" -m venv "$tools"
        if ! "$tools/bin/pip" install --disable-pip-version-check --no-input -q \
                "setuptools>=64" "setuptools-scm>=8" wheel >"$tools.log" 2>&1; then
            grep -v '^WARNING' "$tools.log" | tail -n 20 >&2 || true
            echo "fetch: could not install setuptools/setuptools-scm into $tools" >&2
            exit 1
        fi
        rm -f "$tools.log"
    fi
}

mkdir -p "$DEST/.sdist"
status=0
for v in "${versions[@]}"; do
    if [[ ! "$v" =~ ^[0-9][0-9A-Za-z.+-]*$ ]]; then
        echo "fetch: $v is not a version" >&2; exit 2
    fi
    tree="$DEST/$v"
    if [ -f "$tree/PKG-INFO" ] && [ -d "$tree/vllm_ascend" ]; then
        echo "fetch: vllm-ascend $v: cached in $tree"
        continue
    fi
    archive="$(ls "$DEST/.sdist"/vllm_ascend-"$v".tar.gz "$DEST/.sdist"/vllm-ascend-"$v".tar.gz 2>/dev/null | head -n1 || true)"
    if [ -z "$archive" ]; then
        ensure_tools
        echo "fetch: vllm-ascend $v: downloading the source distribution"
        dl="$(mktemp -d "$DEST/.download.XXXXXX")"
        if ! SOC_VERSION="${SOC_VERSION:-ascend910b1}" "$tools/bin/pip" download --disable-pip-version-check \
                --no-input -q --no-deps --no-binary vllm-ascend --no-build-isolation \
                -d "$dl" "vllm-ascend==$v" >"$dl.log" 2>&1; then
            grep -v '^WARNING' "$dl.log" | tail -n 20 >&2 || true
            echo "fetch: vllm-ascend $v: download failed (see above)" >&2
            rm -rf "$dl" "$dl.log"
            status=1
            continue
        fi
        got="$(ls "$dl"/*.tar.gz 2>/dev/null | head -n1 || true)"
        if [ -z "$got" ]; then
            echo "fetch: vllm-ascend $v: pip returned no .tar.gz source distribution" >&2
            rm -rf "$dl" "$dl.log"; status=1; continue
        fi
        archive="$DEST/.sdist/$(basename "$got")"
        mv "$got" "$archive"
        rm -rf "$dl" "$dl.log"
    fi
    sha="$(sha256sum "$archive" | cut -d' ' -f1)"
    want="${WANT_SHA[$v]:-}"
    if [ -n "$want" ] && [ "$sha" != "$want" ]; then
        echo "fetch: vllm-ascend $v: $archive has sha256 $sha, the manifest expects $want" >&2
        mv "$archive" "$archive.mismatch"
        status=1
        continue
    fi
    unpack="$(mktemp -d "$DEST/.unpack.XXXXXX")"
    tar -xzf "$archive" -C "$unpack" --no-same-owner
    top="$(find "$unpack" -mindepth 1 -maxdepth 1 -type d | head -n1)"
    if [ -z "$top" ] || [ ! -f "$top/PKG-INFO" ]; then
        echo "fetch: vllm-ascend $v: $archive is not an sdist (no top directory with PKG-INFO)" >&2
        rm -rf "$unpack"; status=1; continue
    fi
    rm -rf "$tree"
    mv "$top" "$tree"
    rm -rf "$unpack"
    echo "fetch: vllm-ascend $v: unpacked into $tree (sdist sha256 $sha)"
done
exit $status
