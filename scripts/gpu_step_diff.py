"""One GPU's step kernel by kernel against another's, by position in the step,
with how much of each kernel ran beside an NCCL kernel: where a multi-GPU
step's compute kernels lose time against a one-GPU step, and whether the
communication running beside them is why (issue 14).

    python3 scripts/gpu_step_diff.py STEPS A.csv@DEVICE B.csv@DEVICE [TOP]

The traces (bench/kernel_trace's CSV, or `nsys stats --report
cuda_gpu_trace`) cover STEPS replays of one graph, so each step runs the same
kernels in the same order. NCCL kernels, memsets and copies are left out of
the sequence; the rest are averaged per position over the steps (the first
two left out where there are more than four), the two sequences matched by
kernel kind (a step of B may have kernels A has not, e.g. the packing of
gradients), and printed: time per kind (A, B, difference), then the TOP
(default 15) positions B loses most at, with the fraction of B's kernel that
ran while an NCCL kernel ran on B's device."""
import csv, difflib, os, re, sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timeline import col  # noqa: E402
from kernel_classes import classify  # noqa: E402


def kind(name):
    """A kernel's class, with the convolution's direction: one kind per layer role."""
    for d in ("dgrad", "wgrad", "fprop"):
        if d in name:
            return "conv " + d
    return classify(name)


def load(spec):
    path, _, dev = spec.rpartition("@")
    rows = []
    for r in csv.DictReader(open(path)):
        if col(r, "Device").strip() != dev:
            continue
        name = col(r, "Name").strip('"')
        low = name.lower()
        if low.startswith("memcpy") or low.startswith("memset"):
            continue
        rows.append((int(float(col(r, "Start"))), int(float(col(r, "Duration"))), name))
    rows.sort()
    return rows


def per_position(rows, steps):
    """[(kind, mean ns, mean NCCL-overlap fraction, name)] for one step's compute kernels."""
    nccl = [(s, s + d) for s, d, n in rows if "nccl" in n.lower()]
    comp = [r for r in rows if "nccl" not in r[2].lower()]
    per = len(comp) // steps
    if per == 0 or per * steps != len(comp):
        print(f"note: {len(comp)} compute kernels do not split into {steps} equal steps; positions may drift")
    first = 2 if steps > 4 else 0
    out = []
    for i in range(per):
        durs, fracs = [], []
        for st in range(first, steps):
            s, d, _ = comp[st * per + i]
            e = s + d
            ov = sum(min(e, ne) - max(s, ns) for ns, ne in nccl if ne > s and ns < e)
            durs.append(d)
            fracs.append(ov / d if d else 0.0)
        name = comp[first * per + i][2]
        out.append((kind(name), sum(durs) / len(durs), sum(fracs) / len(fracs), name))
    return out


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    steps = int(sys.argv[1])
    top = int(sys.argv[4]) if len(sys.argv) > 4 else 15
    a, b = per_position(load(sys.argv[2]), steps), per_position(load(sys.argv[3]), steps)
    sm = difflib.SequenceMatcher(None, [k for k, *_ in a], [k for k, *_ in b], autojunk=False)
    pairs = [(blk.a + k, blk.b + k) for blk in sm.get_matching_blocks() for k in range(blk.size)]
    print(f"{len(pairs)} positions matched ({len(a)} kernels a step in A, {len(b)} in B)")
    by = defaultdict(lambda: [0.0, 0.0, 0])
    for i, j in pairs:
        t = by[a[i][0]]
        t[0] += a[i][1]
        t[1] += b[j][1]
        t[2] += 1
    print(f"{'kind':28} {'n':>4} {'A us':>9} {'B us':>9} {'B-A us':>8}")
    for k, (x, y, n) in sorted(by.items(), key=lambda kv: kv[1][0] - kv[1][1]):
        print(f"{k:28} {n:4} {x / 1e3:9.1f} {y / 1e3:9.1f} {(y - x) / 1e3:8.1f}")
    print(f"\npositions B loses most at (us; nccl: share of B's kernel beside an NCCL kernel):")
    for i, j in sorted(pairs, key=lambda p: a[p[0]][1] - b[p[1]][1])[:top]:
        ka, da, _, na = a[i]
        _, db, fb, nb = b[j]
        same = "same name" if na == nb else "other name"
        short = re.sub(r"\(.*$", "", nb)[:70]
        print(f"{i:5} {ka:14} A {da / 1e3:7.1f} B {db / 1e3:7.1f} ({100 * (db / da - 1):+6.1f}%) nccl {fb:4.2f} {same:12} {short}")


if __name__ == "__main__":
    main()
