# shellcheck shell=bash
# scripts/gpu_check.sh stages: Where a step's time goes: traces and profiles, beside PyTorch's.
# Sourced by the dispatcher, which sets OUT, BUILD, C (the chorus binary) and rows (the summary's JSON rows);
# each stage_NAME function is one stage, described by the "# NAME: ..." line above it (--list shows it).

# tracecmp: Chorus's graphed step beside torch.compile's, kernel by kernel (CUPTI)
stage_tracecmp() {
  # Issue 14: Chorus's graphed WRN-28-10 bf16 step beside torch.compile's
  # (TMODE, default max-autotune), kernel by kernel through CUPTI.
  OUT=$OUT bash scripts/trace_compare.sh
}

# profile: GPU time per kernel class (Nsight Systems; CHORUS_PROFILE where it is absent)
stage_profile() {
  # Issue 14: GPU time per kernel class of the timed steps (Nsight Systems,
  # graph nodes traced one by one, kernels not serialised), Chorus's graphed
  # step beside torch.compile's and eager PyTorch's, to pick what to fuse.
  # CHORUS_PROFILER_RANGE=1 and scripts/torch_step_profile.py bracket the
  # steps with cudaProfilerStart/Stop: no plan search, no warm-up in the sums.
  # Without Nsight Systems on the machine: CHORUS_PROFILE's per-kernel table
  # of an eager step (each kernel timed alone, device synchronised around it).
  NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
  [ -z "$NSYS" ] && for m in ${PROFILE_MODELS:-wrn-16-4 wrn-28-10}; do
    echo "== CHORUS_PROFILE $m bf16 channels-last, eager, 20 steps"
    CHORUS_PROFILE=1 timeout 300 $C bench --model $m --precision bf16 --channels-last --devices cuda:0 --batch-size 128 \
      --steps 20 --warmup 5 --no-cuda-graphs 2>&1 >/dev/null | head -30
  done
  nsys_sum() {  # tag command...
    local tag=$1; shift
    timeout 400 $NSYS profile -t cuda --cuda-graph-trace=node --capture-range=cudaProfilerApi --capture-range-end=stop \
      -f true -o "$OUT/prof_$tag" "$@" >"$OUT/prof_$tag.log" 2>&1 || { echo "$tag: nsys failed"; tail -3 "$OUT/prof_$tag.log"; return; }
    timeout 300 $NSYS stats --report cuda_gpu_kern_sum --format csv -f true -o "$OUT/kern_$tag" "$OUT/prof_$tag.nsys-rep" >/dev/null 2>&1
    python3 scripts/kernel_classes.py "$OUT/kern_${tag}_cuda_gpu_kern_sum.csv" 20 "$tag"
  }
  [ -n "$NSYS" ] && for m in ${PROFILE_MODELS:-wrn-28-10}; do
    CHORUS_PROFILER_RANGE=1 nsys_sum "chorus-$m" $C bench --model $m --precision bf16 --channels-last --devices cuda:0 \
      --batch-size 128 --steps 20 --warmup 8
    for mode in ${PROFILE_TORCH_MODES:-reduce-overhead default}; do
      nsys_sum "torch-$m-$mode" python3 scripts/torch_step_profile.py $m bf16 1 $mode 20
    done
  done
}

# ncu: one training step's kernels under Nsight Compute, Chorus beside PyTorch
stage_ncu() {
  # Issue 14: one training step's kernels timed by Nsight Compute (one at a
  # time; caches and clocks left alone), Chorus beside torch.compile and eager
  # PyTorch, summed by kernel class (scripts/ncu_step.py).
  NCU="ncu --clock-control none --cache-control none --csv --print-units base --metrics gpu__time_duration.sum"
  for cfg in ${NCU_CONFIGS:-"wrn-28-10:bf16:1"}; do
    IFS=: read -r m p cl <<<"$cfg"
    flag=""; [ "$cl" = 1 ] && flag=--channels-last
    # Only the timed steps (CHORUS_PROFILER_RANGE): the plan search runs at
    # full speed and its log (CHORUS_CONV_SEARCH_LOG) says what was chosen.
    CHORUS_PROFILER_RANGE=1 CHORUS_CONV_SEARCH_LOG=1 timeout 400 $NCU --profile-from-start off \
      --log-file "$OUT/ncu_chorus_${m}_${p}.csv" $C bench --model $m --precision $p $flag --devices cuda:0 \
      --batch-size 128 --steps 3 --warmup 4 >/dev/null 2>"$OUT/ncu_chorus_${m}_${p}.err"
    python3 scripts/ncu_step.py "$OUT/ncu_chorus_${m}_${p}.csv" "chorus $m $p"
    for mode in ${NCU_TORCH_MODES:-reduce-overhead eager}; do
      timeout 500 $NCU --profile-from-start off --log-file "$OUT/ncu_torch_${m}_${p}_$mode.csv" \
        python3 scripts/torch_step_profile.py $m $p $cl $mode 2 >/dev/null 2>"$OUT/ncu_torch_${m}_${p}_$mode.err"
      python3 scripts/ncu_step.py "$OUT/ncu_torch_${m}_${p}_$mode.csv" "torch $mode $m $p" 2
    done
  done
}

# hostprof: an eager step's host time, sampled by gperftools
stage_hostprof() {
  # Issue 14 item 3: where an eager GPU step's host time goes. gperftools'
  # sampling profiler (SIGPROF: needs no perf_event access, which the GPU
  # machines do not give), preloaded from .bench/prof: Debian's
  # libprofiler.so.0 and libunwind.so.8, and google-pprof to read the profile.
  P=$PWD/.bench/prof
  for m in ${HOSTPROF_MODELS:-wrn-16-4}; do
    timeout 300 env LD_PRELOAD=$P/libprofiler.so.0 LD_LIBRARY_PATH=$P CPUPROFILE="$OUT/host_$m.prof" \
      CPUPROFILE_FREQUENCY=${HOSTPROF_HZ:-2000} $C bench --model $m --precision bf16 --channels-last --devices cuda:0 \
      --batch-size 128 --steps ${HOSTPROF_STEPS:-2000} --warmup 8 --no-cuda-graphs 2>&1 | tail -4
    perl $P/google-pprof --text --nodecount=45 $C "$OUT/host_$m.prof" 2>/dev/null > "$OUT/host_${m}_flat.txt"
    perl $P/google-pprof --text --cum --nodecount=90 $C "$OUT/host_$m.prof" 2>/dev/null > "$OUT/host_${m}_cum.txt"
    echo "== host profile $m (flat)"; head -40 "$OUT/host_${m}_flat.txt" | cut -c1-180
  done
}
