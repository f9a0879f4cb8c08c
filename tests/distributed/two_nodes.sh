#!/usr/bin/env bash
# Two "machines": network namespaces with their own addresses (192.0.2.1 and
# 192.0.2.2, TEST-NET-1, on a veth pair that exists only between them). A job
# of 2 nodes x 2 processes over Gloo, started by `chorus launch --nnodes 2` in
# each namespace, must give the same result as the same job as 4 processes on
# one node. Everything the test creates is removed on exit.
set -uo pipefail
CHORUS=${1:?chorus}; PROBE=${2:?chorus_dist_probe}
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! ip netns list >/dev/null 2>&1; then
  echo "SKIPPED: needs root and ip netns (iproute2)"; exit 0
fi
n0=chorus-n0-$$; n1=chorus-n1-$$; v0=chv0-$$; v1=chv1-$$
cleanup() {
  ip netns pids "$n0" 2>/dev/null | xargs -r kill -9 2>/dev/null
  ip netns pids "$n1" 2>/dev/null | xargs -r kill -9 2>/dev/null
  ip netns del "$n0" 2>/dev/null; ip netns del "$n1" 2>/dev/null
  ip link del "$v0" 2>/dev/null
}
trap cleanup EXIT
ip netns add "$n0" && ip netns add "$n1" || { echo "SKIPPED: cannot create network namespaces here"; exit 0; }
ip link add "$v0" type veth peer name "$v1" || { echo "SKIPPED: cannot create a veth pair here"; exit 0; }
ip link set "$v0" netns "$n0"; ip link set "$v1" netns "$n1"
ip -n "$n0" addr add 192.0.2.1/24 dev "$v0"; ip -n "$n1" addr add 192.0.2.2/24 dev "$v1"
for n in "$n0" "$n1"; do ip -n "$n" link set lo up; done
ip -n "$n0" link set "$v0" up; ip -n "$n1" link set "$v1" up
port=29555
out=$(mktemp -d)
# Every node of a job is given the same secret (Note [Store job secret]).
export CHORUS_JOB_SECRET=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
ip netns exec "$n0" timeout 120 "$CHORUS" launch --nnodes 2 --node-rank 0 --nproc-per-node 2 \
  --master-addr 192.0.2.1 --master-port $port -- "$PROBE" sum > "$out/node0" 2>&1 & p0=$!
ip netns exec "$n1" timeout 120 "$CHORUS" launch --nnodes 2 --node-rank 1 --nproc-per-node 2 \
  --master-addr 192.0.2.1 --master-port $port -- "$PROBE" sum > "$out/node1" 2>&1 & p1=$!
rc=0; wait $p0 || rc=1; wait $p1 || rc=1
cat "$out/node0" "$out/node1"
two=$(cat "$out/node0" "$out/node1" | grep -o "rank [0-9] of 4: sum .*" | sort)
# The same job as 4 processes on one node (inside the first namespace, on loopback).
one=$(ip netns exec "$n0" timeout 120 "$CHORUS" launch --nproc-per-node 4 --master-port $((port + 1)) -- "$PROBE" sum 2>&1 |
      grep -o "rank [0-9] of 4: sum .*" | sort)
rm -rf "$out"
echo "one node:"; echo "$one"
[ $rc -eq 0 ] || { echo "FAIL: the two-node job failed"; exit 1; }
[ "$(wc -l <<<"$two")" = 4 ] && [ "$two" = "$one" ] || { echo "FAIL: two nodes and one node differ"; exit 1; }
echo "ok: 2 nodes x 2 processes (192.0.2.1, 192.0.2.2) equal 4 processes on one node"
