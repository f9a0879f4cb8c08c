#!/usr/bin/env bash
# Issue 47, item 1: `chorus train --strategy ddp --sync-bn` with a
# DataParallel inside each rank (--devices cpu:0,cpu:1) trains (its replicas
# are clones of the converted model: SyncBatchNorm, not the BatchNorm2d that
# the model's constructor builds).
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

exit $fail
