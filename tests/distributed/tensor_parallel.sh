#!/usr/bin/env bash
# Tensor parallelism over Gloo with real processes (chorus launch, one CPU
# process per rank): each rank compares against the tp=1 models::GPT it
# builds alone from the same seed in float64 (tests/distributed/tp_probe.cpp).
#   - tp=2 and tp=4, sequence parallelism off and on: logits, loss, every
#     gradient and the weights after 3 AdamW steps with global-norm clipping
#     <= 1e-12 relative
#   - dp=2 x tp=2 (DDP over the mesh's dp groups) equals one process
#   - pp=2 x tp=2 (1F1B pipeline, sequence parallelism off and on), pp=4, and
#     dp=2 x pp=2 x tp=2 equal one process; so do pp=2 and pp=2 x tp=2 with
#     the interleaved schedule (two stages per pipeline rank), and dp=2 x pp=2
#   - the collectives in chunks (spK: --tp-chunks K, Note [Chunked collectives
#     beside the products]): K=2 at tp=2, tp=4, dp=2 x tp=2 and pp=2 x tp=2;
#     K=8 whose chunks split sequences (the two-copy conversion), and K=3,
#     which divides no rank's tokens (runs unchunked), equal the reference too
#   - dropout: masks agree across tensor ranks, differ across data ranks
#   - a checkpoint gathered at tp=2 loads into a one-process GPT, and at tp=4
#     and dp=2 x tp=2
set -uo pipefail
CHORUS=${1:?chorus}; BIN=${4:?binary folder}
PROBE="$BIN/chorus_tp_probe"
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
[ -x "$PROBE" ] || { echo "FAIL: $PROBE is not built (ninja chorus_tp_probe)"; exit 1; }
source "$(dirname "$0")/../testing/free_port.sh"
fail=0
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
run() {  # N ARGS...: one job of N ranks
  local n=$1; shift
  local out
  out=$(PROBE_TIMEOUT_MS=60000 timeout 240 "$CHORUS" launch --nproc-per-node "$n" --master-port "$(free_port)" -- \
        "$PROBE" "$@" 2>&1)
  local rc=$?
  echo "$out" | grep -E "ok|FAIL|rror|mesh" | sed "s|^|  [$n ranks, $*] |"
  if [ $rc -ne 0 ] || [ "$(grep -c ': ok ' <<<"$out")" != "$n" ]; then
    echo "FAIL: $n ranks: $*"; fail=1
  fi
}
for sp in nosp sp; do
  run 2 match tp=2 $sp
  run 4 match tp=4 $sp
  run 4 match dp=2,tp=2 $sp
done
run 1 match tp=1 nosp
# Chunked collectives: rows chunk-major over rank-major blocks through the whole parallel region.
run 2 match tp=2 sp2
run 4 match tp=4 sp2
run 4 match dp=2,tp=2 sp2
run 2 match tp=2 sp8
run 4 match tp=4 sp3
run 4 match dp=2,tp=2 sp4
run 4 pipeline pp=2,tp=2 sp2
run 4 pipeline pp=2,tp=2 sp4 interleaved
run 4 dropout dp=2,tp=2 sp2
# Tensor x pipeline (x data) parallel: the model as a 1F1B pipeline over the pp groups.
run 4 pipeline pp=2,tp=2 nosp
run 4 pipeline pp=2,tp=2 sp
run 4 pipeline pp=4 nosp
run 8 pipeline dp=2,pp=2,tp=2 sp
# Interleaved: two stages per pipeline rank, the activations in a ring (Note [Pipeline links]).
run 2 pipeline pp=2 nosp interleaved
run 4 pipeline pp=2,tp=2 sp interleaved
run 4 pipeline dp=2,pp=2 nosp interleaved
run 4 dropout dp=2,tp=2 nosp
run 4 dropout dp=2,tp=2 sp
run 2 checkpoint tp=2 "$TMP"
run 4 reload tp=4 "$TMP"
run 4 reload dp=2,tp=2 "$TMP"
[ $fail -eq 0 ] && echo "ok: tensor parallel GPT (tp=1,2,4; dp=2 x tp=2; pp=2 x tp=2, 1f1b and interleaved; dp=2 x pp=2 x tp=2; sequence parallel on and off, collectives in 2, 3, 4 and 8 chunks) equals one process"
exit $fail
