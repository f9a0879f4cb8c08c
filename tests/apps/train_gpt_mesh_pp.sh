#!/usr/bin/env bash
# chorus train|bench --model dN --mesh ...,pp=N (pipeline stages over the
# mesh, Note [GPT pipelines over the mesh] in apps/gpt_mesh.h) as a user runs
# it, on CPU processes over Gloo:
#   - --mesh pp=2 (1F1B), pp=2,tp=2 (GPipe, sequence parallel) and dp=2,pp=2
#     equal one process with the same global batch (train and validation
#     loss, float32), and so does pp=2 with --grad-accum; so do pp=2 and
#     pp=2,tp=2 with --schedule interleaved (two stages per rank)
#   - a checkpoint written at pp=2 resumes in one process and at tp=2 to the
#     uninterrupted run's losses; a one-process checkpoint resumes at pp=2;
#     one written by an interleaved pp=2 run resumes in one process
#   - SIGINT stops a pp=2 run with a checkpoint and exit 130
#   - chorus bench --mesh pp=2 prints its row with the bubble and the bound,
#     1f1b and interleaved (ideal (p-1)/(v m + p-1))
#   - bad input: one clear line and a non-zero exit each
set -uo pipefail
CHORUS=${1:?usage: train_gpt_mesh_pp.sh path/to/chorus}
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
source "$(dirname "$0")/../testing/free_port.sh"
source "$(dirname "$0")/../testing/gpt_mesh_job.sh"
text_corpus 2 "$tmp/t.txt"
T=(train --model d2 --data "text:$tmp/t.txt" --seq-len 32 --steps 8 --log-every 4 --seed 5 --json --quiet)

# 1. Pipeline stages (x tensor x data parallel) equal one process.
one=$("$CHORUS" "${T[@]}" --batch-size 8) || { echo "FAIL: single run"; exit 1; }
pp2=$(launch 2 "${T[@]}" --batch-size 8 --mesh pp=2)
pptp=$(launch 4 "${T[@]}" --batch-size 8 --mesh tp=2,pp=2 --sequence-parallel --schedule gpipe --micro-batches 2)
dppp=$(launch 4 "${T[@]}" --batch-size 4 --mesh dp=2,pp=2 --micro-batches 2)
echo "single:              $one"; echo "pp=2:                $pp2"
echo "pp=2,tp=2 (sp):      $pptp"; echo "dp=2,pp=2:           $dppp"
for k in train_loss val_loss; do
  check "pp=2 (1f1b) equals one process ($k)" "close $(loss "$pp2" $k) $(loss "$one" $k)"
  check "pp=2 x tp=2 (gpipe, sequence parallel) equals one process ($k)" "close $(loss "$pptp" $k) $(loss "$one" $k)"
  check "dp=2 x pp=2 equals one process ($k)" "close $(loss "$dppp" $k) $(loss "$one" $k)"
done
check "the summary names the mesh and the schedule" "[ \"$(loss "$pptp" mesh) $(loss "$pptp" schedule)\" = 'dp=1,pp=2,tp=2 gpipe' ]"
# The interleaved schedule: stage s on rank s % 2, the activations in a ring (Note [Pipeline links]).
cki="$tmp/cki"
ppi=$(launch 2 "${T[@]}" --batch-size 8 --mesh pp=2 --schedule interleaved --checkpoint-dir "$cki" --checkpoint-every 4)
pptpi=$(launch 4 "${T[@]}" --batch-size 8 --mesh pp=2,tp=2 --sequence-parallel --schedule interleaved --virtual-stages 2 \
        --balance 1,1,1,1 --micro-batches 2)
echo "pp=2 interleaved:    $ppi"; echo "pp=2,tp=2 interl.:   $pptpi"
for k in train_loss val_loss; do
  check "pp=2 interleaved (2 stages a rank) equals one process ($k)" "close $(loss "$ppi" $k) $(loss "$one" $k)"
  check "pp=2 x tp=2 interleaved (sequence parallel) equals one process ($k)" "close $(loss "$pptpi" $k) $(loss "$one" $k)"
done
check "the summary names the schedule and its virtual stages" "[ \"$(loss "$ppi" schedule) $(loss "$ppi" virtual_stages)\" = 'interleaved 2' ]"
rm -rf "$cki/ckpt-00000008"
resi=$("$CHORUS" "${T[@]}" --batch-size 8 --checkpoint-dir "$cki" --resume 2>"$tmp/resi.err") || { echo "FAIL: resume"; cat "$tmp/resi.err"; fail=1; }
check "one process resumes an interleaved pp=2 run's checkpoint to the same losses" \
  "grep -q 'resumed from .*ckpt-00000004 at step 4' '$tmp/resi.err' && close $(loss "$resi" train_loss) $(loss "$one" train_loss)"
acc1=$("$CHORUS" "${T[@]}" --batch-size 4 --grad-accum 2 --clip 0.5)
acc2=$(launch 2 "${T[@]}" --batch-size 4 --grad-accum 2 --clip 0.5 --mesh pp=2 --micro-batches 2)
check "pp=2 with --grad-accum 2 and --clip 0.5 equals one process" "close $(loss "$acc2" train_loss) $(loss "$acc1" train_loss)"

# 2. Checkpoints across layouts: pp=2 -> one process and tp=2; one process -> pp=2.
ck="$tmp/ck"
full=$(launch 2 "${T[@]}" --batch-size 8 --mesh pp=2 --checkpoint-dir "$ck" --checkpoint-every 4)
check "the pp=2 run with checkpoints equals one process" "close $(loss "$full" train_loss) $(loss "$one" train_loss)"
rm -rf "$ck/ckpt-00000008"
cp -r "$ck" "$tmp/ck_tp"
res=$("$CHORUS" "${T[@]}" --batch-size 8 --checkpoint-dir "$ck" --resume 2>"$tmp/res.err") || { echo "FAIL: resume"; cat "$tmp/res.err"; fail=1; }
check "one process resumes pp=2's checkpoint at step 4" "grep -q 'resumed from .*ckpt-00000004 at step 4' '$tmp/res.err'"
check "... and ends where the uninterrupted run did" "close $(loss "$res" train_loss) $(loss "$one" train_loss)"
res_tp=$(launch 2 "${T[@]}" --batch-size 8 --mesh tp=2 --checkpoint-dir "$tmp/ck_tp" --resume)
check "tp=2 resumes pp=2's checkpoint to the same losses" "grep -q 'resumed from .*ckpt-00000004 at step 4' '$tmp/launch.err' && close $(loss "$res_tp" train_loss) $(loss "$one" train_loss)"
ck1="$tmp/ck1"
"$CHORUS" "${T[@]}" --batch-size 8 --checkpoint-dir "$ck1" --checkpoint-every 4 > /dev/null || { echo "FAIL: run with checkpoints"; fail=1; }
rm -rf "$ck1/ckpt-00000008"
res2=$(launch 2 "${T[@]}" --batch-size 8 --mesh pp=2 --checkpoint-dir "$ck1" --resume)
check "pp=2 resumes a one-process checkpoint to the same losses" "grep -q 'resumed from .*ckpt-00000004 at step 4' '$tmp/launch.err' && close $(loss "$res2" train_loss) $(loss "$one" train_loss)"

# 2a. SIGINT stops every stage after the same step with a checkpoint (exit 130).
ck2="$tmp/ck2"
timeout 120 "$CHORUS" launch --nproc-per-node 2 --master-port "$(free_port)" --grace-period 5 -- "$CHORUS" train --model d2 \
  --data "text:$tmp/t.txt" --seq-len 32 --steps 100000 --log-every 1 --mesh pp=2 --checkpoint-dir "$ck2" \
  > /dev/null 2> "$tmp/sig.err" & lp=$!
for _ in $(seq 100); do grep -qs "step 3/" "$tmp/sig.err" && break; sleep 0.2; done
kill -INT $lp; wait $lp; rc=$?
check "SIGINT stops a --mesh pp=2 run with exit 130 (got $rc)" "[ $rc = 130 ]"
check "... after writing a checkpoint" "grep -q 'checkpoint written: .*ckpt-' '$tmp/sig.err' && [ -f '$ck2/latest' ]"

# 2b. chorus bench --mesh pp=2: the row, its bubble beside the ideal, the bound.
row=$(launch 2 bench --model d2 --seq-len 32 --batch-size 4 --micro-batches 2 --schedules 1f1b --steps 2 --warmup 1 --json --mesh pp=2)
check "bench --mesh pp=2 reports tokens/s, the bubble (ideal 1/3) and the bound" "python3 -c \"
import json,sys; r=json.loads(sys.argv[1])
ok = r['tok_per_s']>0 and r['mesh']=='dp=1,pp=2,tp=1' and r['schedule']=='1f1b' and 0<=r['bubble']<1
ok = ok and abs(r['bubble_ideal']-1/3)<1e-9 and r['bound_tok_per_s']>0 and len(r['stage_busy_ms'])==2
sys.exit(0 if ok else 1)\" '$row'"
row=$(launch 2 bench --model d2 --seq-len 32 --batch-size 4 --micro-batches 2 --schedules interleaved --virtual-stages 2 \
      --steps 2 --warmup 1 --json --mesh pp=2)
check "bench --mesh pp=2 --schedules interleaved: the bubble beside the ideal 1/5 ((p-1)/(v m + p-1))" "python3 -c \"
import json,sys; r=json.loads(sys.argv[1])
ok = r['tok_per_s']>0 and r['schedule']=='interleaved' and r['virtual_stages']==2 and 0<=r['bubble']<1
ok = ok and abs(r['bubble_ideal']-1/5)<1e-9 and r['bound_tok_per_s']>0 and len(r['stage_busy_ms'])==2
sys.exit(0 if ok else 1)\" '$row'"
timeout 120 "$CHORUS" launch --nproc-per-node 2 --master-port "$(free_port)" --grace-period 2 -- "$CHORUS" bench --model d2 \
  --seq-len 32 --batch-size 4 --micro-batches 2 --schedules naive,gpipe --steps 1 --warmup 1 --mesh pp=2 > "$tmp/bench.txt" 2>&1
check "bench --mesh pp=2 prints a row and a bubble line per schedule" "[ \$(grep -c 'bubble .*(ideal .*bound' '$tmp/bench.txt') = 2 ]"

# 3. Bad input: one line naming the problem, a non-zero exit.
bad() {  # name, expected text, args...
  local name=$1 want=$2; shift 2
  "$CHORUS" "$@" > "$tmp/bad.out" 2> "$tmp/bad.err"; local rc=$?
  check "$name: one line" "[ \$(wc -l < '$tmp/bad.err') -le 1 ]"
  check "$name: non-zero exit (got $rc)" "[ $rc != 0 ]"
  check "$name: says '$want'" "grep -q -- '$want' '$tmp/bad.err'"
}
bad "fewer micro-batches than stages" "micro-batches 2 is fewer than the 4 pipeline stages" "${T[@]}" --mesh pp=4 --micro-batches 2
bad "a batch not dividing into the micro-batches" "batch-size 6 does not divide into 4 micro-batches" "${T[@]}" --batch-size 6 --mesh pp=2
bad "more virtual stages than layers" "makes 6 pipeline stages, but 2 blocks make only 4" "${T[@]}" --mesh pp=2 --schedule interleaved --virtual-stages 3
bad "virtual stages without interleaved" "virtual-stages goes with --schedule interleaved" "${T[@]}" --mesh pp=2 --virtual-stages 2
bad "an interleaved balance of the wrong shape" "with --virtual-stages 2 needs 4 counts" "${T[@]}" --mesh pp=2 --schedule interleaved --balance 2,2
bad "bench: virtual stages without interleaved" "virtual-stages goes with the interleaved schedule" bench --model d2 --mesh pp=2 --schedules 1f1b --virtual-stages 2 --steps 1
bad "more stages than layers" "4 pipeline layers (embeddings, blocks, head), fewer than the stages" "${T[@]}" --mesh pp=8
bad "a balance of the wrong shape" "needs 2 counts adding up to 4" "${T[@]}" --mesh pp=2 --balance 1,2
bad "pipeline options without pp" "micro-batches goes with pipeline stages" "${T[@]}" --mesh tp=2 --micro-batches 4
bad "pp with --strategy dp" "cannot go with it" "${T[@]}" --mesh pp=2 --strategy dp
bad "bench: fewer micro-batches than stages" "micro-batches 1 is fewer than the 2 pipeline stages" bench --model d2 --mesh pp=2 --micro-batches 1 --schedules 1f1b --steps 1
[ $fail -eq 0 ] && echo "ok: chorus train --mesh with pipeline stages"
exit $fail
