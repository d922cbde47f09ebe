#!/usr/bin/env bash
# The whole test suite: fast unit tests, fake-host lab tests and end-to-end tests (pytest markers
# `lab` and `e2e` select them; this script runs all). Installs what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
set +e
.venv/bin/python -m pytest tests "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
    echo "test.sh: pytest collected no tests: failing on purpose" >&2
    exit 1
fi
exit $rc
