#!/usr/bin/env bash
# `chorus train --strategy dp` over two logical CPU devices, whose batches stay
# in host memory and are scattered chunk by chunk to each device, trains like
# one device on the same global batch: same final train and test loss (an MLP:
# no batch norm, whose statistics DataParallel keeps per replica) -- with the
# replicas stepping their own weights (the default) and with --dp-broadcast,
# with each replica's loss on its device (the default) and with the outputs
# gathered for the loss on the first device (--dp-gather-output), and with the
# gradients exchanged and summed by the optimizer's update (--dp-all-reduce
# in-update: bit for bit the replicated updates' training).
set -uo pipefail
CHORUS=${1:?usage: dp_matches_single.sh path/to/chorus}
common=(--model mlp --data synthetic --synthetic-size 1024 --epochs 1 --seed 5 --json --quiet --workers 2)
dp=$("$CHORUS" train "${common[@]}" --strategy dp --devices cpu:0,cpu:1 --batch-size 32) || { echo "FAIL: dp run"; exit 1; }
bc=$("$CHORUS" train "${common[@]}" --strategy dp --devices cpu:0,cpu:1 --batch-size 32 --dp-broadcast) || { echo "FAIL: dp --dp-broadcast run"; exit 1; }
ga=$("$CHORUS" train "${common[@]}" --strategy dp --devices cpu:0,cpu:1 --batch-size 32 --dp-gather-output) || { echo "FAIL: dp --dp-gather-output run"; exit 1; }
iu=$("$CHORUS" train "${common[@]}" --strategy dp --devices cpu:0,cpu:1 --batch-size 32 --dp-all-reduce in-update) || { echo "FAIL: dp --dp-all-reduce in-update run"; exit 1; }
# chorus bench names what summed the gradients: in-update when asked, the
# fallback's adds on CPU devices by default (auto exchanges on two GPUs only).
for m in in-update auto; do
  name=$("$CHORUS" bench --strategy dp --devices cpu:0,cpu:1 --device-counts 2 --model mlp --steps 2 --warmup 1 --json \
         --dp-all-reduce $m | python3 -c 'import json, sys; print([json.loads(l) for l in sys.stdin if l.startswith("{")][-1]["dp_all_reduce"])')
  want=$([ $m = in-update ] && echo in-update || echo adds)
  [ "$name" = "$want" ] || { echo "FAIL: bench --dp-all-reduce $m says dp_all_reduce '$name', expected '$want'"; exit 1; }
  echo "ok: bench --dp-all-reduce $m on cpu:0,cpu:1: dp_all_reduce $name"
done
one=$("$CHORUS" train "${common[@]}" --strategy single --devices cpu:0 --batch-size 64) || { echo "FAIL: single run"; exit 1; }
python3 - "$dp" "$bc" "$ga" "$one" "$iu" <<'PY'
import json, sys
dp, bc, ga, one, iu = (json.loads(a) for a in sys.argv[1:6])
for k in ("train_loss", "test_loss"):
    assert iu[k] == dp[k], f"--dp-all-reduce in-update: {k} {iu[k]!r} against {dp[k]!r} with the all-reduce"
print(f"train_loss: dp --dp-all-reduce in-update {iu['train_loss']!r} = dp {dp['train_loss']!r}")
for name, run in (("dp", dp), ("dp --dp-broadcast", bc), ("dp --dp-gather-output", ga)):
    assert run["steps"] == one["steps"], (name, run["steps"], one["steps"])
    for k in ("train_loss", "test_loss"):
        rel = abs(run[k] - one[k]) / max(abs(one[k]), 1e-12)
        print(f"{k}: {name} {run[k]:.7f} single {one[k]:.7f} rel {rel:.2e}")
        assert rel <= 1e-4, f"{name}: {k} differs: {rel}"
print("ok: DataParallel over cpu:0,cpu:1 from host batches matches one device, replicated updates and broadcasts, per-replica and gathered losses, sums in the update")
PY
