#!/usr/bin/env bash
# ShardedDataParallel (ZeRO stages 1, 2, 3) over Gloo with real processes
# (chorus launch): each rank trains a model under DDP and under sharding on
# the same data, AdamW with weight decay on matrices and global-norm
# clipping, in float64; 5 steps' losses and the final weights must agree to
# 1e-12 relative (tests/distributed/sharded_probe.cpp says how).
#   - stages 1, 2, 3 on 2, 3 and 4 ranks: an MLP with uneven shards, a
#     frozen bias, a tied weight, an unused parameter and one used on some
#     steps and ranks; a 2-block GPT (tied embedding and head)
#   - gradient accumulation under no_sync() and over synced backwards; no
#     gradient shard held between steps (held_bytes); small buckets; stage 3 keeping
#     the weights from forward to backward; named units (stage 3 sharded from
#     construction; stages 1-2 gathered beside the forward); parameters gathered
#     in float32 over float64 masters (param_dtype); odd steps clip through
#     clip_grad_norm_scale, the scale folded into AdamW
set -uo pipefail
CHORUS=${1:?chorus}; BIN_DIR=${4:?binary dir}
PROBE="$BIN_DIR/chorus_sharded_probe"
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
source "$(dirname "$0")/../testing/free_port.sh"
fail=0
run() {  # N ENV... -- ARGS
  local n=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  local out
  out=$(env "${envs[@]}" PROBE_TIMEOUT_MS=60000 timeout 300 \
        "$CHORUS" launch --nproc-per-node "$n" --master-port "$(free_port)" -- "$PROBE" "$@" 2>&1)
  local rc=$?
  echo "$out" | grep -E "ok|FAIL|rror" | sed "s/^/  [$n ranks, $* ${envs[*]}] /" | head -8
  if [ $rc -ne 0 ] || [ "$(grep -c ': ok ' <<<"$out")" != "$n" ]; then
    echo "FAIL: $n ranks: $* ${envs[*]}"; fail=1
  fi
}
for stage in 1 2 3; do
  for n in 2 3 4; do
    run $n -- match mlp $stage
  done
  run 3 -- match gpt $stage
  run 2 -- match mlp $stage micro
done
# two synced backwards a step: the second adds to the pieces' gradients
# (stage 1: they are the full buffer's segments, which it overwrites)
for stage in 1 2 3; do run 2 -- match mlp $stage synced; done
run 3 PROBE_PARAM_DTYPE=float32 -- match gpt 1 synced
run 3 PROBE_BUCKET_BYTES=200 -- match mlp 1
run 3 PROBE_BUCKET_BYTES=200 -- match mlp 2
run 2 PROBE_RESHARD=0 -- match gpt 3
run 1 -- match gpt 3
# param_dtype: gathered in float32 over float64 masters (1e-5 losses, 1e-4 weights)
run 2 PROBE_PARAM_DTYPE=float32 -- match gpt 1
run 4 PROBE_PARAM_DTYPE=float32 -- match gpt 1  # the float64 shards cast into the float32 buffers
run 3 PROBE_PARAM_DTYPE=float32 -- match gpt 2
run 2 PROBE_PARAM_DTYPE=float32 -- match gpt 2 micro
run 3 PROBE_PARAM_DTYPE=float32 PROBE_UNITS=named -- match gpt 3
run 3 PROBE_UNITS=named -- match gpt 3  # the trainer's way: the blocks sharded from construction
run 2 PROBE_UNITS=named PROBE_RESHARD=0 -- match gpt 3
run 3 PROBE_REDUCE=bf16 -- match mlp 2
run 2 PROBE_REDUCE=bf16 -- match mlp 3
run 2 PROBE_DIRECT=1 -- match mlp 3  # wrappers bypassed: gathered with the root unit, one warning
# Note [Gathers beside the forward]: stages 1-2 with named units (the trainer's way) wait for each unit's
# buckets at its forward; small buckets straddle units; the mlp's layers include a tied weight (the root's),
# a unit run on some steps and ranks only and one never run (their gathers end with the forward)
run 3 PROBE_UNITS=named -- match gpt 1
run 4 PROBE_UNITS=named PROBE_BUCKET_BYTES=600 PROBE_PARAM_DTYPE=float32 -- match gpt 1 micro
run 2 PROBE_UNITS=named PROBE_BUCKET_BYTES=600 -- match gpt 2 synced
run 3 PROBE_UNITS=named PROBE_BUCKET_BYTES=200 -- match mlp 1
run 2 PROBE_UNITS=named -- match mlp 2 micro
# the layers called past their wrappers: waited for at the forward's start once the first step has shown it
run 2 PROBE_UNITS=named PROBE_DIRECT=1 PROBE_BUCKET_BYTES=200 -- match mlp 1
# One rank gathers in place (Note [Gathers in place]; NCCL does on GPUs): the master is full's own segment, or its
# cast is written there
run 1 PROBE_UNITS=named PROBE_BUCKET_BYTES=600 -- match gpt 1
run 1 PROBE_UNITS=named PROBE_PARAM_DTYPE=float32 -- match gpt 2 micro
[ $fail -eq 0 ] && echo "sharded: all passed"
exit $fail
