#!/usr/bin/env bash
# chorus train --strategy zero for the image models, as a user runs it, on CPU
# processes over Gloo (the small CNN -- convolutions, batch norm, Linear --
# on synthetic Fashion-MNIST-shaped data, SGD with momentum, float32):
#   - stages 1, 2 and 3 (units found by ShardedDataParallel itself), stage 3
#     keeping weights from forward to backward, and --sync-bn, on 2 ranks,
#     end with DDP's train loss, test loss and test accuracy on 2 ranks (the
#     same seed, the same data split); --hybrid (2 nodes x 2 ranks) with DDP's
#     on 4 ranks; --comm-hook bf16 trains
#   - ResNet-20 and a Wide ResNet at stage 3, their residual blocks the
#     units, end with DDP's figures
#   - checkpoints: written by zero-2 on 2 ranks, resumed as zero-3 and as
#     DDP, each ending where the uninterrupted run did, and by one process;
#     a DDP checkpoint resumed as zero-1 ends where DDP did
#   - chorus bench --strategy ddp,zero-1,zero-3: a row each, zero's loss DDP's
#   - bad options get one clear line
set -uo pipefail
CHORUS=${1:?chorus}
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
source "$(dirname "$0")/../testing/free_port.sh"
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# 512 examples, 2 ranks x batch 32: 8 steps an epoch; --steps 12 crosses an epoch's end.
T=(train --model cnn --data synthetic --synthetic-size 512 --epochs 2 --steps 12 --log-every 4 --seed 5
   --workers 0 --devices cpu --json)
field() { python3 -c "import json,sys; print(json.loads(sys.argv[1])['$2'])" "$1" 2>/dev/null; }
close() {  # A B: equal to 1e-5, relative (float32 sums in another order)
  python3 -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); sys.exit(0 if abs(a-b) <= 1e-5*max(1,abs(b)) else 1)" "$1" "$2"
}
job() {  # ARGS...: chorus train on 2 ranks; rank 0's JSON line
  timeout 300 "$CHORUS" launch --nproc-per-node 2 --master-port "$(free_port)" --grace-period 2 -- \
    "$CHORUS" "${T[@]}" --batch-size 32 "$@" 2>"$tmp/job.err" | grep '^{\|^\[rank 0\] {' | sed 's/^\[rank 0\] //'
}
same() {  # NAME JSON REFERENCE [REFERENCE'S NAME]: the final figures equal the reference run's
  local name=$1 got=$2 want=$3 ref=${4:-DDP}
  if [ -z "$got" ]; then echo "FAIL: $name: no result"; tail -5 "$tmp/job.err"; fail=1; return; fi
  for k in train_loss test_loss test_accuracy; do
    check "$name equals $ref ($k $(field "$got" $k) vs $(field "$want" $k))" "close $(field "$got" $k) $(field "$want" $k)"
  done
}

ddp=$(job --strategy ddp)
[ -n "$ddp" ] || { echo "FAIL: the DDP run"; cat "$tmp/job.err"; exit 1; }
echo "ddp: $ddp"
for st in 1 2 3; do same "zero-$st" "$(job --strategy zero --zero-stage $st)" "$ddp"; done
check "the run says how it shards" "grep -q 'x 2 processes (zero over gloo)' '$tmp/job.err' && grep -q 'zero stage 3: .* units and the root' '$tmp/job.err'"
# Residual networks: stage 3 shards each residual block as a unit from the
# first step (models::residual_blocks); the automatic search finds none there.
for m in resnet20 wrn-10-2; do
  R=(train --model $m --data synthetic --synthetic-size 128 --epochs 1 --steps 3 --log-every 3 --seed 5
     --workers 0 --devices cpu --json --batch-size 16)
  rjob() { timeout 300 "$CHORUS" launch --nproc-per-node 2 --master-port "$(free_port)" --grace-period 2 -- \
             "$CHORUS" "${R[@]}" "$@" 2>"$tmp/job.err" | grep '^{\|^\[rank 0\] {' | sed 's/^\[rank 0\] //'; }
  rddp=$(rjob --strategy ddp)
  same "$m zero-3" "$(rjob --strategy zero --zero-stage 3)" "$rddp"
  units=$([ $m = resnet20 ] && echo 9 || echo 3)
  check "$m zero-3 shards its $units residual blocks as units" "grep -q 'zero stage 3: $units units and the root' '$tmp/job.err'"
done
same "zero-3 --no-reshard-after-forward" "$(job --strategy zero --zero-stage 3 --no-reshard-after-forward)" "$ddp"
same "zero-3 --sync-bn" "$(job --strategy zero --zero-stage 3 --sync-bn)" "$(job --strategy ddp --sync-bn)" "DDP --sync-bn"
# --hybrid: two "nodes" of two ranks on this machine (batch 16 each) against DDP on 4 ranks.
port=$(free_port)
for node in 0 1; do
  CHORUS_JOB_SECRET=train-zero-images-hybrid-$$ timeout 300 "$CHORUS" launch --nnodes 2 --node-rank $node --nproc-per-node 2 \
    --master-addr 127.0.0.1 --master-port $port -- "$CHORUS" "${T[@]}" --strategy zero --zero-stage 3 --hybrid --batch-size 16 \
    >"$tmp/hyb$node.out" 2>"$tmp/hyb$node.err" &
done
wait
ddp4=$(timeout 300 "$CHORUS" launch --nproc-per-node 4 --master-port "$(free_port)" -- "$CHORUS" "${T[@]}" --strategy ddp --batch-size 16 \
       2>"$tmp/job.err" | grep '^{\|^\[rank 0\] {' | sed 's/^\[rank 0\] //')
cp "$tmp/hyb0.err" "$tmp/job.err"
same "zero-3 --hybrid, 2 nodes x 2 ranks" "$(grep '^{\|^\[rank 0\] {' "$tmp/hyb0.out" | sed 's/^\[rank 0\] //')" "$ddp4" "DDP on 4 ranks"
check "--hybrid says how it shards" "grep -q 'over 2 ranks (x 2 replicas: --hybrid)' '$tmp/hyb0.err'"
out=$(job --strategy zero --zero-stage 2 --comm-hook bf16)
check "zero-2 --comm-hook bf16 trains (train loss $(field "$out" train_loss))" \
  "python3 -c 'import math,sys; sys.exit(0 if math.isfinite(float(sys.argv[1])) else 1)' '$(field "$out" train_loss)'"

# Checkpoints at any layout: ckpt-4 of the zero-2 run resumed.
ck="$tmp/ck"
full=$(job --strategy zero --zero-stage 2 --checkpoint-dir "$ck" --checkpoint-every 4)
check "the sharded checkpoint holds one shard per rank and an index" \
  "[ -f '$ck/ckpt-00000004/shard-00000-of-00002.safetensors' ] && [ -f '$ck/ckpt-00000004/index.json' ]"
same "zero-2 with checkpoints" "$full" "$ddp"
keep="$tmp/keep"; cp -r "$ck" "$keep"
from4() { rm -rf "$ck"; cp -r "$keep" "$ck"; rm -rf "$ck"/ckpt-000000{08,12}; }
resumed() {  # NAME JSON: resumed at step 4, ends where the uninterrupted run did
  check "$1: resumed from step 4" "grep -q 'resuming from .*ckpt-00000004 (epoch 1, step 4, 256 examples seen)' '$tmp/job.err'"
  same "$1" "$2" "$full" "the uninterrupted zero-2 run"
}
from4; resumed "zero-2 -> zero-3" "$(job --strategy zero --zero-stage 3 --checkpoint-dir "$ck" --resume)"
from4; resumed "zero-2 -> DDP" "$(job --strategy ddp --checkpoint-dir "$ck" --resume --allow-change strategy)"
from4
"$CHORUS" "${T[@]}" --batch-size 32 --checkpoint-dir "$ck" --resume --allow-change strategy,devices > "$tmp/one.out" 2> "$tmp/job.err"; rc=$?
check "zero-2 -> one process (exit $rc)" "[ $rc = 0 ] && grep -q 'resuming from .*ckpt-00000004 (epoch 1, step 8, 256 examples seen)' '$tmp/job.err'"
rm -rf "$ck"
dfull=$(job --strategy ddp --checkpoint-dir "$ck" --checkpoint-every 4)
rm -rf "$ck"/ckpt-000000{08,12}
out=$(job --strategy zero --zero-stage 1 --checkpoint-dir "$ck" --resume --allow-change strategy)
check "DDP -> zero-1: resumed from step 4" "grep -q 'resuming from .*ckpt-00000004 (epoch 1, step 4' '$tmp/job.err'"
same "DDP checkpoint -> zero-1" "$out" "$dfull" "the uninterrupted DDP run"

bad() {  # NAME EXPECTED ARGS...: exit non-zero with one line naming it (no launcher around)
  local name=$1 want=$2; shift 2
  local err; err=$(env -u RANK -u WORLD_SIZE "$CHORUS" "$@" 2>&1 >/dev/null); local rc=$?
  check "$name: exit $rc, one line naming it" "[ $rc -ne 0 ] && grep -q -- \"$want\" <<<\"\$err\" && [ \$(grep -c . <<<\"\$err\") -le 2 ]"
}
bad "stage 4" "--zero-stage must be 1, 2 or 3" "${T[@]}" --strategy zero --zero-stage 4
bad "--zero-stage without zero" "goes with --strategy zero" "${T[@]}" --zero-stage 2
bad "keeping weights below stage 3" "goes with --zero-stage 3" "${T[@]}" --strategy zero --zero-stage 2 --no-reshard-after-forward
bad "zero with --channels-last" "channels-last is not offered with --strategy zero" "${T[@]}" --strategy zero --channels-last
bad "zero without a launcher" "strategy zero runs one process per device" "${T[@]}" --strategy zero
err=$(RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$(free_port) "$CHORUS" train --model cnn --data synthetic --steps 1 \
      --strategy zero --devices cpu:0,cpu:1 2>&1 >/dev/null)
check "zero with two devices in a process: one line" "grep -q 'one device per process' <<<\"\$err\" && [ \$(grep -c . <<<\"\$err\") -le 2 ]"
# chorus bench: ddp and zero rows side by side, each a 2-process job the
# bench launches; the same seeded steps end with DDP's loss.
rows=$(timeout 300 "$CHORUS" bench --model cnn --devices cpu:0,cpu:1 --device-counts 2 --strategy ddp,zero-1,zero-3 \
       --batch-size 16 --steps 2 --warmup 1 --json 2>"$tmp/bench.err")
for st in zero-1 zero-3; do
  got=$(python3 -c "import json,sys; r=[json.loads(l) for l in sys.stdin if l.startswith('{')]; d={x['strategy']:x for x in r}; print(d['$st']['loss'], d['ddp']['loss'], d['$st']['devices'], d['$st']['zero_stage'])" <<<"$rows" 2>/dev/null)
  read -r l ld dv zs <<<"$got"
  check "bench $st row: 2 devices, stage $zs, loss $l vs ddp's $ld" "[ -n '$got' ] && [ '$dv' = 2 ] && close '$l' '$ld'"
done
bad "bench --zero-param-dtype for a CNN" "offered for GPT models" bench --model cnn --strategy zero-1 --zero-param-dtype bf16 --steps 1
[ $fail -eq 0 ] && echo "train_zero_images: all passed"
exit $fail
