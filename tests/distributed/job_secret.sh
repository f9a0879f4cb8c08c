#!/usr/bin/env bash
# Issue 47, item 6 (Note [Store job secret] in distributed/store_auth.h): outsiders
# who reach the job's store cannot touch its keys. An outsider without the
# secret sets world_size, job, resume_from and chorus/launch/0/failed before
# and while the ranks join: the job finishes as if nothing happened, and the
# launcher names the first dropped connection once. A worker given another
# secret is refused with one line naming the secret; a secret file others can
# read is refused; two "nodes" (two launchers on this machine) with one secret
# work and with two fail clearly; the store listens on the master address.
set -uo pipefail
CHORUS=${1:?chorus}; PROBE=${2:?chorus_dist_probe}
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
source "$(dirname "$0")/../testing/free_port.sh"  # free_port: a master port no other job can take
M="job-secret-test-$$"; fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
tmp=$(mktemp -d "$PWD/dist_job_secret.XXXXXX"); trap 'rm -rf "$tmp"; pkill -9 -f "$M" 2>/dev/null' EXIT
unset CHORUS_JOB_SECRET CHORUS_RUN_ID
S1=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n'); S2=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
sums() { grep -ho "rank [0-9] of [0-9]: sum .*" "$@" | sort | tr '\n' ';'; }

# 1. An outsider writes the job's keys from before the store is up until the
#    job ends (PyTorch's protocol: VALIDATE, then SET; no secret).
port=$(free_port)
python3 - "$port" "$tmp/stop" > "$tmp/outsider" 2>&1 <<'PY' & op=$!
import os, socket, struct, sys, time
port, stop = int(sys.argv[1]), sys.argv[2]
def s(x): return struct.pack("<Q", len(x)) + x
keys = [b"chorus/0/world_size", b"chorus/0/job", b"chorus/0/resume_from", b"chorus/launch/0/failed",
        b"world_size", b"job", b"resume_from"]
tries = served = 0
deadline = time.time() + 60
while not os.path.exists(stop) and time.time() < deadline:
    try:
        c = socket.create_connection(("127.0.0.1", port), timeout=1)
    except OSError:
        time.sleep(0.02); continue
    tries += 1
    try:
        msg = b"\x00" + struct.pack("<I", 0x3C85F7CE)
        for k in keys: msg += b"\x01" + s(k) + s(b"outsider's text: 99")
        msg += b"\x0d" + struct.pack("<I", 7)  # PING: answered only to a client let in
        c.sendall(msg)
        if c.recv(4) == struct.pack("<I", 7): served += 1
    except OSError:
        pass
    c.close()
    time.sleep(0.02)
print(f"outsider: {tries} connections, {served} served")
PY
CHORUS_JOB_SECRET=$S1 timeout 120 "$CHORUS" launch --nproc-per-node 2 --master-port "$port" -- \
  bash -c 'sleep 1; "$1" sum && sleep 1' "$M" "$PROBE" > "$tmp/out1" 2> "$tmp/err1" & lp=$!
# While it runs: the secret is in the workers' environment, on no command line.
for _ in $(seq 100); do pgrep -f "$M" >/dev/null && break; sleep 0.05; done
w=$(pgrep -f "$M" | head -1)
check "workers get the secret in their environment" "tr '\0' '\n' < /proc/$w/environ | grep -qx 'CHORUS_JOB_SECRET=$S1'"
# The secret travels to the scan in the environment: a pattern on the
# scanner's own command line would find itself.
no_cmdline_has() {
  SECRET="$1" python3 -c '
import glob, os, sys
s = os.environ["SECRET"].encode()
def has(p):
    try:
        return s in open(p, "rb").read()
    except OSError:
        return False
sys.exit(1 if any(has(p) for p in glob.glob("/proc/[0-9]*/cmdline")) else 0)'
}
check "no command line holds the secret" "no_cmdline_has '$S1'"
wait $lp; rc=$?; touch "$tmp/stop"; wait $op
check "the job finished unharmed (exit $rc): $(sums "$tmp/out1" "$tmp/err1")" \
  "[ $rc = 0 ] && [ \"\$(sums '$tmp/out1' '$tmp/err1')\" = 'rank 0 of 2: sum 3.0 6.0 9.0;rank 1 of 2: sum 3.0 6.0 9.0;' ]"
check "$(cat "$tmp/outsider")" "grep -q ' 0 served' '$tmp/outsider' && ! grep -q ' 0 connections' '$tmp/outsider'"
check "the launcher names the first dropped connection once: $(grep -c dropped "$tmp/err1") line(s)" \
  "[ \$(grep -c 'did not prove the job secret' '$tmp/err1') -le 2 ] && grep -q 'dropped a connection from 127.0.0.1:' '$tmp/err1'"
check "nothing printed the secret or the outsider's text" "! grep -q -e '$S1' -e \"outsider's\" '$tmp/out1' '$tmp/err1'"

# 2. A worker given another secret: one line naming the secret, not the operator.
CHORUS_JOB_SECRET=$S1 timeout 120 "$CHORUS" launch --nproc-per-node 2 --grace-period 1 --master-port "$(free_port)" -- \
  bash -c 'if [ "$RANK" = 1 ]; then export CHORUS_JOB_SECRET=$2; fi; PROBE_TIMEOUT_MS=5000 exec "$1" sum' "$M" "$PROBE" "$S2" \
  > "$tmp/out2" 2> "$tmp/err2"; rc=$?
line=$(grep -o "was given another job secret.*" "$tmp/err2" | head -1)
check "a worker with another secret is refused (exit $rc): $line" \
  "[ $rc != 0 ] && grep -q 'the store at 127.0.0.1:[0-9]* was given another job secret than this process' '$tmp/err2' && ! grep -q -e 'world size' -e \"another job's\" '$tmp/err2'"
check "no output holds either secret" "! grep -q -e '$S1' -e '$S2' '$tmp/out2' '$tmp/err2'"

# 3. --job-secret-file: refused when others can read it; used when they cannot.
printf '%s\n' "$S1" > "$tmp/secret"; chmod 644 "$tmp/secret"
out=$("$CHORUS" launch --job-secret-file "$tmp/secret" --master-port "$(free_port)" -- true 2>&1); rc=$?
check "a 0644 secret file is refused with one line (exit $rc): $out" \
  "[ $rc != 0 ] && [ \$(wc -l <<<\"\$out\") = 1 ] && grep -q 'has mode 0644.*chmod 600' <<<\"\$out\""
chmod 600 "$tmp/secret"
"$CHORUS" launch --job-secret-file "$tmp/secret" --master-port "$(free_port)" -- \
  bash -c 'test "$CHORUS_JOB_SECRET" = "$1"' "$M" "$S1" 2> "$tmp/err3"; rc=$?
check "a 0600 secret file is handed to the workers (exit $rc)" "[ $rc = 0 ]"

# 4. Two nodes on this machine: one secret works; two fail clearly; none is refused.
port=$(free_port)
node() { timeout 60 "$CHORUS" launch --nnodes 2 --node-rank "$1" --nproc-per-node 2 --master-addr 127.0.0.1 \
           --master-port "$port" --grace-period 1 -- "$PROBE" sum; }
CHORUS_JOB_SECRET=$S1 node 0 > "$tmp/n0" 2>&1 & p0=$!
CHORUS_JOB_SECRET=$S1 node 1 > "$tmp/n1" 2>&1; r1=$?; wait $p0; r0=$?
check "two nodes with one secret (exit $r0, $r1): $(sums "$tmp/n0" "$tmp/n1")" \
  "[ $r0 = 0 ] && [ $r1 = 0 ] && [ \$(sums '$tmp/n0' '$tmp/n1' | tr ';' '\n' | grep -c 'of 4: sum 10.0 20.0 30.0') = 4 ]"
port=$(free_port)
CHORUS_JOB_SECRET=$S1 PROBE_TIMEOUT_MS=3000 node 0 > "$tmp/n0" 2>&1 & p0=$!
start=$(date +%s); CHORUS_JOB_SECRET=$S2 node 1 > "$tmp/n1" 2>&1; r1=$?; took=$(( $(date +%s) - start )); wait $p0; r0=$?
check "two nodes with two secrets: node 1 stops in ${took} s (exit $r1): $(cat "$tmp/n1")" \
  "[ $r1 != 0 ] && [ $took -lt 20 ] && [ \$(wc -l < '$tmp/n1') = 1 ] && grep -q 'another job secret' '$tmp/n1'"
check "and node 0 names the refused connection (exit $r0)" "[ $r0 != 0 ] && grep -q 'dropped a connection from 127.0.0.1:' '$tmp/n0'"
out=$("$CHORUS" launch --nnodes 2 --node-rank 1 -- true 2>&1); rc=$?
check "several nodes without a secret: one line (exit $rc): $out" \
  "[ $rc != 0 ] && [ \$(wc -l <<<\"\$out\") = 1 ] && grep -q 'every node of the job must be given the same secret' <<<\"\$out\""

# 5. The store listens on the master address (127.0.0.2), not on every interface.
port=$(free_port)
timeout 60 "$CHORUS" launch --nproc-per-node 2 --master-addr 127.0.0.2 --master-port "$port" -- \
  bash -c '"$1" sum && for _ in $(seq 300); do [ -e "$2" ] && exit 0; sleep 0.1; done; exit 9' "$M" "$PROBE" "$tmp/listened" \
  > "$tmp/out5" 2>&1 & lp=$!
for _ in $(seq 300); do grep -q "sum" "$tmp/out5" && break; sleep 0.1; done
listening=$(ss -ltnH "sport = :$port" 2>/dev/null | awk '{print $4}' | tr '\n' ' ')
check "ss: the store listens on 127.0.0.2:$port alone (${listening:-ss not usable})" \
  "[ -z \"\$listening\" ] || [ \"\$listening\" = '127.0.0.2:$port ' ]"
check "nothing answers on 127.0.0.1:$port" \
  "! python3 -c 'import socket,sys; socket.create_connection((\"127.0.0.1\", $port), timeout=2)' 2>/dev/null"
touch "$tmp/listened"; wait $lp; rc=$?
check "the job on 127.0.0.2 finished (exit $rc)" "[ $rc = 0 ] && grep -q 'rank 0 of 2: sum 3.0 6.0 9.0' '$tmp/out5'"

# 6. Without chorus launch (mpirun): rank 0 hosts the store; CHORUS_JOB_SECRET
#    in every rank's environment is used, and without it rank 0 says once that
#    the store is unauthenticated.
if command -v mpirun >/dev/null; then
  mpi() { MASTER_PORT=$(free_port) timeout 120 mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_PORT "$@" \
            "$PROBE" sum 2>&1; }
  out=$(CHORUS_JOB_SECRET=$S1 mpi -x CHORUS_JOB_SECRET); rc=$?
  check "mpirun with CHORUS_JOB_SECRET (exit $rc): no warning" \
    "[ $rc = 0 ] && [ \$(grep -c 'of 2: sum 3.0 6.0 9.0' <<<\"\$out\") = 2 ] && ! grep -q 'no secret' <<<\"\$out\""
  out=$(mpi); rc=$?
  check "mpirun without one (exit $rc): $(grep 'no secret' <<<"$out" | head -1)" \
    "[ $rc = 0 ] && [ \$(grep -c \"the job's store has no secret (CHORUS_JOB_SECRET is not set)\" <<<\"\$out\") = 1 ]"
fi
exit $fail
