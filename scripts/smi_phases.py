#!/usr/bin/env python3
# The GPU clock and power by phase of a device call (session 41: why a sustained gpt2 step is power-bound):
# SMI_CSV from `nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader
# -lms 20`, MARKS lines "name epoch-seconds" written between the runs (`echo "name $(date +%s.%N)" >> MARKS`).
# Usage: python3 scripts/smi_phases.py SMI_CSV MARKS
# Summarise nvidia-smi samples (timestamp, clocks.sm, clocks.mem, power, temp) between the marker times in argv[2].
import sys, csv, datetime, statistics
marks = [l.split() for l in open(sys.argv[2]) if l.strip()]
marks = [(n, float(t)) for n, t in marks]
rows = []
for r in csv.reader(open(sys.argv[1])):
    try:
        ts = datetime.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((ts, float(r[1].split()[0]), float(r[2].split()[0]), float(r[3].split()[0]), float(r[4])))
    except Exception:
        pass
for (a, ta), (b, tb) in zip(marks, marks[1:]):
    s = [x for x in rows if ta <= x[0] < tb and x[3] > 250]
    if not s: print(f"{a}-{b}: no busy samples ({len([x for x in rows if ta <= x[0] < tb])} in all)"); continue
    print(f"{a}-{b}: {len(s)} busy samples: sm MHz median {statistics.median(x[1] for x in s):.0f} "
          f"(min {min(x[1] for x in s):.0f}, max {max(x[1] for x in s):.0f}), mem {statistics.median(x[2] for x in s):.0f}, "
          f"power median {statistics.median(x[3] for x in s):.0f} W (max {max(x[3] for x in s):.0f}), temp {max(x[4] for x in s):.0f} C")
