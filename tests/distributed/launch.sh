#!/usr/bin/env bash
# chorus launch as a user sees it: output passed through (rank 0 untouched,
# others prefixed), --log-dir, a failing worker named with its exit code and
# last lines and the others stopped, SIGTERM forwarded, --max-restarts, bad
# input; a process of another job given the same port. Every run leaves no
# process behind (a unique marker is checked).
set -uo pipefail
CHORUS=${1:?chorus}
source "$(dirname "$0")/../testing/free_port.sh"  # free_port: a master port no other job can take
M="launch-test-$$"; fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
left() { pgrep -f "$M" | wc -l; }
# Scratch space in the build directory (ctest's working directory), not
# /tmp: twice, in full-suite runs beside dist.train_ddp, a /tmp/tmp.* folder
# of this test vanished between two steps (not understood; never when the
# test ran alone).
tmp=$(mktemp -d "$PWD/dist_launch.XXXXXX"); trap 'rm -rf "$tmp"; pkill -9 -f "$M" 2>/dev/null' EXIT

# 1. Output and --log-dir.
"$CHORUS" launch --nproc-per-node 3 --master-port "$(free_port)" --log-dir "$tmp/logs" -- \
  bash -c 'echo "out $RANK of $WORLD_SIZE local $LOCAL_RANK"; echo "err $RANK" >&2' "$M" > "$tmp/out" 2> "$tmp/err"
rc=$?
check "all ranks succeed -> exit 0" "[ $rc = 0 ]"
check "rank 0's stdout untouched" "grep -qx 'out 0 of 3 local 0' '$tmp/out'"
check "other ranks prefixed" "grep -qx '\[rank 1\] out 1 of 3 local 1' '$tmp/out' && grep -qx '\[rank 2\] out 2 of 3 local 2' '$tmp/out'"
check "stderr prefixed" "grep -qx '\[rank 2\] err 2' '$tmp/err'"
check "--log-dir has one log per rank" "grep -q 'out 1 of 3' '$tmp/logs/rank_1.log' && grep -q 'err 2' '$tmp/logs/rank_2.log'"

# 2. A failing worker: named, with its code and last lines; the others stopped.
start=$(date +%s)
"$CHORUS" launch --nproc-per-node 3 --grace-period 1 --master-port "$(free_port)" -- \
  bash -c 'if [ "$RANK" = 1 ]; then echo "about to fail"; exit 7; fi; sleep 60' "$M" > "$tmp/out" 2> "$tmp/err"
rc=$?; took=$(( $(date +%s) - start ))
check "a failed worker -> exit 1 (got $rc)" "[ $rc = 1 ]"
check "names the rank and its exit code" "grep -q 'rank 1 (pid [0-9]*) exited with code 7' '$tmp/err'"
check "shows its last lines" "grep -q '| about to fail' '$tmp/err'"
check "the others were stopped quickly (${took} s)" "[ $took -lt 20 ]"
check "no process left" "[ \$(left) = 0 ]"

# 3. A worker killed by a signal.
"$CHORUS" launch --nproc-per-node 2 --grace-period 1 --master-port "$(free_port)" -- \
  bash -c 'if [ "$RANK" = 0 ]; then kill -9 $$; fi; sleep 60' "$M" > /dev/null 2> "$tmp/err"
check "a worker killed by SIGKILL is named" "grep -q 'rank 0 (pid [0-9]*) was killed by signal 9' '$tmp/err'"
check "no process left" "[ \$(left) = 0 ]"

# 4. SIGTERM to the launcher reaches every worker.
"$CHORUS" launch --nproc-per-node 2 --master-port "$(free_port)" -- bash -c 'sleep 60' "$M" > /dev/null 2> "$tmp/err" &
lp=$!; sleep 1; kill -TERM $lp; wait $lp; rc=$?
check "SIGTERM -> exit 143 (got $rc)" "[ $rc = 143 ]"
check "no process left after SIGTERM" "[ \$(left) = 0 ]"

# 5. --max-restarts: the first attempt fails, the second succeeds.
"$CHORUS" launch --nproc-per-node 2 --max-restarts 2 --grace-period 1 --master-port "$(free_port)" -- \
  bash -c 'if [ "$CHORUS_RESTART_COUNT" = 0 ] && [ "$RANK" = 0 ]; then exit 3; fi; echo "attempt $CHORUS_RESTART_COUNT ok"' "$M" \
  > "$tmp/out" 2> "$tmp/err"
rc=$?
check "restarted once, then exit 0 (got $rc)" "[ $rc = 0 ] && grep -q 'restarting the job in 1.0 s (1 of 2 restarts)' '$tmp/err' && grep -q 'attempt 1 ok' '$tmp/out'"

# 7. Two jobs given one port (Note [Job ids] in distributed/launch_env.h): a process of
# the second, started by hand with its own CHORUS_RUN_ID, is stopped at once
# with one line naming that; the first job, whose store it is, finishes.
# Job A's workers stay until the check is done (a marker file), however slow
# the machine; no launcher's id variable is inherited from the test's runner.
# Both are given one job secret (a user who exports CHORUS_JOB_SECRET in their
# shell): the secret lets the process in, the job id stops it.
PROBE=${2:-}
if [ -n "$PROBE" ] && ! "$CHORUS" --version | grep -q "^Gloo: no"; then
  port=$(free_port)
  no_ids=(env -u CHORUS_RUN_ID -u TORCHELASTIC_RUN_ID -u SLURM_JOB_ID -u SLURM_STEP_ID -u PMIX_NAMESPACE
          -u OMPI_MCA_ess_base_jobid CHORUS_JOB_SECRET=one-secret-of-this-user-$$)
  "${no_ids[@]}" "$CHORUS" launch --nproc-per-node 2 --master-port "$port" -- \
    bash -c '"$1" sum || exit 1; for _ in $(seq 1200); do [ -e "$2" ] && exit 0; sleep 0.1; done; exit 9' \
    "$M" "$PROBE" "$tmp/checked" > "$tmp/a_out" 2> "$tmp/a_err" & a=$!
  for _ in $(seq 1200); do grep -q "sum" "$tmp/a_out" && break; sleep 0.1; done
  start=$(date +%s)
  out=$("${no_ids[@]}" RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        TORCHELASTIC_USE_AGENT_STORE=True CHORUS_RUN_ID=other PROBE_TIMEOUT_MS=60000 timeout 120 "$PROBE" sum 2>&1)
  rc=$?; took=$(( $(date +%s) - start ))
  check "another job's process on the port -> exit $rc in ${took} s: $(grep -o "the store there is another job's.*" <<<"$out" | head -1)" \
    "[ $rc != 0 ] && [ $took -lt 30 ] && grep -q \"another job's (job id 'chorus:[0-9]*-[0-9a-f]*', this process's 'chorus:other')\" <<<\"\$out\""
  touch "$tmp/checked"; wait $a; rc=$?
  check "the first job finished (exit $rc)" "[ $rc = 0 ] && grep -q 'rank 0 of 2: sum 3.0 6.0 9.0' '$tmp/a_out'"
fi

# 6. Bad input: one line, non-zero.
bad() { local out; out=$("$CHORUS" launch "$@" 2>&1); local rc=$?
  check "bad input '$*' -> exit $rc: $(head -1 <<<"$out")" "[ $rc != 0 ] && [ \$(wc -l <<<\"\$out\") = 1 ]"; }
bad --nproc-per-node 0 -- true
bad --nproc-per-node many -- true
bad --nnodes 2 --node-rank 2 -- true
bad --nproc-per-node 2
exit $fail
