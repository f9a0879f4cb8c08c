"""Per-GPU busy time of a profile, to tell where a multi-GPU step loses time.

    python3 scripts/gpu_timeline.py TRACE.csv STEPS LABEL

TRACE.csv: `nsys stats --report cuda_gpu_trace --format csv` of a profile
that covers STEPS steps (CHORUS_PROFILER_RANGE=1). Per device, per step:
the span from the first to the last kernel, the time some kernel ran (the
union), the compute kernels' summed time and the NCCL kernels' (with how much
of NCCL's time ran beside compute), then the memsets and copies per step and
the idle gaps between kernels by length. Compute time that grows from one GPU to two
means the communication slows the compute (shared SMs, memory); a span longer
than the union means the GPU waited (the tail of the last bucket, a
collective's latency, the host)."""
import csv, re, sys
from collections import defaultdict


def col(row, *names):
    for n in names:
        for k in row:
            if k.startswith(n):
                return row[k]
    raise KeyError(names)


def union(iv):
    total, end = 0, None
    for s, e in sorted(iv):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def gaps(iv):
    """Idle stretches between kernels, binned: {label: (count, ns)}."""
    bins = [(2e3, "<2us"), (4e3, "2-4us"), (8e3, "4-8us"), (20e3, "8-20us"), (1e5, "20-100us"), (float("inf"), ">100us")]
    out = {label: [0, 0] for _, label in bins}
    end = None
    for s, e in sorted(iv):
        if end is not None and s > end:
            g = s - end
            label = next(lb for top, lb in bins if g < top)
            out[label][0] += 1
            out[label][1] += g
        end = e if end is None else max(end, e)
    return out


def main():
    path, steps, label = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    per = defaultdict(lambda: {"all": [], "nccl": [], "compute": [], "memset": 0, "memcpy": 0})
    for r in csv.DictReader(open(path)):
        name = col(r, "Name")
        dev = col(r, "Device")
        # Copies and memsets (the CUPTI trace records them) are counted, not
        # timed as kernels: a memset node between two kernels shows as gaps.
        # (CUPTI names them "memset N B" / "memcpy ..."; a kernel whose mangled
        # name merely contains the word, graph_memsets.cu's fill kernel, is a kernel.)
        low = name.lower().strip('"')
        if low.startswith("memcpy") or low.startswith("memset"):
            per[dev]["memset" if low.startswith("memset") else "memcpy"] += 1
            continue
        s = int(float(col(r, "Start")))
        d = int(float(col(r, "Duration")))
        iv = (s, s + d)
        per[dev]["all"].append(iv)
        per[dev]["nccl" if re.search("nccl", name, re.I) else "compute"].append(iv)
    for dev, k in sorted(per.items()):
        if not k["all"]:
            continue
        span = max(e for _, e in k["all"]) - min(s for s, _ in k["all"])
        busy = union(k["all"])
        comp = sum(e - s for s, e in k["compute"])
        comp_u = union(k["compute"])
        nccl = sum(e - s for s, e in k["nccl"])
        nccl_alone = busy - comp_u  # NCCL time with no compute kernel beside it
        ms = lambda ns: ns / 1e6 / steps
        print(f"{label} {dev}: per step span {ms(span):.3f} ms, busy {ms(busy):.3f}, compute kernels {ms(comp):.3f} "
              f"(union {ms(comp_u):.3f}), nccl kernels {ms(nccl):.3f} (alone {ms(nccl_alone):.3f}), idle {ms(span - busy):.3f}")
        g = gaps(k["all"])
        print(f"{label} {dev}: per step {k['memset'] / steps:.1f} memsets, {k['memcpy'] / steps:.1f} copies; idle gaps "
              + ", ".join(f"{lb} {n / steps:.1f} x = {ns / 1e3 / steps:.1f} us" for lb, (n, ns) in g.items() if n))


if __name__ == "__main__":
    main()
