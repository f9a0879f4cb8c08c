#!/usr/bin/env bash
# The memory plan (apps/memory_check.h) on the CPU, with --memory-plan:
#   - chorus train --model d2 prints the table before step 1 and the measured
#     peak beside the plan after it; --quiet prints neither
#   - gpt2 against an impossibly small --memory-limit-gib stops before the
#     model is built, in one line naming what it needs and a layout that would
#     fit, with a non-zero exit; --ignore-memory-plan runs anyway
#   - chorus bench --model d2 prints the plan and the measured line
#   - an image model prints the static part, its activations measured on the
#     first step
#   - --recompute auto picks the fewest recomputed blocks with which the plan
#     fits: one block fewer is refused against the same limit, and the run
#     with its choice trains; --recompute N and its bad spellings
set -uo pipefail
CHORUS=${1:?usage: memory_plan.sh path/to/chorus}
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -c "
import random; random.seed(1); w='in the beginning god created heaven and earth light was good'.split()
print('\n'.join(' '.join(random.choice(w) for _ in range(12)) for _ in range(2000)))" > "$tmp/text.txt"
T=(train --data "text:$tmp/text.txt" --seq-len 32 --batch-size 2 --steps 2 --log-every 1 --devices cpu)

# 1. The table before step 1, the measured line after it.
"$CHORUS" "${T[@]}" --model d2 --memory-plan > "$tmp/out" 2> "$tmp/err"; rc=$?
check "d2 --memory-plan trains" "[ $rc -eq 0 ]"
check "the table's rows" "grep -q '^memory plan per GPU (--strategy single):' $tmp/err && grep -q '^  weights  *[0-9.]* GiB' $tmp/err && grep -q '^  activations  *[0-9.]* GiB' $tmp/err && grep -q '^  with reserve  *[0-9.]* GiB' $tmp/err"
check "the table comes before step 1" "[ \$(grep -n '^memory plan' $tmp/err | cut -d: -f1) -lt \$(grep -n '^step 1/' $tmp/err | cut -d: -f1) ]"
check "the measured line" "grep -Eq '^memory: peak [0-9.]+ GiB measured, plan [0-9.]+ GiB \([0-9]+%\)$' $tmp/err"
"$CHORUS" "${T[@]}" --model d2 --memory-plan --quiet > /dev/null 2> "$tmp/err"
check "--quiet prints no plan" "! grep -q 'memory' $tmp/err"

# 2. A refusal before anything is built: one line, a suggestion, exit 1.
"$CHORUS" "${T[@]}" --model gpt2 --memory-plan --memory-limit-gib 0.5 > /dev/null 2> "$tmp/err"; rc=$?
check "gpt2 in 0.5 GiB refused" "[ $rc -eq 1 ]"
check "the table is printed before the refusal" "grep -q '^  free  *0.50 GiB' $tmp/err"
check "one clear line" "grep -Eq '^chorus: error: gpt2 with --strategy single needs [0-9.]+ GiB per GPU \(weights [0-9.]+, gradients [0-9.]+, optimizer [0-9.]+, activations [0-9.]+, reserve [0-9.]+\), cpu:0 \(--memory-limit-gib\) has 0.50 GiB free; ' $tmp/err"
check "no model was built" "! grep -q 'parameters, ' $tmp/err"
# The target: d84 (9.7B parameters) under DDP over 8 GPUs of 79 GiB
# stops at once -- before the rendezvous, which the launch variables below
# could never complete -- and names the ZeRO stage that fits.
ddp_env=(env RANK=0 WORLD_SIZE=8 LOCAL_RANK=0 LOCAL_WORLD_SIZE=8 MASTER_ADDR=127.0.0.1 MASTER_PORT=9)
timeout 60 "${ddp_env[@]}" "$CHORUS" "${T[@]}" --model d84 --strategy ddp --memory-limit-gib 79 --quiet \
  > /dev/null 2> "$tmp/err"; rc=$?
check "d84 with ddp over 8 ranks refused at once, --quiet too" "[ $rc -eq 1 ] && grep -q '^chorus: error: d84 with --strategy ddp needs' $tmp/err"
check "it names a ZeRO stage that fits" "grep -Eq 'with --strategy zero --zero-stage [23] it would need [0-9.]+ GiB' $tmp/err"
check "--quiet prints no table" "! grep -q '^memory plan' $tmp/err"
"$CHORUS" "${T[@]}" --model d2 --memory-limit-gib 0.001 --ignore-memory-plan --quiet --json > "$tmp/out" 2> "$tmp/err"; rc=$?
check "--ignore-memory-plan runs anyway" "[ $rc -eq 0 ] && grep -q '\"train_loss\"' $tmp/out"
"$CHORUS" "${T[@]}" --model d2 --memory-limit-gib -1 > /dev/null 2> "$tmp/err"; rc=$?
check "a negative limit is bad input" "[ $rc -ne 0 ] && grep -q 'memory-limit-gib' $tmp/err"

# 3. chorus bench.
"$CHORUS" bench --model d2 --devices cpu --batch-size 2 --seq-len 32 --steps 1 --warmup 1 --memory-plan > /dev/null 2> "$tmp/err"; rc=$?
check "bench --memory-plan" "[ $rc -eq 0 ] && grep -q '^memory plan per GPU' $tmp/err && grep -q '^memory: peak .* measured, plan ' $tmp/err"

# 4. An image model: the static part, then its activations measured.
"$CHORUS" train --model mlp --data synthetic --synthetic-size 256 --batch-size 32 --steps 2 --devices cpu --memory-plan \
  > /dev/null 2> "$tmp/err"; rc=$?
check "mlp --memory-plan trains" "[ $rc -eq 0 ]"
check "activations measured on the first step" "grep -q '^  activations     measured on the first step' $tmp/err && grep -Eq '^memory: peak [0-9.]+ GiB measured, [0-9.]+ GiB before the activations; activations and workspaces [0-9.]+ GiB' $tmp/err"
# 5. --recompute auto (Note [Recomputing some blocks] in models/gpt.cpp): a
# limit halfway between the plans with no block and with every block
# recomputed; auto's choice k is checked by the plan's own refusal of k - 1.
R=(train --data "text:$tmp/text.txt" --seq-len 128 --batch-size 8 --steps 1 --log-every 1 --devices cpu --model d6 --memory-plan)
# The plan's total, read from its table: planned against 0.001 GiB, the run is
# refused after the table, before the model is built (a d6 step trained for
# nothing here took 13 s of the test's time, each).
planned() { "$CHORUS" "${R[@]}" --memory-limit-gib 0.001 --recompute "$1" 2>&1 >/dev/null | awk '/^  with reserve/ {print $3}'; }
none=$(planned never) every=$(planned always) three=$(planned 3)
check "the plan falls as blocks recompute ($none > $three > $every GiB)" \
  "python3 -c 'import sys; a, b, c = map(float, sys.argv[1:]); sys.exit(0 if a > b > c > 0 else 1)' $none $three $every"
limit=$(python3 -c "import sys; print(round((float(sys.argv[1]) + float(sys.argv[2])) / 2, 3))" "$none" "$every")
"$CHORUS" "${R[@]}" --memory-limit-gib "$limit" --recompute auto --json > "$tmp/out" 2> "$tmp/err"; rc=$?
k=$(sed -n 's/^--recompute auto: \([0-9]*\) of 6 blocks recompute.*/\1/p' "$tmp/err")
check "auto at $limit GiB trains, recomputing $k of 6 blocks, some but not all" \
  "[ $rc -eq 0 ] && [ -n '$k' ] && [ '$k' -gt 0 ] && [ '$k' -lt 6 ] && grep -q '\"train_loss\"' $tmp/out"
"$CHORUS" "${R[@]}" --memory-limit-gib "$limit" --recompute $((k - 1)) > /dev/null 2> "$tmp/err"; rc=$?
check "one block fewer ($((k - 1))) is refused by the plan" "[ $rc -eq 1 ] && grep -q '^chorus: error: d6 with --strategy single needs' $tmp/err"
"$CHORUS" "${R[@]}" --recompute auto > /dev/null 2> "$tmp/err"; rc=$?
check "auto on a CPU without a limit: none, and says why" "[ $rc -eq 0 ] && grep -q 'free memory is unknown' $tmp/err"
"$CHORUS" "${R[@]}" --recompute 7 > /dev/null 2> "$tmp/err"; rc=$?
check "--recompute 7 of 6 blocks is bad input" "[ $rc -eq 1 ] && grep -q '^chorus: error: --recompute 7: d6 has 6 blocks' $tmp/err"
"$CHORUS" "${R[@]}" --recompute some > /dev/null 2> "$tmp/err"; rc=$?
check "--recompute some is bad input" "[ $rc -eq 1 ] && [ \$(wc -l < $tmp/err) -eq 1 ] && grep -q 'never, always, auto' $tmp/err"

[ $fail -eq 0 ] || { echo "--- last stderr:"; cat "$tmp/err"; }
exit $fail
