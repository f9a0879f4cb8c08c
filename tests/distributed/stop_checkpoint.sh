#!/usr/bin/env bash
# Issue 47, item 9: SIGTERM to `chorus launch` running `chorus train
# --strategy ddp` ends with a stop checkpoint. The ranks agree to stop a
# step or two after the signal (Note [Stopping ranks together]) rather than
# at the next --log-every window, the launcher gives them --stop-timeout to
# write the checkpoint (it killed them after a fixed 10 s), and its last line
# says whether they stopped by themselves and where the checkpoint is.
set -uo pipefail
CHORUS=${1:?chorus}
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
source "$(dirname "$0")/../testing/free_port.sh"  # free_port: a master port no other job can take
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
tmp=$(mktemp -d); trap 'kill "${lp:-}" 2>/dev/null; rm -rf "$tmp"' EXIT
T=(train --strategy ddp --model mlp --data synthetic --synthetic-size 512 --workers 0 --batch-size 16 --epochs 100000
   --log-every 100000 --quiet --checkpoint-dir "$tmp/ck")

timeout 300 "$CHORUS" launch --nproc-per-node 2 --master-port "$(free_port)" -- "$CHORUS" "${T[@]}" > "$tmp/out" 2> "$tmp/err" &
lp=$!
for _ in $(seq 600); do [ -s "$tmp/ck/lock" ] && [ -d "$tmp/ck/ckpt-00000016" ] && break; sleep 0.1; done
start=$(date +%s); kill -TERM $lp; wait $lp; rc=$?; took=$(( $(date +%s) - start )); lp=
check "SIGTERM -> exit 143 in ${took} s (got $rc)" "[ $rc = 143 ] && [ $took -lt 30 ]"
check "the launcher says every worker stopped and where the checkpoint is: $(tail -1 "$tmp/err")" \
  "tail -1 '$tmp/err' | grep -q 'every worker stopped by itself; rank [01]: chorus: stopped by SIGTERM at step [0-9]*; checkpoint written to $tmp/ck/ckpt-[0-9]* (continue with --resume)'"
s0=$(grep -o '^\[rank 0\] chorus: stopped by SIGTERM at step [0-9]*' "$tmp/err" | grep -o '[0-9]*$')
s1=$(grep -o '^\[rank 1\] chorus: stopped by SIGTERM at step [0-9]*' "$tmp/err" | grep -o '[0-9]*$')
check "both ranks stopped after the same step (${s0:-none}, ${s1:-none})" "[ -n '$s0' ] && [ '$s0' = '$s1' ]"
ck=$(printf '%s/ck/ckpt-%08d' "$tmp" "${s0:-0}")
check "the stop checkpoint is complete: $ck" "[ -f '$ck/state.json' ] && [ -f '$ck/model.safetensors' ] && grep -q '\"step\": ${s0:-x}' '$ck/state.json'"
[ $fail = 0 ] || cat "$tmp/err"
timeout 300 "$CHORUS" launch --nproc-per-node 2 --master-port "$(free_port)" -- "$CHORUS" "${T[@]}" --steps $(( ${s0:-0} + 4 )) \
  --resume --allow-change steps > "$tmp/out" 2> "$tmp/err"; rc=$?
check "the job resumes from it (exit $rc)" "[ $rc = 0 ]"
exit $fail
