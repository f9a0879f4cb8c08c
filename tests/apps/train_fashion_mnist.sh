#!/usr/bin/env bash
# One epoch of the small CNN on Fashion-MNIST on the CPU reaches >= 0.88 test
# accuracy (the issue's bar is 0.89 on an uninterrupted run; CI asserts 0.88).
# With CHORUS_TEST_QUICK=1 (the sanitizer stage) it trains 150 steps of that
# epoch instead and asserts >= 0.78 (a run of it reaches about 0.84).
set -euo pipefail
CHORUS=$1
if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  # .ci/run installs the data set, so in CI its absence is a failure, not a skip.
  if [ -n "${CI:-}" ]; then echo "dataset-fashion-mnist is not installed"; exit 1; fi
  echo "SKIP: dataset-fashion-mnist not installed"; exit 0
fi
steps=(); bar=0.88
if [ "${CHORUS_TEST_QUICK:-0}" = 1 ]; then steps=(--steps 150); bar=0.78; fi
out=$("$CHORUS" train --model cnn --data fashion-mnist --epochs 1 "${steps[@]}" --devices cpu --seed 1 --json --quiet)
# --no-cuda-graphs is accepted everywhere (a no-op off the GPU).
"$CHORUS" train --model cnn --data synthetic --synthetic-size 256 --epochs 1 --devices cpu --no-cuda-graphs --quiet --json >/dev/null
echo "$out"
python3 - "$out" "$bar" <<'PY'
import json, sys
s = json.loads(sys.argv[1])
bar = float(sys.argv[2])
for k in ["model", "strategy", "devices", "precision", "epochs", "steps", "train_loss", "test_loss", "test_accuracy", "img_per_s", "seconds",
          "cuda_graph_replays"]:
    assert k in s, f"summary lacks {k}"
# CUDA graphs apply to one CUDA device only: on the CPU the step is eager, silently.
assert s["cuda_graph_replays"] is None, s["cuda_graph_replays"]
acc = s["test_accuracy"]
print(f"test_accuracy={acc:.4f} seconds={s['seconds']:.1f}")
assert acc >= bar, f"test accuracy {acc} < {bar}"
PY
