#!/usr/bin/env bash
# A run killed with SIGKILL mid-epoch and restarted with --resume ends with the
# same weights, bit for bit, as an uninterrupted run with the same seed.
set -euo pipefail
CHORUS=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
args=(train --model cnn --data synthetic --synthetic-size 4096 --batch-size 32 --steps 90 --epochs 2
      --devices cpu --seed 7 --checkpoint-every 10 --quiet --workers 2)

"$CHORUS" "${args[@]}" --checkpoint-dir "$tmp/full" >/dev/null

"$CHORUS" "${args[@]}" --checkpoint-dir "$tmp/killed" >/dev/null &
pid=$!
# Kill it once a mid-run checkpoint exists (step 40 of 90, inside epoch 1).
for _ in $(seq 1 600); do
  [ -f "$tmp/killed/ckpt-00000040/state.json" ] && break
  kill -0 $pid 2>/dev/null || break
  sleep 0.1
done
kill -9 $pid 2>/dev/null || { echo "run finished before it could be killed"; exit 1; }
wait $pid 2>/dev/null || true
ls "$tmp/killed"
[ ! -f "$tmp/killed/ckpt-00000090/state.json" ] || { echo "run reached the end before the kill"; exit 1; }
"$CHORUS" "${args[@]}" --checkpoint-dir "$tmp/killed" --resume >/dev/null

cmp "$tmp/full/ckpt-00000090/model.safetensors" "$tmp/killed/ckpt-00000090/model.safetensors"
cmp "$tmp/full/ckpt-00000090/optimizer.safetensors" "$tmp/killed/ckpt-00000090/optimizer.safetensors"
echo "resumed run matches the uninterrupted run bit for bit"
