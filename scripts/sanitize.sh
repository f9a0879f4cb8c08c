#!/usr/bin/env bash
# CI's sanitizer stages, each in its own build directory and each printing
# its duration:
#   asan  scripts/test.sh with CHORUS_SANITIZE=address: the whole suite (unit
#         tests, command-line, dist and README tests, fuzz corpus replays, the
#         install test), CPU build, under AddressSanitizer +
#         UndefinedBehaviorSanitizer; any report fails the test that made it
#   tsan  (CPU-only) the multi-threaded tests (chorus_threaded_tests: engine, device
#         threads and streams, DataParallel, data loader, copies and
#         collectives, store and reducer) built with ThreadSanitizer
#
#   scripts/sanitize.sh [asan] [tsan]      (default: both)
set -euo pipefail
cd "$(dirname "$0")/.."
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(asan tsan)
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
LAUNCH=()
command -v ccache >/dev/null 2>&1 && LAUNCH=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
COMMON=(-DCMAKE_BUILD_TYPE=Release -DCHORUS_WITH_CUDA=OFF -DCHORUS_BUILD_BENCH=OFF)
JOBS=${CHORUS_CTEST_JOBS:-$(nproc)}
# OpenBLAS' own threads are not instrumented: one thread keeps it out of the picture.
export OPENBLAS_NUM_THREADS=1

configure() {  # dir, flags, extra cmake args...
  local dir=$1 flags=$2
  shift 2
  cmake -S . -B "$dir" "${GEN[@]}" "${LAUNCH[@]}" "${COMMON[@]}" -DCMAKE_CXX_FLAGS="$flags" \
    -DCMAKE_EXE_LINKER_FLAGS="$flags" "$@" >/dev/null
}

stage_asan() {
  # The whole suite, CPU build (scripts/test.sh with CHORUS_SANITIZE=address). CHORUS_TEST_QUICK=1: every test runs, and the few
  # long ones run a shorter variant of themselves: dist.train_ddp leaves its
  # convergence runs (minutes of training, 3x slower under ASan) to the plain
  # suite, dist.dead_rank kills and stops a rank 6 times each instead of 20,
  # cli.train_fashion_mnist trains 150 steps, install.out_of_tree leaves
  # compiling each header alone to the plain suite, dist.store_flood makes
  # 20,000 hostile connections instead of 100,000.
  CHORUS_SANITIZE=address CHORUS_TEST_QUICK=${CHORUS_TEST_QUICK:-1} scripts/test.sh
}

stage_tsan() {
  local dir=${TSAN_BUILD_DIR:-build-tsan}
  # Gloo is not instrumented; the threaded tests do not need it.
  configure "$dir" "-fsanitize=thread -fno-omit-frame-pointer -g1" -DCHORUS_WITH_GLOO=OFF -DCHORUS_OPT=-O1 -DCHORUS_TEST_OPT=-O0
  cmake --build "$dir" -j "$(nproc)" --target chorus_threaded_tests
  echo "sanitize: tsan build done after $(( $(date +%s) - start )) s"
  export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
  "$dir/chorus_threaded_tests" --gtest_brief=1
}

for s in "${STAGES[@]}"; do
  start=$(date +%s)
  echo "sanitize: stage $s"
  "stage_$s"
  echo "sanitize: stage $s passed in $(( $(date +%s) - start )) s"
done
