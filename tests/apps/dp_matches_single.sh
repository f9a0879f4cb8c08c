#!/usr/bin/env bash
# `chorus train --strategy dp` over two logical CPU devices, whose batches stay
# in host memory and are scattered chunk by chunk to each device, trains like
# one device on the same global batch: same final train and test loss (an MLP:
# no batch norm, whose statistics DataParallel keeps per replica).
set -uo pipefail
CHORUS=${1:?usage: dp_matches_single.sh path/to/chorus}
common=(--model mlp --data synthetic --synthetic-size 1024 --epochs 1 --seed 5 --json --quiet --workers 2)
dp=$("$CHORUS" train "${common[@]}" --strategy dp --devices cpu:0,cpu:1 --batch-size 32) || { echo "FAIL: dp run"; exit 1; }
one=$("$CHORUS" train "${common[@]}" --strategy single --devices cpu:0 --batch-size 64) || { echo "FAIL: single run"; exit 1; }
python3 - "$dp" "$one" <<'PY'
import json, sys
dp, one = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert dp["steps"] == one["steps"], (dp["steps"], one["steps"])
for k in ("train_loss", "test_loss"):
    rel = abs(dp[k] - one[k]) / max(abs(one[k]), 1e-12)
    print(f"{k}: dp {dp[k]:.7f} single {one[k]:.7f} rel {rel:.2e}")
    assert rel <= 1e-4, f"{k} differs: {rel}"
print("ok: DataParallel over cpu:0,cpu:1 from host batches matches one device")
PY
