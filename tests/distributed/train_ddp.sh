#!/usr/bin/env bash
# chorus train --strategy ddp as a user runs it, on logical CPU devices and
# Gloo: rank 0 alone reports; checkpoints written by N ranks resume on M ranks
# and on one process, and a one-process checkpoint resumes under DDP; bad
# input (no launcher, --devices cuda without a GPU, a rank whose data set is
# missing: every rank stops, no hang); the two DDP example programs; and real
# convergence on Fashion-MNIST, 2 processes: 2 epochs from mpirun, resumed to
# 5 by chorus launch (on CI's 2 cores two 5-epoch runs were the suite's long
# pole, 512 of its 955 s), skipped with CHORUS_TEST_QUICK=1, as the sanitizer
# stage does.
set -uo pipefail
CHORUS=${1:?chorus}; BIN=${4:?binary dir}
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
source "$(dirname "$0")/../testing/free_port.sh"  # free_port: a master port no other job can take
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
launch() { local n=$1; shift; timeout 600 "$CHORUS" launch --nproc-per-node "$n" --master-port "$(free_port)" --grace-period 2 -- "$@"; }
T=(train --strategy ddp --workers 1 --log-every 10)

# 1. Rank 0 alone reports; metrics name the world size.
launch 2 "$CHORUS" "${T[@]}" --steps 20 --metrics "$tmp/m.jsonl" > "$tmp/out" 2> "$tmp/err"; rc=$?
check "2 ranks train (exit $rc)" "[ $rc = 0 ]"
check "one summary line, from rank 0" "[ \$(grep -c 'test accuracy' '$tmp/out') = 1 ] && ! grep -q '^\[rank 1\].*test accuracy' '$tmp/out'"
check "progress from rank 0 only" "grep -q 'x 2 processes (DDP over gloo)' '$tmp/err' && ! grep -q '^\[rank 1\] step' '$tmp/err'"
check "metrics name the world size" "grep -q '\"world_size\":2' '$tmp/m.jsonl'"

# 2. Checkpoints: 2 ranks -> 3 ranks -> one process; one process -> 2 ranks. Progress
# counts examples, --steps steps of the first run's global batch (Note [Progress in
# samples]): 30 steps of 2 x 64 are 20 of 3 x 64; --steps 50 ends at 6400 examples
# (34 steps of 192: 6528), checkpoint ckpt-51 (6528 / 128); 102 steps of 64 on one process,
# which goes on to --steps 60 (7680 examples: 18 steps of 64; --steps 200 trained 298).
launch 2 "$CHORUS" "${T[@]}" --steps 30 --checkpoint-dir "$tmp/ck" --quiet > /dev/null 2>&1
check "rank 0 wrote one checkpoint" "[ -f '$tmp/ck/ckpt-00000030/state.json' ] && [ \$(ls '$tmp/ck' | grep -c '^ckpt-') = 1 ]"
launch 3 "$CHORUS" "${T[@]}" --steps 50 --resume --allow-change steps --checkpoint-dir "$tmp/ck" > "$tmp/out" 2> "$tmp/err"; rc=$?
check "3 ranks resume a 2-rank checkpoint (exit $rc)" "[ $rc = 0 ] && grep -q 'resuming from .*ckpt-00000030 (epoch 1, step 20, 3840 examples seen)' '$tmp/err'"
"$CHORUS" train --workers 1 --steps 60 --resume --allow-change steps,strategy --checkpoint-dir "$tmp/ck" > "$tmp/out" 2> "$tmp/err"; rc=$?
check "one process resumes a 3-rank checkpoint (exit $rc)" "[ $rc = 0 ] && grep -q 'resuming from .*ckpt-00000051 (epoch 1, step 102, 6528 examples seen)' '$tmp/err'"
"$CHORUS" train --workers 1 --steps 20 --checkpoint-dir "$tmp/one" --quiet > /dev/null 2>&1
launch 2 "$CHORUS" "${T[@]}" --steps 30 --resume --allow-change steps,strategy --checkpoint-dir "$tmp/one" > "$tmp/out" 2> "$tmp/err"; rc=$?
check "2 ranks resume a one-process checkpoint (exit $rc)" "[ $rc = 0 ] && grep -q 'resuming from .*ckpt-00000020 (epoch 1, step 10, 1280 examples seen)' '$tmp/err'"
check "--sync-bn trains" "launch 2 '$CHORUS' ${T[*]} --steps 10 --sync-bn --quiet > /dev/null 2>&1"

# 3. Bad input.
out=$(env -u RANK -u WORLD_SIZE "$CHORUS" train --strategy ddp --steps 1 2>&1); rc=$?
check "no launcher: says how to launch (exit $rc)" "[ $rc = 1 ] && grep -q \"chorus launch --nproc-per-node N -- chorus train --strategy ddp\" <<<\"\$out\""
if ! "$CHORUS" --version | grep -q "^CUDA: no" && ! nvidia-smi -L >/dev/null 2>&1; then
  out=$(launch 2 "$CHORUS" "${T[@]}" --devices cuda --steps 1 2>&1); rc=$?
  check "--devices cuda without a GPU is an error (exit $rc)" "[ $rc != 0 ] && grep -q 'no GPU' <<<\"\$out\""
fi
start=$(date +%s)
out=$(launch 2 bash -c 'd=/usr/share/datasets/fashion-mnist; [ "$RANK" = 1 ] && d=/nonexistent-chorus-data; exec "$0" train --strategy ddp --steps 5 --data-dir "$d" --dist-timeout 60' "$CHORUS" 2>&1); rc=$?
took=$(( $(date +%s) - start ))
check "a rank without its data set: the job stops (exit $rc) in ${took} s, naming the rank and the file" \
  "[ $rc != 0 ] && [ $took -lt 60 ] && grep -q 'rank 1' <<<\"\$out\" && grep -q 'nonexistent-chorus-data' <<<\"\$out\""

# 4. The examples.
check "example: one process per device" "launch 2 '$BIN/example_ddp_one_process_per_gpu' | grep -c 'weights identical' | grep -qx 2"
check "example: two devices per process" "CHORUS_CPU_DEVICES=2 launch 2 '$BIN/example_ddp_two_devices_per_process' | grep -c 'devices cpu:0 + cpu:1' | grep -qx 2"

# 5. Convergence: Fashion-MNIST, 2 processes, seed 1: through mpirun 2 epochs >= 0.90
# test accuracy (seed 1 reached 0.899 after one, 0.914 after two); chorus launch
# resumes that run's checkpoint to 5 epochs >= 0.91. Each launcher trained
# from scratch before, the first 2 epochs the same training twice (7 epochs of
# the suite's longest test for 5); resumed, the 5-epoch run reached 0.9254,
# an uninterrupted one 0.9250 (2026-11-29), and the checkpoint crosses
# launchers on the way. Without mpirun, chorus launch trains the 2 epochs.
if [ "${CHORUS_TEST_QUICK:-0}" = 1 ]; then
  echo "SKIPPED: convergence runs (CHORUS_TEST_QUICK=1)"
else
  accuracy() { python3 -c 'import sys, json; print(json.loads(sys.stdin.read())["test_accuracy"])'; }
  if command -v mpirun > /dev/null; then
    first=mpirun
    acc=$(MASTER_PORT=$(free_port) timeout 900 mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_PORT \
          "$CHORUS" "${T[@]}" --epochs 2 --seed 1 --quiet --json --checkpoint-dir "$tmp/conv" | accuracy)
  else
    first="chorus launch"
    acc=$(launch 2 "$CHORUS" "${T[@]}" --epochs 2 --seed 1 --quiet --json --checkpoint-dir "$tmp/conv" | accuracy)
  fi
  check "$first, 2 epochs on 2 processes: test accuracy $acc >= 0.90" "python3 -c 'import sys; sys.exit(0 if float(\"$acc\" or 0) >= 0.90 else 1)'"
  acc=$(launch 2 "$CHORUS" "${T[@]}" --epochs 5 --seed 1 --json --resume --allow-change epochs --checkpoint-dir "$tmp/conv" \
        2> "$tmp/conv.err" | accuracy)
  check "chorus launch resumes the $first run after its 2 epochs" "grep -q 'resuming from .*ckpt-00000938 (epoch 3, step 938, 120064 examples seen)' '$tmp/conv.err'"
  check "chorus launch, 5 epochs on 2 processes: test accuracy $acc >= 0.91" "python3 -c 'import sys; sys.exit(0 if float(\"$acc\" or 0) >= 0.91 else 1)'"
fi
exit $fail
