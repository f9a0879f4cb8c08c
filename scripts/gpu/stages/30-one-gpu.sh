# shellcheck shell=bash
# scripts/gpu_check.sh stages: One GPU: throughput beside PyTorch, training runs, memory over a long run.
# Sourced by the dispatcher, which sets OUT, BUILD, C (the chorus binary) and rows (the summary's JSON rows);
# each stage_NAME function is one stage, described by the "# NAME: ..." line above it (--list shows it).

bench_pair() {  # model precision channels_last
  local m=$1 p=$2 cl=$3 flag=""
  [ "$cl" = 1 ] && flag=--channels-last
  timeout 300 $C bench --model $m --precision $p $flag --devices cuda:0 --batch-size 128 --steps 30 --warmup 8 --json | tee -a "$rows"
  timeout 300 python3 scripts/torch_reference.py --model $m --precision $p $flag --batch 128 --steps 30 --warmup 8 | tee -a "$rows"
}

# bench: WRN-28-10 and WRN-16-4, fp32 and bf16, on one GPU beside PyTorch eager (rows for the summary)
stage_bench() {
  for m in wrn-28-10 wrn-16-4; do
    bench_pair $m fp32 0
    bench_pair $m bf16 1
  done
}

# graphs: the CUDA-graph tests, then one GPU against torch.compile per model (GRAPH_CONFIGS, GRAPH_COMPILE_MODES)
stage_graphs() {
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
}

# train: the Fashion-MNIST CNN, 5 epochs on one GPU
stage_train() {
  timeout 300 $C train --model cnn --data fashion-mnist --data-dir ${FMNIST_DIR:-.bench/fashion-mnist} --devices cuda:0 --epochs 5 --seed 1 --json | tee "$OUT/train_gpu.json"
}

# layout: chorus train channels-last against --no-channels-last, and a checkpoint resumed across them
stage_layout() {
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
}

# memrun: about nine minutes of WRN-16-4 training; the peak memory of every epoch
stage_memrun() {
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
}
