# shellcheck shell=bash
# scripts/gpu_check.sh stages: DistributedDataParallel and the NCCL process group: one process per GPU.
# Sourced by the dispatcher, which sets OUT, BUILD, C (the chorus binary) and rows (the summary's JSON rows);
# each stage_NAME function is one stage, described by the "# NAME: ..." line above it (--list shows it).

# ddp: DDP (graphed, eager) at 1 and DDP_GPUS (2) GPUs beside DataParallel and PyTorch DDP (rows for the summary)
stage_ddp() {
  # DistributedDataParallel at 1 and N GPUs (DDP_GPUS, default 2: the first N)
  # beside Chorus's DataParallel and PyTorch's DDP (and PyTorch on one GPU, for
  # its scaling), same run.
  # DDP_CONFIGS="model:precision:flag ..." picks the rows (default: all three).
  local n=${DDP_GPUS:-2} devs
  devs=$(seq -s, 0 $((n - 1)) | sed 's/[0-9]\+/cuda:&/g')
  for cfg in ${DDP_CONFIGS:-"wrn-28-10:fp32:" "wrn-28-10:bf16:--channels-last" "wrn-16-4:bf16:--channels-last"}; do
    IFS=: read -r m p cl <<<"$cfg"
    # The step as a CUDA graph with its collectives (the default), then eager (--no-cuda-graphs).
    timeout 300 $C bench --model $m --strategy ddp --devices $devs --device-counts 1,$n --precision $p $cl \
      --batch-size 128 --steps 30 --warmup 8 --json | tee -a "$rows"
    timeout 300 $C bench --model $m --strategy ddp --devices $devs --device-counts ${DDP_EAGER_COUNTS:-$n} --precision $p $cl \
      --batch-size 128 --steps 30 --warmup 8 --no-cuda-graphs --json | tee -a "$rows"
    if [ "${DDP_DP:-1}" = 1 ]; then
      timeout 300 $C bench --model $m --strategy dp --devices $devs --device-counts $n --precision $p $cl \
        --batch-size 128 --steps 30 --warmup 8 --json | tee -a "$rows"
    fi
    if [ "${DDP_TORCH_SINGLE:-1}" = 1 ]; then
      timeout 300 python3 scripts/torch_reference.py --model $m --precision $p $cl --batch 128 --steps 30 --warmup 8 | tee -a "$rows"
    fi
    # (mp.spawn re-imports the main module: run the script itself, tag its rows)
    timeout 300 python3 .bench/torch_baseline.py --model $m --mode ddp --gpus $n --precision $p $cl --batch 128 --steps 30 --warmup 8 \
      | python3 -c 'import sys, json; [print(json.dumps({**json.loads(l), "torch": 1}), flush=True) for l in sys.stdin if l.startswith("{")]' \
      | tee -a "$rows"
  done
}

# ddpgraphs: graphed DDP against eager on 2 GPUs; a rank stopped mid-replay is named
stage_ddpgraphs() {
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
}

# ddpprof: 2-GPU DDP or DataParallel against 1 GPU, every kernel (nsys, or CUPTI), per GPU and step
stage_ddpprof() {
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
}

# ddptune: WRN-28-10 bf16 DDP at 1 GPU, then 2 GPUs under each variant (TUNE_VARIANTS)
stage_ddptune() {
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
}

# ddptrain: the Fashion-MNIST CNN, 5 epochs of DDP on 2 GPUs, from chorus launch and from mpirun
stage_ddptrain() {
  # Real convergence: the Fashion-MNIST CNN, 5 epochs, DDP on 2 GPUs, from chorus launch and from mpirun.
  F=${FMNIST_DIR:-.bench/fashion-mnist}
  timeout 300 $C launch --nproc-per-node 2 --master-port 29640 -- $C train --strategy ddp --data-dir $F --epochs 5 --seed 1 --quiet --json \
    | tee "$OUT/train_ddp_launch.json"
  MASTER_PORT=29641 timeout 300 mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_PORT -x NCCL_NVLS_ENABLE \
    $C train --strategy ddp --data-dir $F --epochs 5 --seed 1 --quiet --json | tee "$OUT/train_ddp_mpirun.json"
}

# dist: the NCCL process group on 2 GPUs: collectives, bus bandwidth beside PyTorch, a stopped rank, three launchers
stage_dist() {
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
}
