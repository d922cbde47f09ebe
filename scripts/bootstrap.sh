#!/usr/bin/env bash
# Install what yrpd and its tests need on a fresh Debian 12 machine (root): apt packages and a venv in .venv.
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."

#   bootstrap.sh [--no-lab]   --no-lab: only what a deployment needs (the demo), not the lab tests' packages
# (a deployment reaches other hosts over SSH with Fabric, and localhost through a local shell: this machine needs no sshd)
APT_PACKAGES=(openssh-client iproute2 procps util-linux coreutils git curl)
if [ "${1:-}" != "--no-lab" ]; then
    # the fake hosts' sshd
    APT_PACKAGES+=(openssh-server)
    # the docker lab test: a dockerd inside each fake host, and the stand-in image's root file system
    APT_PACKAGES+=(docker.io debootstrap)
    # the host-fault lab's link delay where the kernel has no sch_netem: netfilterqueue builds against these
    APT_PACKAGES+=(libnetfilter-queue-dev gcc python3-dev)
    # `yrpd status --watch` is checked in a real terminal; `yrpd metrics` against a real Prometheus
    APT_PACKAGES+=(tmux prometheus)
    EXTRAS=test,lab
else
    EXTRAS=test
fi

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "bootstrap: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # never let the package start dockerd in this (root) namespace: it would turn on ip_forward and set the
    # iptables FORWARD policy for the whole machine; the lab tests run their own dockerd inside fake hosts
    policy_rc=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && policy_rc=1
    fi
    rc=0
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || rc=$?
    [ -z "$policy_rc" ] || rm -f /usr/sbin/policy-rc.d
    [ "$rc" -eq 0 ] || exit "$rc"
    if [ -d /run/systemd/system ] && printf '%s\n' "${missing[@]}" | grep -qx docker.io; then
        systemctl disable --now docker.service docker.socket >/dev/null 2>&1 || true
    fi
fi

stamp=.venv/.yrpd-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $EXTRAS"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    . deploy_scripts/pyinstall.sh
    pyi_init "${ENV_ROOT:-/opt/yrpd/venvs}"  # (uv's own venv beside the hosts' venvs: one for both)
    [ -x .venv/bin/python ] || pyi_phase "venv .venv" python3 -m venv .venv
    pyi_phase "yrpd and its [$EXTRAS] packages into .venv" pyi_install .venv -e ".[$EXTRAS]"
    pyi_phase "bytecode of .venv" pyi_compile .venv
    echo "$want" > "$stamp"
fi
