#!/usr/bin/env bash
# SyncBatchNorm across real processes over Gloo (chorus_syncbn_probe, the
# third argument): 1, 2 and 3 ranks with uneven per-rank batches, then 2 and 3
# ranks that each run a DataParallel over 2 logical CPU devices (replicas sum
# first, then the ranks). Each rank compares against nn::BatchNorm2d on the
# global batch in one process and prints its largest relative errors.
set -uo pipefail
CHORUS=${1:?chorus}; PROBE=${5:?chorus_syncbn_probe}
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
source "$(dirname "$0")/../testing/free_port.sh"  # free_port: a master port no other job can take
fail=0
run_world() {  # N [DP]: N ranks, each with DataParallel over DP devices when given
  local n=$1 dp=${2:-0} port pids=() out rc=0
  port=$(free_port); out=$(mktemp -d)
  for ((r = 0; r < n; r++)); do
    RANK=$r WORLD_SIZE=$n LOCAL_RANK=$r LOCAL_WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      SYNCBN_DP=$dp SYNCBN_CONTROL=${SYNCBN_CONTROL:-0} CHORUS_CPU_DEVICES=4 timeout 300 "$PROBE" > "$out/$r" 2>&1 & pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  cat "$out"/*; rm -rf "$out"
  [ $rc -eq 0 ] || { echo "FAIL: world of $n (DataParallel over $dp)"; fail=1; }
}
for n in 1 2 3; do run_world $n; done
for n in 2 3; do run_world $n 2; done
# The control: batch norms without the process group (each rank's own
# statistics) must fail. In $( ) run_world's `fail` stays in the subshell.
out=$(SYNCBN_CONTROL=1 run_world 2 2>&1); grep -E "^rank" <<<"$out" | sed 's/^/control: /'
grep -q "FAIL: world of 2" <<<"$out" || { echo "FAIL: the control (no process group) passed"; fail=1; }
[ $fail -eq 0 ] && echo "ok: SyncBatchNorm over 1-3 processes, and over 2-3 processes of 2 replicas each"
exit $fail
