#!/usr/bin/env bash
# DistributedDataParallel over Gloo with real processes (chorus launch, one
# logical CPU device per rank): each run's ranks compare against a reference
# trained alone on the global batch (tests/distributed/ddp_probe.cpp says how).
#   - MLP and CNN (no batch norm) with 1, 2 and 3 processes; many small
#     buckets (rebuilt from rank 0's order); the bf16-compressed hook; the
#     noop hook (nothing communicated: each rank equals training on its rows);
#     a hook of the user's own (an all_gather averaged in rank order)
#   - no_sync over 4 micro-steps; a parameter used only on some steps and
#     ranks; a model that differs on one rank; a model-parallel module; DDP
#     over a DataParallel of two devices per process
#   - the CNN with batch norm under SyncBatchNorm, when the build has it
set -uo pipefail
CHORUS=${1:?chorus}; PROBE=${3:?chorus_ddp_probe}
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
source "$(dirname "$0")/../testing/free_port.sh"  # free_port: a master port no other job can take
fail=0
run() {  # N ENV... -- ARGS: one job of N ranks
  local n=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local out
  out=$(env "${envs[@]}" CHORUS_CPU_DEVICES=2 PROBE_TIMEOUT_MS=60000 timeout 300 \
        "$CHORUS" launch --nproc-per-node "$n" --master-port "$(free_port)" -- "$PROBE" "$@" 2>&1)
  local rc=$?
  echo "$out" | grep -E "ok|FAIL|rror|relative|buckets|SKIPPED" | sed "s/^/  [$n ranks, $*] /"
  if [ $rc -ne 0 ] || [ "$(grep -c ': ok ' <<<"$out")" != "$n" ] && ! grep -q SKIPPED <<<"$out"; then
    echo "FAIL: $n ranks: $* ${envs[*]}"; fail=1
  fi
}
for n in 1 2 3; do
  run $n -- match mlp
  run $n -- match cnn
done
run 3 PROBE_BUCKET_BYTES=100 -- match mlp
run 2 PROBE_BUCKET_BYTES=1000 -- match cnn
run 2 PROBE_HOOK=bf16 -- match cnn
run 2 PROBE_HOOK=noop -- match cnn  # no communication: each rank equals itself alone on its rows
run 3 PROBE_HOOK=rank-order PROBE_BUCKET_BYTES=1000 -- match cnn  # a hook written in the probe (DDPOptions::hook)
for n in 1 2 3; do run $n -- no_sync; done
for n in 2 3; do run $n -- unused; done
run 3 -- mismatch
run 2 -- modelpar
run 2 -- dp
for n in 1 2 3; do run $n -- match cnn-bn-sync; done
[ $fail -eq 0 ] && echo "ok: DistributedDataParallel over 1-3 processes equals one process on the global batch"
exit $fail
