#!/usr/bin/env bash
# A run resumed on another number of ranks continues the run it resumes
# (Note [Progress in samples], apps/run_position.h), real processes over Gloo:
# a 2-rank DDP run of --steps 24 writes a checkpoint every 8 steps; its step-8
# checkpoint, resumed on 1 rank with the same --steps (half the global batch),
#   - takes every step's learning rate at the same examples consumed as the
#     uninterrupted run (the same schedule, read at the position; between two
#     of its steps, linearly), where progress counted in steps jumped from
#     step 8 to step 16 of 24;
#   - ends at the same budget (24 steps of the first global batch: 768
#     examples, 48 steps of 16) and with the same last checkpoint name;
#   - names its checkpoints by that position, so pruning keeps the newest
#     three by position (ckpt-16, -20, -24), not by the writer's own steps;
#   - continues the loss curve (its first loss is near the uninterrupted run's
#     at that point, far from a fresh start's) and trains as well by the end.
# The same for a GPT, counted in tokens (d2 on a generated text, --steps 8).
set -uo pipefail
CHORUS=${1:?chorus}
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
source "$(dirname "$0")/../testing/free_port.sh"  # free_port: a master port no other job can take
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
run_check() { local what=$1; shift; if "$@"; then echo "ok: $what"; else echo "FAIL: $what"; fail=1; fi; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
launch() { local n=$1; shift; timeout 300 "$CHORUS" launch --nproc-per-node "$n" --master-port "$(free_port)" --grace-period 2 -- "$@"; }

# --- chorus train, examples ----------------------------------------------------
T=(train --strategy ddp --model mlp --data synthetic --synthetic-size 2048 --batch-size 16 --workers 0 --seed 3
   --log-every 1 --steps 24 --checkpoint-every 8 --json)
launch 2 "$CHORUS" "${T[@]}" --metrics "$tmp/full.jsonl" --checkpoint-dir "$tmp/full" > "$tmp/full.out" 2> "$tmp/full.err"; rc=$?
check "2 ranks train 24 steps (exit $rc)" "[ $rc = 0 ] && [ -f '$tmp/full/ckpt-00000008/state.json' ]"
mkdir -p "$tmp/one" && cp -r "$tmp/full/ckpt-00000008" "$tmp/one/"
launch 1 "$CHORUS" "${T[@]}" --metrics "$tmp/one.jsonl" --checkpoint-dir "$tmp/one" --resume > "$tmp/one.out" 2> "$tmp/one.err"; rc=$?
check "1 rank resumes the 2-rank checkpoint (exit $rc): $(grep -m1 resuming "$tmp/one.err")" \
  "[ $rc = 0 ] && grep -q 'resuming from .*ckpt-00000008 (epoch 1, step 16, 256 examples seen)' '$tmp/one.err'"
run_check "the same learning rate at the same examples consumed, the budget and the loss curve" \
  python3 - "$tmp" samples 16 2 <<'PY'
import json, math, sys
d, key, batch, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def steps(name, per_step):  # {examples consumed when the step began: record}
    return {r[key] - per_step: r for r in map(json.loads, open(f"{d}/{name}.jsonl")) if key in r and "lr" in r}
full, one = steps("full", batch * world), steps("one", batch)
start = min(one)
shared = [p for p in one if p in full]
assert len(shared) == len(one) // 2, (len(shared), len(one))
for p in shared:  # on the first run's step boundaries: its schedule exactly
    assert math.isclose(one[p]["lr"], full[p]["lr"], rel_tol=1e-12), (p, one[p]["lr"], full[p]["lr"])
for p in one:  # between two of them: between their rates
    if p not in full:  # (past the first run's last step: the cosine falls on)
        after = full[p + batch]["lr"] if p + batch in full else 0.0
        lo, hi = sorted((full[p - batch]["lr"], after))
        assert lo <= one[p]["lr"] <= hi, (p, one[p]["lr"], lo, hi)
end_full, end_one = max(r[key] for r in full.values()), max(r[key] for r in one.values())
assert end_one == end_full, ("budget", end_one, end_full)
fresh = max(r["loss"] for r in full.values())  # the untrained model's loss, about
first = one[start]["loss"]
assert abs(first - full[start]["loss"]) < 0.5 * (fresh - full[start]["loss"]), ("loss curve", first, full[start]["loss"], fresh)
print(f"  {len(one)} steps from {start} to {end_one} {key}; lr at {len(shared)} shared positions equal; "
      f"first loss {first:.3f} (uninterrupted {full[start]['loss']:.3f}, untrained {fresh:.3f})")
PY
acc() { python3 -c 'import json,re,sys; print(json.loads(re.sub(r"^\[rank \d+\] ", "", sys.stdin.read().splitlines()[-1]))["test_loss"])' < "$1"; }
check "it trains as well: test loss $(acc "$tmp/one.out") against $(acc "$tmp/full.out") uninterrupted" \
  "python3 -c 'import sys; sys.exit(0 if float(\"$(acc "$tmp/one.out")\") < 2 * float(\"$(acc "$tmp/full.out")\") + 0.05 else 1)'"
check "checkpoints named by position, pruned by it: $(ls "$tmp/one" | tr '\n' ' ')" \
  "[ \"\$(ls '$tmp/one' | grep '^ckpt-' | tr '\n' ' ')\" = 'ckpt-00000016 ckpt-00000020 ckpt-00000024 ' ] && [ \"\$(cat '$tmp/one/latest')\" = ckpt-00000024 ]"
check "the last checkpoint holds the examples consumed and the reference step" \
  "python3 -c 'import json,sys; e=json.load(open(sys.argv[1]))[\"extra\"]; sys.exit(0 if (e[\"samples\"], e[\"step_samples\"], e[\"global_batch\"]) == (768, 32, 16) else 1)' '$tmp/one/ckpt-00000024/state.json'"
# A run that already consumed its budget resumes to nothing, and a checkpoint
# whose step does not match its examples is refused, naming the file.
launch 1 "$CHORUS" "${T[@]}" --checkpoint-dir "$tmp/one" --resume > "$tmp/again.out" 2> "$tmp/again.err"; rc=$?
check "resuming the finished run trains no more (exit $rc)" \
  "[ $rc = 0 ] && grep -q 'step 48, 768 examples seen' '$tmp/again.err' && [ -z \"\$(ls '$tmp/one' | grep -v -e '^ckpt-0000001[6]\$' -e '^ckpt-0000002[04]\$' -e '^latest\$' -e '^lock\$')\" ]"
python3 -c 'import json,sys; p=sys.argv[1]; s=json.load(open(p)); s["extra"]["samples"]=100; json.dump(s, open(p,"w"))' "$tmp/one/ckpt-00000024/state.json"
out=$(launch 1 "$CHORUS" "${T[@]}" --checkpoint-dir "$tmp/one" --resume 2>&1); rc=$?
check "a step that does not match the examples consumed is refused (exit $rc)" \
  "[ $rc != 0 ] && grep -q 'ckpt-00000024/state.json: step 24 does not match the 100 examples consumed (32 to a step: step 3)' <<<\"\$out\""

# --- a GPT, tokens ---------------------------------------------------------------
python3 -c "
import random; random.seed(1); w='in the beginning god created heaven and earth light was good'.split()
print('\n'.join(' '.join(random.choice(w) for _ in range(12)) for _ in range(3000)))" > "$tmp/text.txt"
G=(train --model d2 --data "text:$tmp/text.txt" --seq-len 32 --batch-size 4 --steps 8 --log-every 1 --seed 3 --quiet --json
   --strategy ddp --devices cpu --checkpoint-every 4)
launch 2 "$CHORUS" "${G[@]}" --metrics "$tmp/gfull.jsonl" --checkpoint-dir "$tmp/gfull" > "$tmp/gfull.out" 2> "$tmp/gfull.err"; rc=$?
check "GPT: 2 ranks train 8 steps (exit $rc)" "[ $rc = 0 ] && [ -f '$tmp/gfull/ckpt-00000004/state.json' ]"
mkdir -p "$tmp/gone" && cp -r "$tmp/gfull/ckpt-00000004" "$tmp/gone/"
launch 1 "$CHORUS" "${G[@]}" --metrics "$tmp/gone.jsonl" --checkpoint-dir "$tmp/gone" --resume > "$tmp/gone.out" 2> "$tmp/gone.err"; rc=$?
check "GPT: 1 rank resumes the 2-rank checkpoint (exit $rc): $(grep -m1 resumed "$tmp/gone.err")" \
  "[ $rc = 0 ] && grep -q 'resumed from .*ckpt-00000004 at step 8' '$tmp/gone.err'"
run_check "GPT: the same learning rate at the same tokens consumed, and the budget" \
  python3 - "$tmp" tokens 128 2 <<'PY'
import json, math, sys
d, key, per_rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def steps(name, per_step):
    return {r[key] - per_step: r for r in map(json.loads, open(f"{d}/{name}.jsonl")) if key in r and "lr" in r}
full, one = steps("gfull", per_rank * world), steps("gone", per_rank)
shared = [p for p in one if p in full]
assert len(shared) == len(one) // 2 and shared, (len(shared), len(one))
for p in shared:
    assert math.isclose(one[p]["lr"], full[p]["lr"], rel_tol=1e-12), (p, one[p]["lr"], full[p]["lr"])
assert max(r[key] for r in one.values()) == max(r[key] for r in full.values()), "budget"
print(f"  {len(one)} steps; lr at {len(shared)} shared positions equal; both end at {max(r[key] for r in one.values())} {key}")
PY
check "GPT: checkpoints named by position: $(ls "$tmp/gone" | tr '\n' ' ')" \
  "[ -f '$tmp/gone/ckpt-00000008/state.json' ] && [ -f '$tmp/gone/ckpt-00000006/state.json' ] && [ ! -e '$tmp/gone/ckpt-00000012' ]"
exit $fail
