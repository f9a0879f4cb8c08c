# shellcheck shell=bash
# scripts/gpu_check.sh stages: compute-sanitizer, over Chorus's CUDA tests and over PyTorch's convolutions.
# Sourced by the dispatcher, which sets OUT, BUILD, C (the chorus binary) and rows (the summary's JSON rows);
# each stage_NAME function is one stage, described by the "# NAME: ..." line above it (--list shows it).

# The kernels a racecheck log reports hazards in, with counts.
race_kernels() {
  echo "race hazards $(basename "$1"): $(grep -cE "Potential [A-Z]+ hazard|Race reported" "$1")"
  grep -oE "at 0x[0-9a-f]+ in [^(]+" "$1" | sed -E 's/^at 0x[0-9a-f]+ in (.*:)?//' | cut -c1-120 | sort | uniq -c | sort -rn | head -8 |
    sed "s/^/race kernels $(basename "$1"): /"
  grep -m1 -A4 -E "Potential [A-Z]+ hazard|Race reported" "$1" | cut -c1-240
}

# sanitize: compute-sanitizer memcheck and racecheck over the CUDA tests (SANITIZE_TOOLS, SANITIZE_FILTER)
stage_sanitize() {
  # SANITIZE_TOOLS: "memcheck racecheck" (default) or either alone; RACECHECK_ARGS="--kernel-name kns=chorus"
  # limits racecheck to Chorus's own kernels (cuDNN's and NCCL's then run uninstrumented, much faster).
  [[ " ${SANITIZE_TOOLS:-memcheck racecheck} " == *" memcheck "* ]] && {
  timeout ${SANITIZE_TIMEOUT:-420} compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 ./$BUILD/chorus_tests --gtest_filter="${SANITIZE_FILTER:-*_CUDA}" >"$OUT/memcheck.log" 2>&1
  echo "memcheck exit $? ($(grep -c 'Invalid' "$OUT/memcheck.log") invalid accesses)"; tail -3 "$OUT/memcheck.log"; }
  [[ " ${SANITIZE_TOOLS:-memcheck racecheck} " == *" racecheck "* ]] && {
  timeout ${SANITIZE_TIMEOUT:-420} compute-sanitizer --tool racecheck --racecheck-report hazard ${RACECHECK_ARGS:-} --error-exitcode 9 ./$BUILD/chorus_tests --gtest_filter="${SANITIZE_FILTER:-*_CUDA}" >"$OUT/racecheck.log" 2>&1
  echo "racecheck exit $? ($(grep -c 'Race reported\|Hazard' "$OUT/racecheck.log") hazard lines)"
  grep -E "^\[ +(OK|FAILED|PASSED) " "$OUT/racecheck.log" | tail -40; tail -3 "$OUT/racecheck.log"
  race_kernels "$OUT/racecheck.log"; }
}

# racetorch: PyTorch's own convolutions under racecheck (scripts/torch_racecheck.py)
stage_racetorch() {
  # PyTorch's own convolutions (scripts/torch_racecheck.py) under racecheck: which
  # kernels it reports hazards in when PyTorch, not Chorus, calls cuDNN.
  timeout ${RACETORCH_TIMEOUT:-420} compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
    python3 scripts/torch_racecheck.py ${RACETORCH_CASES:-} >"$OUT/racetorch.log" 2>&1
  echo "racetorch exit $?"; python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())'
  grep "torch_racecheck" "$OUT/racetorch.log" | tail -10; tail -3 "$OUT/racetorch.log"
  race_kernels "$OUT/racetorch.log"
}
