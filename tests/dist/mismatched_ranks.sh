#!/usr/bin/env bash
# Issue 47, item 7: ranks of one job given different things.
#  - bench-comm with another --sizes-mb on rank 1: collectives of different
#    sizes (which ended a rank with SIGABRT on Gloo's own thread) are one
#    DistError on every rank naming the collective, its number and what each
#    rank brought (Note [Collective signatures] in dist/gloo_group.cpp).
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

exit $fail
