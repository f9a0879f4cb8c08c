# shellcheck shell=bash
# scripts/gpu_check.sh stages: Building and testing.
# Sourced by the dispatcher, which sets OUT, BUILD, C (the chorus binary) and rows (the summary's JSON rows);
# each stage_NAME function is one stage, described by the "# NAME: ..." line above it (--list shows it).

# build: cmake + ninja into build-gpu (CUDA, cuDNN and NCCL where found)
stage_build() {
  cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
  ninja -C $BUILD >"$OUT/build.log" 2>&1 || { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
  echo "build ok"
}

# tests: the CUDA tests (TESTS_FILTER; default every *CUDA* test)
stage_tests() {
  timeout 900 ./$BUILD/chorus_tests --gtest_filter="${TESTS_FILTER:-*_CUDA:*_MultiCUDA:*CUDA*}" 2>&1 | tee "$OUT/cuda_tests.log" | grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests ran|Failure|error" | head -60
}
