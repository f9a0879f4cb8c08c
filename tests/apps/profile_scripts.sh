#!/usr/bin/env bash
# The trace analysis scripts of `gpu_check.sh ddpprof` (gpu_step_diff.py,
# gpu_kernel_diff.py) on synthetic traces whose answers are known: a 2-GPU
# step whose backward-data convolution takes 150 us beside an NCCL kernel
# against 100 us on one GPU, and one packing kernel more.
# Usage: profile_scripts.sh CHORUS_BINARY (unused: the scripts need no build).
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 - "$dir" <<'PY'
import sys
d = sys.argv[1]
def write(path, rows):
    with open(path, "w") as f:
        f.write("Start (ns),Duration (ns),Device,Strm,Name\n")
        for s, dur, dev, name in rows:
            f.write(f'{s},{dur},{dev},7,"{name}"\n')
one, two = [], []
for st in range(6):
    t = st * 1_000_000
    one += [(t, 100_000, 0, "sm90_xmma_fprop_x"), (t + 200_000, 100_000, 0, "sm90_xmma_dgrad_x"),
            (t + 400_000, 50_000, 0, "sm90_xmma_wgrad_x"), (t + 500_000, 1_000, 0, "memset 4 B"),
            (t + 600_000, 10_000, 0, "chorus_sgd_kernel")]
    for dev in (0, 1):
        slow = 150_000 if dev == 0 else 100_000
        two += [(t, 100_000, dev, "sm90_xmma_fprop_x"), (t + 200_000, slow, dev, "sm90_xmma_dgrad_x"),
                (t + 360_000, 5_000, dev, "copy_multi_kernel"), (t + 400_000, 50_000, dev, "sm90_xmma_wgrad_x"),
                (t + 600_000, 10_000, dev, "chorus_sgd_kernel")]
    two.append((t + 200_000, 150_000, 0, "ncclDevKernel_AllReduce"))
write(f"{d}/one.csv", one)
write(f"{d}/two.csv", sorted(two))
PY
out=$(python3 scripts/gpu_step_diff.py 6 "$dir/one.csv@0" "$dir/two.csv@0" 3)
echo "$out"
grep -qE "^conv dgrad +1 +100\.0 +150\.0 +50\.0$" <<<"$out"
grep -qE "^conv fprop +1 +100\.0 +100\.0 +0\.0$" <<<"$out"
grep -qE "^ +1 conv dgrad +A +100\.0 B +150\.0 \( \+50\.0%\) nccl 1\.00 same name" <<<"$out"
grep -q "4 positions matched (4 kernels a step in A, 5 in B)" <<<"$out"
# The other GPU ran no NCCL kernel and lost nothing.
out1=$(python3 scripts/gpu_step_diff.py 6 "$dir/one.csv@0" "$dir/two.csv@1" 3)
grep -qE "^conv dgrad +1 +100\.0 +100\.0 +0\.0$" <<<"$out1"
grep -qE "nccl 0\.00" <<<"$out1"
# Per kernel class, per step: NCCL only on the 2-GPU step's cuda:0.
diff=$(python3 scripts/gpu_kernel_diff.py 6 "one=$dir/one.csv@0" "two0=$dir/two.csv@0" "two1=$dir/two.csv@1")
echo "$diff"
grep -qE "^NCCL +0\.000 +0\.150 +0\.000$" <<<"$diff"
grep -qE "^total +0\.260 +0\.465 +0\.265$" <<<"$diff"
echo "profile scripts: ok"
