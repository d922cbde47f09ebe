#!/usr/bin/env bash
# Build the Python 3.12 STAND-IN image for the data system in containers, as a `docker load` archive:
#
#   scripts/build_standin_py312_image.sh [OUT_DIR]   (default /var/cache/yrpd/standin; tag and archive: last two lines)
#
# Today's vllm-ascend images (v0.23.0 on) run Python 3.12 in their own prefix (/usr/local/python3.12.13), for which
# the `yr` CLI has no wheel. This image has exactly that layout and nothing of vLLM (it serves nothing): Debian
# minbase (scripts/build_standin_rootfs.sh) plus a CPython 3.12 with a shared libpython, relocated into
# /usr/local/python3.12.13 (this machine's pyenv build, YRPD_PY312_PREFIX to name another), found through
# ld.so.conf as in the CANN images, its bin directory after /usr/bin on PATH (Debian's python3 is 3.11), and a FAKE
# CANN set_env.sh. No network inside (the lab's hosts have none). Cached: rebuilt when its inputs change.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/standin_lib.sh

OUT="${1:-/var/cache/yrpd/standin}"
TAG="yrpd-lab/vllm-ascend-standin:py312-datasystem"
PREFIX=/usr/local/python3.12.13
SRC_PREFIX="${YRPD_PY312_PREFIX:-$(ls -d /root/.pyenv/versions/3.12.* 2>/dev/null | sort -V | tail -n1 || true)}"

[ "$(id -u)" = 0 ] || { echo "build_standin_py312_image: needs root" >&2; exit 1; }
[ -n "$SRC_PREFIX" ] && [ -x "$SRC_PREFIX/bin/python3.12" ] \
    || { echo "build_standin_py312_image: no CPython 3.12 found (pyenv's /root/.pyenv/versions/3.12.*); set YRPD_PY312_PREFIX" >&2; exit 1; }
[ -f "$SRC_PREFIX/lib/libpython3.12.so.1.0" ] \
    || { echo "build_standin_py312_image: $SRC_PREFIX has no shared libpython (needed to relocate it)" >&2; exit 1; }

rootfs_tar="$(./scripts/build_standin_rootfs.sh "$OUT" | tail -n1)"
key="$(printf '%s\n' "$(sha256sum "$0" scripts/docker_archive.py scripts/standin_lib.sh | cut -c1-16)" "$(basename "$rootfs_tar")" \
       "$("$SRC_PREFIX/bin/python3.12" -VV)" | sha256sum | cut -c1-12)"
archive="$OUT/vllm-ascend-standin-py312-$key.tar"
standin_begin "$OUT" "$archive" "$TAG" "$rootfs_tar"
echo "build_standin_py312_image: CPython 3.12 at $PREFIX" >&2
# the standard library with venv support (ensurepip's bundled pip wheel): what the data system's venv is made from
relocate_python "$SRC_PREFIX" 3.12 "$root" "$PREFIX"
ldconfig -r "$root"
fake_cann "$root"
rm -rf "$root/root/.cache"
echo "build_standin_py312_image: docker load archive" >&2
python3 scripts/docker_archive.py "$root" "$TAG" "$archive" \
    --env "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PREFIX/bin" \
    --label "FAKE image with today's vllm-ascend layout for the data system: Debian minbase, CPython 3.12 in $PREFIX, a FAKE CANN environment; no vLLM, no NPU code"
echo "$TAG"
echo "$archive"
