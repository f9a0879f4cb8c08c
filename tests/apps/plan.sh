#!/usr/bin/env bash
# chorus plan on the CPU (apps/plan.h):
#   - without a calibration it prints memory only and says it is uncalibrated
#   - its DDP / single memory column is the plan chorus train prints
#   - --calibrate on the CPU writes a file that --calibration reads, and the
#     plan then has step times, tok/s and a best layout
#   - under chorus launch with 2 ranks --calibrate also measures the bus
#     bandwidth, and the plan times layouts of 64 and 1024 GPUs
#   - --model name[:batch] times one model at several micro-batches; the file
#     (version 2) holds the checkpointed block's timing and, on a CPU, no
#     CUDA graph timing; a version 1 file is read with its defaults, said so
#   - scripts/plan_table.py regenerates docs/parallelism.md's predicted
#     beside measured table from the committed calibration (bench/plan/)
#   - bad input: one clear line, a non-zero exit
set -uo pipefail
CHORUS=${1:?usage: plan.sh path/to/chorus}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; sed 's/^/    /' "$tmp/err" | head -5; fail=1; fi; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
: > "$tmp/err"
# A free port of the range this test was given (41700-41799).
port=$(python3 - <<'PY'
import random, socket
for p in random.sample(range(41700, 41800), 100):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p)); print(p); break
    except OSError:
        pass
    finally:
        s.close()
PY
)

# 1. Uncalibrated: memory only, said so.
"$CHORUS" plan --model gpt2-xl --gpus 4 > "$tmp/out" 2> "$tmp/err"; rc=$?
check "uncalibrated plan runs" "[ $rc -eq 0 ]"
check "it says it is uncalibrated" "grep -q '^uncalibrated: memory only' $tmp/out"
check "rows for ddp and the ZeRO stages" "grep -Eq '^ +ddp ' $tmp/out && grep -Eq '^ +zero-3 ' $tmp/out"
check "no times without a calibration" "! grep -q '^best:' $tmp/out"

# 2. The memory column is chorus train's plan: gpt2-xl, fp32, 2 x 32 tokens a GPU,
# refused against a tiny --memory-limit-gib before anything is built (one
# process; and, as rank 0 of 4 whose rendezvous never happens, DDP and ZeRO-3).
python3 - "$tmp/tok_train_000.bin" <<'PY'
import random, struct, sys
random.seed(0); n = 20000
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
    f.write(struct.pack(f"<{n}H", *(random.randrange(50257) for _ in range(n))))
PY
TR=(train --model gpt2-xl --data "tokens:$tmp/tok_train_*.bin" --seq-len 32 --batch-size 2 --steps 1 --devices cpu
    --precision fp32 --memory-plan --memory-limit-gib 0.01)
"$CHORUS" plan --model gpt2-xl --gpus 1 --batch-size 2 --seq-len 32 --precision fp32 --json > "$tmp/json1" 2> "$tmp/err"
"$CHORUS" plan --model gpt2-xl --gpus 4 --batch-size 2 --seq-len 32 --precision fp32 --json > "$tmp/json4" 2> "$tmp/err"
plan_gib() {  # JSONL LAYOUT: that row's memory in GiB as the memory plan prints it
  python3 -c "
import json, sys
b = [json.loads(l) for l in open('$1') if json.loads(l)['layout'] == '$2'][0]['memory_bytes'] / 2**30
print(f'{b:.1f}' if b >= 10 else f'{b:.2f}')"
}
for case in "single json1" "ddp json4 --strategy ddp" "zero-3 json4 --strategy zero --zero-stage 3"; do
  set -- $case; layout=$1 rows=$2; shift 2
  env_=(); [ "$layout" != single ] && env_=(RANK=0 WORLD_SIZE=4 LOCAL_RANK=0 LOCAL_WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=9)
  timeout 120 env "${env_[@]}" "$CHORUS" "${TR[@]}" "$@" > /dev/null 2> "$tmp/train"
  train_total=$(awk '$1 == "total" {print $2}' "$tmp/train")
  plan_total=$(plan_gib "$tmp/$rows" "$layout")
  check "$layout: the plan's memory is chorus train's ($plan_total vs $train_total GiB)" \
    "[ -n '$train_total' ] && [ '$plan_total' = '$train_total' ]"
done

# 3. Calibrate the CPU, plan with it.
C=(plan --devices cpu --precision fp32 --batch-size 2 --seq-len 32 --warmup 0 --iters 1)
"$CHORUS" "${C[@]}" --calibrate "$tmp/cal.json" --model d2,d4 > "$tmp/out" 2> "$tmp/err"; rc=$?
check "--calibrate on the CPU" "[ $rc -eq 0 ] && grep -q 'calibration written to' $tmp/out"
check "the file names its format, device, both models and the shards timed (d4: tp 2, 4)" \
  "python3 -c \"import json; j = json.load(open('$tmp/cal.json')); assert j['format'] == 'chorus-plan-calibration' and j['device'] == 'cpu:0' and [m['model'] for m in j['models']] == ['d2', 'd4'] and j['models'][0]['gemm']['rate'] > 0 and 'bus' not in j and [g['tp'] for g in j['models'][1]['gemm_shards']] == [2, 4]\""
"$CHORUS" plan --model d2 --gpus 1 --batch-size 2 --seq-len 32 --precision fp32 --calibration "$tmp/cal.json" \
  > "$tmp/out" 2> "$tmp/err"; rc=$?
check "the plan reads it" "[ $rc -eq 0 ] && grep -q '^calibration .*cal.json: .*kernels timed at d2' $tmp/out"
check "with a step time and a best layout" "grep -Eq '^\* +single +[0-9.]+ +[0-9.]+ +yes +[0-9.]+ +[0-9]+ ' $tmp/out && grep -q '^best: single' $tmp/out"
"$CHORUS" plan --model d2 --gpus 8 --batch-size 2 --seq-len 32 --precision fp32 --calibration "$tmp/cal.json" \
  > "$tmp/out" 2> "$tmp/err"
check "more than one GPU without a bus bandwidth: no times, said so" "grep -q 'no bus bandwidth measured' $tmp/out && ! grep -q '^best:' $tmp/out"

# 3b. name[:batch]: d2 at 1 and 4 sequences; the plan takes the timing of its
# own batch first and lists the other; recompute timed, no graph on a CPU.
"$CHORUS" "${C[@]}" --calibrate "$tmp/calmb.json" --model d2:1,d2:4 > "$tmp/out" 2> "$tmp/err"; rc=$?
check "--calibrate d2:1,d2:4" "[ $rc -eq 0 ]"
check "version 2: two d2 timings at 32 and 128 tokens, a recompute timing each, no graph on the CPU" \
  "python3 -c \"import json; j = json.load(open('$tmp/calmb.json')); m = j['models']; assert j['version'] == 2 and [x['tokens'] for x in m] == [32, 128] and all(x['recompute']['seconds'] > 0 and 'graph' not in x for x in m)\""
"$CHORUS" plan --model d2 --gpus 1 --batch-size 4 --seq-len 32 --precision fp32 --calibration "$tmp/calmb.json" \
  > "$tmp/out" 2> "$tmp/err"; rc=$?
check "the plan at 4 sequences takes the 128-token timing first" \
  "[ $rc -eq 0 ] && grep -q 'kernels timed at d2.s shapes (128, 32 tokens); recompute x[0-9.]*, no CUDA graph timed' $tmp/out"
python3 - "$tmp/calmb.json" "$tmp/v1.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); j["version"] = 1
for m in j["models"]: m.pop("recompute"); m.pop("graph", None)
json.dump(j, open(sys.argv[2], "w"))
PY
"$CHORUS" plan --model d2 --gpus 1 --batch-size 1 --seq-len 32 --precision fp32 --calibration "$tmp/v1.json" \
  > "$tmp/out" 2> "$tmp/err"; rc=$?
check "a version 1 file: read, its defaults said" \
  "[ $rc -eq 0 ] && grep -q 'version 1: recompute x4/3 and no CUDA graph timings assumed' $tmp/out && grep -q '^best: single' $tmp/out"

# 3c. The predicted beside measured table from the committed calibration.
python3 "$ROOT/scripts/plan_table.py" --chorus "$CHORUS" --calibration "$ROOT/bench/plan/h200_s38_v2.json" \
  --measured "$ROOT/bench/plan/measured.jsonl" --beyond > "$tmp/table" 2> "$tmp/err"; rc=$?
rows=$(wc -l < "$ROOT/bench/plan/measured.jsonl")
check "plan_table.py: a row per measured row, a ratio each, and 64/1024 GPUs" \
  "[ $rc -eq 0 ] && [ \$(grep -Ec '^\| [a-z0-9-]+ \| .* \| \**[0-9]\.[0-9]{3}\** \|$' $tmp/table) -eq $rows ] && grep -q '^Within 10%: [0-9]* of $rows rows' $tmp/table && grep -q '^| d84 | 1024 | ' $tmp/table"
echo '{"model": "gpt2", "gpus": 2, "batch": 16, "layout": "zero-9", "label": "x", "tok_s": 1, "machine": "m", "source": "s"}' > "$tmp/badrows.jsonl"
python3 "$ROOT/scripts/plan_table.py" --chorus "$CHORUS" --calibration "$ROOT/bench/plan/h200_s38_v2.json" \
  --measured "$tmp/badrows.jsonl" > /dev/null 2> "$tmp/err"; rc=$?
check "plan_table.py: a layout the plan does not list, named" "[ $rc -ne 0 ] && grep -q \"no layout 'zero-9'\" $tmp/err"

# 4. Under chorus launch: the bus bandwidth too, then 64 and 1024 GPUs.
timeout 300 "$CHORUS" launch --nproc-per-node 2 --master-port "$port" --grace-period 2 -- \
  "$CHORUS" "${C[@]}" --calibrate "$tmp/cal2.json" --model d4 --bus-sizes-mb 0.25,1 > "$tmp/out" 2> "$tmp/err"; rc=$?
check "--calibrate under chorus launch" "[ $rc -eq 0 ] && grep -q 'bus bandwidth over 2 ranks (gloo)' $tmp/err"
check "the file holds the bus rows and the compute's slowdown beside them" \
  "python3 -c \"import json; b = json.load(open('$tmp/cal2.json'))['bus']; assert b['ranks'] == 2 and b['busbw_GBs'] > 0 and len(b['rows']) == 2 and b['overlap_slowdown'] > 0\""
for g in 64 1024; do
  "$CHORUS" plan --model d4 --gpus $g --batch-size 2 --seq-len 32 --precision fp32 --calibration "$tmp/cal2.json" \
    --top 0 > "$tmp/out" 2> "$tmp/err"; rc=$?
  check "$g GPUs: a best layout, meshes listed" "[ $rc -eq 0 ] && grep -q '^best: ' $tmp/out && grep -q 'dp=.*,tp=2,pp=2 m=' $tmp/out && grep -q 'NIC 400 Gb/s' $tmp/out"
done

# 5. Bad input: one line each, non-zero exit.
bad() {  # DESCRIPTION PATTERN ARGS...
  local what=$1 pattern=$2; shift 2
  "$CHORUS" "$@" > /dev/null 2> "$tmp/err"; local rc=$?
  check "$what" "[ $rc -ne 0 ] && [ \$(wc -l < $tmp/err) -eq 1 ] && grep -q -- \"$pattern\" $tmp/err"
}
bad "unknown model" "unknown GPT model 'gpt5'" plan --model gpt5 --gpus 4
bad "gpus not a multiple of gpus-per-node" "--gpus 12 spans more than one node but is not a multiple of --gpus-per-node 8" plan --model gpt2 --gpus 12
bad "missing calibration file" "$tmp/none.json" plan --model gpt2 --gpus 4 --calibration "$tmp/none.json"
echo '{"format": "chorus-plan-calibration", "version": 1,' > "$tmp/corrupt.json"
bad "corrupt calibration file" "calibration $tmp/corrupt.json is not JSON" plan --model gpt2 --gpus 4 --calibration "$tmp/corrupt.json"
bad "a calibration of another precision" "was measured in fp32, not --precision bf16" plan --model d2 --gpus 4 --calibration "$tmp/cal.json"
bad "--calibrate and --calibration together" "give one" plan --calibrate "$tmp/x.json" --calibration "$tmp/cal.json"
bad "bf16 calibration on a CPU" "with --precision fp32" plan --calibrate "$tmp/x.json" --devices cpu --model d2
bad "an unknown gathered dtype" "--zero-param-dtype must be bf16 or fp32" plan --model gpt2 --gpus 4 --zero-param-dtype fp16
"$CHORUS" plan --calibrate "$tmp/x.json" --devices cpu --precision fp32 --model d2:0 > /dev/null 2> "$tmp/err"; rc=$?
check "--model d2:0 refused" "[ $rc -ne 0 ] && [ \$(wc -l < $tmp/err) -eq 1 ] && grep -q \"'d2:0' is not name\[:batch\]\" $tmp/err"
bad "zero GPUs" "--gpus must be at least 1" plan --model gpt2 --gpus 0
bad "seq past the context" "exceeds the model's context" plan --model gpt2 --gpus 2 --seq-len 4096
exit $fail
