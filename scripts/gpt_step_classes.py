"""A GPT step's GPU time by kernel class, from the CUPTI trace of
`scripts/gpu_gpt.sh profile` ($OUT/trace/k.*.csv) or of launch_profile
($OUT/trace_lp_TAG/trace/k.*.csv: pass $OUT/trace_lp_TAG).

    python3 scripts/gpt_step_classes.py OUT_DIR [STEPS] [TOP]

Takes the last STEPS (3) whole steps -- a step starts at the fused
classifier's kernel, which runs once a step -- and prints the kernels a step,
their summed time and the span from the first kernel's start to the last one's
end, then milliseconds a step by class (GEMM, attention, layer norm, ...) and,
with TOP, the TOP costliest kernels with their launches a step. The benchmarks
journal's "kernels a step" figures for gpt2 come from it (sessions 41, 42)."""
import collections
import csv
import glob
import re
import sys


def kernel_class(name):
    if "nvjet" in name or "splitK" in name or "gemm" in name.lower():
        return "GEMM"
    if "sdpa" in name or "cudnn" in name:
        return "attention"
    if "layer_norm" in name:
        return "layer norm"
    if "column_sums" in name or "sum_partial_rows" in name:
        return "bias grads + GELU grad"
    if "cross_entropy" in name:
        return "classifier"
    if "adamw" in name or "sum_squares" in name or "sum_partials" in name:
        return "optimizer + clip"
    if "nccl" in name.lower():
        return "NCCL"
    if "memcpy" in name or "memset" in name or "fill_kernel" in name:
        return "copies/fills"
    return "other"


def main():
    out = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    # Rank 0's file where several processes wrote one each (launch_profile): the lowest pid, the launcher
    # starting the ranks in order (names without a pid sort after).
    def pid_of(path):
        m = re.search(r"\.(\d+)\.csv$", path)
        return (0, int(m.group(1))) if m else (1, 0)
    paths = sorted(glob.glob(out + "/trace/k.*.csv"), key=lambda p: (pid_of(p), p))
    if not paths:
        sys.exit(f"gpt_step_classes: no trace/k.*.csv under {out}")
    rows = sorted((int(r["Start (ns)"]), int(r["Duration (ns)"]), r["Name"]) for r in csv.DictReader(open(paths[0])))
    starts = [i for i, r in enumerate(rows) if "cross_entropy_fused" in r[2]]
    if len(starts) < steps + 1:
        sys.exit(f"gpt_step_classes: {len(starts)} classifier kernels in the trace, need {steps + 1}")
    seg = rows[starts[-1 - steps]:starts[-1]]
    by_kernel = collections.defaultdict(lambda: [0.0, 0.0])
    by_class = collections.defaultdict(float)
    for _, dur, name in seg:
        by_kernel[name[:100]][0] += dur / steps / 1e6
        by_kernel[name[:100]][1] += 1 / steps
        by_class[kernel_class(name)] += dur / steps / 1e6
    busy = sum(r[1] for r in seg) / steps / 1e6
    span = (seg[-1][0] + seg[-1][1] - seg[0][0]) / steps / 1e6
    print(f"kernels a step {len(seg) / steps:.0f}, busy {busy:.3f} ms, span {span:.3f} ms")
    for k, v in sorted(by_class.items(), key=lambda x: -x[1]):
        print(f"  {k:28s} {v:7.3f}")
    for k, (ms, n) in sorted(by_kernel.items(), key=lambda x: -x[1][0])[:top]:
        print(f"{ms:7.3f} {n:5.0f}  {k}")


if __name__ == "__main__":
    main()
