# shellcheck shell=bash
# scripts/gpu_check.sh stages: Pipelines: a model in stages over 2 GPUs.
# Sourced by the dispatcher, which sets OUT, BUILD, C (the chorus binary) and rows (the summary's JSON rows);
# each stage_NAME function is one stage, described by the "# NAME: ..." line above it (--list shows it).

# pipeline: WRN models in 2 stages on 2 GPUs (naive, GPipe, 1F1B, interleaved); stages over processes (interleaved too)
stage_pipeline() {
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
  echo "== pipeline stages over processes (NCCL send/recv, one GPU per rank; interleaved: two stages a rank) vs one device"
  for s in gpipe 1f1b interleaved; do
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
}

# microbatch: how fast a micro-batch runs per image against the whole batch, one GPU, per model
stage_microbatch() {
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
}

# pipetrain: the Fashion-MNIST CNN in 2 stages on 2 GPUs, graphed and eager
stage_pipetrain() {
  # Fashion-MNIST CNN, 2 stages on 2 GPUs, 4 micro-batches, 1F1B: the default
  # (each step one CUDA graph over both GPUs) against --no-cuda-graphs, same seed.
  F=${FMNIST_DIR:-.bench/fashion-mnist}
  for g in "" --no-cuda-graphs; do
    timeout 300 $C train --data-dir $F --strategy pipeline --devices cuda:0,cuda:1 --micro-batches 4 --schedule 1f1b \
      --epochs ${PIPETRAIN_EPOCHS:-5} --seed 1 --quiet --json $g 2>&1 | tail -3 | sed "s/^/pipetrain ${g:-graphed}: /"
  done
}
