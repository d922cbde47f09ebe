#!/usr/bin/env bash
# Build the root file system of the stand-in image the docker lab test uses in place of the vllm-ascend image:
# Debian minbase plus git and python3 (with PyYAML and packaging, which yrpd's patch manager imports), as a tar
# for `docker import`. No registry is involved. Cached: built once per suite and package list, then reused.
#
#   scripts/build_standin_rootfs.sh [OUT_DIR]      (default /var/cache/yrpd/standin; prints the tar's path)
#
# Needs root and debootstrap (scripts/bootstrap.sh installs it). The Debian mirror is the one apt on this machine
# uses (its first deb URI), else debootstrap's default. About 1-2 minutes and 200 MB the first time.
set -euo pipefail

OUT="${1:-/var/cache/yrpd/standin}"
SUITE="${YRPD_STANDIN_SUITE:-bookworm}"
PACKAGES="git,python3,python3-yaml,python3-packaging"
# bump the last word when the recipe below changes, so a stale cache is not reused
key="$(printf '%s %s %s\n' "$SUITE" "$PACKAGES" "recipe-1" | sha256sum | cut -c1-12)"
tar_path="$OUT/debian-$SUITE-minbase-$key.tar"

if [ -s "$tar_path" ]; then
    echo "$tar_path"
    exit 0
fi
[ "$(id -u)" = 0 ] || { echo "build_standin_rootfs: needs root (debootstrap)" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "build_standin_rootfs: debootstrap not found; run scripts/bootstrap.sh" >&2; exit 1; }

apt_mirror() {  # the first Debian URI apt is configured with (deb822 .sources or one-line sources.list)
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*\).*/\1/p' "$f" | grep -v -- '-security' | head -n1 && return
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }' "$f" \
            | grep -v -- '-security' | head -n1 && return
    done
    true
}

mkdir -p "$OUT"
exec 9>"$OUT/.build.lock"
flock 9  # one builder at a time; a second caller waits and then finds the tar
if [ -s "$tar_path" ]; then
    echo "$tar_path"
    exit 0
fi
tmp="$(mktemp -d "$OUT/build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
mirror="$(apt_mirror)"
echo "build_standin_rootfs: debootstrap --variant=minbase $SUITE with $PACKAGES ${mirror:+from $mirror}" >&2
if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$tmp/rootfs" ${mirror:+"$mirror"} \
        >"$tmp/debootstrap.log" 2>&1; then
    tail -n 30 "$tmp/debootstrap.log" >&2
    echo "build_standin_rootfs: debootstrap failed (log above)" >&2
    exit 1
fi
rm -rf "$tmp/rootfs/var/cache/apt/archives/"*.deb "$tmp/rootfs/var/lib/apt/lists/"* "$tmp/rootfs/debootstrap"
tar -C "$tmp/rootfs" --numeric-owner -cf "$tmp/rootfs.tar" .
mv "$tmp/rootfs.tar" "$tar_path"
echo "$tar_path"
