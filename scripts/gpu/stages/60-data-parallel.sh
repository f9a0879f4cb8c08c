# shellcheck shell=bash
# scripts/gpu_check.sh stages: DataParallel: several GPUs in one process.
# Sourced by the dispatcher, which sets OUT, BUILD, C (the chorus binary) and rows (the summary's JSON rows);
# each stage_NAME function is one stage, described by the "# NAME: ..." line above it (--list shows it).

# dp: DataParallel WRN-28-10 fp32 and bf16 at 1 and 2 GPUs (rows for the summary)
stage_dp() {
  for p in fp32 bf16; do
    cl=""; [ $p = bf16 ] && cl=--channels-last
    timeout 300 $C bench --model wrn-28-10 --strategy dp --devices cuda:0,cuda:1 --device-counts 1,2 --precision $p $cl \
      --batch-size 128 --steps 20 --warmup 5 --json | tee -a "$rows"
  done
}

# dpupdates: DataParallel at 1 and 2 GPUs, bf16, graphed, per variant (DPUPDATES_MODELS, DPUPDATES_VARIANTS)
stage_dpupdates() {
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
}

# dpgraphs: DataParallel with and without CUDA graphs at 1 and 2 GPUs, after its graph tests
stage_dpgraphs() {
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
}

# dpcrash: repeated 1,2-GPU DataParallel runs per variant, counting the crashes (DPCRASH_VARIANTS)
stage_dpcrash() {
  # The DataParallel capture crash (Note [NCCL graph mixing] in cuda/runtime/nccl.h): DPCRASH_RUNS
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
}

# multi: DataParallel on every GPU of the machine beside PyTorch's nn.DataParallel
stage_multi() {
  n=$(nvidia-smi -L | wc -l)
  devs=$(seq -s, 0 $((n-1)) | sed 's/[0-9]\+/cuda:&/g')
  timeout 300 ./$BUILD/bench_concurrency 2>&1 | tail -5
  for p in fp32 bf16; do
    cl=""; [ $p = bf16 ] && cl=--channels-last
    timeout 300 $C bench --model wrn-28-10 --strategy dp --devices "$devs" --precision $p $cl --batch-size 128 --steps 20 --warmup 5 --json | tee -a "$rows"
    timeout 300 python3 scripts/torch_reference.py --model wrn-28-10 --mode dp --gpus $n --precision $p $cl --steps 10 --warmup 3 | tee -a "$rows"
  done
}
