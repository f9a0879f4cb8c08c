#!/usr/bin/env bash
# chorus train --strategy ddp over 2 ranks (logical CPU devices, Gloo):
# --trace puts every rank's spans in one file (pid = rank; rank 0 gathers them
# through the store), with the wait for the gradients' all-reduce as a phase;
# --tensorboard-all-ranks writes one event file per rank under one run
# directory, and without it rank 0 alone writes.
set -euo pipefail
CHORUS=${1:?chorus}
HERE=$(cd "$(dirname "$0")" && pwd)
"$CHORUS" --version | grep -q "^Gloo: no" && { echo "SKIPPED: this build has no Gloo"; exit 0; }
source "$HERE/../testing/free_port.sh"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
launch() { timeout 300 "$CHORUS" launch --nproc-per-node 2 --master-port "$(free_port)" --grace-period 2 -- "$@"; }
T=(train --strategy ddp --model mlp --data synthetic --synthetic-size 512 --batch-size 32 --epochs 1 --workers 0
   --log-every 2 --quiet)

launch "$CHORUS" "${T[@]}" --trace "$tmp/t.json" --trace-steps 2-3 --tensorboard "$tmp/tb" --tensorboard-all-ranks \
  > "$tmp/out" 2> "$tmp/err" || { cat "$tmp/err"; exit 1; }
python3 "$HERE/../apps/check_trace.py" "$tmp/t.json" --ranks 2 --steps 2-3 \
  --phases data,forward,backward,optimizer,wait_gradients --comm all_reduce
ls "$tmp"/tb/*-mlp-ddp/rank0/events.out.tfevents.* "$tmp"/tb/*-mlp-ddp/rank1/events.out.tfevents.*
[ "$(ls -d "$tmp"/tb/* | wc -l)" = 1 ] || { echo "FAIL: the ranks wrote $(ls "$tmp/tb") (one run directory wanted)"; exit 1; }

launch "$CHORUS" "${T[@]}" --steps 4 --tensorboard "$tmp/tb0" > /dev/null 2>&1
[ "$(find "$tmp/tb0" -name 'events.out.tfevents.*' | wc -l)" = 1 ] || { echo "FAIL: rank 0 alone should write"; exit 1; }
echo "ok: ddp trace and tensorboard"
