#!/usr/bin/env bash
# chorus train --model dN --mesh ... (tensor parallelism, apps/train_gpt_mesh.cpp)
# as a user runs it, on CPU processes over Gloo:
#   - --mesh tp=2, and dp=2,tp=2 with --sequence-parallel, equal one process
#     with the same global batch (train and validation loss, float32); so
#     does tp=2 with --sequence-parallel --tp-chunks 2
#   - a checkpoint written at tp=2 resumes without --mesh (one process) to the
#     uninterrupted run's losses, and chorus generate reads it; a one-process
#     checkpoint resumes at tp=2
#   - SIGINT stops every rank with a checkpoint and exit 130
#   - chorus bench --mesh prints a row
#   - bad input: one clear line and a non-zero exit each
set -uo pipefail
CHORUS=${1:?usage: train_gpt_mesh.sh path/to/chorus}
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
source "$(dirname "$0")/../testing/free_port.sh"
source "$(dirname "$0")/../testing/gpt_mesh_job.sh"
text_corpus 1 "$tmp/t.txt"
T=(train --model d2 --data "text:$tmp/t.txt" --seq-len 64 --steps 12 --log-every 4 --seed 3 --json --quiet)

# 1. Tensor parallel (and x data parallel, sequence parallel) equals one process.
one=$("$CHORUS" "${T[@]}" --batch-size 8) || { echo "FAIL: single run"; exit 1; }
tp2=$(launch 2 "${T[@]}" --batch-size 8 --mesh tp=2)
dptp=$(launch 4 "${T[@]}" --batch-size 4 --mesh dp=2,tp=2 --sequence-parallel)
tpk2=$(launch 2 "${T[@]}" --batch-size 8 --mesh tp=2 --sequence-parallel --tp-chunks 2)
echo "single:         $one"; echo "tp=2:           $tp2"; echo "dp=2,tp=2 (sp): $dptp"; echo "tp=2 (sp, K=2): $tpk2"
for k in train_loss val_loss; do
  check "tp=2 equals one process ($k)" "close $(loss "$tp2" $k) $(loss "$one" $k)"
  check "dp=2 x tp=2, sequence parallel, equals one process ($k)" "close $(loss "$dptp" $k) $(loss "$one" $k)"
  check "tp=2, sequence parallel, --tp-chunks 2, equals one process ($k)" "close $(loss "$tpk2" $k) $(loss "$one" $k)"
done
check "the summary names the chunks" "[ \"$(loss "$tpk2" tp_chunks)\" = 2 ]"
check "the summary names the mesh" "[ \"$(loss "$dptp" mesh)\" = dp=2,pp=1,tp=2 ]"

# 2. Checkpoints across layouts: tp=2 -> one process, one process -> tp=2.
ck="$tmp/ck"
full=$(launch 2 "${T[@]}" --batch-size 8 --mesh tp=2 --checkpoint-dir "$ck" --checkpoint-every 4)
check "the tp=2 run with checkpoints equals one process" "close $(loss "$full" train_loss) $(loss "$one" train_loss)"
rm -rf "$ck/ckpt-00000012" "$ck/ckpt-00000008"
res=$("$CHORUS" "${T[@]}" --batch-size 8 --checkpoint-dir "$ck" --resume 2>"$tmp/res.err") || { echo "FAIL: resume"; cat "$tmp/res.err"; fail=1; }
check "one process resumes tp=2's checkpoint at step 4" "grep -q 'resumed from .*ckpt-00000004 at step 4' '$tmp/res.err'"
check "... and ends where the uninterrupted run did" "close $(loss "$res" train_loss) $(loss "$one" train_loss)"
out=$("$CHORUS" generate --checkpoint "$ck" --prompt "in the" --max-tokens 10 --seed 1 2>/dev/null)
check "generate reads tp=2's checkpoint" "[ \"\${out:0:6}\" = 'in the' ] && [ \${#out} -ge 16 ]"
ck1="$tmp/ck1"
"$CHORUS" "${T[@]}" --batch-size 8 --checkpoint-dir "$ck1" --checkpoint-every 4 > /dev/null || { echo "FAIL: run with checkpoints"; fail=1; }
rm -rf "$ck1/ckpt-00000012" "$ck1/ckpt-00000008"
res2=$(launch 2 "${T[@]}" --batch-size 8 --mesh tp=2 --checkpoint-dir "$ck1" --resume)
check "tp=2 resumes a one-process checkpoint to the same losses" "grep -q 'resumed from .*ckpt-00000004 at step 4' '$tmp/launch.err' && close $(loss "$res2" train_loss) $(loss "$one" train_loss)"

# 2a. SIGINT stops every rank after the same step with a checkpoint (exit 130), which resumes.
ck2="$tmp/ck2"
timeout 120 "$CHORUS" launch --nproc-per-node 2 --master-port "$(free_port)" --grace-period 5 -- "$CHORUS" train --model d2 \
  --data "text:$tmp/t.txt" --seq-len 64 --steps 100000 --log-every 1 --mesh tp=2 --checkpoint-dir "$ck2" \
  > /dev/null 2> "$tmp/sig.err" & lp=$!
for _ in $(seq 100); do grep -q "step 3/" "$tmp/sig.err" && break; sleep 0.2; done
kill -INT $lp; wait $lp; rc=$?
check "SIGINT stops a --mesh run with exit 130 (got $rc)" "[ $rc = 130 ]"
check "... after writing a checkpoint" "grep -q 'checkpoint written: .*ckpt-' '$tmp/sig.err' && [ -f '$ck2/latest' ]"

# 2b. chorus bench --mesh: one row from rank 0.
row=$(launch 2 bench --model d2 --seq-len 32 --batch-size 2 --steps 2 --warmup 1 --json --mesh tp=2 --sequence-parallel --tp-chunks 2)
check "bench --mesh tp=2 reports tokens/s and the mesh" "python3 -c \"import json,sys; r=json.loads(sys.argv[1]); sys.exit(0 if r['tok_per_s']>0 and r['mesh']=='dp=1,pp=1,tp=2' and r['sequence_parallel'] and r['tp_chunks']==2 and r['commit'] and r['device_name'] else 1)\" '$row'"

# 3. Bad input: one line naming the problem, a non-zero exit.
bad() {  # name, expected text, ranks (0: no launcher), args...
  local name=$1 want=$2 n=$3; shift 3
  local rc
  if [ "$n" = 0 ]; then
    "$CHORUS" "$@" > "$tmp/bad.out" 2> "$tmp/bad.err"; rc=$?
    check "$name: one line" "[ \$(wc -l < '$tmp/bad.err') -le 1 ]"
  else
    timeout 120 "$CHORUS" launch --nproc-per-node "$n" --master-port "$(free_port)" --grace-period 2 -- "$CHORUS" "$@" \
      > "$tmp/bad.out" 2> "$tmp/bad.err"; rc=$?
  fi
  check "$name: non-zero exit (got $rc)" "[ $rc != 0 ]"
  check "$name: says '$want'" "grep -q -- '$want' '$tmp/bad.err'"
}
bad "axes not multiplying to the world" "needs 4 processes, but the job has 2" 2 "${T[@]}" --mesh dp=2,tp=2
bad "a mesh without a launcher" "needs 2 processes, but the job has 1" 0 "${T[@]}" --mesh tp=2
bad "heads not dividing by tp" "2 attention heads do not divide over 4" 4 "${T[@]}" --mesh tp=4
bad "an unknown axis" "unknown axis .zz." 0 "${T[@]}" --mesh zz=2
bad "a size that is not a number" "needs a whole number" 0 "${T[@]}" --mesh tp=two
bad "--sequence-parallel without tp" "needs --mesh with tp > 1" 0 "${T[@]}" --sequence-parallel
bad "--tp-chunks without --mesh" "needs --mesh with tp > 1 and --sequence-parallel" 0 "${T[@]}" --tp-chunks 2
bad "--tp-chunks without --sequence-parallel" "it needs --sequence-parallel" 2 "${T[@]}" --mesh tp=2 --tp-chunks 2
bad "--tp-chunks 0" "--tp-chunks must be at least 1" 2 "${T[@]}" --mesh tp=2 --sequence-parallel --tp-chunks 0
bad "--mesh with --strategy dp" "cannot go with it" 0 "${T[@]}" --mesh tp=2 --strategy dp
bad "--recompute with --mesh" "not offered with --mesh" 0 "${T[@]}" --mesh tp=2 --recompute always
bad "bench --mesh for an image model" "offered for GPT models" 0 bench --model cnn --mesh tp=2 --steps 1
# A tensor group across "nodes" (two launchers of 2 processes on this machine):
# refused, unless --allow-tp-across-nodes.
two_nodes() {  # ARGS...: both nodes' launchers; their output in $tmp/node0, $tmp/node1
  local port; port=$(free_port)
  for node in 0 1; do
    CHORUS_RUN_ID="tp-span-$$" CHORUS_JOB_SECRET="tp-span-secret-$$" timeout 120 "$CHORUS" launch --nnodes 2 --node-rank $node --nproc-per-node 2 \
      --master-addr 127.0.0.1 --master-port "$port" --grace-period 2 -- "$CHORUS" "$@" > "$tmp/node$node" 2>&1 &
  done
  wait
}
D4=(train --model d4 --data "text:$tmp/t.txt" --seq-len 32 --batch-size 2 --steps 2 --quiet --mesh tp=4)
two_nodes "${D4[@]}"
# Every rank refuses; which node's launcher shows it first depends on which stops its ranks
# first (the other reports the job stopped), so either node's output may carry the line.
check "tp=4 over two nodes of 2 is refused" "cat '$tmp/node0' '$tmp/node1' | grep -q 'tp=4 would span nodes of 2 processes'"
two_nodes "${D4[@]}" --allow-tp-across-nodes --json
check "... and runs with --allow-tp-across-nodes" "grep -q '\"mesh\":\"dp=1,pp=1,tp=4\"' '$tmp/node0'"
[ $fail -eq 0 ] && echo "ok: chorus train --mesh"
exit $fail
