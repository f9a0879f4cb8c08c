#!/usr/bin/env bash
# Issue 47, items 1 and 3: `chorus train --strategy ddp --sync-bn` with a
# DataParallel inside each rank (--devices cpu:0,cpu:1) trains (its replicas
# are clones of the converted model: SyncBatchNorm, not the BatchNorm2d that
# the model's constructor builds), and --resume checks --sync-bn both ways
# with a reason that names it.
set -uo pipefail
CHORUS=${1:?chorus}
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
source "$(dirname "$0")/../testing/free_port.sh"  # free_port: a master port no other job can take
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
launch() { local n=$1; shift; timeout 300 "$CHORUS" launch --nproc-per-node "$n" --master-port "$(free_port)" --grace-period 2 -- "$@"; }
T=(train --strategy ddp --model cnn --data synthetic --workers 0 --batch-size 8 --quiet)

# 1. The command of the issue: 2 ranks, each a DataParallel over cpu:0,cpu:1, SyncBatchNorm.
launch 2 "$CHORUS" "${T[@]}" --sync-bn --devices cpu:0,cpu:1 --steps 3 > "$tmp/out" 2> "$tmp/err"; rc=$?
check "--sync-bn over 2 ranks x 2 devices trains (exit $rc)" "[ $rc = 0 ] && ! grep -q 'assertion failed' '$tmp/err'"
[ $rc = 0 ] || cat "$tmp/err"

# 3. --resume and --sync-bn: refused both ways, naming --sync-bn.
launch 1 "$CHORUS" "${T[@]}" --sync-bn --devices cpu:0 --steps 2 --checkpoint-dir "$tmp/with" > /dev/null 2>&1
launch 1 "$CHORUS" "${T[@]}" --devices cpu:0 --steps 2 --checkpoint-dir "$tmp/without" > /dev/null 2>&1
check "two checkpoints written" "[ -d '$tmp/with/ckpt-00000002' ] && [ -d '$tmp/without/ckpt-00000002' ]"
launch 1 "$CHORUS" "${T[@]}" --devices cpu:0 --steps 4 --allow-change steps --resume --checkpoint-dir "$tmp/with" > /dev/null 2> "$tmp/err"; rc=$?
check "a --sync-bn checkpoint resumed without --sync-bn is refused (exit $rc): $(grep -m1 -- '--sync-bn' "$tmp/err")" \
  "[ $rc != 0 ] && grep -q -- '--sync-bn is false but the checkpoint (.*) was trained with true' '$tmp/err'"
launch 1 "$CHORUS" "${T[@]}" --sync-bn --devices cpu:0 --steps 4 --allow-change steps --resume --checkpoint-dir "$tmp/without" > /dev/null 2> "$tmp/err"; rc=$?
check "a checkpoint without --sync-bn resumed with it is refused (exit $rc): $(grep -m1 -- '--sync-bn' "$tmp/err")" \
  "[ $rc != 0 ] && grep -q -- '--sync-bn is true but the checkpoint (.*) was trained with false' '$tmp/err' && ! grep -q 'another version' '$tmp/err'"
launch 1 "$CHORUS" "${T[@]}" --sync-bn --devices cpu:0 --steps 4 --allow-change steps --resume --checkpoint-dir "$tmp/with" > /dev/null 2> "$tmp/err"; rc=$?
check "--sync-bn resumes its own checkpoint (exit $rc)" "[ $rc = 0 ]"
[ $rc = 0 ] || cat "$tmp/err"
exit $fail
