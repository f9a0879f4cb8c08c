#!/usr/bin/env bash
# chorus train --strategy zero (sharded data parallelism) as a user runs it, on
# CPU processes over Gloo (d2 GPT, byte-level text, float32):
#   - stages 1, 2 and 3 on 2 ranks (batch 4 each), stage 3 keeping weights
#     from forward to backward, stage 1 gathering every weight before the
#     forward (--no-zero-prefetch), stage 3 with --recompute always, stage 2
#     with --grad-accum 2, and --hybrid
#     (2 nodes x 2 ranks: sharded in a node, replicated across) equal one
#     process with batch 8 (the same windows)
#   - checkpoints: written by zero-2 on 2 ranks in the background, resumed as
#     zero-3 on 4 ranks, as DDP on 2 ranks and as one process, each ending
#     where the uninterrupted run did; a DDP checkpoint resumed as zero-1;
#     chorus checkpoint consolidate writes Hugging Face's names
#   - chorus bench --strategy ddp,zero-1,zero-2,zero-3: a row each
#   - a rank killed mid-run is named; bad options get one clear line
set -uo pipefail
CHORUS=${1:?chorus}
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
source "$(dirname "$0")/../testing/free_port.sh"
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -c "
import random; random.seed(1); w='in the beginning god created heaven and earth and the light was good'.split()
print('\n'.join(' '.join(random.choice(w) for _ in range(12)) for _ in range(3000)))" > "$tmp/text.txt"
T=(train --model d2 --data "text:$tmp/text.txt" --seq-len 64 --steps 12 --log-every 4 --seed 3 --json)
loss() { python3 -c "import json,sys; print(json.loads(sys.argv[1])['$2'])" "$1"; }
close() { python3 -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); sys.exit(0 if abs(a-b) <= 2e-5*max(1,abs(b)) else 1)" "$1" "$2"; }
job() {  # N ARGS...: chorus train on N ranks; rank 0's JSON line
  local n=$1; shift
  timeout 300 "$CHORUS" launch --nproc-per-node "$n" --master-port "$(free_port)" --grace-period 2 -- \
    "$CHORUS" "${T[@]}" --devices cpu "$@" 2>"$tmp/job.err" | grep '^{\|^\[rank 0\] {' | sed 's/^\[rank 0\] //'
}
# The end lines of a run's stderr `$1`: the first save's and the later ones'
# stall by phase (Note [Stall by phase] in io/sharded_writer.h), each phase's
# time >= 0, adding up to their sum, which is no more than the stall the
# line before reports (to their rounding).
phases_add_up() {
  python3 - "$1" <<'PY'
import re, sys
err = open(sys.argv[1]).read()
per = re.search(r"checkpoints: ([0-9]+) saves?, stall per save ([0-9.]+) ms on the host", err)
split = re.search(r"the first ([0-9.]+) ms on the host, the later ones ([0-9.]+) ms", err)
p = re.search(r"checkpoints: the first save's stall by phase(?: \(the device (?:busy|idle) as it began\))?: "
              r"(.*?) ms \(sum ([0-9.]+) ms\)(?:; the later ones' \(mean of ([0-9]+)"
              r"(?:; the device busy as [0-9]+ of them began)?\): (.*) ms \(sum ([0-9.]+) ms\))?\n", err)
assert per and p, "no stall line or no phase line"
saves = int(per[1])
assert (split is not None) == (saves > 1) == (p[3] is not None), "the later saves' figures"
parts = [(p[1], p[2], split[1] if split else per[2])] + ([(p[4], p[5], split[2])] if split else [])
assert saves == 1 or int(p[3]) == saves - 1, (saves, p[3])
for phases, total, stall in parts:
    names = [x.rsplit(" ", 1)[0] for x in phases.split(", ")]
    ms = [float(x.rsplit(" ", 1)[1]) for x in phases.split(", ")]
    assert names[:4] == ["live state", "pieces", "replicated", "metadata"] and names[-1] == "start", names
    assert all(v >= 0 for v in ms) and abs(sum(ms) - float(total)) <= 0.005 * (len(ms) + 1), (ms, total)
    assert float(total) <= float(stall) + 0.055, (total, stall)
print(f"  {saves} saves: phases add up to {', '.join(t for _, t, _ in parts)} ms, stalls {', '.join(s for _, _, s in parts)} ms")
PY
}
same() {  # NAME JSON: train and val loss equal the one-process run's
  if [ -z "$2" ]; then echo "FAIL: $1: no result"; tail -5 "$tmp/job.err"; fail=1; return; fi
  for k in train_loss val_loss; do check "$1 equals one process ($k)" "close $(loss "$2" $k) $(loss "$one" $k)"; done
}

one=$("$CHORUS" "${T[@]}" --batch-size 8 2>"$tmp/one.err") || { echo "FAIL: single run"; exit 1; }
echo "single: $one"
for st in 1 2 3; do same "zero-$st, 2 x 4" "$(job 2 --strategy zero --zero-stage $st --batch-size 4)"; done
same "zero-3 --no-reshard-after-forward" "$(job 2 --strategy zero --zero-stage 3 --no-reshard-after-forward --batch-size 4)"
same "zero-2, 2 x 2 x --grad-accum 2" "$(job 2 --strategy zero --zero-stage 2 --batch-size 2 --grad-accum 2)"
same "zero-3 on 4 ranks, 4 x 2" "$(job 4 --strategy zero --zero-stage 3 --batch-size 2)"
# --recompute: each block's own small backward runs inside the step's (Note
# [Nested backward passes]); its end must not finish the step.
same "zero-3 --recompute always, 2 x 4" "$(job 2 --strategy zero --zero-stage 3 --recompute always --batch-size 4)"
same "zero-1 --recompute always, 2 x 4" "$(job 2 --strategy zero --zero-stage 1 --recompute always --batch-size 4)"
# Note [Gathers beside the forward]: stages 1-2 wait for each block's gathers at its forward (the runs above),
# or, --no-zero-prefetch, for every bucket's before the forward.
check "zero-1 says its gathers go beside the forward" "grep -q 'weights gathered beside the forward (2 units)' '$tmp/job.err'"
same "zero-1 --no-zero-prefetch, 2 x 4" "$(job 2 --strategy zero --zero-stage 1 --no-zero-prefetch --batch-size 4)"
check "--no-zero-prefetch says so" "grep -q 'every weight gathered before the forward (--no-zero-prefetch)' '$tmp/job.err'"
same "ddp --recompute always, 2 x 4" "$(job 2 --strategy ddp --recompute always --batch-size 4)"
# Some blocks recomputed, the others not (Note [Recomputing some blocks]):
# both kinds of unit in one zero-3 step.
same "zero-3 --recompute 1, 2 x 4" "$(job 2 --strategy zero --zero-stage 3 --recompute 1 --batch-size 4)"
# --hybrid: two "nodes" of two ranks on this machine.
port=$(free_port)
for node in 0 1; do
  CHORUS_JOB_SECRET=train-zero-hybrid-$$ timeout 300 "$CHORUS" launch --nnodes 2 --node-rank $node --nproc-per-node 2 --master-addr 127.0.0.1 --master-port $port -- \
    "$CHORUS" "${T[@]}" --devices cpu --strategy zero --zero-stage 2 --hybrid --batch-size 2 >"$tmp/hyb$node.out" 2>"$tmp/hyb$node.err" &
done
wait
same "zero-2 --hybrid, 2 nodes x 2 ranks x 2" "$(grep '^{\|^\[rank 0\] {' "$tmp/hyb0.out" | sed 's/^\[rank 0\] //')"
check "--hybrid says how it shards" "grep -q 'over 2 ranks (x 2 replicas: --hybrid)' '$tmp/hyb0.err'"

# Checkpoints at any layout.
ck="$tmp/ck"
full=$(job 2 --strategy zero --zero-stage 2 --batch-size 4 --checkpoint-dir "$ck" --checkpoint-every 4)
check "the sharded checkpoint holds one shard per rank and an index" \
  "[ -f '$ck/ckpt-00000004/shard-00000-of-00002.safetensors' ] && [ -f '$ck/ckpt-00000004/index.json' ]"
same "zero-2 with checkpoints" "$full"
keep="$tmp/keep"; cp -r "$ck" "$keep"
resume_as() {  # NAME N ARGS...: resume from ckpt-4 (later ones removed) and end where the full run did
  local name=$1 n=$2; shift 2
  rm -rf "$ck"; cp -r "$keep" "$ck"; rm -rf "$ck/ckpt-00000008" "$ck/ckpt-00000012"
  local out
  if [ "$n" = 1 ]; then out=$("$CHORUS" "${T[@]}" "$@" --checkpoint-dir "$ck" --resume 2>"$tmp/job.err")
  else out=$(job "$n" "$@" --checkpoint-dir "$ck" --resume); fi
  check "$name: resumed from step 4" "grep -q 'resumed from .*ckpt-00000004 at step 4' '$tmp/job.err'"
  [ -n "$out" ] && check "$name: ends where the uninterrupted run did" "close $(loss "$out" train_loss) $(loss "$full" train_loss)" \
    || { echo "FAIL: $name: no result"; tail -5 "$tmp/job.err"; fail=1; }
}
resume_as "zero-2 (2 ranks) -> zero-3 on 4 ranks" 4 --strategy zero --zero-stage 3 --batch-size 2
check "the stall of a background save is reported" "grep -q 'training stalled .* ms' '$tmp/job.err'"
check "the saves' stall is summed up against a step" \
  "grep -q 'checkpoints: [0-9]* saves*, stall per save .* ms on the host + .* ms of device copies (.*% of a step)' '$tmp/job.err'"
check "--json holds the stall per save" \
  "python3 -c \"import json,sys; v=json.loads(sys.argv[1])['checkpoint_stall_ms']; sys.exit(0 if v >= 0 else 1)\" '$full'"
# Note [Stall by phase] (io/sharded_writer.h): the line after it splits the
# first save's stall and the later ones' mean by phase; the phases add up to
# no more than the stall the line before reports (to its rounding).
check "the stall by phase: $(grep -m1 "stall by phase" "$tmp/job.err")" "phases_add_up '$tmp/job.err'"
check "--json holds the stall by phase, adding up to the first save's" \
  "python3 -c \"import json,sys; j=json.loads(sys.argv[1]); f=j['checkpoint_stall_phases_ms']['first']; sys.exit(0 if 'start' in f and 'later' in j['checkpoint_stall_phases_ms'] and abs(sum(f.values()) - j['checkpoint_first_stall_ms']) <= 1e-6 else 1)\" '$full'"
resume_as "zero-2 (2 ranks) -> DDP on 2 ranks" 2 --strategy ddp --batch-size 4
resume_as "zero-2 (2 ranks) -> one process" 1 --batch-size 8
# A DDP checkpoint resumed as zero-1.
rm -rf "$ck"
dfull=$(job 2 --strategy ddp --batch-size 4 --checkpoint-dir "$ck" --checkpoint-every 4)
rm -rf "$ck/ckpt-00000008" "$ck/ckpt-00000012"
out=$(job 2 --strategy zero --zero-stage 1 --batch-size 4 --checkpoint-dir "$ck" --resume)
[ -n "$out" ] && check "DDP checkpoint -> zero-1: ends where DDP did" "close $(loss "$out" train_loss) $(loss "$dfull" train_loss)" \
  || { echo "FAIL: DDP -> zero-1: no result"; tail -5 "$tmp/job.err"; fail=1; }
"$CHORUS" checkpoint consolidate "$keep" "$tmp/hf.safetensors" 2>"$tmp/cons.err" || { echo "FAIL: consolidate"; cat "$tmp/cons.err"; fail=1; }
check "consolidate writes Hugging Face's names" \
  "python3 -c \"import json,struct,sys; f=open('$tmp/hf.safetensors','rb'); n=struct.unpack('<Q',f.read(8))[0]; h=json.loads(f.read(n)); sys.exit(0 if 'transformer.h.0.attn.c_attn.weight' in h else 1)\""

# A rank killed mid-run is named.
marker="zero-dead-$$"
CHORUS_TEST_MARKER=$marker timeout 120 "$CHORUS" launch --nproc-per-node 2 --master-port "$(free_port)" -- \
  "$CHORUS" train --model d2 --data "text:$tmp/text.txt" --seq-len 64 --steps 100000 --log-every 1 --devices cpu \
  --strategy zero --zero-stage 3 --batch-size 4 --dist-timeout 5 \
  >/dev/null 2>"$tmp/dead.err" &
lpid=$!
victim=""
for _ in $(seq 100); do
  sleep 0.2
  for p in $(grep -l "CHORUS_TEST_MARKER=$marker" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); do
    grep -qz '^RANK=1$' /proc/$p/environ 2>/dev/null && grep -q 'step' "$tmp/dead.err" && victim=$p
  done
  [ -n "$victim" ] && break
done
[ -n "$victim" ] && kill -9 "$victim"
wait $lpid; rc=$?
check "a killed rank stops the job (exit $rc)" "[ $rc -ne 0 ]"
check "the killed rank is named" "grep -q 'rank 1 .*killed by signal 9' '$tmp/dead.err'"

# chorus bench: DDP and the three stages side by side, one row each.
rows=$(timeout 300 "$CHORUS" launch --nproc-per-node 2 --master-port "$(free_port)" -- "$CHORUS" bench --model d2 \
  --strategy ddp,zero-1,zero-2,zero-3 --devices cpu --batch-size 2 --seq-len 32 --steps 2 --warmup 1 --json 2>"$tmp/bench.err" \
  | grep '^{\|^\[rank 0\] {' | sed 's/^\[rank 0\] //')
check "bench --strategy ddp,zero-1,zero-2,zero-3 prints four rows" \
  "[ \$(python3 -c \"import json,sys; print(','.join(json.loads(l)['strategy'] for l in sys.stdin if l.strip()))\" <<<'$rows') = ddp,zero-1,zero-2,zero-3 ]"

bad() {  # NAME EXPECTED ARGS...
  local name=$1 want=$2; shift 2
  local err; err=$("$CHORUS" "$@" 2>&1 >/dev/null); local rc=$?
  check "$name: exit $rc, one line naming it" "[ $rc -ne 0 ] && grep -q -- \"$want\" <<<\"\$err\" && [ \$(grep -c . <<<\"\$err\") -le 2 ]"
}
bad "stage 4" "--zero-stage must be 1, 2 or 3" "${T[@]}" --strategy zero --zero-stage 4
bad "zero without a launcher" "strategy zero runs one process per device" "${T[@]}" --strategy zero
bad "--zero-stage without zero" "goes with --strategy zero" "${T[@]}" --zero-stage 2
bad "--skip-nan under zero" "--skip-nan is not offered with --strategy zero" "${T[@]}" --strategy zero --skip-nan
bad "keeping weights below stage 3" "goes with --zero-stage 3" "${T[@]}" --strategy zero --zero-stage 2 --no-reshard-after-forward
bad "--no-zero-prefetch without zero" "--no-zero-prefetch goes with --strategy zero" "${T[@]}" --strategy ddp --no-zero-prefetch
[ $fail -eq 0 ] && echo "train_zero: all passed"
exit $fail
