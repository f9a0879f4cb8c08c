#!/usr/bin/env bash
# Issue 47, item 5: the launcher's store under 100,000 connect-and-close calls
# from outside the job (each finished connection's thread kept its stack
# mapped until the launcher ended; about 33,000 aborted it, exit 134, and the
# workers died with it), plus clients that announce a 1 GiB value and stall,
# and clients that connect and say nothing (Note [Store connections are
# bounded] in distributed/tcp_store.h). The job must finish as if nothing happened.
# The launcher's store now has a job secret (Note [Store job secret]), so the
# SETs are dropped at their first byte; Store.ServerSurvivesHostileConnections
# keeps the stalled 1 GiB value covered on a store without one.
# With CHORUS_TEST_QUICK=1 (the sanitizer stage) 20,000 connect-and-close
# calls: the same path, each call alike, with the store's threads reaped
# thousands of times over; the plain suite floods with 100,000.
set -uo pipefail
CHORUS=${1:?chorus}
source "$(dirname "$0")/../testing/free_port.sh"  # free_port: a master port no other job can take
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
port=$(free_port)
n=100000
[ "${CHORUS_TEST_QUICK:-0}" = 1 ] && n=20000
# The job: one worker that waits until the flood is over, then exits 0.
timeout 900 "$CHORUS" launch --nproc-per-node 1 --master-port "$port" -- \
  bash -c 'for _ in $(seq 9000); do [ -e "$1" ] && exit 0; sleep 0.1; done; exit 9' _ "$tmp/flooded" \
  > "$tmp/out" 2> "$tmp/err" &
lp=$!
start=$(date +%s)
python3 - "$port" "$n" <<'PY'
import socket, struct, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
for _ in range(300):  # the launcher's store comes up
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close(); break
    except OSError:
        time.sleep(0.1)
rst = struct.pack("ii", 1, 0)
# A connect the store cannot take yet (its accept queue is full: the kernel
# drops the SYN) would wait for the kernel's SYN retry, 1 s: 30,000 calls spent
# 20 of their 23 s that way, the CPU idle. Given up after 50 ms, before any
# byte reached the store, and tried again, each of the n calls still connects.
for i in range(n):
    while True:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, rst)
        s.settimeout(0.05)
        try:
            s.connect(("127.0.0.1", port))
            break
        except socket.timeout:
            s.close()
    s.close()
held = []
for i in range(64):  # a SET of a 1 GiB value, 10 bytes of it sent
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x01" + struct.pack("<Q", 1) + b"x" + struct.pack("<Q", 1 << 30) + b"\xab" * 10)
    held.append(s)
for i in range(64):  # connect and say nothing
    held.append(socket.create_connection(("127.0.0.1", port)))
time.sleep(1)
print("flood sent")
PY
took=$(( $(date +%s) - start ))
touch "$tmp/flooded"
wait $lp; rc=$?
check "the launcher and its job survive $n hostile connections (exit $rc, ${took} s of flood)" "[ $rc = 0 ]"
[ $rc = 0 ] || tail -5 "$tmp/err"
exit $fail
