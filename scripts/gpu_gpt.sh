#!/usr/bin/env bash
# GPT-2 on a GPU machine, in the calls of one lease: build Chorus (cmake + ninja,
# the two targets needed), run the transformer CUDA tests, train gpt2 (124M) on
# random tokens beside PyTorch (bench/torch/torch_gpt.py, a copy of ../shared/bench/torch_gpt.py plus --mode tp)
# and karpathy/llm.c (carried as .anchors/llm.c with cudnn-frontend's headers in
# .anchors/cudnn-frontend), and print a table last.
#
# Usage: scripts/gpu_gpt.sh STAGE...
#   stages: build tests chorus chorus_eager chorus_composite torch compile llmc llmc_mpi converge profile dp ddp
#           profile_llmc launch_profile mesh_profile mesh3d zero_check zero_eval_capture zero zero_images refuse big mesh_pp mesh_tp plan obs table
#   (plan: chorus plan --calibrate on cuda:0 (and the bus bandwidth over 2 GPUs under chorus launch where there
#    are 2), then the plans of gpt2-xl on 1, 2, 4, 64 and 1024 GPUs, gpt2 on 1, 2, 4, gpt2-large on 4, d84 on 4,
#    64 and 1024; the calibration and every plan's JSON rows land in $OUT/plan_*, the predicted-beside-measured
#    table (scripts/plan_table.py over bench/plan/measured.jsonl) in $OUT/plan_table.md)
#   (zero_check: --strategy zero equal to DDP over NCCL; zero: ZERO_STAGES beside PyTorch FSDP2, each run's
#    memory plan checked against its measured peak (within 10%), ZERO_CKPT=N: a sharded checkpoint every N
#    steps and its stall; refuse: BIG_MODEL (d84) under DDP and ZeRO-1 stops at once with the plan's message
#    (REFUSE_FLAGS: e.g. --memory-limit-gib 79 to plan an H100's memory on an H200);
#    big: BIG_MODEL with ZeRO-3, BIG_BATCH (1) sequences a GPU, BIG_FLAGS (extra train flags);
#    obs: a slowed and a stopped rank named over NCCL, --trace's device tracks (and of a --mesh tp=2 GPT, trained
#    and benched), a killed --mesh tp=2 rank named by the survivor, on 2 GPUs)
#   ZERO_STAGES entries: 1 2 3, with e for eager (--no-cuda-graphs), f for float32 gathered weights
#   (--zero-param-dtype fp32) and g for --recompute-gelu, e.g. 3e 1f 1g; ddp: DDP_ONE=0 skips the one-GPU run,
#   DDP_TORCH=0 PyTorch's
#   tests: GPU_TESTS (a gtest filter) instead of the transformer tests
#   GPT_MODEL (gpt2), GPT_BATCH (16), GPT_SEQ (1024), GPT_STEPS (30); BUILD_TARGETS (chorus_cli chorus_tests)
# Rows land in $OUT/gpt_rows.jsonl (one JSON object per run) for the table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpt_out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
BUILD=build-gpu
MODEL=${GPT_MODEL:-gpt2}; B=${GPT_BATCH:-16}; T=${GPT_SEQ:-1024}; STEPS=${GPT_STEPS:-30}
ROWS="$OUT/gpt_rows.jsonl"
DATA=/tmp/gpt_tokens

tokens() {  # random GPT-2 token ids in llm.c's format: a train and a val shard
  [ -f $DATA/rand_train_000.bin ] && return
  mkdir -p $DATA
  python3 - $DATA <<'PY'
import sys, numpy as np
rng = np.random.default_rng(0)
for name, n in (("rand_train_000.bin", 4_000_000), ("rand_val_000.bin", 300_000)):
    h = np.zeros(256, np.int32); h[0], h[1], h[2] = 20240520, 1, n
    with open(f"{sys.argv[1]}/{name}", "wb") as f:
        f.write(h.tobytes()); f.write(rng.integers(0, 50257, n, dtype=np.uint16).tobytes())
PY
}

memplan() {  # NAME ERRFILE: the memory plan's measured line, checked within 10% of the plan
  python3 - "$1" "$2" <<'PY'
import re, sys
m = re.findall(r"memory: peak ([\d.]+) GiB measured, plan ([\d.]+) GiB", open(sys.argv[2], errors="replace").read())
if not m: print(f"memory plan {sys.argv[1]}: no measured line"); sys.exit()
peak, plan = map(float, m[0])
ok = abs(peak / plan - 1) <= 0.10
print(f"memory plan {sys.argv[1]}: peak {peak:.2f} GiB, plan {plan:.2f} GiB, {100 * peak / plan:.1f}% -> {'ok' if ok else 'FAIL'} (within 10%)")
PY
}

kernel_sum() {  # CSV STEPS: GPU time by kernel, per step, from the CUPTI trace library's CSV
  python3 - "$1" "$2" <<'PY'
import csv, sys, collections
rows = list(csv.DictReader(open(sys.argv[1]))); steps = int(sys.argv[2])
t = collections.Counter(); n = collections.Counter()
for r in rows:
    k = r["Name"][:90]; t[k] += int(r["Duration (ns)"]); n[k] += 1
total = sum(t.values())
print(f"GPU busy over {steps} steps: {total/1e6:.1f} ms ({total/steps/1e6:.1f} ms a step)")
for k, v in t.most_common(30):
    print(f"{v/steps/1e6:8.2f} ms/step {100*v/total:5.1f}% {n[k]//steps:5d}x  {k}")
PY
}

for stage in "$@"; do
  case $stage in
  build)
    t0=$(date +%s)
    cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DCHORUS_BUILD_BENCH=OFF >"$OUT/cmake.log" 2>&1 \
      || { tail -30 "$OUT/cmake.log"; exit 1; }
    ninja -C $BUILD ${BUILD_TARGETS:-chorus_cli chorus_tests} >"$OUT/build.log" 2>&1 || { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
    echo "build: $(( $(date +%s) - t0 )) s"
    ;;
  tests)
    $BUILD/chorus_tests --gtest_filter="${GPU_TESTS:-TransformerOps.*:GPTModel.*:TokenFiles.*:Bpe.*:CudaKernels.*:GradcheckElementwise.*}" \
      2>&1 | tee "$OUT/tests.log" | grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]|Failure|error" | head -40
    ;;
  chorus|chorus_eager|chorus_composite)
    # chorus_eager: --no-cuda-graphs; chorus_composite: --attention composite (no
    # fused flash attention): each against the default step on the same machine.
    tokens
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    # GPT_TAG: a suffix telling apart runs of one stage (e.g. under an env switch); GPT_FLAGS: more train flags
    flags=(${GPT_FLAGS:-}); tag=bf16${GPT_TAG:-}
    [ $stage = chorus_eager ] && { flags+=(--no-cuda-graphs); tag=bf16_eager${GPT_TAG:-}; }
    [ $stage = chorus_composite ] && { flags=(--attention composite); tag=bf16_composite; }
    $BUILD/chorus train --model $MODEL --data "tokens:$DATA/rand_train_*.bin" --seq-len $T --batch-size $B \
      --precision bf16 --steps $STEPS --log-every 10 --val-windows 16 --json "${flags[@]}" 2>"$OUT/chorus_$tag.err" \
      | tail -1 > "$OUT/chorus_$tag.json"
    grep -v "^device memory" "$OUT/chorus_$tag.err" | tail -3
    grep "^device memory" "$OUT/chorus_$tag.err"  # Note [Device memory breakdown]
    memplan "single $tag" "$OUT/chorus_$tag.err"
    python3 - "$OUT/chorus_$tag.json" "$ROWS" $tag <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
row = {"who": "chorus", "mode": "single " + sys.argv[3], "tok_per_s": r["tok_per_s"], "mfu": r["mfu"],
       "peak_gib": r["peak_mem_bytes"] / 2**30,
       "dev_gib": r.get("device_used_bytes", 0) / 2**30 or None, "loss": r["train_loss"]}
open(sys.argv[2], "a").write(json.dumps(row) + "\n")
PY
    ;;
  torch|compile)
    args=(--model $MODEL --batch $B --seq $T --steps 20 --warmup 5)
    [ $stage = compile ] && args+=(--compile default)
    python3 bench/torch/torch_gpt.py "${args[@]}" 2>"$OUT/torch_$stage.err" | tail -1 > "$OUT/torch_$stage.json" \
      || tail -5 "$OUT/torch_$stage.err"
    cat "$OUT/torch_$stage.json"
    python3 - "$OUT/torch_$stage.json" "$ROWS" "$stage" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
row = {"who": "pytorch", "mode": "eager" if sys.argv[3] == "torch" else "torch.compile", "tok_per_s": r["tok_per_s"],
       "mfu": r["tflops_per_gpu"] * 1e12 / 989.4e12, "peak_gib": r["peak_mem_gib"], "loss": r["loss"]}
open(sys.argv[2], "a").write(json.dumps(row) + "\n")
PY
    ;;
  llmc)
    tokens
    L=.anchors/llm.c
    if [ ! -x /tmp/train_gpt2cu ]; then
      t0=$(date +%s)
      NV=(nvcc -O3 -t=0 --use_fast_math -std=c++17 --generate-code arch=compute_90,code=[compute_90,sm_90]
          -DENABLE_BF16 -DENABLE_CUDNN -I../cudnn-frontend/include)
      (cd $L && "${NV[@]}" -c llmc/cudnn_att.cpp -o /tmp/cudnn_att.o && "${NV[@]}" train_gpt2.cu /tmp/cudnn_att.o \
        -lcublas -lcublasLt -lcudnn -lnvidia-ml -lnvrtc -lcuda -o /tmp/train_gpt2cu) >"$OUT/llmc_build.log" 2>&1 \
        || { tail -20 "$OUT/llmc_build.log"; continue; }
      echo "llm.c build: $(( $(date +%s) - t0 )) s"
    fi
    depth=$(python3 -c "print({'gpt2':12,'gpt2-medium':24,'gpt2-large':36,'gpt2-xl':48}.get('$MODEL','$MODEL'.lstrip('d')))")
    (cd /tmp && ./train_gpt2cu -i "$DATA/rand_train_*.bin" -j "$DATA/rand_val_*.bin" -e "d$depth" -b $B -t $T \
      -x $STEPS -v 100000 -s 0 -h 0 -y 0) >"$OUT/llmc.log" 2>&1 || tail -20 "$OUT/llmc.log"
    grep -E "^step" "$OUT/llmc.log" | tail -3
    python3 - "$OUT/llmc.log" "$ROWS" <<'PY'
import re, sys, json
steps = [l for l in open(sys.argv[1]) if l.startswith("step")]
# "step   30/30 | loss ... | norm ... | lr ... | 33.31 ms | 40.2% bf16 MFU | 491844 tok/s"
tail = steps[len(steps) // 2:]  # the second half: past the warm-up
toks = [float(re.search(r"\|\s*([\d.]+) tok/s", l).group(1)) for l in tail]
# llm.c prints -100% where it does not know the GPU's peak (the H200): no MFU then
mfu = [float(re.search(r"(-?[\d.]+)% bf16 MFU", l).group(1)) for l in tail]
mfu = sum(mfu) / len(mfu) / 100 if all(m > 0 for m in mfu) else None
mem = re.findall(r"device memory usage: (\d+) MiB", open(sys.argv[1]).read())
row = {"who": "llm.c", "mode": "single bf16 cudnn", "tok_per_s": sum(toks) / len(toks), "mfu": mfu,
       "peak_gib": int(mem[-1]) / 1024 if mem else None,
       "dev_gib": int(mem[-1]) / 1024 if mem else None, "loss": None}
open(sys.argv[2], "a").write(json.dumps(row) + "\n")
PY
    ;;
  llmc_mpi)  # llm.c over the GPUs (MPI + NCCL, -z LLMC_ZERO: 1 = ZeRO-1 as its README trains), GPT_GPUS (all)
    tokens
    L=.anchors/llm.c
    NG=${GPT_GPUS:-$(nvidia-smi -L | wc -l)}
    if [ ! -x /tmp/train_gpt2cu_mpi ]; then
      t0=$(date +%s)
      MPI_I=$(mpicxx --showme:compile | tr ' ' '\n' | grep '^-I' | tr '\n' ' ')
      MPI_L=$(mpicxx --showme:link | tr ' ' '\n' | grep -E '^-[Ll]' | tr '\n' ' ')
      NV=(nvcc -O3 -t=0 --use_fast_math -std=c++17 --generate-code arch=compute_90,code=[compute_90,sm_90]
          -DENABLE_BF16 -DENABLE_CUDNN -DMULTI_GPU -DUSE_MPI -I../cudnn-frontend/include $MPI_I)
      (cd $L && "${NV[@]}" -c llmc/cudnn_att.cpp -o /tmp/cudnn_att_mpi.o && "${NV[@]}" train_gpt2.cu /tmp/cudnn_att_mpi.o \
        -lcublas -lcublasLt -lcudnn -lnvidia-ml -lnvrtc -lcuda -lnccl $MPI_L -o /tmp/train_gpt2cu_mpi) \
        >"$OUT/llmc_mpi_build.log" 2>&1 || { tail -20 "$OUT/llmc_mpi_build.log"; continue; }
      echo "llm.c (MPI) build: $(( $(date +%s) - t0 )) s"
    fi
    depth=$(python3 -c "print({'gpt2':12,'gpt2-medium':24,'gpt2-large':36,'gpt2-xl':48}.get('$MODEL','$MODEL'.lstrip('d')))")
    (cd /tmp && timeout 500 mpirun --allow-run-as-root -np $NG ./train_gpt2cu_mpi -i "$DATA/rand_train_*.bin" \
      -j "$DATA/rand_val_*.bin" -e "d$depth" -b $B -t $T -x $STEPS -v 100000 -s 0 -h 0 -y 0 -z ${LLMC_ZERO:-1}) \
      >"$OUT/llmc_mpi.log" 2>&1 || tail -20 "$OUT/llmc_mpi.log"
    grep -E "^step" "$OUT/llmc_mpi.log" | tail -2
    python3 - "$OUT/llmc_mpi.log" "$ROWS" $NG ${LLMC_ZERO:-1} <<'PY'
import re, sys, json
steps = [l for l in open(sys.argv[1]) if l.startswith("step")]
tail = steps[len(steps) // 2:]
toks = [float(re.search(r"\|\s*([\d.]+) tok/s", l).group(1)) for l in tail]
# llm.c prints -100% where it does not know the GPU's peak (the H200): no MFU then
mfu = [float(re.search(r"(-?[\d.]+)% bf16 MFU", l).group(1)) for l in tail]
mfu = sum(mfu) / len(mfu) / 100 if all(m > 0 for m in mfu) else None
mem = re.findall(r"device memory usage: (\d+) MiB", open(sys.argv[1]).read())
row = {"who": "llm.c", "mode": f"{sys.argv[3]} GPUs zero-{sys.argv[4]} cudnn", "tok_per_s": sum(toks) / len(toks),
       "mfu": mfu, "peak_gib": int(mem[-1]) / 1024 if mem else None,
       "dev_gib": int(mem[-1]) / 1024 if mem else None, "loss": None}
open(sys.argv[2], "a").write(json.dumps(row) + "\n")
PY
    ;;
  dp)  # DataParallel over the GPUs of this process (GPT_GPUS, default all)
    tokens
    NG=${GPT_GPUS:-$(nvidia-smi -L | wc -l)}
    devs=$(python3 -c "print(','.join(f'cuda:{i}' for i in range($NG)))")
    $BUILD/chorus train --model $MODEL --strategy dp --devices $devs --data "tokens:$DATA/rand_train_*.bin" \
      --seq-len $T --batch-size $B --precision bf16 --steps $STEPS --log-every 10 --val-windows 4 --json \
      2>"$OUT/dp$NG.err" | tail -1 > "$OUT/dp$NG.json" || tail -5 "$OUT/dp$NG.err"
    grep -E "CUDA graphs|step $STEPS/" "$OUT/dp$NG.err" | tail -2
    python3 - "$OUT/dp$NG.json" "$ROWS" $NG <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
row = {"who": "chorus", "mode": f"dp {sys.argv[3]} GPUs", "tok_per_s": r["tok_per_s"], "mfu": r["mfu"],
       "peak_gib": r["peak_mem_bytes"] / 2**30,
       "dev_gib": r.get("device_used_bytes", 0) / 2**30 or None, "loss": r["train_loss"]}
open(sys.argv[2], "a").write(json.dumps(row) + "\n")
PY
    ;;
  ddp)  # DDP over the GPUs (chorus launch, NCCL) beside PyTorch DDP; GPT_GPUS (all)
    tokens
    NG=${GPT_GPUS:-$(nvidia-smi -L | wc -l)}
    counts="1 $NG"; [ "${DDP_ONE:-1}" = 0 ] && counts=$NG  # DDP_ONE=0: no one-GPU run
    for n in $counts; do
      timeout 500 $BUILD/chorus launch --nproc-per-node $n -- $BUILD/chorus train --model $MODEL --strategy ddp \
        --devices cuda --data "tokens:$DATA/rand_train_*.bin" --seq-len $T --batch-size $B --precision bf16 \
        --steps $STEPS --log-every 10 --val-windows 4 --json 2>"$OUT/ddp$n.err" | grep '{' | sed 's/^\[rank 0\] //' | tail -1 \
        > "$OUT/ddp$n.json" || tail -5 "$OUT/ddp$n.err"
      grep -E "step $STEPS/" "$OUT/ddp$n.err" | tail -1
      python3 - "$OUT/ddp$n.json" "$ROWS" $n <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
row = {"who": "chorus", "mode": f"ddp {sys.argv[3]} GPUs", "tok_per_s": r["tok_per_s"], "mfu": r["mfu"],
       "peak_gib": r["peak_mem_bytes"] / 2**30,
       "dev_gib": r.get("device_used_bytes", 0) / 2**30 or None, "loss": r["train_loss"]}
open(sys.argv[2], "a").write(json.dumps(row) + "\n")
PY
    done
    [ "${DDP_TORCH:-1}" = 0 ] && continue  # DDP_TORCH=0: no PyTorch DDP run
    python3 bench/torch/torch_gpt.py --model $MODEL --mode ddp --gpus $NG --batch $B --seq $T --steps 20 --warmup 5 \
      2>"$OUT/torch_ddp.err" | tail -1 > "$OUT/torch_ddp.json" || tail -5 "$OUT/torch_ddp.err"
    cat "$OUT/torch_ddp.json"
    python3 - "$OUT/torch_ddp.json" "$ROWS" $NG <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
row = {"who": "pytorch", "mode": f"ddp {sys.argv[3]} GPUs", "tok_per_s": r["tok_per_s"],
       "mfu": r["tflops_per_gpu"] * 1e12 / 989.4e12, "peak_gib": r["peak_mem_gib"], "loss": r["loss"]}
open(sys.argv[2], "a").write(json.dumps(row) + "\n")
PY
    ;;
  profile)  # GPU time by kernel over a few steps (CUPTI injection library, bench/kernel_trace)
    tokens
    cmake -S . -B $BUILD -DCHORUS_BUILD_BENCH=ON >/dev/null 2>&1 && ninja -C $BUILD chorus_kernel_trace >/dev/null 2>&1 \
      || { echo "profile: no CUPTI trace library"; continue; }
    rm -rf "$OUT/trace"; mkdir -p "$OUT/trace"
    CHORUS_KERNEL_TRACE_ALL=1 CUDA_INJECTION64_PATH=$PWD/$BUILD/libchorus_kernel_trace.so CHORUS_KERNEL_TRACE="$OUT/trace/k" \
      $BUILD/chorus train --model $MODEL --data "tokens:$DATA/rand_train_*.bin" --seq-len $T --batch-size $B \
      --precision bf16 --steps 6 --log-every 3 --val-windows 1 --quiet --json >/dev/null 2>"$OUT/profile.err" || tail -3 "$OUT/profile.err"
    kernel_sum "$OUT"/trace/k.*.csv 6
    ;;
  mesh3d)  # issue 50's 3-D row on 4 GPUs: BIG_MODEL (d84) at --mesh MESH3D (dp=1,pp=2,tp=2) --sequence-parallel, a
    # batch of MESH3D_BATCH (16) sequences in MESH3D_M (8) micro-batches, 1F1B, beside ZeRO-3 with BIG_BATCH (4)
    # sequences a GPU (the same tokens a step) and --recompute always (what fits it: session 34); bench rows, tok/s,
    # MFU, peak memory, then which wins
    NG=${GPT_GPUS:-4}; BM=${BIG_MODEL:-d84}; MM=${MESH3D:-dp=1,pp=2,tp=2}
    t0=$(date +%s)
    timeout ${MESH3D_TIMEOUT:-300} $BUILD/chorus launch --nproc-per-node $NG --master-port 41516 -- $BUILD/chorus bench \
      --model $BM --devices cuda --mesh $MM --sequence-parallel --seq-len $T --batch-size ${MESH3D_BATCH:-16} \
      --micro-batches ${MESH3D_M:-8} --schedules 1f1b --precision bf16 --steps ${MESH3D_STEPS:-6} --warmup 2 --json \
      2>"$OUT/mesh3d.err" | sed 's/^\[rank 0\] //' | grep '^{' | tail -1 > "$OUT/mesh3d.json" || tail -8 "$OUT/mesh3d.err"
    echo "$BM $MM: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
    timeout ${MESH3D_TIMEOUT:-300} $BUILD/chorus launch --nproc-per-node $NG --master-port 41517 -- $BUILD/chorus bench \
      --model $BM --devices cuda --strategy zero-3 --recompute always --seq-len $T --batch-size ${BIG_BATCH:-4} \
      --precision bf16 --steps ${MESH3D_STEPS:-6} --warmup 2 --json 2>"$OUT/mesh3d_zero3.err" | sed 's/^\[rank 0\] //' \
      | grep '^{' | tail -1 > "$OUT/mesh3d_zero3.json" || tail -8 "$OUT/mesh3d_zero3.err"
    echo "$BM zero-3: $(( $(date +%s) - t0 )) s"
    python3 - "$OUT/mesh3d.json" "$OUT/mesh3d_zero3.json" "$ROWS" "$BM" "$MM" $NG <<'PY' || { tail -5 "$OUT/mesh3d.err"; tail -5 "$OUT/mesh3d_zero3.err"; }
import json, sys
rows = []
for f, mode in ((sys.argv[1], f"{sys.argv[5]} sp {sys.argv[4]}"), (sys.argv[2], f"zero-3 {sys.argv[4]} recompute")):
    txt = open(f).read().strip()
    if not txt:
        print(f"{mode}: no row"); continue
    r = json.loads(txt)
    row = {"who": "chorus", "mode": mode, "gpus": int(sys.argv[6]), "tok_per_s": r["tok_per_s"], "mfu": r["mfu"],
           "peak_gib": r.get("peak_mem_bytes_max", r["peak_mem_bytes"]) / 2**30, "loss": r.get("loss")}
    open(sys.argv[3], "a").write(json.dumps(row) + "\n"); rows.append(row)
    print(f"chorus   {mode:28} {row['tok_per_s']:10.0f} tok/s  MFU {100 * row['mfu']:5.1f}%  peak {row['peak_gib']:6.2f} GiB")
if len(rows) == 2:
    print(f"{rows[0]['mode']} / {rows[1]['mode']}: {rows[0]['tok_per_s'] / rows[1]['tok_per_s']:.3f}")
PY
    ;;
  mesh_profile)  # GPU time by kernel of one rank of `chorus train --mesh MESH_PROF (tp=GPT_GPUS) [--sequence-parallel]`
    # over 6 steps (CUPTI injection on every rank; the table is the first rank's file by pid, the rest stay in $OUT)
    tokens; NG=${GPT_GPUS:-2}; MP=${MESH_PROF:-tp=$NG}
    cmake -S . -B $BUILD -DCHORUS_BUILD_BENCH=ON >/dev/null 2>&1 && ninja -C $BUILD chorus_kernel_trace >/dev/null 2>&1 \
      || { echo "mesh_profile: no CUPTI trace library"; continue; }
    rm -rf "$OUT/trace_mesh"; mkdir -p "$OUT/trace_mesh"
    CHORUS_KERNEL_TRACE_ALL=1 CUDA_INJECTION64_PATH=$PWD/$BUILD/libchorus_kernel_trace.so CHORUS_KERNEL_TRACE="$OUT/trace_mesh/k" \
      timeout 300 $BUILD/chorus launch --nproc-per-node $NG --master-port 41515 -- $BUILD/chorus train --model $MODEL \
      --data "tokens:$DATA/rand_train_*.bin" --seq-len $T --batch-size ${MESH_TP_BATCH:-$B} --precision bf16 --steps 6 \
      --log-every 3 --val-windows 1 --mesh $MP ${MESH_PROF_FLAGS:---sequence-parallel} --quiet --json >/dev/null \
      2>"$OUT/mesh_profile.err" || tail -3 "$OUT/mesh_profile.err"
    first=$(ls "$OUT"/trace_mesh/k.*.csv | sort -t. -k2 -n | head -1)
    [ -n "$first" ] && { echo "mesh_profile $MP: $first"; kernel_sum "$first" 6; }
    ;;
  launch_profile)  # GPU time by kernel of rank 0 of `chorus launch --nproc-per-node GPT_GPUS (1) -- chorus train LP_FLAGS`
    # (default --strategy ddp) over 6 steps, CUPTI on every rank, classes by scripts/gpt_step_classes.py; LP_TAG names
    # the trace folder ($OUT/trace_lp_TAG). On one GPU it shows what a data-parallel engine adds to the single step.
    tokens; NG=${GPT_GPUS:-1}; tagd="$OUT/trace_lp_${LP_TAG:-ddp}"
    cmake -S . -B $BUILD -DCHORUS_BUILD_BENCH=ON >/dev/null 2>&1 && ninja -C $BUILD chorus_kernel_trace >/dev/null 2>&1 \
      || { echo "launch_profile: no CUPTI trace library"; continue; }
    rm -rf "$tagd"; mkdir -p "$tagd/trace"
    CHORUS_KERNEL_TRACE_ALL=1 CUDA_INJECTION64_PATH=$PWD/$BUILD/libchorus_kernel_trace.so CHORUS_KERNEL_TRACE="$tagd/trace/k" \
      timeout 300 $BUILD/chorus launch --nproc-per-node $NG --master-port 41518 -- $BUILD/chorus train --model $MODEL \
      --devices cuda --data "tokens:$DATA/rand_train_*.bin" --seq-len $T --batch-size $B --precision bf16 --steps 6 \
      --log-every 3 --val-windows 1 ${LP_FLAGS:---strategy ddp} --quiet --json >/dev/null 2>"$tagd/train.err" \
      || tail -3 "$tagd/train.err"
    echo "launch_profile ${LP_TAG:-ddp} (${LP_FLAGS:---strategy ddp}, $NG GPUs):"
    python3 scripts/gpt_step_classes.py "$tagd" 3 ${LP_TOP:-12}
    ;;
  profile_llmc)  # llm.c's GPU time by kernel under the same CUPTI library (after llmc built it), LLMC_PROF_STEPS steps
    P=${LLMC_PROF_STEPS:-8}
    [ -x /tmp/train_gpt2cu ] && [ -f $BUILD/libchorus_kernel_trace.so ] || { echo "profile_llmc: run llmc and profile first"; continue; }
    rm -rf "$OUT/trace_llmc"; mkdir -p "$OUT/trace_llmc"
    depth=$(python3 -c "print({'gpt2':12,'gpt2-medium':24,'gpt2-large':36,'gpt2-xl':48}.get('$MODEL','$MODEL'.lstrip('d')))")
    (cd /tmp && CHORUS_KERNEL_TRACE_ALL=1 CUDA_INJECTION64_PATH=$OLDPWD/$BUILD/libchorus_kernel_trace.so \
      CHORUS_KERNEL_TRACE="$OUT/trace_llmc/k" ./train_gpt2cu -i "$DATA/rand_train_*.bin" -j "$DATA/rand_val_*.bin" \
      -e "d$depth" -b $B -t $T -x $P -v 100000 -s 0 -h 0 -y 0) >"$OUT/profile_llmc.log" 2>&1 || tail -5 "$OUT/profile_llmc.log"
    kernel_sum "$OUT"/trace_llmc/k.*.csv $P
    ;;
  converge)  # d6 byte-level on the King James Bible (carried as .bench/kjv.txt), Chorus and PyTorch, same schedule
    CS=${CONV_STEPS:-1500}
    [ -f .bench/kjv.txt ] || { echo "converge: .bench/kjv.txt missing (bible -f 'Gen1:1-Rev22:21' > .bench/kjv.txt)"; continue; }
    t0=$(date +%s)
    $BUILD/chorus train --model d6 --data text:.bench/kjv.txt --seq-len 256 --batch-size 64 --steps $CS --lr 1e-3 \
      --windows random --decay-embeddings --val-windows 32 --precision bf16 --log-every 250 --seed 1 --json \
      2>"$OUT/conv_chorus.err" | tail -1 > "$OUT/conv_chorus.json"
    grep -E "^step" "$OUT/conv_chorus.err" | tail -2; echo "chorus: $(( $(date +%s) - t0 )) s"
    t0=$(date +%s)
    python3 bench/torch/torch_gpt.py --model d6 --text .bench/kjv.txt --seq 256 --batch 64 --warmup 0 --steps $CS --lr 1e-3 \
      2>"$OUT/conv_torch.err" | tail -1 > "$OUT/conv_torch.json" || tail -3 "$OUT/conv_torch.err"
    echo "pytorch: $(( $(date +%s) - t0 )) s"
    python3 - "$OUT/conv_chorus.json" "$OUT/conv_torch.json" $CS <<'PY'
import json, sys
c, t = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
print(f"d6 on the KJV Bible, {sys.argv[3]} steps of 64 x 256 bytes, bf16:")
print(f"  chorus  train {c['train_loss']:.4f}  val {c['val_loss']:.4f}  ({c['tok_per_s']:.0f} tok/s)")
print(f"  pytorch train {t['loss']:.4f}  val {t['val_loss']:.4f}  ({t['tok_per_s']:.0f} tok/s)")
print(f"  val loss chorus / pytorch: {c['val_loss'] / t['val_loss']:.4f}")
PY
    ;;
  zero_check)  # NCCL: --strategy zero stages 1-3 equal DDP (fp32; NCCL sums in another order: ~1e-6) on GPT_GPUS (2) GPUs, d6, 8 steps,
    # eager and as CUDA graphs (ZC_GRAPHS: "eager graphs"); ZC_PRECISION=bf16: zero's bf16 gathered matrices
    # against DDP's per-use casts (close, not equal)
    tokens
    NG=${GPT_GPUS:-2}
    for gr in ${ZC_GRAPHS:-eager graphs}; do
      gflag=(); [ $gr = eager ] && gflag=(--no-cuda-graphs)
      for mode in "ddp" "zero --zero-stage 1" "zero --zero-stage 1 --no-zero-prefetch" "zero --zero-stage 2" "zero --zero-stage 3" "zero --zero-stage 3 --no-reshard-after-forward"; do
        timeout 300 $BUILD/chorus launch --nproc-per-node $NG -- $BUILD/chorus train --model d6 --strategy $mode \
          --devices cuda --data "tokens:$DATA/rand_train_*.bin" --seq-len 256 --batch-size 4 --steps 8 --log-every 4 \
          --val-windows 2 --json --precision ${ZC_PRECISION:-fp32} "${gflag[@]}" 2>"$OUT/zc.err" | grep '{' | sed 's/^\[rank 0\] //' | tail -1 \
          | python3 -c "import json,sys; r=json.load(sys.stdin); print(f\"{sys.argv[1]:48} {sys.argv[2]:6} train {r['train_loss']:.10f} val {r.get('val_loss')}\")" "$mode" $gr \
          || { echo "$mode $gr: failed"; tail -5 "$OUT/zc.err"; }
        grep -i -E "graph|eager" "$OUT/zc.err" | grep -v "^\[rank 0\] step" | head -2
      done
    done
    ;;
  zero_eval_capture)  # --strategy zero with an evaluation right before the captured step (--log-every 2 --val-every 2:
    # gather_parameters() at step 2, the capture at step 3), as CUDA graphs and eager (--no-cuda-graphs), stages 1 and 3,
    # bf16 (the gathered matrices in bf16), d6 byte-level on the King James Bible (.bench/kjv.txt: it learns fast, so
    # stale weights show) on GPT_GPUS (1) GPUs: the losses within 2e-3 (the graph must hold every gather: Note [Sharded
    # steps in a CUDA graph])
    tokens; NG=${GPT_GPUS:-1}
    for st in 1 3; do
      for gr in graphs eager; do
        gflag=(); [ $gr = eager ] && gflag=(--no-cuda-graphs)
        timeout 300 $BUILD/chorus launch --nproc-per-node $NG -- $BUILD/chorus train --model d6 --strategy zero \
          --zero-stage $st --devices cuda --data text:.bench/kjv.txt --seq-len 128 --batch-size 8 --steps 16 --lr 2e-3 \
          --log-every 2 --val-every 2 --val-windows 4 --precision bf16 --seed 7 --json "${gflag[@]}" 2>"$OUT/zec$st$gr.err" \
          | grep '{' | sed 's/^\[rank 0\] //' | tail -1 > "$OUT/zec$st$gr.json" || tail -5 "$OUT/zec$st$gr.err"
      done
      python3 - "$OUT/zec${st}graphs.json" "$OUT/zec${st}eager.json" $st <<'PY'
import json, sys
try:
    g, e = (json.load(open(f)) for f in sys.argv[1:3])
except Exception as x:
    print(f"zero-{sys.argv[3]} eval before capture: no result ({x})"); sys.exit()
d = max(abs(g[k] - e[k]) / max(1e-9, abs(e[k])) for k in ("train_loss", "val_loss"))
print(f"zero-{sys.argv[3]} eval before capture: graphs train {g['train_loss']:.5f} val {g['val_loss']:.5f}, eager train "
      f"{e['train_loss']:.5f} val {e['val_loss']:.5f}: {d:.1e} relative -> {'ok' if d <= 2e-3 else 'FAIL'}")
PY
    done
    ;;
  zero)  # --strategy zero stages (ZERO_STAGES, default "1 2 3") on GPT_GPUS GPUs beside DDP and PyTorch FSDP2
    tokens
    NG=${GPT_GPUS:-$(nvidia-smi -L | wc -l)}
    for st in ${ZERO_STAGES:-1 2 3}; do  # "3e": stage 3 eager (--no-cuda-graphs); "1f": float32 gathered weights
      zs=${st:0:1}; zf=(); tag=""
      [[ $st == *e* ]] && { zf+=(--no-cuda-graphs); tag+=" eager"; }
      [[ $st == *f* ]] && { zf+=(--zero-param-dtype fp32); tag+=" fp32-params"; }
      [[ $st == *g* ]] && { zf+=(--recompute-gelu); tag+=" gelu-recomputed"; }
      ck=(); [ -n "${ZERO_CKPT:-}" ] && { rm -rf /tmp/zck$st; ck=(--checkpoint-dir /tmp/zck$st --checkpoint-every $ZERO_CKPT); }
      timeout 500 $BUILD/chorus launch --nproc-per-node $NG -- $BUILD/chorus train --model $MODEL --strategy zero \
        --zero-stage $zs --devices cuda --data "tokens:$DATA/rand_train_*.bin" --seq-len $T --batch-size $B --precision bf16 \
        --steps $STEPS --log-every 10 --val-windows 4 --json "${ck[@]}" "${zf[@]}" 2>"$OUT/zero$st.err" | grep '{' | sed 's/^\[rank 0\] //' | tail -1 \
        > "$OUT/zero$st.json" || tail -5 "$OUT/zero$st.err"
      grep -E "^(\[rank 0\] )?(zero|checkpoint|CUDA graphs)|step $STEPS/|memory:|device memory" "$OUT/zero$st.err" | sed 's/^\[rank 0\] //' | tail -9
      memplan "zero-$st" "$OUT/zero$st.err"
      python3 - "$OUT/zero$st.json" "$ROWS" $NG $zs "$tag" <<'PY' || tail -5 "$OUT/zero$st.err"
import json, sys
r = json.load(open(sys.argv[1]))
row = {"who": "chorus", "mode": f"zero-{sys.argv[4]} {sys.argv[3]} GPUs{sys.argv[5]}", "tok_per_s": r["tok_per_s"], "mfu": r["mfu"],
       "peak_gib": r["peak_mem_bytes"] / 2**30,
       "dev_gib": r.get("device_used_bytes", 0) / 2**30 or None, "loss": r["train_loss"]}
if "checkpoint_stall_ms" in r: row["checkpoint_stall_ms"] = r["checkpoint_stall_ms"]
open(sys.argv[2], "a").write(json.dumps(row) + "\n")
PY
    done
    if [ "${ZERO_TORCH:-1}" != 0 ]; then
      python3 bench/torch/torch_gpt.py --model $MODEL --mode fsdp --gpus $NG --batch $B --seq $T --steps 20 --warmup 5 \
        2>"$OUT/torch_fsdp.err" | tail -1 > "$OUT/torch_fsdp.json" || tail -5 "$OUT/torch_fsdp.err"
      python3 - "$OUT/torch_fsdp.json" "$ROWS" $NG <<'PY' || tail -5 "$OUT/torch_fsdp.err"
import json, sys
r = json.load(open(sys.argv[1]))
row = {"who": "pytorch", "mode": f"fsdp2 {sys.argv[3]} GPUs", "tok_per_s": r["tok_per_s"],
       "mfu": r["tflops_per_gpu"] * 1e12 / 989.4e12, "peak_gib": r["peak_mem_gib"], "loss": r["loss"]}
open(sys.argv[2], "a").write(json.dumps(row) + "\n")
PY
    fi
    ;;
  zero_images)  # image models under --strategy zero on GPT_GPUS (2) GPUs: bench rows ddp, zero-1, zero-3 (NCHW: zero
    # shards row-major ranges) beside DDP channels-last, bf16, ZI_MODELS (wrn-16-4), ZI_BATCH (128) a GPU; then
    # chorus train --strategy zero --zero-stage 3 on synthetic CIFAR-shaped data (the graphed step trains)
    NG=${GPT_GPUS:-2}; devs=$(seq -s, -f "cuda:%g" 0 $((NG - 1)))
    for m in ${ZI_MODELS:-wrn-16-4}; do
      timeout 300 $BUILD/chorus bench --model $m --devices $devs --device-counts $NG --strategy ddp,zero-1,zero-3 \
        --precision bf16 --batch-size ${ZI_BATCH:-128} --steps 30 --warmup 5 2>"$OUT/zi_$m.err" | tail -3 \
        || tail -5 "$OUT/zi_$m.err"
      timeout 300 $BUILD/chorus bench --model $m --devices $devs --device-counts $NG --strategy ddp --channels-last \
        --precision bf16 --batch-size ${ZI_BATCH:-128} --steps 30 --warmup 5 2>>"$OUT/zi_$m.err" | tail -1 | sed 's/$/ (channels-last)/'
    done
    timeout 300 $BUILD/chorus launch --nproc-per-node $NG -- $BUILD/chorus train --model resnet20 --strategy zero --zero-stage 3 \
      --devices cuda --data synthetic --synthetic-size 20000 --batch-size 128 --precision bf16 --steps 100 --log-every 50 \
      --json 2>"$OUT/zi_train.err" | grep '{' | sed 's/^\[rank 0\] //' | tail -1 \
      | python3 -c "import json,sys; r=json.load(sys.stdin); print(f\"zero-3 resnet20 train: loss {r['train_loss']:.4f} acc {r['test_accuracy']:.3f} img/s {r['img_per_s']:.0f} graph replays {r['cuda_graph_replays']}\")" \
      || tail -8 "$OUT/zi_train.err"
    grep -E "zero stage|CUDA graph" "$OUT/zi_train.err" | sed 's/^\[rank 0\] //' | head -3
    ;;
  refuse)  # BIG_MODEL under DDP and ZeRO-1 on GPT_GPUS GPUs: the memory plan's message before step 1, not an OOM
    tokens
    NG=${GPT_GPUS:-$(nvidia-smi -L | wc -l)}
    for mode in "ddp" "zero --zero-stage 1"; do
      t0=$(date +%s)
      timeout 300 $BUILD/chorus launch --nproc-per-node $NG -- $BUILD/chorus train --model ${BIG_MODEL:-d84} \
        --strategy $mode --devices cuda --data "tokens:$DATA/rand_train_*.bin" --seq-len $T --batch-size ${BIG_BATCH:-1} \
        --precision bf16 --steps 2 ${REFUSE_FLAGS:-} >/dev/null 2>"$OUT/refuse.err"
      rc=$?
      echo "${BIG_MODEL:-d84} --strategy $mode: exit $rc after $(( $(date +%s) - t0 )) s:"
      grep -m1 -E "error" "$OUT/refuse.err" | cut -c1-400
      grep -q -i "out of memory" "$OUT/refuse.err" && echo "FAIL: an out-of-memory error"
    done
    ;;
  big)  # BIG_MODEL with ZeRO-3 on GPT_GPUS GPUs: BIG_BATCH sequences a GPU, BIG_STEPS steps
    tokens
    NG=${GPT_GPUS:-$(nvidia-smi -L | wc -l)}
    t0=$(date +%s)
    timeout ${BIG_TIMEOUT:-400} $BUILD/chorus launch --nproc-per-node $NG -- $BUILD/chorus train --model ${BIG_MODEL:-d84} \
      --strategy zero --zero-stage 3 --devices cuda --data "tokens:$DATA/rand_train_*.bin" --seq-len $T \
      --batch-size ${BIG_BATCH:-1} --precision bf16 --steps ${BIG_STEPS:-8} --log-every 2 --val-windows 1 --json \
      ${BIG_FLAGS:-} 2>"$OUT/big.err" | grep '{' | sed 's/^\[rank 0\] //' | tail -1 > "$OUT/big.json" || tail -8 "$OUT/big.err"
    echo "${BIG_MODEL:-d84} zero-3: $(( $(date +%s) - t0 )) s"
    grep -E "^(\[rank 0\] )?(zero|memory|step )|rror" "$OUT/big.err" | sed 's/^\[rank 0\] //' | tail -8
    memplan "${BIG_MODEL:-d84} zero-3" "$OUT/big.err"
    python3 - "$OUT/big.json" "$ROWS" $NG "${BIG_MODEL:-d84}" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
row = {"who": "chorus", "mode": f"zero-3 {sys.argv[3]} GPUs {sys.argv[4]}", "tok_per_s": r["tok_per_s"], "mfu": r["mfu"],
       "peak_gib": r["peak_mem_bytes"] / 2**30,
       "dev_gib": r.get("device_used_bytes", 0) / 2**30 or None, "loss": r["train_loss"]}
open(sys.argv[2], "a").write(json.dumps(row) + "\n")
print(row)
PY
    ;;
  mesh_pp)  # issue 50 on MESH_PP_P (2) GPUs: chorus bench --mesh pp=P (MESH_PP_SCHEDULES, default 1f1b,gpipe, may list
    # interleaved; MESH_PP_M micro-batches, default 8; MESH_PP_V virtual stages a rank for interleaved, default 2) and
    # --mesh tp=2 beside --strategy ddp on the same 2 GPUs (GPT_MODEL, GPT_BATCH sequences a rank: a pipeline's whole
    # batch, cut into the micro-batches): tok/s, MFU, peak memory, and for pp=2 the measured bubble beside the ideal
    # (p-1)/(v m+p-1) and the bound (Note [Mesh pipeline bound] in apps/bench_gpt_mesh.cpp); MESH_PP_TP=0 skips the
    # tp=P row, MESH_PP_DDP=0 the DDP row; MESH_PP_CHECK=0 skips the d2 NCCL check that interleaved triggers
    M=${MESH_PP_M:-8}
    SCHED=${MESH_PP_SCHEDULES:-1f1b,gpipe}
    if [[ ,$SCHED, == *,interleaved,* ]] && [ "${MESH_PP_CHECK:-1}" = 1 ]; then
      # Interleaved over NCCL (Note [Pipeline links]): first a small d2 trained at pp=2 by 1f1b and by interleaved
      # (fp32, same seed and micro-batches) must give the same losses -- a deadlock ends in the timeout.
      python3 -c "
import random; random.seed(2); w='in the beginning god created heaven and earth light was good'.split()
print('\n'.join(' '.join(random.choice(w) for _ in range(12)) for _ in range(3000)))" > "$OUT/mesh_pp_text.txt"
      # Not --quiet: on a timeout the tail of its stderr shows how far it got (steps, "done:" -- printed before the
      # teardown, Note [Pipeline links at exit]); --dist-timeout 60 lets a stuck collective be named within the 180 s.
      for s in 1f1b interleaved; do
        timeout 180 $BUILD/chorus launch --nproc-per-node 2 -- $BUILD/chorus train --model d2 --devices cuda \
          --data "text:$OUT/mesh_pp_text.txt" --seq-len 64 --batch-size 8 --micro-batches 4 --steps 20 --log-every 10 \
          --seed 5 --mesh pp=2 --schedule $s --dist-timeout 60 --json 2>"$OUT/mesh_pp_train_$s.err" \
          | sed 's/^\[rank 0\] //' | grep '^{' > "$OUT/mesh_pp_train_$s.json"
        rc=(${PIPESTATUS[@]})
        [ "${rc[0]}" = 0 ] && [ "${rc[2]}" = 0 ] || { echo "FAIL: mesh_pp train $s (exit ${rc[0]}; 124: timed out):"; tail -15 "$OUT/mesh_pp_train_$s.err"; }
      done
      python3 - "$OUT/mesh_pp_train_1f1b.json" "$OUT/mesh_pp_train_interleaved.json" <<'PY'
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:3])
ok = all(abs(a[k] - b[k]) <= 1e-5 * max(1, abs(a[k])) for k in ("train_loss", "val_loss"))
print(f"mesh_pp train d2 pp=2 on NCCL: 1f1b loss {a['train_loss']:.6f} val {a['val_loss']:.6f}, interleaved "
      f"(v={b['virtual_stages']}) loss {b['train_loss']:.6f} val {b['val_loss']:.6f}: {'equal' if ok else 'DIFFERENT'}")
PY
    fi
    P=${MESH_PP_P:-2}; meshes="pp=$P"; [ "${MESH_PP_TP:-1}" = 1 ] && meshes+=" tp=$P"
    for mesh in $meshes; do
      extra=(); [ $mesh = pp=$P ] && extra=(--micro-batches $M --schedules $SCHED)
      [ $mesh = pp=$P ] && [[ ,$SCHED, == *,interleaved,* ]] && extra+=(--virtual-stages ${MESH_PP_V:-2})
      timeout 300 $BUILD/chorus launch --nproc-per-node $P -- $BUILD/chorus bench --model $MODEL --devices cuda \
        --mesh $mesh --seq-len $T --batch-size $B --precision bf16 --steps ${MESH_PP_STEPS:-10} --warmup 3 "${extra[@]}" \
        2>"$OUT/mesh_$mesh.err" | sed 's/^\[rank 0\] //' | grep -v '^mesh ' || tail -5 "$OUT/mesh_$mesh.err"
    done
    [ "${MESH_PP_DDP:-1}" = 1 ] && { timeout 300 $BUILD/chorus launch --nproc-per-node $P -- $BUILD/chorus bench --model $MODEL \
      --strategy ddp --devices cuda --seq-len $T --batch-size $B --precision bf16 --steps ${MESH_PP_STEPS:-10} --warmup 3 \
      2>"$OUT/mesh_ddp.err" | sed 's/^\[rank 0\] //' || tail -5 "$OUT/mesh_ddp.err"; }
    ;;
  mesh_tp)  # issue 50, tensor parallel on GPT_GPUS (2) GPUs in one call: chorus bench --mesh tp=N beside chorus bench
    # --strategy ddp on the same GPUs and PyTorch's own tensor parallelism (bench/torch/torch_gpt.py --mode tp:
    # parallelize_module, Colwise/RowwiseParallel, SequenceParallel, loss_parallel); MESH_TP_SP (default 1; "1 0" both):
    # sequence parallelism on both sides; MESH_TP_DP=D: a dp=D x tp=N/D mesh instead; GPT_BATCH sequences a GPU
    # (ddp) and a tensor group (tp) unless MESH_TP_BATCH gives the tensor group's. Rows in $ROWS, then the ratios (Chorus tp / PyTorch tp, Chorus tp / Chorus DDP per
    # GPU). First a check that PyTorch's tp trains the model its single GPU trains: d12 byte-level, 60 steps, both
    # losses side by side (MESH_TP_CHECK=0 skips it). With sequence parallelism Chorus runs once per K of
    # MESH_TP_CHUNKS (default "1 2": --tp-chunks K, the forward's collectives in K chunks beside the products, Note
    # [Chunked collectives beside the products]) and prints K's tok/s over K=1's; MESH_TP_FLAGS: more options for
    # Chorus's tp runs.
    NG=${GPT_GPUS:-2}; DPN=${MESH_TP_DP:-1}; TPN=$((NG / DPN)); TS=${MESH_TP_STEPS:-20}
    mesh=tp=$TPN; targs=(); [ "$DPN" -gt 1 ] && { mesh=dp=$DPN,tp=$TPN; targs=(--dp $DPN); }
    if [ "${MESH_TP_CHECK:-1}" = 1 ]; then
      txt=.bench/kjv.txt
      [ -f $txt ] || { txt=$OUT/tp_words.txt; python3 -c "
import random; random.seed(4); w='in the beginning god created heaven and earth light was good and it was evening'.split()
print('\n'.join(' '.join(random.choice(w) for _ in range(12)) for _ in range(40000)))" > $txt; }
      for m in single tp; do
        extra=(); [ $m = tp ] && extra=(--mode tp --gpus $NG "${targs[@]}" --port 41511)
        timeout 300 python3 -X faulthandler bench/torch/torch_gpt.py --model d12 --text $txt --seq 256 --batch 16 \
          --warmup 0 --steps 60 --lr 1e-3 "${extra[@]}" 2>"$OUT/tp_check_$m.err" | tail -1 > "$OUT/tp_check_$m.json"
        rc=${PIPESTATUS[0]}
        [ "$rc" = 0 ] || { echo "PyTorch tp check, $m: exit $rc (124: timed out; 128+N: signal N)"; tail -5 "$OUT/tp_check_$m.err"; }
      done
      python3 - "$OUT/tp_check_single.json" "$OUT/tp_check_tp.json" $mesh <<'PY' || echo "FAIL: PyTorch tp check (see tp_check_*.err)"
import json, sys
s, t = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
d = abs(t["val_loss"] / s["val_loss"] - 1)
print(f"PyTorch d12 byte-level, 60 steps: single GPU train {s['loss']:.4f} val {s['val_loss']:.4f}; {sys.argv[3]} train "
      f"{t['loss']:.4f} val {t['val_loss']:.4f} ({100 * d:.2f}% apart) -> {'ok' if d < 0.02 else 'FAIL'} (within 2%, bf16)")
PY
    fi
    mesh_tp_row() {  # WHO JSON MODE: one row of chorus bench or torch_gpt.py into $ROWS
      python3 - "$1" "$2" "$ROWS" "$3" $NG <<'PY'
import json, sys
who, f = sys.argv[1], sys.argv[2]
text = open(f).read().strip()
if not text:
    print(f"{who} {sys.argv[4]}: no row"); sys.exit(0)
r = json.loads(text)
row = {"who": who, "mode": sys.argv[4], "gpus": int(sys.argv[5]), "tok_per_s": r["tok_per_s"],
       "mfu": r["mfu"] if who == "chorus" else r["tflops_per_gpu"] * 1e12 / 989.4e12,
       "peak_gib": r["peak_mem_bytes"] / 2**30 if who == "chorus" else r["peak_mem_gib"], "loss": r["loss"]}
open(sys.argv[3], "a").write(json.dumps(row) + "\n")
print(f"{who:8} {sys.argv[4]:26} {row['tok_per_s']:10.0f} tok/s  MFU {100 * row['mfu']:5.1f}%  peak {row['peak_gib']:6.2f} GiB")
PY
    }
    for sp in ${MESH_TP_SP:-1}; do
      spf=(); tag=""; ks=1; [ $sp = 1 ] && { spf=(--sequence-parallel); tag=" sp"; ks=${MESH_TP_CHUNKS:-1 2}; }
      for k in $ks; do
        ktag=""; [ "$k" != 1 ] && ktag=" k=$k"
        timeout 300 $BUILD/chorus launch --nproc-per-node $NG --master-port 41512 -- $BUILD/chorus bench --model $MODEL \
          --devices cuda --mesh $mesh "${spf[@]}" --tp-chunks $k ${MESH_TP_FLAGS:-} --seq-len $T \
          --batch-size ${MESH_TP_BATCH:-$B} --precision bf16 --steps $TS --warmup 5 --json 2>"$OUT/mesh_tp${sp}k$k.err" \
          | sed 's/^\[rank 0\] //' | grep '^{' | tail -1 > "$OUT/mesh_tp${sp}k$k.json" || tail -5 "$OUT/mesh_tp${sp}k$k.err"
        mesh_tp_row chorus "$OUT/mesh_tp${sp}k$k.json" "$mesh $NG GPUs$tag$ktag"
      done
      timeout 300 python3 bench/torch/torch_gpt.py --model $MODEL --mode tp --gpus $NG "${targs[@]}" --sp $sp --batch ${MESH_TP_BATCH:-$B} \
        --seq $T --steps $TS --warmup 5 --port 41513 2>"$OUT/torch_tp$sp.err" | tail -1 > "$OUT/torch_tp$sp.json" \
        || tail -5 "$OUT/torch_tp$sp.err"
      mesh_tp_row pytorch "$OUT/torch_tp$sp.json" "$mesh $NG GPUs$tag"
    done
    timeout 300 $BUILD/chorus launch --nproc-per-node $NG --master-port 41514 -- $BUILD/chorus bench --model $MODEL \
      --strategy ddp --devices cuda --seq-len $T --batch-size $B --precision bf16 --steps $TS --warmup 5 --json \
      2>"$OUT/mesh_tp_ddp.err" | sed 's/^\[rank 0\] //' | grep '^{' | tail -1 > "$OUT/mesh_tp_ddp.json" || tail -5 "$OUT/mesh_tp_ddp.err"
    python3 - "$OUT/mesh_tp_ddp.json" "$ROWS" $NG <<'PY' || tail -5 "$OUT/mesh_tp_ddp.err"
import json, sys
r = json.load(open(sys.argv[1]))
row = {"who": "chorus", "mode": f"ddp {sys.argv[3]} GPUs bench", "gpus": int(sys.argv[3]), "tok_per_s": r["tok_per_s"],
       "mfu": r["mfu"], "peak_gib": r["peak_mem_bytes"] / 2**30, "loss": r["loss"]}
open(sys.argv[2], "a").write(json.dumps(row) + "\n")
print(f"chorus   {row['mode']:22} {row['tok_per_s']:10.0f} tok/s  MFU {100 * row['mfu']:5.1f}%  peak {row['peak_gib']:6.2f} GiB")
PY
    python3 - "$ROWS" $NG <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ddp = [r for r in rows if r["who"] == "chorus" and r["mode"] == f"ddp {sys.argv[2]} GPUs bench"]
for r in rows:
    if r["who"] != "chorus" or "tp=" not in r["mode"]:
        continue
    for t in rows:
        if t["who"] == "pytorch" and t["mode"] == r["mode"]:
            print(f"chorus / pytorch {r['mode']}: {r['tok_per_s'] / t['tok_per_s']:.3f}")
    if ddp:  # the same GPUs: tok/s per GPU in the ratio of the whole job's
        print(f"chorus {r['mode']} / chorus ddp, per GPU: {r['tok_per_s'] / ddp[-1]['tok_per_s']:.3f}")
PY
    ;;
  plan)  # chorus plan: calibrate this GPU (and 2 GPUs' bus bandwidth), then the plans the docs compare and predict
    t0=$(date +%s)  # the program first (incremental on a machine that ran `build`)
    [ -f $BUILD/build.ninja ] || cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DCHORUS_BUILD_BENCH=OFF \
      >"$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
    ninja -C $BUILD chorus_cli >"$OUT/build_plan.log" 2>&1 || { grep -E "error|FAILED" "$OUT/build_plan.log" | head -40; exit 1; }
    echo "plan: chorus built in $(( $(date +%s) - t0 )) s"
    NG=$(nvidia-smi -L | wc -l)
    cal="$OUT/plan_calibration.json"
    # Each model at the micro-batches the compared runs use (Note [Calibration]): gpt2 16 a GPU, gpt2-large 8 (DDP)
    # and 32 (tp=4's micro-batch), gpt2-xl 8 and 2 (pp=4's micro-batches), d84 4 (ZeRO-3) and 2 (the mesh's).
    calib=($BUILD/chorus plan --calibrate "$cal" --model gpt2:16,gpt2-large:8,gpt2-large:32,gpt2-xl:8,gpt2-xl:2,d84:4,d84:2
           --seq-len 1024 --precision bf16)
    t1=$(date +%s)
    if [ "$NG" -ge 2 ]; then
      timeout 300 $BUILD/chorus launch --nproc-per-node 2 -- "${calib[@]}" 2>&1 | tail -14
    else
      timeout 300 "${calib[@]}" --devices cuda:0 2>&1 | tail -14
    fi
    echo "plan: calibrated in $(( $(date +%s) - t1 )) s"
    [ -f "$cal" ] || { echo "plan: no calibration written"; continue; }
    plan_of() {  # MODEL GPUS BATCH [FLAGS...]: the table, and its rows as JSON
      local m=$1 g=$2 b=$3; shift 3
      $BUILD/chorus plan --model $m --gpus $g --batch-size $b --calibration "$cal" --top 5 "$@"
      $BUILD/chorus plan --model $m --gpus $g --batch-size $b --calibration "$cal" --json "$@" > "$OUT/plan_${m}_$g.jsonl"
    }
    for g in 1 2 4 64 1024; do plan_of gpt2-xl $g 8; done
    for g in 1 2 4; do plan_of gpt2 $g 16; done
    plan_of gpt2-large 4 8
    for g in 4 64 1024; do plan_of d84 $g 4 --recompute; done
    # docs/parallelism.md's "predicted beside measured" table (the measured rows: bench/plan/measured.jsonl) and the
    # best layouts past this machine; paste $OUT/plan_table.md, keep $OUT/plan_calibration.json as bench/plan/.
    python3 scripts/plan_table.py --chorus $BUILD/chorus --calibration "$cal" --measured bench/plan/measured.jsonl \
      --beyond | tee "$OUT/plan_table.md"
    ;;
  table)
    python3 - "$ROWS" "$MODEL" "$B" "$T" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{sys.argv[2]} batch {sys.argv[3]} seq {sys.argv[4]}, one GPU")
# peak GiB: what tensors held at most (Chorus's allocator; llm.c: its device usage); device GiB: what the driver
# counted as used at the end (cudaMemGetInfo: pools, context, workspaces, NCCL), llm.c's own figure
print(f"{'who':10} {'mode':20} {'tok/s':>10} {'MFU':>7} {'peak GiB':>9} {'device GiB':>10}")
for r in rows:
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
    pk = f"{r['peak_gib']:.2f}" if r.get("peak_gib") else "-"
    dv = f"{r['dev_gib']:.2f}" if r.get("dev_gib") else "-"
    print(f"{r['who']:10} {r['mode']:20} {r['tok_per_s']:>10.0f} {mfu:>7} {pk:>9} {dv:>10}")
for c in rows:  # every single-GPU Chorus row (GPT_TAG tells apart runs under a switch) beside the others
    if c["who"] != "chorus" or not c["mode"].startswith("single"):
        continue
    for r in rows:
        if r["who"] != "chorus" and not r["mode"].startswith("ddp"):
            print(f"chorus {c['mode']} / {r['who']} {r['mode']}: {c['tok_per_s'] / r['tok_per_s']:.3f}")
for r in rows:
    if r["who"] == "chorus" and r["mode"].startswith("zero") and not r["mode"].endswith(("d84", "d72", "d60")):
        n = r["mode"].split()[1]
        for t in rows:
            if t["mode"] in (f"ddp {n} GPUs", f"fsdp2 {n} GPUs") or (t["who"] == "llm.c" and t["mode"].startswith(f"{n} GPUs")):
                print(f"chorus {r['mode']} / {t['who']} {t['mode']}: {r['tok_per_s'] / t['tok_per_s']:.3f}")
ddp = {r["mode"]: r for r in rows if r["who"] == "chorus" and r["mode"].startswith("ddp")}
for mode, r in ddp.items():
    n = int(mode.split()[1])
    if n > 1 and "ddp 1 GPUs" in ddp:
        print(f"chorus {mode}: scaling efficiency {r['tok_per_s'] / (n * ddp['ddp 1 GPUs']['tok_per_s']):.3f}")
    for t in rows:
        if t["who"] == "pytorch" and t["mode"] == mode:
            print(f"chorus / pytorch {mode}: {r['tok_per_s'] / t['tok_per_s']:.3f}")
for r in rows:  # mesh_tp's rows: tensor parallel beside PyTorch's and beside DDP on the same GPUs
    if r["who"] == "chorus" and "tp=" in r["mode"]:
        for t in rows:
            if t["who"] == "pytorch" and t["mode"] == r["mode"]:
                print(f"chorus / pytorch {r['mode']}: {r['tok_per_s'] / t['tok_per_s']:.3f}")
            if t["who"] == "chorus" and t["mode"] == f"ddp {r['gpus']} GPUs bench":
                print(f"chorus {r['mode']} / chorus ddp, per GPU: {r['tok_per_s'] / t['tok_per_s']:.3f}")
            if " k=" in r["mode"] and t["who"] == "chorus" and t["mode"] == r["mode"].split(" k=")[0]:
                print(f"chorus {r['mode']} / {t['mode']} (k=1): {r['tok_per_s'] / t['tok_per_s']:.3f}")
PY
    ;;
  obs)  # issue 51 over NCCL on 2 GPUs: (a) a rank slowed by SIGSTOP/SIGCONT named by --stats-every; (b) a rank
    # stopped for good named early by the NCCL group's watch (Note [Stuck collectives named early]), the survivor's
    # flight recorder, the job ending within a bound; (c) --trace with the CUPTI device tracks (Note [Device tracks]),
    # checked by tests/apps/check_trace.py --gpu: (a) and (c) train resnet20 on synthetic images, (b) GPT d12 on random
    # tokens (CUDA graphs: the watched unit is a replay); (d) --trace of GPT d12 over --mesh tp=2 (eager steps: the host
    # phases, the tensor group's NCCL kernels); (e) chorus bench --mesh tp=2 --trace, the same checks; (f) a --mesh
    # tp=2 rank killed mid-training, named by the survivor. Prints PASS/FAIL lines; exits 1 on any FAIL.
    tokens
    fails=0
    obs_pass() { echo "PASS obs: $*"; }
    obs_fail() { echo "FAIL obs: $*"; fails=$((fails + 1)); }
    $BUILD/chorus --version | grep -E "^(NCCL|CUPTI):"
    find_rank1() {  # MARKER ERRFILE PATTERN: pid of the job's rank 1 once PATTERN is in ERRFILE
      local v=""
      for _ in $(seq 300); do
        for f in $(grep -l "CHORUS_OBS_MARKER=$1" /proc/[0-9]*/environ 2>/dev/null); do
          tr '\0' '\n' < "$f" 2>/dev/null | grep -qx RANK=1 && v=$(cut -d/ -f3 <<<"$f")
        done
        [ -n "$v" ] && grep -q "$3" "$2" && { echo "$v"; return; }
        sleep 0.1
      done
    }
    IMG=(train --strategy ddp --devices cuda --model resnet20 --data synthetic --workers 1 --batch-size 128)
    # (a) rank 1 stopped 80 ms of every 100 ms while the job runs
    CHORUS_OBS_MARKER=obsa$$ timeout 120 $BUILD/chorus launch --nproc-per-node 2 --master-port 29611 -- $BUILD/chorus \
      "${IMG[@]}" --synthetic-size 40000 --epochs 1 --log-every 10 --stats-every 0.5 >"$OUT/obs_slow.out" 2>"$OUT/obs_slow.err" &
    job=$!
    victim=$(find_rank1 obsa$$ "$OUT/obs_slow.err" "training resnet20")
    if [ -z "$victim" ]; then obs_fail "(a) rank 1 of the slowed job not found"; tail -5 "$OUT/obs_slow.err"; kill $job 2>/dev/null
    else
      while kill -STOP "$victim" 2>/dev/null; do sleep 0.08; kill -CONT "$victim" 2>/dev/null; sleep 0.02; done
    fi
    wait $job || { obs_fail "(a) the slowed job failed"; tail -5 "$OUT/obs_slow.err"; }
    grep "slowest rank" "$OUT/obs_slow.err" | head -8
    python3 - "$OUT/obs_slow.err" <<'PY' && obs_pass "(a) the slowed rank 1 named by --stats-every" || obs_fail "(a) slowed rank not named"
import re, sys
lines = re.findall(r"step (\d+): ([\d.]+) ms median, slowest rank (\d+) at ([\d.]+) ms \(([+-]\d+)%, (data loading|compute)\)",
                   open(sys.argv[1]).read())
named = [l for l in lines if l[2] == "1"]
print(f"(a) {len(lines)} stats lines, rank 1 slowest in {len(named)}")
sys.exit(0 if len(lines) >= 2 and 2 * len(named) > len(lines) else 1)
PY
    # (b) rank 1 stopped for good, a 20 s collective timeout: named at a quarter of it, the job over well within 60 s
    CHORUS_OBS_MARKER=obsb$$ timeout 200 $BUILD/chorus launch --nproc-per-node 2 --master-port 29612 --grace-period 5 -- \
      $BUILD/chorus train --model d12 --strategy ddp --devices cuda --data "tokens:$DATA/rand_train_*.bin" --seq-len 256 \
      --batch-size 4 --steps 100000 --log-every 10 --dist-timeout 20 >"$OUT/obs_stuck.out" 2>"$OUT/obs_stuck.err" &
    job=$!
    victim=$(find_rank1 obsb$$ "$OUT/obs_stuck.err" "parameters")
    if [ -z "$victim" ]; then obs_fail "(b) rank 1 of the stuck job not found"; kill $job 2>/dev/null; wait $job
    else
      for _ in $(seq 600); do grep -q "step 20" "$OUT/obs_stuck.err" && break; sleep 0.1; done  # a few steps in
      kill -STOP "$victim"; t0=$(date +%s.%N)
      wait $job; rc=$?; secs=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
      kill -KILL "$victim" 2>/dev/null
      echo "(b) rc $rc, ${secs} s after the stop"
      grep -E "has waited|last collectives|^\[rank 0\] +#[0-9]+ |DistError" "$OUT/obs_stuck.err" | head -26
      [ $rc != 0 ] && python3 -c "import sys; sys.exit(0 if float('$secs') < 60 else 1)" \
        && obs_pass "(b) the job ended non-zero (rc $rc) ${secs} s after the stop" || obs_fail "(b) rc $rc after ${secs} s"
      python3 - "$OUT/obs_stuck.err" <<'PY' && obs_pass "(b) rank 1 named before the timeout; rank 0's last collectives logged" \
        || obs_fail "(b) no early line naming rank 1, or no flight recorder"
import re, sys
text = open(sys.argv[1], errors="replace").read()
early = re.search(r"\[rank 0\] chorus: rank 0: nccl (.+?) #(\d+) \(([\d.]+ [kM]?B)\) has waited ([\d.]+) s of its 20 s timeout: "
                  r"rank 1 has not arrived", text)
rec = re.search(r"\[rank 0\] chorus: rank 0: nccl .+ #\d+ failed; the last collectives of group", text)
entries = re.findall(r"^\[rank 0\]   #(\d+) (.+?) ([\d.]+ [kM]?B) (running for [\d.]+ s|[\d.]+ s)$", text, re.M)
print(f"(b) early line: {early.group(0) if early else None}")
print(f"(b) flight recorder: {bool(rec)}, {len(entries)} entries, last {entries[-1] if entries else None}")
ok = early and float(early.group(4)) < 20 and rec and 2 <= len(entries) <= 20 and text.find(early.group(0)) < text.find(rec.group(0))
sys.exit(0 if ok else 1)
PY
    fi
    # (c) --trace of two DDP ranks on GPUs, steps 5-7
    rm -f "$OUT/obs_trace.json"
    timeout 180 $BUILD/chorus launch --nproc-per-node 2 --master-port 29613 -- $BUILD/chorus "${IMG[@]}" \
      --synthetic-size 4096 --steps 8 --log-every 4 --trace "$OUT/obs_trace.json" --trace-steps 5-7 \
      >"$OUT/obs_trace.out" 2>"$OUT/obs_trace.err" || { obs_fail "(c) the traced job failed"; tail -5 "$OUT/obs_trace.err"; }
    grep "trace:" "$OUT/obs_trace.err"
    # --phases data: a graphed step (replays from step 4) has no host forward/backward spans
    python3 tests/apps/check_trace.py "$OUT/obs_trace.json" --ranks 2 --steps 5-7 --phases data \
      --devices 'cuda:{rank}' --gpu && obs_pass "(c) device tracks: compute stream, NCCL kernels, copies on both ranks" \
      || obs_fail "(c) trace check"
    # (d) --trace of a GPT over --mesh tp=2, steps 5-7
    rm -f "$OUT/obs_mesh_trace.json"
    timeout 180 $BUILD/chorus launch --nproc-per-node 2 --master-port 41515 -- $BUILD/chorus train --model d12 --mesh tp=2 \
      --devices cuda --data "tokens:$DATA/rand_train_*.bin" --seq-len 256 --batch-size 4 --steps 8 --log-every 4 \
      --trace "$OUT/obs_mesh_trace.json" --trace-steps 5-7 >"$OUT/obs_mesh.out" 2>"$OUT/obs_mesh.err" \
      || { obs_fail "(d) the traced --mesh job failed"; tail -5 "$OUT/obs_mesh.err"; }
    grep "trace:" "$OUT/obs_mesh.err"
    python3 tests/apps/check_trace.py "$OUT/obs_mesh_trace.json" --ranks 2 --steps 5-7 --phases data,forward,backward,optimizer \
      --devices 'cuda:{rank}' --gpu && obs_pass "(d) --mesh tp=2: host phases, compute stream, NCCL kernels, copies on both ranks" \
      || obs_fail "(d) --mesh trace check"
    # (e) chorus bench --mesh tp=2 --trace: the bench row's timed steps 2-3, the same tracks
    rm -f "$OUT/obs_bench_mesh.json"
    timeout 180 $BUILD/chorus launch --nproc-per-node 2 --master-port 41516 -- $BUILD/chorus bench --model d12 --mesh tp=2 \
      --devices cuda --seq-len 256 --batch-size 4 --warmup 2 --steps 4 --trace "$OUT/obs_bench_mesh.json" --trace-steps 2-3 \
      >"$OUT/obs_bench_mesh.out" 2>"$OUT/obs_bench_mesh.err" || { obs_fail "(e) the traced mesh bench failed"; tail -5 "$OUT/obs_bench_mesh.err"; }
    cat "$OUT/obs_bench_mesh.out"
    python3 tests/apps/check_trace.py "$OUT/obs_bench_mesh.json" --ranks 2 --steps 2-3 --phases forward,backward,optimizer \
      --devices 'cuda:{rank}' --gpu && obs_pass "(e) bench --mesh tp=2 --trace: phases and device tracks on both ranks" \
      || obs_fail "(e) bench --mesh trace check"
    # (f) rank 1 of --mesh tp=2 killed (SIGKILL) mid-training over NCCL: rank 0 ends by itself (long --grace-period)
    # naming rank 1 by its job rank (Note [Ranks named in the job's numbering]) within the timeout and a roll call
    CHORUS_OBS_MARKER=obsf$$ timeout 200 $BUILD/chorus launch --nproc-per-node 2 --master-port 41517 --grace-period 90 -- \
      $BUILD/chorus train --model d12 --mesh tp=2 --devices cuda --data "tokens:$DATA/rand_train_*.bin" --seq-len 256 \
      --batch-size 4 --steps 100000 --log-every 10 --dist-timeout 20 >"$OUT/obs_kill.out" 2>"$OUT/obs_kill.err" &
    job=$!
    victim=$(find_rank1 obsf$$ "$OUT/obs_kill.err" "step 20/")
    # The rank's own process: the lowest pid of a chorus process with RANK=1 (a child it starts inherits both)
    for f in $(grep -l "CHORUS_OBS_MARKER=obsf$$" /proc/[0-9]*/environ 2>/dev/null); do
      p=$(cut -d/ -f3 <<<"$f")
      [ "$(cat /proc/$p/comm 2>/dev/null)" = chorus ] && tr '\0' '\n' < "$f" 2>/dev/null | grep -qx RANK=1 \
        && [ "$p" -lt "$victim" ] && victim=$p
    done
    if [ -z "$victim" ]; then obs_fail "(f) rank 1 of the mesh job not found"; kill $job 2>/dev/null; wait $job
    else
      kill -KILL "$victim"; t0=$(date +%s.%N)
      wait $job; rc=$?; secs=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
      grep -E "chorus: error|has waited|killed by signal" "$OUT/obs_kill.err" | cut -c1-300 | head -6
      grep -Eq "^\[rank 0\] chorus: error: .*failed on rank 0 \(timeout 20 s[^)]*\): rank 1 did not arrive" "$OUT/obs_kill.err" \
        && [ $rc != 0 ] && python3 -c "import sys; sys.exit(0 if float('$secs') < 60 else 1)" \
        && obs_pass "(f) killed tp rank 1 named by rank 0, the job over (rc $rc) ${secs} s after the kill" \
        || obs_fail "(f) rc $rc after ${secs} s, rank 1 not named by rank 0's own error"
    fi
    echo "obs: $fails FAIL"
    [ $fails = 0 ] || exit 1
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
