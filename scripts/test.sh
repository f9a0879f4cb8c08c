#!/usr/bin/env bash
# Builds Chorus and runs the whole test suite (unit tests and command-line
# tests). Tests that need a GPU skip, visibly, where there is none.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
scripts/build.sh
t1=$(date +%s)
echo "test: build took $(( t1 - t0 )) s"
cd "${BUILD_DIR:-build}"
ctest --output-on-failure -j "${CHORUS_CTEST_JOBS:-$(nproc)}" --timeout 1500
echo "test: ctest took $(( $(date +%s) - t1 )) s"
