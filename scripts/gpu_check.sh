#!/usr/bin/env bash
# On a GPU machine: build (cmake + ninja), run the CUDA tests (and optionally
# compute-sanitizer), benchmark Chorus against PyTorch in the same run, and
# print a short table last. Stages: build tests sanitize bench train multi
# (default: build tests bench); memrun trains WRN-16-4 for nine minutes and
# prints the peak memory per epoch; dist runs the NCCL process group; ddp runs
# DistributedDataParallel (graphed and eager) beside DataParallel and PyTorch DDP;
# ddpprof profiles 2-GPU DDP against 1 GPU (nsys, or a CUPTI trace; for dp also each GPU's step kernel by kernel against 1 GPU's); ddpgraphs checks graphed DDP against eager and a rank dying mid-replay; ddptrain trains
# Fashion-MNIST with DDP on 2 GPUs; layout trains channels-last (the
# default) and --no-channels-last and resumes across them; dp runs DataParallel WRN-28-10 fp32 and bf16 at 1 and 2 GPUs;
# graphs runs the CUDA-graph tests and one GPU against torch.compile; direct checks and times the stem's direct
# convolution kernels and cuDNN's GEN_STATS fusion probe; graphlaunch times
# CUDA graph replays of several shapes (bench/graph_launch);
# bnbench times the batch-norm kernels per layer shape; convadd times the residual add in the convolution's epilogue; tracecmp sets Chorus's step beside torch.compile's kernel by kernel; hostprof samples an eager step's host time (gperftools); profile sums GPU time per kernel class (nsys); dpgraphs runs DataParallel
# with and without CUDA graphs on 2 GPUs;
# pipeline runs WRN-28-10 and WRN-40-10 in 2 stages (naive, GPipe, 1F1B,
# interleaved) and a pipeline of 2 processes over NCCL send/recv; pipetrain trains Fashion-MNIST
# in 2 stages, graphed and eager. Every command runs under `timeout`, so a hang
# shows up as a failed row instead of eating the machine's time. Logs and JSON rows go to $OUT (or ./gpu-out).
# PyTorch's reference script is read from .bench/torch_baseline.py (a copy of
# ../shared/bench, carried by the device tool).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
STAGES=${*:-build tests bench}
BUILD=build-gpu
rows="$OUT/rows.jsonl"
: > "$rows"
has() { [[ " $STAGES " == *" $1 "* ]]; }
# The kernels a racecheck log reports hazards in, with counts.
race_kernels() {
  echo "race hazards $(basename "$1"): $(grep -cE "Potential [A-Z]+ hazard|Race reported" "$1")"
  grep -oE "at 0x[0-9a-f]+ in [^(]+" "$1" | sed -E 's/^at 0x[0-9a-f]+ in (.*:)?//' | cut -c1-120 | sort | uniq -c | sort -rn | head -8 |
    sed "s/^/race kernels $(basename "$1"): /"
  grep -m1 -A4 -E "Potential [A-Z]+ hazard|Race reported" "$1" | cut -c1-240
}

nvidia-smi -L
if has build; then
  cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
  ninja -C $BUILD >"$OUT/build.log" 2>&1 || { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
  echo "build ok"
fi
C=./$BUILD/chorus
$C --version; $C devices
if has tests; then
  timeout 900 ./$BUILD/chorus_tests --gtest_filter="${TESTS_FILTER:-*_CUDA:*_MultiCUDA:*CUDA*}" 2>&1 | tee "$OUT/cuda_tests.log" | grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests ran|Failure|error" | head -60
fi
if has sanitize; then
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
fi
if has racetorch; then
  # PyTorch's own convolutions (scripts/torch_racecheck.py) under racecheck: which
  # kernels it reports hazards in when PyTorch, not Chorus, calls cuDNN.
  timeout ${RACETORCH_TIMEOUT:-420} compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
    python3 scripts/torch_racecheck.py ${RACETORCH_CASES:-} >"$OUT/racetorch.log" 2>&1
  echo "racetorch exit $?"; python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())'
  grep "torch_racecheck" "$OUT/racetorch.log" | tail -10; tail -3 "$OUT/racetorch.log"
  race_kernels "$OUT/racetorch.log"
fi
if has graphlaunch; then
  # What a CUDA graph's replay costs beyond its kernels (bench/graph_launch):
  # one device, through a caller's stream, one graph over two devices, a graph
  # per device; per device, the gap between replays and the time inside one.
  timeout 300 ./$BUILD/bench_graph_launch ${GRAPHLAUNCH_ARGS:-400 20 200} | tee "$OUT/graph_launch.txt"
fi
if has dpcrash; then
  # The DataParallel capture crash (Note [NCCL graph mixing] in cuda/nccl.h): DPCRASH_RUNS
  # runs of the 1,2-GPU DataParallel bench per variant, "name:VAR=value,VAR=value"
  # (default: as shipped, and with NCCL graph mixing back on, which crashed 4 in 10).
  A="bench --model ${DPCRASH_MODEL:-wrn-28-10} --strategy dp --devices cuda:0,cuda:1 --device-counts 1,2 --precision bf16 --channels-last --batch-size 128 --steps ${DPCRASH_STEPS:-60} --warmup 8 --json"
  for var in ${DPCRASH_VARIANTS:-default:CHORUS_DPCRASH=1 mixing:NCCL_GRAPH_MIXING_SUPPORT=1}; do
    name=${var%%:*}; envs=${var#*:}; crashes=0; rates=""
    for i in $(seq ${DPCRASH_RUNS:-4}); do
      env ${envs//,/ } timeout 150 $C $A > "$OUT/dpcrash_${name}_$i.txt" 2>&1
      rc=$?; [ $rc = 0 ] || crashes=$((crashes + 1))
      rates="$rates $(python3 -c 'import json,sys; r=[json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]; print("/".join("%.0f" % x["img_per_s"] for x in r) or "-", end="")' "$OUT/dpcrash_${name}_$i.txt")(rc $rc)"
    done
    echo "dpcrash $name [$envs]: $crashes of ${DPCRASH_RUNS:-4} runs failed; img/s 1 GPU/2 GPUs:$rates"
  done
fi
if has dpupdates; then
  # DataParallel on 2 GPUs, bf16 + channels-last, batch 128 per GPU, graphed:
  # replicas stepping their own weights (the default, Note [Replicated updates])
  # against --dp-broadcast, each at 1 and 2 GPUs in the same run
  # (DPUPDATES_MODELS, DPUPDATES_REPEAT runs of each; DPUPDATES_VARIANTS: the
  # flags of each row, "default" for none, e.g. "default --dp-all-reduce=copy-engine
  # NCCL_CTA_POLICY=1": a variant with "=" and no leading "-" is environment,
  # with any flags among it: "NCCL_CTA_POLICY=1,--bucket-mb=8").
  for m in ${DPUPDATES_MODELS:-wrn-16-4 wrn-28-10}; do
    for i in $(seq ${DPUPDATES_REPEAT:-1}); do
      for f in ${DPUPDATES_VARIANTS:-default --dp-broadcast}; do
        # A variant is flags ("--dp-all-reduce=copy-engine"), or environment
        # settings joined by commas ("NCCL_CTA_POLICY=1"), named in the table.
        envs=(); flags=${f#default}
        if [[ $f == *=* && $f != -* ]]; then
          # Environment settings and flags may be mixed: "A=1,--bucket-mb=8".
          flags=""
          for part in ${f//,/ }; do [[ $part == -* ]] && flags+=" $part" || envs+=("$part"); done
        fi
        env "${envs[@]}" timeout 200 $C bench --model $m --strategy dp --devices cuda:0,cuda:1 --device-counts 1,2 --precision bf16 \
          --channels-last --batch-size 128 --steps ${DPUPDATES_STEPS:-40} --warmup 8 --json $flags |
          CHORUS_VARIANT="$f" python3 -c 'import json,os,sys
for l in sys.stdin:
    if l.startswith("{"): r = json.loads(l); r["variant"] = os.environ.get("CHORUS_VARIANT", ""); print(json.dumps(r))' |
          tee -a "$OUT/dpupdates.jsonl" >/dev/null
      done
    done
  done
  python3 - "$OUT/dpupdates.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print(f"{'model':10} {'variant':28} {'updates':11} {'loss':11} {'all-reduce':11} {'grads':9} {'1 GPU':>9} {'2 GPUs':>9} {'efficiency':>10}")
for i in range(0, len(rows) - 1, 2):
    one, two = rows[i], rows[i + 1]
    print(f"{one['model']:10} {one.get('variant', ''):28} {one.get('dp_updates') or '-':11} {one.get('dp_loss') or '-':11} {two.get('dp_all_reduce') or '-':11} {two.get('dp_grads') or '-':9} {one['img_per_s']:9.0f} {two['img_per_s']:9.0f} "
          f"{two['img_per_s'] / (2 * one['img_per_s']):10.3f}")
PY
fi
if has microbatch; then
  # The one factor of a pipeline's bound that is not its schedule: how fast a
  # micro-batch runs per image against the whole batch, one GPU, per model
  # (MICRO_MODELS, MICRO_BATCHES: micro-batch first, whole batch last).
  for m in ${MICRO_MODELS:-wrn-28-10 wrn-40-10 wrn-28-20}; do
    for b in ${MICRO_BATCHES:-32 256}; do
      timeout 200 $C bench --model $m --devices cuda:0 --precision bf16 --channels-last --batch-size $b --steps 20 --warmup 5 --json \
        | tee -a "$OUT/microbatch.jsonl"
    done
  done
  # MICRO_TORCH="eager reduce-overhead ...": PyTorch's per-image ratio too, same batches, same run.
  for mode in ${MICRO_TORCH:-}; do
    for m in ${MICRO_MODELS:-wrn-28-10 wrn-40-10 wrn-28-20}; do
      for b in ${MICRO_BATCHES:-32 256}; do
        timeout 300 python3 .bench/torch_baseline.py --model $m --batch $b --precision bf16 --channels-last --steps 20 --warmup 5 \
          $([ $mode = eager ] || echo --compile $mode) 2>/dev/null | grep "^{" | sed "s/^{/{\"torch_mode\": \"$mode\", /" | tee -a "$OUT/microbatch_torch.jsonl"
      done
    done
  done
  python3 - "$OUT/microbatch.jsonl" "$OUT/microbatch_torch.jsonl" <<'PY'
import json, os, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
by = {}
for r in rows: by.setdefault(r["model"], []).append(r)
for m, rs in by.items():
    first, last = rs[0], rs[-1]
    print(f"microbatch {m:10} " + "  ".join(f"batch {r['batch_per_device']} {r['img_per_s']:.0f} img/s" for r in rs) +
          f"  per image {first['img_per_s'] / last['img_per_s']:.2f} of the whole batch's")
if os.path.exists(sys.argv[2]):
    by = {}
    for r in (json.loads(l) for l in open(sys.argv[2]) if l.startswith("{")):
        by.setdefault((r["torch_mode"], r["model"]), []).append(r)
    for (mode, m), rs in by.items():
        first, last = rs[0], rs[-1]
        print(f"microbatch torch {mode:15} {m:10} " + "  ".join(f"batch {r['batch_per_gpu']} {r['img_per_s']:.0f} img/s" for r in rs) +
              f"  per image {first['img_per_s'] / last['img_per_s']:.2f} of the whole batch's")
PY
fi
if has memrun; then
  # Issue 15: about nine minutes of WRN-16-4 training; the peak memory of each
  # epoch (metrics) must be flat after the first. SIGTERM ends it cleanly.
  rm -f "$OUT/memrun.jsonl"
  timeout -s TERM ${MEMRUN_SECONDS:-540} $C train --model wrn-16-4 --data synthetic --synthetic-size 20000 --devices cuda:0 \
    --precision bf16 --batch-size 128 --epochs 100000 --quiet --metrics "$OUT/memrun.jsonl" >/dev/null 2>"$OUT/memrun.err"
  echo "memrun exit $? (143: stopped by SIGTERM as planned)"; tail -2 "$OUT/memrun.err"
  python3 - "$OUT/memrun.jsonl" <<'PY'
import json, sys
ep = [r for r in map(json.loads, open(sys.argv[1])) if "peak_mem_bytes" in r]
peaks = [r["peak_mem_bytes"] / 2**20 for r in ep]
print(f"memrun: {len(ep)} epochs; peak MiB first {peaks[0]:.1f}, after it min {min(peaks[1:]):.1f} max {max(peaks[1:]):.1f}; "
      f"in use at epoch ends {ep[1]['mem_in_use_bytes'] / 2**20:.1f} .. {ep[-1]['mem_in_use_bytes'] / 2**20:.1f} MiB")
PY
fi
bench_pair() {  # model precision channels_last
  local m=$1 p=$2 cl=$3 flag=""
  [ "$cl" = 1 ] && flag=--channels-last
  timeout 300 $C bench --model $m --precision $p $flag --devices cuda:0 --batch-size 128 --steps 30 --warmup 8 --json | tee -a "$rows"
  timeout 300 python3 scripts/torch_reference.py --model $m --precision $p $flag --batch 128 --steps 30 --warmup 8 | tee -a "$rows"
}
if has bench; then
  for m in wrn-28-10 wrn-16-4; do
    bench_pair $m fp32 0
    bench_pair $m bf16 1
  done
fi
if has bnbench; then
  # Issue 14: the channels-last batch norm + ReLU kernels alone, per layer
  # shape (microseconds and GB/s against the GPU's copy bandwidth), then the
  # same kernels' test and one graphed WRN-28-10 bf16 run.
  ./$BUILD/bench_batch_norm_gpu | tee "$OUT/bnbench.txt"
  ./$BUILD/bench_batch_norm_gpu --fp32 | tee -a "$OUT/bnbench.txt"
  timeout 300 ./$BUILD/chorus_tests --gtest_filter='CudaBatchNorm*:SyncBatchNorm.Alone*' 2>&1 | grep -E "^\[  (FAILED|PASSED) |Failure"
fi
if has direct; then
  # Issue 14: the few-channel convolution kernels (Note [Direct convolutions of
  # a few input channels], cuda/conv_direct.h, for the stem; Note [Tensor-core
  # convolutions of few channels], cuda/conv_mma.h, for the first block's
  # forward):
  # their tests, the choices against cuDNN, cuDNN's GEN_STATS fusion probe
  # (bench/conv_genstats_gpu.cpp), then whole graphed WRN-28-10 steps with
  # both (default), without the tensor-core one (CHORUS_CONV_MMA=0) and
  # without either, alternated DIRECT_REPEAT times.
  timeout 300 ./$BUILD/chorus_tests --gtest_filter='ConvDirect.*:ConvGemm.*:ConvMma.*' 2>&1 | grep -E "^\[  (FAILED|PASSED) |Failure|Expected|Which is|forward|gradient" | head -40
  CHORUS_CONV_SEARCH_LOG=1 timeout 200 $C bench --model wrn-28-10 --precision bf16 --channels-last --devices cuda:0 \
    --batch-size 128 --steps 10 --warmup 3 2>&1 | grep -E "conv (direct|gemm|mma):"
  [ "${GENSTATS:-1}" = 1 ] && timeout 200 ./$BUILD/bench_conv_genstats_gpu | tee "$OUT/genstats.txt"
  for r in $(seq ${DIRECT_REPEAT:-3}); do
    for v in "1 1" "1 0" "0 0"; do
      set -- $v
      CHORUS_CONV_DIRECT=$1 CHORUS_CONV_MMA=$2 timeout 300 $C bench --model wrn-28-10 --precision bf16 --channels-last --devices cuda:0 \
        --batch-size 128 --steps 40 --warmup 8 --json | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print(f'direct=$1 mma=$2 wrn-28-10 {r[\"img_per_s\"]:.1f} img/s')"
    done
  done
fi
if has convadd; then
  # Issue 14: the residual add in the convolution's epilogue (Note [Residual
  # add in the epilogue], cuda/conv.cpp): per layer shape against conv + add,
  # then whole graphed steps with it (default) and without
  # (CHORUS_CONV_ADD_EPILOGUE=0), alternated CONVADD_REPEAT times.
  timeout 200 ./$BUILD/bench_conv_add_gpu | tee "$OUT/convadd.txt"
  for r in $(seq ${CONVADD_REPEAT:-2}); do
    for e in 1 0; do
      for m in ${CONVADD_MODELS:-wrn-28-10 wrn-16-4}; do
        CHORUS_CONV_ADD_EPILOGUE=$e timeout 300 $C bench --model $m --precision bf16 --channels-last --devices cuda:0 \
          --batch-size 128 --steps 40 --warmup 8 --json | python3 -c "import json,sys; r=json.loads(sys.stdin.read()); print(f'convadd epilogue=$e $m {r[\"img_per_s\"]:.0f} img/s')"
      done
    done
  done
fi
if has tracecmp; then
  # Issue 14: Chorus's graphed WRN-28-10 bf16 step beside torch.compile's
  # (TMODE, default max-autotune), kernel by kernel through CUPTI.
  OUT=$OUT bash scripts/trace_compare.sh
fi
if has train; then
  timeout 300 $C train --model cnn --data fashion-mnist --data-dir ${FMNIST_DIR:-.bench/fashion-mnist} --devices cuda:0 --epochs 5 --seed 1 --json | tee "$OUT/train_gpu.json"
fi
if has layout; then
  # chorus train's layouts: channels-last (the default on GPUs) against
  # --no-channels-last, the same accuracy (Fashion-MNIST, 2 epochs, seed 1)
  # and each one's throughput (a WRN-16-4 bf16 run too); then a checkpoint
  # written in one layout resumed in the other.
  F=${FMNIST_DIR:-.bench/fashion-mnist}
  for cl in "" --no-channels-last; do
    timeout 200 $C train --data-dir $F --devices cuda:0 --epochs 2 --seed 1 --quiet --json $cl | tail -1 | tee -a "$OUT/layout.jsonl"
    timeout 300 $C train --model wrn-16-4 --data synthetic --synthetic-size 25600 --devices cuda:0 --precision bf16 \
      --batch-size 128 --epochs 2 --seed 1 --quiet --json $cl | tail -1 | tee -a "$OUT/layout.jsonl"
  done
  rm -rf "$OUT/ckpt-layout"
  timeout 200 $C train --data-dir $F --devices cuda:0 --epochs 1 --seed 1 --quiet --checkpoint-dir "$OUT/ckpt-layout" --json | tail -1
  timeout 200 $C train --data-dir $F --devices cuda:0 --epochs 2 --seed 1 --quiet --checkpoint-dir "$OUT/ckpt-layout" --resume \
    --allow-change epochs --no-channels-last --json | tail -1
  echo "layout resume exit $?"
  python3 - "$OUT/layout.jsonl" <<'PY'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    print(f"layout: {r['model']:9} {r['precision']} channels_last={r.get('channels_last')} test_accuracy {r['test_accuracy']:.4f} img/s {r['img_per_s']:.0f}")
PY
fi
if has dp; then
  for p in fp32 bf16; do
    cl=""; [ $p = bf16 ] && cl=--channels-last
    timeout 300 $C bench --model wrn-28-10 --strategy dp --devices cuda:0,cuda:1 --device-counts 1,2 --precision $p $cl \
      --batch-size 128 --steps 20 --warmup 5 --json | tee -a "$rows"
  done
fi
if has ddp; then
  # DistributedDataParallel at 1 and 2 GPUs beside Chorus's DataParallel and
  # PyTorch's DDP (and PyTorch on one GPU, for its scaling), same run.
  # DDP_CONFIGS="model:precision:flag ..." picks the rows (default: all three).
  for cfg in ${DDP_CONFIGS:-"wrn-28-10:fp32:" "wrn-28-10:bf16:--channels-last" "wrn-16-4:bf16:--channels-last"}; do
    IFS=: read -r m p cl <<<"$cfg"
    # The step as a CUDA graph with its collectives (the default), then eager (--no-cuda-graphs).
    timeout 300 $C bench --model $m --strategy ddp --devices cuda:0,cuda:1 --device-counts 1,2 --precision $p $cl \
      --batch-size 128 --steps 30 --warmup 8 --json | tee -a "$rows"
    timeout 300 $C bench --model $m --strategy ddp --devices cuda:0,cuda:1 --device-counts ${DDP_EAGER_COUNTS:-2} --precision $p $cl \
      --batch-size 128 --steps 30 --warmup 8 --no-cuda-graphs --json | tee -a "$rows"
    if [ "${DDP_DP:-1}" = 1 ]; then
      timeout 300 $C bench --model $m --strategy dp --devices cuda:0,cuda:1 --device-counts 2 --precision $p $cl \
        --batch-size 128 --steps 30 --warmup 8 --json | tee -a "$rows"
    fi
    if [ "${DDP_TORCH_SINGLE:-1}" = 1 ]; then
      timeout 300 python3 scripts/torch_reference.py --model $m --precision $p $cl --batch 128 --steps 30 --warmup 8 | tee -a "$rows"
    fi
    # (mp.spawn re-imports the main module: run the script itself, tag its rows)
    timeout 300 python3 .bench/torch_baseline.py --model $m --mode ddp --gpus 2 --precision $p $cl --batch 128 --steps 30 --warmup 8 \
      | python3 -c 'import sys, json; [print(json.dumps({**json.loads(l), "torch": 1}), flush=True) for l in sys.stdin if l.startswith("{")]' \
      | tee -a "$rows"
  done
fi
if has ddpgraphs; then
  # Note [DDP in a CUDA graph]: graphed DDP steps against eager ones on 2 GPUs
  # (fp32, deterministic convolutions), with batch norm and with SyncBatchNorm;
  # then a rank that stops itself while the other replays: named, no hang.
  for m in cnn-bn cnn-bn-sync; do
    PROBE_DEVICE=cuda PROBE_TIMEOUT_MS=60000 timeout 180 $C launch --nproc-per-node 2 --master-port $((29660 + ${#m})) -- \
      ./$BUILD/chorus_ddp_probe graphed $m 2>&1 | grep -E "ok|FAIL|rror|replays|relative"
  done
  echo "== nccl, graphed: rank 1 stops itself (SIGSTOP) while rank 0 replays, timeout 5 s"
  PROBE_BACKEND=nccl PROBE_TIMEOUT_MS=5000 timeout 120 $C launch --nproc-per-node 2 --master-port 29670 -- \
    ./$BUILD/chorus_dist_probe hanggraph 1 STOP 2>&1 | grep -v "^  |" | tail -5
  echo "launcher exit ${PIPESTATUS[0]}; processes left: $(pgrep -fc 'chorus_dist_probe hanggraph' || true)"
fi
if has ddpprof; then
  # Where 2-GPU DDP loses time against 1 GPU (WRN-28-10 bf16 + channels-last,
  # graphed, batch 128 per GPU): every kernel of the timed steps of
  # `chorus bench --strategy ddp` at 1 and at 2 GPUs, per rank, graph nodes one
  # by one, through Nsight Systems where it is installed, else through
  # CUPTI (bench/kernel_trace: libchorus_kernel_trace.so as CUDA's injection
  # library); per GPU and step: span, busy, compute and NCCL kernel time and
  # NCCL's time with no compute beside it (scripts/gpu_timeline.py).
  NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
  TRACE_LIB=$PWD/$BUILD/libchorus_kernel_trace.so
  # DDPPROF_CASES: "STRATEGY:MODEL ..." (dp: DataParallel's one graph over both GPUs).
  for case in ${DDPPROF_CASES:-ddp:${DDPPROF_MODEL:-wrn-28-10}}; do
  S=${case%%:*} M=${case#*:}
  for n in ${DDPPROF_COUNTS:-1 2}; do
    tag=$S-$M-$n
    args=(bench --strategy $S --devices cuda:0,cuda:1 --device-counts $n --model $M --precision bf16 --channels-last
          --batch-size 128 --steps 20 --warmup 8 ${DDPPROF_FLAGS:-})
    if [ -n "$NSYS" ]; then
      CHORUS_PROFILER_RANGE=1 timeout 400 $NSYS profile -t cuda --cuda-graph-trace=node --capture-range=cudaProfilerApi \
        --capture-range-end=stop -f true -o "$OUT/prof_$tag" $C "${args[@]}" >"$OUT/prof_$tag.log" 2>&1 \
        || { echo "$tag: nsys failed"; tail -5 "$OUT/prof_$tag.log"; continue; }
      timeout 300 $NSYS stats --report cuda_gpu_trace --format csv -f true -o "$OUT/st_$tag" "$OUT/prof_$tag.nsys-rep" >/dev/null 2>&1
      traces=("$OUT/st_${tag}_cuda_gpu_trace.csv")
    elif [ -f "$TRACE_LIB" ]; then
      mkdir -p "$OUT/trace_$tag"
      CHORUS_PROFILER_RANGE=1 CUDA_INJECTION64_PATH=$TRACE_LIB CHORUS_KERNEL_TRACE="$OUT/trace_$tag/rank" \
        timeout 400 $C "${args[@]}" >"$OUT/prof_$tag.log" 2>&1 || { echo "$tag: traced run failed"; tail -5 "$OUT/prof_$tag.log"; continue; }
      traces=("$OUT"/trace_$tag/rank.*.csv)
    else
      echo "ddpprof: neither nsys nor the CUPTI trace library (no CUPTI in this build); skipped"; break
    fi
    grep -E "img/s" "$OUT/prof_$tag.log" | tail -1
    for t in "${traces[@]}"; do
      [ -s "$t" ] && python3 scripts/gpu_timeline.py "$t" 20 "$tag $(basename "$t" .csv)"
    done
  done
    # Each GPU of the 2-GPU step against the 1-GPU step, kernel by kernel
    # (scripts/gpu_step_diff.py): which kernels lose time, and beside NCCL or not.
    one=$(ls "$OUT"/trace_$S-$M-1/*.csv 2>/dev/null | head -1) two=$(ls "$OUT"/trace_$S-$M-2/*.csv 2>/dev/null | head -1)
    if [ -n "$one" ] && [ -n "$two" ] && [ "$S" = dp ]; then
      for g in 0 1; do
        echo "== $S $M: 2-GPU step's cuda:$g against the 1-GPU step, by position"
        python3 scripts/gpu_step_diff.py 20 "$one@0" "$two@$g" ${DDPPROF_TOP:-8}
      done
    fi
  done
  # The device tool returns a bounded number of files: the traces travel as one archive.
  ls "$OUT"/trace_* >/dev/null 2>&1 && tar -czf "$OUT/traces.tgz" -C "$OUT" $(cd "$OUT" && ls -d trace_*) && rm -rf "$OUT"/trace_*
fi
if has ddptune; then
  # Where WRN-28-10 bf16's DDP scaling goes: 1 GPU, then 2 GPUs under each
  # variant (TUNE_VARIANTS: "NAME:ENV=V,ENV=V:extra bench flags" ...).
  M=${TUNE_MODEL:-wrn-28-10}
  # TUNE_ONE_GPUS="0 1": the 1-GPU baseline on each GPU (are the two GPUs equally fast?); the first is the baseline.
  for g in ${TUNE_ONE_GPUS:-0}; do
    timeout 200 $C bench --model $M --strategy ddp --devices cuda:$g --device-counts 1 --precision bf16 --channels-last \
      --batch-size 128 --steps 40 --warmup 8 --json | sed "s/^{/{\"variant\":\"1gpu-cuda$g\",/" | tee -a "$OUT/tune.jsonl"
  done
  for v in ${TUNE_VARIANTS:-"default::"}; do
    IFS=: read -r name envs flags <<<"$v"
    timeout 200 env ${envs//,/ } $C bench --model $M --strategy ddp --devices cuda:0,cuda:1 --device-counts 2 --precision bf16 \
      --channels-last --batch-size 128 --steps 40 --warmup 8 $flags --json | sed "s/^{/{\"variant\":\"$name\",/" | tee -a "$OUT/tune.jsonl"
  done
  python3 - "$OUT/tune.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
base = next((r["img_per_s"] for r in rows if r["variant"].startswith("1gpu")), float("nan"))
for r in rows:
    print(f"tune {r['variant']:16} {r['devices']} GPU  {r['img_per_s']:9.1f} img/s  {r['step_ms']:6.2f} ms  efficiency {r['img_per_s'] / (r['devices'] * base):.3f}")
PY
fi
if has ddptrain; then
  # Real convergence: the Fashion-MNIST CNN, 5 epochs, DDP on 2 GPUs, from chorus launch and from mpirun.
  F=${FMNIST_DIR:-.bench/fashion-mnist}
  timeout 300 $C launch --nproc-per-node 2 --master-port 29640 -- $C train --strategy ddp --data-dir $F --epochs 5 --seed 1 --quiet --json \
    | tee "$OUT/train_ddp_launch.json"
  MASTER_PORT=29641 timeout 300 mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_PORT -x NCCL_NVLS_ENABLE \
    $C train --strategy ddp --data-dir $F --epochs 5 --seed 1 --quiet --json | tee "$OUT/train_ddp_mpirun.json"
fi
if has dist; then
  # The NCCL process group on 2 GPUs: collectives vs hand-computed values, bus
  # bandwidth beside PyTorch's, a stopped rank, and one job under three launchers.
  P=29610
  echo "== nccl collectives"
  PROBE_BACKEND=nccl PROBE_TIMEOUT_MS=60000 timeout 180 $C launch --nproc-per-node 2 --master-port $P -- ./$BUILD/chorus_dist_probe collectives 2>&1 | tail -4
  echo "== all-reduce bus bandwidth: chorus, then pytorch"
  timeout 200 $C launch --nproc-per-node 2 --master-port $((P+1)) -- $C bench-comm --backend nccl --sizes-mb 16,146,512 --json 2>&1 | tee "$OUT/busbw.jsonl"
  timeout 200 python3 .bench/nccl_busbw.py 2 2>&1 | grep "^{" | tee -a "$OUT/busbw.jsonl"
  echo "== nccl: rank 1 stops itself (SIGSTOP), timeout 5 s"
  PROBE_BACKEND=nccl PROBE_TIMEOUT_MS=5000 timeout 120 $C launch --nproc-per-node 2 --master-port $((P+2)) -- ./$BUILD/chorus_dist_probe hang 1 STOP 2>&1 | grep -v "^  |" | tail -5
  echo "launcher exit ${PIPESTATUS[0]}; processes left: $(pgrep -fc 'chorus_dist_probe hang' || true)"
  echo "== the same job under chorus launch, mpirun, torchrun"
  PROBE_BACKEND=nccl timeout 120 $C launch --nproc-per-node 2 --master-port $((P+3)) -- ./$BUILD/chorus_dist_probe sum 2>&1 | sed 's/^/chorus launch: /'
  PROBE_BACKEND=nccl MASTER_PORT=$((P+4)) timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 -x PROBE_BACKEND -x MASTER_PORT -x NCCL_NVLS_ENABLE ./$BUILD/chorus_dist_probe sum 2>&1 | sed 's/^/mpirun: /'
  PROBE_BACKEND=nccl timeout 120 torchrun --no-python --nproc-per-node 2 --master-port $((P+5)) ./$BUILD/chorus_dist_probe sum 2>&1 | grep -v "^W\|^\*" | sed 's/^/torchrun: /'
fi
if has pipeline; then
  # 2 stages on 2 GPUs, bf16 + channels-last, batch 256, 8 micro-batches: naive
  # model parallelism (1 micro-batch), GPipe, 1F1B, interleaved (2 virtual
  # stages per GPU); the balance measured once per model and shared by the rows.
  # A micro-batch of 32 runs WRN-28-10 at about half the speed per image of a
  # batch of 256 even on one GPU, so batch 1024 (micro-batches of 128) shows
  # what the schedules do when the micro-batches are not themselves the limit.
  # Each step is captured as one CUDA graph over both GPUs (the default);
  # PIPELINE_FLAGS=--no-cuda-graphs for eager steps. PIPELINE_CONFIGS: "model:batch ...".
  # PIPELINE_EAGER_TOO=1: each configuration eagerly as well (--no-cuda-graphs), same run.
  for cfg in ${PIPELINE_CONFIGS:-wrn-28-10:256 wrn-40-10:256 wrn-28-10:1024}; do
    set -- ${cfg//:/ }
    # PIPELINE_BOUND=1 (default): the first run of each configuration also times plain
    # steps of the micro-batch and of the batch on cuda:0 and gives each row its bound.
    b=$([ "${PIPELINE_BOUND:-1}" = 1 ] && echo --bound)
    for g in "${PIPELINE_FLAGS:-}" $([ "${PIPELINE_EAGER_TOO:-0}" = 1 ] && echo --no-cuda-graphs); do
      timeout 500 $C bench --strategy pipeline --model $1 --devices cuda:0,cuda:1 --precision bf16 --channels-last \
        --batch-size $2 --micro-batches 8 --schedules ${PIPELINE_SCHEDULES:-naive,gpipe,1f1b,interleaved} --steps 15 --warmup 4 \
        $g $b --json | tee -a "$OUT/pipeline.jsonl"
      b=
    done
  done
  [ "${PIPELINE_SINGLE:-1}" = 1 ] && for b in ${PIPELINE_SINGLE_BATCHES:-32 256}; do  # one GPU, micro-batch against whole batch
    timeout 200 $C bench --model wrn-28-10 --devices cuda:0 --precision bf16 --channels-last --batch-size $b --steps 20 --warmup 5 --json \
      | tee -a "$OUT/pipeline_single.jsonl"
  done
  echo "== pipeline stages over processes (NCCL send/recv, one GPU per rank) vs one device"
  for s in gpipe 1f1b; do
    PROBE_DEVICE=cuda timeout 180 $C launch --nproc-per-node 2 --master-port $((29650 + ${#s})) -- \
      ./$BUILD/chorus_pipeline_probe stages $s 2>&1 | grep -E "ok|FAIL|rror"
  done
  python3 - "$OUT/pipeline.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for r in rows:
    if r.get("strategy") == "plain":
        print(f"{r['model']} plain steps on {r['device_list']}: batch {r['micro_batch']} {r['micro_batch_img_per_s']:.1f} img/s, "
              f"batch {r['batch']} {r['batch_img_per_s']:.1f} img/s")
rows = [r for r in rows if r.get("strategy") == "pipeline"]
print(f"{'model':10} {'batch':>5} {'schedule':11} {'M':>2} {'graph':5} {'balance':>9} {'img/s':>9} {'x naive':>7} {'bound':>6} {'bubble':>6} {'ideal':>6} {'peak MiB per GPU':>18}")
for r in rows:
    peaks = "/".join(f"{p / 2**20:.0f}" for p in r["peak_mem_bytes_per_device"])
    sp = r["speedup_vs_naive"] or float("nan")
    bd = r.get("bound_vs_naive")
    print(f"{r['model']:10} {r['batch']:>5} {r['schedule']:11} {r['micro_batches']:>2} {'yes' if r.get('cuda_graphs') else 'no':5} {r['balance']:>9} {r['img_per_s']:9.1f} {sp:7.2f} "
          f"{'-' if bd is None else format(bd, '.2f'):>6} "
          f"{'-' if r['bubble'] is None else format(r['bubble'], '.3f'):>6} {r['bubble_ideal']:6.3f} {peaks:>18}")
PY
fi
if has pipetrain; then
  # Fashion-MNIST CNN, 2 stages on 2 GPUs, 4 micro-batches, 1F1B: the default
  # (each step one CUDA graph over both GPUs) against --no-cuda-graphs, same seed.
  F=${FMNIST_DIR:-.bench/fashion-mnist}
  for g in "" --no-cuda-graphs; do
    timeout 300 $C train --data-dir $F --strategy pipeline --devices cuda:0,cuda:1 --micro-batches 4 --schedule 1f1b \
      --epochs ${PIPETRAIN_EPOCHS:-5} --seed 1 --quiet --json $g 2>&1 | tail -3 | sed "s/^/pipetrain ${g:-graphed}: /"
  done
fi
if has graphs; then
  # Issue 14: the graphed step's tests, then one GPU against PyTorch's best
  # mode per model (eager, torch.compile default / reduce-overhead, and
  # max-autotune where GRAPH_COMPILE_MODES asks), Chorus with and without
  # CUDA graphs, all in this run.
  # GRAPH_TESTS=0: the benchmark rows only (a second call for more models).
  if [ "${GRAPH_TESTS:-1}" = 1 ]; then
  timeout 600 ./$BUILD/chorus_tests --gtest_filter='GraphedStep*:GraphCapture*:CudaKernels.*Update*:AdamW*:Optim*' 2>&1 \
    | tee "$OUT/graph_tests.log" | grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests ran|Failure|rror|CUDA graphs" | head -40
  # chorus train's default on a GPU (graphed) against --no-cuda-graphs: same seed, 2 epochs.
  F=${FMNIST_DIR:-.bench/fashion-mnist}
  for g in "" --no-cuda-graphs; do
    timeout 200 $C train --data-dir $F --devices cuda:0 --epochs 2 --seed 1 --quiet --json $g 2>&1 | tail -2 | tee -a "$OUT/graph_train.log"
  done
  fi
  : > "$OUT/graphs.jsonl"
  for cfg in ${GRAPH_CONFIGS:-"wrn-16-4:bf16:--channels-last" "wrn-28-10:bf16:--channels-last" "wrn-28-10:fp32:"}; do
    IFS=: read -r m p cl <<<"$cfg"
    timeout 300 $C bench --model $m --precision $p $cl --devices cuda:0 --batch-size 128 --steps 40 --warmup 8 --json | tee -a "$OUT/graphs.jsonl"
    timeout 300 $C bench --model $m --precision $p $cl --devices cuda:0 --batch-size 128 --steps 40 --warmup 8 --no-cuda-graphs --json | tee -a "$OUT/graphs.jsonl"
    timeout 300 python3 scripts/torch_reference.py --model $m --precision $p $cl --batch 128 --steps 40 --warmup 8 | tee -a "$OUT/graphs.jsonl"
    for mode in ${GRAPH_COMPILE_MODES:-default reduce-overhead}; do
      [ "$mode" = none ] && continue
      timeout 600 python3 scripts/torch_reference.py --model $m --precision $p $cl --batch 128 --steps 40 --warmup 8 --compile $mode 2>"$OUT/compile_${m}_${p}_${mode}.log" | tee -a "$OUT/graphs.jsonl"
    done
  done
  python3 - "$OUT/graphs.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
keys = sorted({(r["model"], r["precision"]) for r in rows})
print(f"{'model':10} {'prec':5} {'chorus graph':>12} {'chorus eager':>12} {'torch eager':>11} {'compile':>8} {'reduce-oh':>9} {'autotune':>8} {'ratio vs best':>13} {'peak MiB c/t':>13}")
for m, p in keys:
    rs = [r for r in rows if r["model"] == m and r["precision"] == p]
    ch = [r for r in rs if "strategy" in r]
    g = next((r for r in ch if r.get("cuda_graphs")), None)
    e = next((r for r in ch if not r.get("cuda_graphs")), None)
    t = {r.get("compile") or "eager": r for r in rs if r.get("torch")}
    best = max(t.values(), key=lambda r: r["img_per_s"], default=None)
    v = lambda r: r["img_per_s"] if r else float("nan")
    mine = max(v(g), v(e)) if g or e else float("nan")
    print(f"{m:10} {p:5} {v(g):12.1f} {v(e):12.1f} {v(t.get('eager')):11.1f} {v(t.get('default')):8.1f} {v(t.get('reduce-overhead')):9.1f} "
          f"{v(t.get('max-autotune')):8.1f} {mine / v(best):8.2f} ({(best or {}).get('compile') or 'eager'}) "
          f"{((g or e or {}).get('peak_mem_bytes', 0)) / 2**20:6.0f}/{(best or {}).get('peak_mem_bytes', 0) / 2**20:.0f}")
PY
fi
if has dpgraphs; then
  # Issue 14 on 2 GPUs: DataParallel steps captured as one graph over both
  # devices against eager DataParallel, at 1 and 2 GPUs (scaling efficiency).
  timeout 300 ./$BUILD/chorus_tests --gtest_filter='GraphedStep*:DeviceThread*:DataParallel*' 2>&1 \
    | tee "$OUT/dpgraph_tests.log" | grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|rror|CUDA graphs" | head -30
  for cfg in ${DPGRAPHS_CONFIGS:-wrn-16-4:bf16:--channels-last wrn-28-10:bf16:--channels-last}; do
    set -- ${cfg//:/ }
    for g in "" --no-cuda-graphs; do
      # DPGRAPHS_GDB=1: under gdb, which prints the stack of a crash.
      dbg=""; [ "${DPGRAPHS_GDB:-0}" = 1 ] && command -v gdb >/dev/null && dbg="gdb -q -batch -ex run -ex bt --args"
      timeout 300 $dbg $C bench --model $1 --strategy dp --devices cuda:0,cuda:1 --device-counts ${DPGRAPHS_COUNTS:-1,2} --precision $2 $3 \
        --batch-size 128 --steps 30 --warmup 8 $g 2>&1 | grep -v '^\[New Thread\|^\[Thread .* exited\|^\[Inferior' | tee -a "$OUT/dpgraphs.txt"
    done
  done
fi
if has profile; then
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
fi
if has ncu; then
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
fi
if has hostprof; then
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
fi
if has multi; then
  n=$(nvidia-smi -L | wc -l)
  devs=$(seq -s, 0 $((n-1)) | sed 's/[0-9]\+/cuda:&/g')
  timeout 300 ./$BUILD/bench_concurrency 2>&1 | tail -5
  for p in fp32 bf16; do
    cl=""; [ $p = bf16 ] && cl=--channels-last
    timeout 300 $C bench --model wrn-28-10 --strategy dp --devices "$devs" --precision $p $cl --batch-size 128 --steps 20 --warmup 5 --json | tee -a "$rows"
    timeout 300 python3 scripts/torch_reference.py --model wrn-28-10 --mode dp --gpus $n --precision $p $cl --steps 10 --warmup 3 | tee -a "$rows"
  done
fi
echo "== summary (img/s; ratio = Chorus / PyTorch, same machine, same run)"
python3 - "$rows" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
ch = [r for r in rows if "strategy" in r]
th = [r for r in rows if r.get("torch")]
print(f"{'model':10} {'prec':5} {'strategy':8} {'graph':5} {'dev':>3} {'chorus':>9} {'torch':>9} {'ratio':>6} {'peakMiB':>8} {'torchMiB':>8} {'issue/total ms':>15}")
for c in ch:
    mode = "single" if c["devices"] == 1 else c["strategy"]
    t = next((t for t in th if t["model"] == c["model"] and t["precision"] == c["precision"] and t["gpus"] == c["devices"]
              and t.get("channels_last", False) == c.get("channels_last", False)
              and (t["mode"] == mode or (mode == "dp" and t["mode"] == "ddp"))), None)
    tv = t["img_per_s"] if t else float("nan")
    tm = t.get("peak_mem_bytes", float("nan")) / 2**20 if t else float("nan")
    print(f"{c['model']:10} {c['precision']:5} {c['strategy']:8} {'yes' if c.get('cuda_graphs') else 'no':5} {c['devices']:>3} {c['img_per_s']:9.1f} {tv:9.1f} {c['img_per_s']/tv:6.2f} "
          f"{c['peak_mem_bytes']/2**20:8.0f} {tm:8.0f} {c.get('host_issue_ms',0):7.1f}/{c.get('total_ms',0):.1f}")
PY
