#!/usr/bin/env bash
# Issue 47, items 14 and 10: `chorus launch --max-restarts` waits before each restart
# (1 s, then twice as long each time, --restart-backoff) and a signal ends the
# wait; --grace-period and --restart-backoff take finite numbers in range, as
# bench-comm's --sizes-mb and --dist-timeout do; and one very long output line
# costs the launcher linear time (it cost quadratic). A launcher of node 1
# whose node 0 is unreachable stops on SIGTERM at once (it ignored signals for
# up to 300 s).
set -uo pipefail
CHORUS=${1:?chorus}
source "$(dirname "$0")/../testing/free_port.sh"  # free_port: a master port no other job can take
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
M=launch-limits-$$  # marks this test's workers

# 1. Backoff: two restarts of a job that always fails wait 1 s, then 2 s.
start=$(date +%s.%N)
"$CHORUS" launch --nproc-per-node 1 --max-restarts 2 --grace-period 0 --master-port "$(free_port)" -- \
  bash -c 'exit 3' "$M" > /dev/null 2> "$tmp/err"; rc=$?
took=$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$start" "$(date +%s.%N)")
check "two restarts, then exit 1 (got $rc) after ${took} s" \
  "[ $rc = 1 ] && grep -q 'restarting the job in 1.0 s (1 of 2 restarts)' '$tmp/err' && grep -q 'restarting the job in 2.0 s (2 of 2 restarts)' '$tmp/err' && python3 -c 'import sys; sys.exit(float(sys.argv[1]) < 3)' $took"

# 2. A signal during the wait ends it: no restart, exit 128 + signal.
"$CHORUS" launch --nproc-per-node 1 --max-restarts 5 --restart-backoff 60 --grace-period 0 --master-port "$(free_port)" -- \
  bash -c 'exit 3' "$M" > /dev/null 2> "$tmp/err2" &
lp=$!
for _ in $(seq 300); do grep -qs 'restarting the job in' "$tmp/err2" && break; sleep 0.1; done
start=$(date +%s); kill -TERM $lp; wait $lp; rc=$?; took=$(( $(date +%s) - start ))
check "SIGTERM while waiting to restart -> exit 143 at once (got $rc in ${took} s): $(tail -1 "$tmp/err2")" \
  "[ $rc = 143 ] && [ $took -lt 5 ] && grep -q 'while waiting to restart; not restarting' '$tmp/err2' && [ \$(grep -c 'restarting the job in' '$tmp/err2') = 1 ]"

# 2b. Item 10: a launcher of node 1 waiting for node 0's store answers SIGTERM at once.
CHORUS_JOB_SECRET=launch-limits-secret-$$ "$CHORUS" launch --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr 127.0.0.1 \
  --master-port "$(free_port)" -- \
  bash -c 'exit 0' "$M" > /dev/null 2> "$tmp/err3" &
lp=$!; sleep 2
start=$(date +%s); kill -TERM $lp; wait $lp; rc=$?; took=$(( $(date +%s) - start ))
check "node 1's launcher, node 0 unreachable, SIGTERM -> exit 143 in ${took} s (got $rc): $(cat "$tmp/err3")" \
  "[ $rc = 143 ] && [ $took -lt 5 ] && grep -q \"while waiting for node 0's store; no worker was started\" '$tmp/err3'"

# 2c. Item 6 in part: a one-node job's store listens on loopback only (read from
# /proc/net/tcp: no traffic leaves 127.0.0.1).
port=$(free_port)
"$CHORUS" launch --nproc-per-node 1 --master-port "$port" -- bash -c 'sleep 3' "$M" > /dev/null 2>&1 &
lp=$!
hex=$(printf '%04X' "$port")
for _ in $(seq 100); do grep -q ":$hex 00000000:0000 0A" /proc/net/tcp && break; sleep 0.1; done
bound=$(awk -v p=":$hex" '$2 ~ p"$" && $4 == "0A" {print $2}' /proc/net/tcp | head -1)
wait $lp
check "a one-node job's store listens on 127.0.0.1 only (local address $bound)" "[ '$bound' = '0100007F:$hex' ]"

# 3. Numbers that are not numbers, or out of range: one line, exit 2.
expect_error() {  # expect_error "what stderr must contain" args...
  local want=$1; shift
  local err rc
  err=$(timeout 60 "$CHORUS" "$@" 2>&1 >/dev/null); rc=$?
  check "chorus $* -> exit $rc: $err" "[ $rc = 1 -o $rc = 2 ] && [ \$(grep -c . <<<\"\$err\") = 1 ] && grep -qF -- \"\$want\" <<<\"\$err\""
}
for v in nan inf 1e308 -1; do
  expect_error "--grace-period: '$v' is not a number from 0 to 86400" launch --grace-period "$v" -- true
done
expect_error "--restart-backoff: 'nan' is not a number from 0 to 60" launch --restart-backoff nan -- true
expect_error "--sizes-mb is empty" bench-comm --sizes-mb ''
expect_error "--dist-timeout: 'nan' is not a number from 0.1 to 1000000" bench-comm --dist-timeout nan

# 4. One 300 MB line from rank 1 (rank 0's stdout passes through untouched):
# 2 s here, 21 s for 200 MB before (the time grew with the square of the length:
# ~47 s for 300 MB). The bound is 30 s: under AddressSanitizer on a loaded
# 2-core machine the linear path took 16 s.
start=$(date +%s)
timeout 300 "$CHORUS" launch --nproc-per-node 2 --master-port "$(free_port)" -- \
  bash -c '[ "$RANK" = 1 ] && python3 -c "import sys; sys.stdout.write(\"x\" * 300_000_000 + \"\\n\")"; echo "rank $RANK done"' "$M" \
  > "$tmp/out" 2> "$tmp/err4"; rc=$?
took=$(( $(date +%s) - start ))
[ $rc = 0 ] || head -c 2000 "$tmp/err4"
check "a 300 MB line passes in ${took} s (exit $rc)" "[ $rc = 0 ] && [ $took -lt 30 ] && grep -qx '\[rank 1\] rank 1 done' '$tmp/out'"
check "...every byte of it, in pieces of 1 MiB" "[ \$(grep '^\[rank 1\] x' '$tmp/out' | tr -d '\n' | sed 's/\[rank 1\] //g' | wc -c) = 300000000 ]"
exit $fail
