# Sourced by the stand-in image builders (scripts/build_standin_*image.sh): put a CPython with a shared libpython
# into the image's root file system under a prefix of its own, as CANN base images build theirs, found through
# ld.so.conf. Its site-packages stays empty (the builder adds what the image carries).
#
#   relocate_python SRC_PREFIX X.Y ROOT PREFIX
relocate_python() {
    local src="$1" xy="$2" root="$3" prefix="$4"
    mkdir -p "$root$prefix/bin" "$root$prefix/lib"
    cp -a "$src/bin/python$xy" "$root$prefix/bin/"
    ln -s "python$xy" "$root$prefix/bin/python3"
    cp -a "$src"/lib/libpython"$xy".so* "$root$prefix/lib/"
    tar -C "$src/lib" --exclude="python$xy/test" --exclude="python$xy/site-packages/*" \
        --exclude='__pycache__' -cf - "python$xy" | tar -C "$root$prefix/lib" -xf -
    echo "$prefix/lib" > "$root/etc/ld.so.conf.d/python$xy.conf"
}
