"""Sums an Nsight Systems cuda_gpu_kern_sum CSV by kernel class, per step.

    python3 scripts/kernel_classes.py KERN.csv STEPS LABEL

STEPS: the steps the profile covers (bench warm-up + timed steps), to give
milliseconds and launches per step. Prints one line per class and the ten
costliest kernels, so the benchmarks journal can show time per kernel class
before and after a change (issue 14)."""
import csv, re, sys

CLASSES = [  # first match wins (also scripts/ncu_step.py's, which sees PyTorch's kernels too)
    ("NCCL", r"nccl"),
    ("conv (cuDNN)", r"xmma|cudnn|implicit_convolve|conv|sm90_|sm100_|dgrad|wgrad|fprop|winograd|cutlass"),
    ("optimizer", r"sgd|adamw|multi_tensor_apply"),
    ("batch norm (+relu, +add)",
     r"batch_norm|bn_|BatchNorm|welford|triton_(per|red)_|stats_(partial|finalize)|affine_kernel|backward_(partial|finalize|elementwise)_kernel"),
    ("fused pointwise (triton)", r"triton_poi"),
    ("GEMM (cuBLAS)", r"gemm|cublas|Kernel2|nvjet"),
    ("cast / copy", r"copy|cast|convert|to_dtype"),
    ("loss / softmax / pool", r"softmax|cross_entropy|nll|pool|avg"),
    ("elementwise", r"elementwise|unary|binary|fill|add|mul|relu"),
    ("reduction", r"reduce|sum"),
]


def classify(name):
    for cls, pat in CLASSES:
        if re.search(pat, name, re.IGNORECASE):
            return cls
    return "other"


def main():
    path, steps, label = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    rows = list(csv.DictReader(open(path)))
    if not rows:
        print(f"{label}: no kernels in {path}")
        return
    tkey = next(k for k in rows[0] if k.startswith("Total Time"))
    scale = 1e-6 if "ns" in tkey else 1e-3  # to ms
    by = {}
    total = 0.0
    for r in rows:
        ms = float(r[tkey]) * scale / steps
        n = float(r["Instances"]) / steps
        c = classify(r["Name"])
        t, k = by.get(c, (0.0, 0.0))
        by[c] = (t + ms, k + n)
        total += ms
    print(f"== {label}: GPU kernel time per step {total:.3f} ms")
    for c, (t, k) in sorted(by.items(), key=lambda kv: -kv[1][0]):
        print(f"  {c:22} {t:8.3f} ms {100 * t / total:5.1f}%  {k:6.1f} launches")
    top = sorted(rows, key=lambda r: -float(r[tkey]))[:10]
    for r in top:
        print(f"    {float(r[tkey]) * scale / steps:7.3f} ms x{float(r['Instances']) / steps:5.1f}  {r['Name'][:110]}")


if __name__ == "__main__":
    main()
