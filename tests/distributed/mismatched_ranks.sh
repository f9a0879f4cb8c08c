#!/usr/bin/env bash
# Issue 47, items 7 and 8: ranks of one job given different things.
#  - bench-comm with another --sizes-mb on rank 1: collectives of different
#    sizes (which ended a rank with SIGABRT on Gloo's own thread) are one
#    DistError on every rank naming the collective, its number and what each
#    rank brought (Note [Collective signatures] in distributed/gloo_group.cpp).
#  - chorus train --strategy ddp with one option changed on rank 1 only (it
#    trained on silently, replicas drifting): refused at the start, naming
#    the rank and the option (Note [Options every rank shares]).
set -uo pipefail
CHORUS=${1:?chorus}
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
source "$(dirname "$0")/../testing/free_port.sh"  # free_port: a master port no other job can take
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# launch2 "ARGS OF EVERY RANK" ARGS OF RANK 1...: 2 ranks, rank 1 given more.
launch2() {
  local common=$1; shift
  timeout 300 "$CHORUS" launch --nproc-per-node 2 --master-port "$(free_port)" --grace-period 5 -- \
    bash -c 'c=$1; common=$2; shift 2; if [ "$RANK" = 1 ]; then exec "$c" $common "$@"; else exec "$c" $common; fi' \
    _ "$CHORUS" "$common" "$@"
}

# 7. bench-comm, 1 MiB on rank 0 and 2 MiB on rank 1.
launch2 "bench-comm --iters 2 --warmup 1 --dist-timeout 60" --sizes-mb 2 > "$tmp/out" 2> "$tmp/err"; rc=$?
line=$(grep -m1 'brought different collectives' "$tmp/err")
check "different --sizes-mb: exit $rc, no SIGABRT: $line" \
  "[ $rc = 1 ] && ! grep -q 'signal 6' '$tmp/err' && [ \$(grep -c 'rank 0: all_reduce of 262144 x float32 (sum); rank 1: all_reduce of 524288 x float32 (sum)' '$tmp/err') -ge 2 ] && grep -q 'gloo all_reduce #[0-9]* on rank 1: the ranks brought different collectives' '$tmp/err'"
[ $rc = 1 ] || cat "$tmp/err"

# 8. chorus train: one option changed on rank 1.
T="train --strategy ddp --model mlp --data synthetic --synthetic-size 256 --workers 0 --batch-size 16 --steps 4 --quiet"
expect_refused() {  # expect_refused "message" ARGS OF RANK 1...
  local want=$1; shift
  launch2 "$T" "$@" > "$tmp/out" 2> "$tmp/err"; local rc=$?
  local got; got=$(grep -m1 'must train with the same options' "$tmp/err")
  check "rank 1 given $*: exit $rc: $got" \
    "[ $rc = 1 ] && [ \$(grep -cF -- '$want' '$tmp/err') -ge 1 ] && ! grep -q 'signal 6' '$tmp/err'"
}
expect_refused "rank 1 was given --lr 0.1 but rank 0 0.05" --lr 0.1
expect_refused "rank 1 was given --optimizer \"adamw\" but rank 0 \"sgd\"" --optimizer adamw --lr 0.05
expect_refused "rank 1 was given --momentum 0.5 but rank 0 0.9" --momentum 0.5
expect_refused "rank 1 was given --weight-decay 0.01 but rank 0" --weight-decay 0.01
expect_refused "rank 1 was given --seed 7 but rank 0" --seed 7
expect_refused "rank 1 was given --label-smoothing 0.1 but rank 0 0.0" --label-smoothing 0.1
expect_refused "rank 1 was given --log-every 2 but rank 0 20" --log-every 2
# (an option that the common part gives cannot be given twice: these two leave rank 0 its default)
T="train --strategy ddp --model mlp --data synthetic --workers 0 --steps 4 --quiet"
expect_refused "rank 1 was given --synthetic-size 512 but rank 0 10000" --synthetic-size 512
expect_refused "rank 1 was given --batch-size 16 but rank 0 64" --batch-size 16
T="train --strategy ddp --model mlp --data synthetic --synthetic-size 256 --workers 0 --batch-size 16 --steps 4 --quiet"
# The same options on both ranks still train.
launch2 "$T" > "$tmp/out" 2> "$tmp/err"; rc=$?
check "the same options on every rank train (exit $rc)" "[ $rc = 0 ]"
[ $rc = 0 ] || cat "$tmp/err"
exit $fail
