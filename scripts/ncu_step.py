"""GPU time of one training step, kernel by kernel, from Nsight Compute.

    python3 scripts/ncu_step.py NCU.csv LABEL [STEPS]

NCU.csv: `ncu --csv --print-units base --metrics gpu__time_duration.sum` over a
program. Chorus's steps end with its optimizer launches (sgd_multi_kernel):
the kernels after the second-to-last one, through the last, are one step. A
PyTorch profile is taken between torch.cuda.profiler.start() and stop()
around STEPS steps (scripts/torch_step_profile.py) and divided by STEPS.
Kernels are timed one at a time (ncu serialises them), so this is kernel
time, not the step's wall time; it says which kernel classes differ between
two programs that run the same model (issue 14)."""
import csv, os, re, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_classes import classify  # noqa: E402


def main():
    path, label = sys.argv[1], sys.argv[2]
    steps = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    lines = [l for l in open(path, errors="replace") if l.startswith('"')]
    rows = [r for r in csv.DictReader(lines) if r.get("Metric Name") == "gpu__time_duration.sum"]
    kernels = [(r["Kernel Name"], float(r["Metric Value"].replace(",", "")) / 1e6) for r in rows]  # ns -> ms
    if not kernels:
        print(f"== {label}: no kernels in {path}")
        return
    if steps == 0:  # Chorus: one step between the last two optimizer launches
        # (the update may take several launches in a row: a run ends a step)
        sgd = [i for i, (n, _) in enumerate(kernels) if "sgd_multi_kernel" in n]
        ends = [i for i in sgd if i + 1 not in sgd]
        if len(ends) < 2:
            print(f"== {label}: fewer than two optimizer launches in {path}")
            return
        kernels, steps = kernels[ends[-2] + 1:ends[-1] + 1], 1.0
    by, total = {}, 0.0
    for n, ms in kernels:
        c = classify(n)
        t, k = by.get(c, (0.0, 0))
        by[c] = (t + ms / steps, k + 1 / steps)
        total += ms / steps
    print(f"== {label}: kernel time per step {total:.3f} ms, {len(kernels) / steps:.0f} launches")
    for c, (t, k) in sorted(by.items(), key=lambda kv: -kv[1][0]):
        print(f"  {c:26} {t:8.3f} ms {100 * t / total:5.1f}%  {k:6.1f} launches")
    agg = {}
    for n, ms in kernels:
        short = re.sub(r"\(.*", "", n)[:100]
        t, k = agg.get(short, (0.0, 0))
        agg[short] = (t + ms / steps, k + 1 / steps)
    for n, (t, k) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"    {t:7.3f} ms x{k:5.1f}  {n}")


if __name__ == "__main__":
    main()
