#!/usr/bin/env bash
# Pipelines across processes over Gloo with real processes (chorus launch):
# each rank compares with a reference trained alone on one device on the
# global batch (tests/distributed/pipeline_probe.cpp says how).
#   - one stage per process, activations and gradients by send/recv: 2, 3
#     and 4 processes, GPipe and 1F1B; two stages per process (interleaved):
#     2 and 3 processes
#   - data parallelism over pipelines: 2 processes x a 2-stage pipeline on
#     cpu:0 and cpu:1 each, every schedule; and 2 pipelines of 2 processes
#     each (stage_group and data_group together), 1F1B and interleaved
set -uo pipefail
CHORUS=${1:?chorus}; BIN=${4:?binary folder}
PROBE="$BIN/chorus_pipeline_probe"
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
source "$(dirname "$0")/../testing/free_port.sh"  # free_port: a master port no other job can take
fail=0
run() {  # N ARGS: one job of N ranks
  local n=$1; shift
  local out
  out=$(CHORUS_CPU_DEVICES=2 timeout 300 "$CHORUS" launch --nproc-per-node "$n" --master-port "$(free_port)" -- \
        "$PROBE" "$@" 2>&1)
  local rc=$?
  echo "$out" | grep -E "ok|FAIL|rror" | sed "s/^/  [$n ranks, $*] /"
  if [ $rc -ne 0 ] || [ "$(grep -c ': ok ' <<<"$out")" != "$n" ]; then
    echo "FAIL: $n ranks: $*"; fail=1
  fi
}
for n in 2 3 4; do
  run $n stages gpipe
  run $n stages 1f1b
done
# Two stages per process, a ring of links (Note [Pipeline links]); 3 ranks: 4
# micro-batches are no multiple of them (a longer warm-up).
for n in 2 3; do run $n stages interleaved; done
for s in gpipe 1f1b interleaved; do run 2 dp $s; done
# Both at once: two 2-process pipelines, their stages averaged over data groups.
for s in 1f1b interleaved; do run 4 both $s; done
[ $fail = 0 ] && echo "pipelines across processes: all ok"
exit $fail
