#!/usr/bin/env bash
# Builds Chorus and runs the whole test suite (unit tests and command-line
# tests). Tests that need a GPU skip, visibly, where there is none.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
cd "${BUILD_DIR:-build}"
ctest --output-on-failure -j "$(nproc)" --timeout 1500
