#!/usr/bin/env bash
# Builds Chorus and runs the whole test suite (unit tests and command-line
# tests). Tests that need a GPU skip, visibly, where there is none.
#
# CHORUS_SANITIZE=address (scripts/sanitize.sh asan): the CPU build of
# everything (the plain build compiles the CUDA code; no GPU test runs without
# a GPU) under AddressSanitizer + UndefinedBehaviorSanitizer (library -O1, its
# CPU kernels -O2, test programs -O0), in build-asan; any report fails the
# test that made it.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
ARGS=()
case "${CHORUS_SANITIZE:-}" in
  "") ;;
  address)
    export BUILD_DIR=${BUILD_DIR:-build-asan}
    san="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
    ARGS=(-DCMAKE_CXX_FLAGS="$san" -DCMAKE_EXE_LINKER_FLAGS="$san" -DCHORUS_OPT=-O1 -DCHORUS_KERNEL_OPT=-O2 -DCHORUS_TEST_OPT=-O0
          -DCHORUS_BUILD_BENCH=OFF -DCHORUS_WITH_CUDA=OFF)
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=0:malloc_context_size=10
    export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    # Allocations the CUDA runtime and cuBLASLt make once and keep for the
    # life of the process are not leaks of Chorus's.
    export LSAN_OPTIONS=suppressions=$PWD/scripts/lsan.supp
    ;;
  *) echo "test.sh: CHORUS_SANITIZE must be 'address' or unset, got '${CHORUS_SANITIZE}'" >&2; exit 2 ;;
esac
scripts/build.sh "${ARGS[@]}"
t1=$(date +%s)
echo "test: build took $(( t1 - t0 )) s"
cd "${BUILD_DIR:-build}"
ctest --output-on-failure -j "${CHORUS_CTEST_JOBS:-$(nproc)}" --timeout 1500
echo "test: ctest took $(( $(date +%s) - t1 )) s"
