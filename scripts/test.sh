#!/usr/bin/env bash
# Installs what is missing, builds, and runs the default test suite.
# Exits non-zero on any failure; the last line is ctest's summary.
#   scripts/test.sh                 default suite (label 'unit' and 'e2e')
#   CTEST_ARGS="-L slow" scripts/test.sh   another label set
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
build="${CDCCA_BUILD_DIR:-$root/build}"
cd "$build"
# Tests that need real weights, long training or a GPU carry other labels and stay out.
# shellcheck disable=SC2086
ctest --output-on-failure -j "$(nproc)" -L '^(unit|e2e)$' ${CTEST_ARGS:-} 2>&1 | tee "$build/ctest.log"
status=${PIPESTATUS[0]}
summary=$(grep -E '^[0-9]+% tests passed' "$build/ctest.log" | tail -n 1 || true)
echo "${summary:-ctest printed no summary}"
exit "$status"
