#!/usr/bin/env bash
# Builds the libFuzzer harnesses (tests/fuzz/fuzz_*.cpp) with clang,
# AddressSanitizer and UndefinedBehaviorSanitizer (CPU-only) in build-fuzz/,
# then runs each for SECONDS (default 60), one after another, and prints
# per harness: executions, coverage (edges, features), corpus size, crashes.
#
#   scripts/fuzz.sh [SECONDS] [HARNESS...]      e.g. scripts/fuzz.sh 600 idx safetensors
#
# Each harness starts from its checked-in seeds (tests/fuzz/corpus/<name>/,
# read-only here) plus what earlier runs found (build-fuzz/corpus/<name>/).
# A crash is written to build-fuzz/crashes/<name>/; fix it, then copy the
# input into tests/fuzz/corpus/fuzz_<name>/ so the test suite replays it.
# Needs clang and libFuzzer (Debian: apt-get install clang libclang-rt-dev).
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-60}
shift || true
BUILD_DIR=${FUZZ_BUILD_DIR:-build-fuzz}
CXX=$(command -v clang++ || command -v clang++-14 || true)
if [ -z "$CXX" ]; then echo "fuzz.sh: clang++ not found (apt-get install clang libclang-rt-dev)" >&2; exit 1; fi

ALL=()
for f in tests/fuzz/fuzz_*.cpp; do n=$(basename "$f" .cpp); ALL+=("${n#fuzz_}"); done
HARNESSES=("$@")
[ ${#HARNESSES[@]} -eq 0 ] && HARNESSES=("${ALL[@]}")

LAUNCH=()
command -v ccache >/dev/null 2>&1 && LAUNCH=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
SAN="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
cmake -S . -B "$BUILD_DIR" -G Ninja "${LAUNCH[@]}" -DCMAKE_CXX_COMPILER="$CXX" \
  -DCMAKE_BUILD_TYPE=Release -DCHORUS_WITH_CUDA=OFF -DCHORUS_WITH_GLOO=OFF -DCHORUS_BUILD_BENCH=OFF \
  -DCHORUS_FUZZ=ON -DCMAKE_CXX_FLAGS="$SAN" >/dev/null
TARGETS=()
for h in "${HARNESSES[@]}"; do TARGETS+=("fuzz_$h"); done
cmake --build "$BUILD_DIR" -j "$(nproc)" --target "${TARGETS[@]}"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
printf '%-14s %8s %12s %8s %8s %8s %8s\n' harness seconds execs cov ft corpus crashes
status=0
for h in "${HARNESSES[@]}"; do
  corpus="$BUILD_DIR/corpus/$h" crashes="$BUILD_DIR/crashes/$h" log="$BUILD_DIR/fuzz-$h.log"
  mkdir -p "$corpus" "$crashes"
  start=$(date +%s)
  "$BUILD_DIR/fuzz_$h" -max_total_time="$SECS" -max_len=16384 -rss_limit_mb=2560 -timeout=30 \
    -print_final_stats=1 -artifact_prefix="$crashes/" "$corpus" "tests/fuzz/corpus/fuzz_$h" >"$log" 2>&1 || status=1
  secs=$(( $(date +%s) - start ))
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  last=$(grep -E '^#[0-9]+' "$log" | tail -1)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  n=$(find "$corpus" -type f | wc -l)
  c=$(find "$crashes" -type f | wc -l)
  printf '%-14s %8s %12s %8s %8s %8s %8s\n' "$h" "$secs" "${execs:-?}" "${cov:-?}" "${ft:-?}" "$n" "$c"
  [ "$c" -eq 0 ] || status=1
done
exit $status
