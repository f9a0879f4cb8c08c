#!/usr/bin/env bash
# Never hang (Note [Collective timeouts]): a job of 3 ranks under chorus
# launch, all-reducing in a loop with a 2 s timeout; at step 3 one rank kills
# itself with SIGKILL (20 times) or stops itself with SIGSTOP (20 times).
# Every survivor must exit with DistError naming that rank within
# timeout + 10 s, the launcher must exit non-zero, and no process may be left.
# With CHORUS_TEST_QUICK=1 (the sanitizer stage) 6 times each, so that each
# signal still hits every rank twice; DEAD_RANK_REPS sets the count.
set -uo pipefail
CHORUS=${1:?chorus}; PROBE=${2:?chorus_dist_probe}
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
REPS=${DEAD_RANK_REPS:-20}
[ "${CHORUS_TEST_QUICK:-0}" = 1 ] && REPS=${DEAD_RANK_REPS:-6}
TIMEOUT_MS=2000
source "$(dirname "$0")/../testing/free_port.sh"  # free_port: a master port no other job can take
# The runs mostly wait (for the timeout, for the launcher): DEAD_RANK_JOBS of
# them (default 4) go at once, each its own job on its own port.
JOBS=${DEAD_RANK_JOBS:-4}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
one_run() {  # sig, i -> $tmp/$sig-$i.{out,rc,left}
  local sig=$1 i=$2 victim=$(($2 % 3))
  local marker="dead-rank-$$-$sig-$i"
  PROBE_TIMEOUT_MS=$TIMEOUT_MS CHORUS_TEST_MARKER=$marker timeout 60 \
    "$CHORUS" launch --nproc-per-node 3 --master-port "$(free_port)" -- "$PROBE" hang $victim $sig > "$tmp/$sig-$i.out" 2>&1
  echo $? > "$tmp/$sig-$i.rc"
  # Processes of this run only (the marker is in their environment); any
  # left are counted, then killed (never another test's processes).
  local left
  left=$(grep -l "CHORUS_TEST_MARKER=$marker" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3)
  echo "$left" | grep -c . > "$tmp/$sig-$i.left"
  [ -n "$left" ] && kill -9 $left 2>/dev/null
  return 0
}
for sig in KILL STOP; do
  for ((i = 0; i < REPS; i++)); do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
    one_run $sig $i &
  done
done
wait
fail=0; slowest=0; ok_runs=0
for sig in KILL STOP; do
  for ((i = 0; i < REPS; i++)); do
    victim=$((i % 3)); out=$(cat "$tmp/$sig-$i.out"); rc=$(cat "$tmp/$sig-$i.rc"); left=$(cat "$tmp/$sig-$i.left")
    survivors=$(grep -cE "^(\[rank [0-9]+\] )?rank [0-9]+: DistError after .*rank $victim did not arrive" <<<"$out")
    times=$(grep -o "DistError after [0-9.]* s" <<<"$out" | grep -o "[0-9.]*" | sort -n | tail -1)
    if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || [ "$survivors" != 2 ] || [ "$left" != 0 ] ||
       ! grep -q "chorus launch: rank .* the job is stopped" <<<"$out"; then
      echo "FAIL: SIG$sig of rank $victim (run $i): launcher exit $rc, $survivors survivors named it, $left processes left"
      echo "$out" | head -20; fail=1
      continue
    fi
    ok_runs=$((ok_runs + 1))
    slowest=$(python3 -c "print(max($slowest, ${times:-0}))")
  done
  echo "SIG$sig: done"
done
limit=$(python3 -c "print($TIMEOUT_MS / 1000 + 10)")
echo "dead rank: $ok_runs/$((2 * REPS)) runs detected, slowest detection ${slowest} s (limit ${limit} s)"
python3 -c "import sys; sys.exit(0 if $slowest <= $limit else 1)" || { echo "FAIL: too slow"; fail=1; }
exit $fail
