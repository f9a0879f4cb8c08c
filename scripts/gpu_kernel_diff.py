"""Kernel time per step of several traced runs side by side, to tell which
kernels one GPU of a multi-GPU step runs slower than the other, or than a
one-GPU step (issue 14: where DataParallel's 2-GPU step loses against 1 GPU).

    python3 scripts/gpu_kernel_diff.py STEPS LABEL=TRACE.csv[@DEVICE] ...

TRACE.csv: a trace with columns Start, Duration, Device, Name (the CUPTI
trace library's, bench/kernel_trace, or `nsys stats --report cuda_gpu_trace`);
@DEVICE keeps one device's rows (default: all). Prints per kernel class the
milliseconds per step of each column, then the kernels whose time differs
most between the first column and any other (time and launches per step).
Memsets and copies are left out (they are counted by gpu_timeline.py)."""
import csv, os, re, sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_classes import classify  # noqa: E402
from gpu_timeline import col  # noqa: E402


def short(name):
    """A kernel's name without its template arguments and parameter list, so
    one kernel's instantiations stay apart only where the name says more."""
    n = name.strip('"')
    n = re.sub(r"\(.*$", "", n) if not n.startswith("void ") else re.sub(r"\(.*$", "", n[5:])
    return n[:100]


def load(spec):
    label, _, rest = spec.partition("=")
    path, _, dev = rest.partition("@")
    times, counts = defaultdict(float), defaultdict(float)
    for r in csv.DictReader(open(path)):
        if dev and col(r, "Device").strip() != dev:
            continue
        name = col(r, "Name")
        low = name.lower().strip('"')
        if low.startswith("memcpy") or low.startswith("memset"):
            continue
        key = short(name)
        times[key] += float(col(r, "Duration"))
        counts[key] += 1
    return label, times, counts


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    steps = float(sys.argv[1])
    runs = [load(s) for s in sys.argv[2:]]
    ms = lambda ns: ns / 1e6 / steps
    head = "".join(f"{lb[:14]:>15}" for lb, _, _ in runs)
    print(f"{'class':28}{head}")
    classes = sorted({classify(k) for _, t, _ in runs for k in t})
    for c in classes + ["total"]:
        vals = [sum(v for k, v in t.items() if c == "total" or classify(k) == c) for _, t, _ in runs]
        print(f"{c:28}" + "".join(f"{ms(v):15.3f}" for v in vals))
    names = {k for _, t, _ in runs for k in t}
    base = runs[0][1]
    diff = lambda k: max(abs(t.get(k, 0.0) - base.get(k, 0.0)) for _, t, _ in runs[1:]) if len(runs) > 1 else base.get(k, 0.0)
    print(f"\nkernels differing most from {runs[0][0]} (ms per step, launches per step):")
    for k in sorted(names, key=lambda k: -diff(k))[:25]:
        cells = "".join(f"{ms(t.get(k, 0.0)):9.3f} x{n.get(k, 0.0) / steps:4.0f}" for _, t, n in runs)
        print(f"{cells}  {k[:90]}")


if __name__ == "__main__":
    main()
