# Sourced by the stand-in image builders (scripts/build_standin_*image.sh).

# standin_begin OUT ARCHIVE TAG ROOTFS_TAR: an archive already built is printed (tag, path) and the builder exits;
# else, holding OUT's lock, the root file system is unpacked into $root under a temporary directory $tmp (removed
# when the builder exits)
standin_begin() {
    local out="$1" archive="$2" tag="$3" rootfs_tar="$4"
    if [ -s "$archive" ]; then echo "$tag"; echo "$archive"; exit 0; fi
    mkdir -p "$out"
    exec 9>"$out/.image.lock"
    flock 9
    if [ -s "$archive" ]; then echo "$tag"; echo "$archive"; exit 0; fi
    tmp="$(mktemp -d "$out/image.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    root="$tmp/rootfs"
    mkdir -p "$root"
    tar -C "$root" -xf "$rootfs_tar"
}

# relocate_python SRC_PREFIX X.Y ROOT PREFIX: a CPython with a shared libpython into the image's root file system
# under a prefix of its own, as CANN base images build theirs, found through ld.so.conf. Its site-packages stays
# empty (the builder adds what the image carries).
relocate_python() {
    local src="$1" xy="$2" root="$3" prefix="$4"
    mkdir -p "$root$prefix/bin" "$root$prefix/lib"
    cp -a "$src/bin/python$xy" "$root$prefix/bin/"
    ln -s "python$xy" "$root$prefix/bin/python3"
    cp -a "$src"/lib/libpython"$xy".so* "$root$prefix/lib/"
    tar -C "$src/lib" --exclude="python$xy/test" --exclude="python$xy/site-packages/*" \
        --exclude='__pycache__' -cf - "python$xy" | tar -C "$root$prefix/lib" -xf -
    echo "$prefix/lib" > "$root/etc/ld.so.conf.d/python$xy.conf"
    compile_bytecode "$src/bin/python$xy" "$root" "$prefix/lib/python$xy"
}

# compile_bytecode PYTHON ROOT DIR: the image's $DIR compiled ahead, as a pip-installed image is. Without it the first
# process of each container compiled everything it imported (vLLM's API server: 2.5 times a warm import's CPU). Hash-
# checked, so a file patched later (vllm-ascend's tree, yrpd's patches) is compiled again, never run stale; the paths
# inside are the image's. Some packages carry files for other Pythons that never compile (nor are imported): its
# exit status is not the image's.
compile_bytecode() {
    "$1" -m compileall -q -j 0 --invalidation-mode checked-hash -s "$2" -p / "$2$3" >/dev/null 2>&1 || true
}

# fake_cann ROOT: a FAKE CANN toolkit directory whose set_env.sh exports what CANN's does, in kind, and a marker the
# tests look for
fake_cann() {
    local cann="$1/usr/local/Ascend/ascend-toolkit"
    mkdir -p "$cann/latest/lib64"
    cat > "$cann/set_env.sh" <<'SETENV'
# FAKE set_env.sh (yrpd stand-in image): exports what CANN's does, in kind, and a marker the tests look for
export ASCEND_TOOLKIT_HOME=/usr/local/Ascend/ascend-toolkit/latest
export LD_LIBRARY_PATH=${ASCEND_TOOLKIT_HOME}/lib64:${LD_LIBRARY_PATH}
export YRPD_STANDIN_CANN_ENV=sourced
SETENV
}
