#!/usr/bin/env bash
# Issue 14: Chorus's graphed WRN-28-10 bf16 channels-last step beside
# torch.compile's (TMODE, default max-autotune), every kernel of 20 steps
# through CUPTI (libchorus_kernel_trace.so as CUDA's injection library; no
# Nsight needed): busy and idle time per step (scripts/gpu_timeline.py), kernel
# time per class side by side (scripts/gpu_kernel_diff.py), and each side's 30
# longest kernels per step. Run from the repository root after
# `scripts/gpu_check.sh build`; writes under $OUT.
set -u
OUT=${OUT:-gpu-out}
B=build-gpu; C=./$B/chorus; L=$PWD/$B/libchorus_kernel_trace.so
mkdir -p $OUT/tc $OUT/tt
CHORUS_PROFILER_RANGE=1 CUDA_INJECTION64_PATH=$L CHORUS_KERNEL_TRACE=$OUT/tc/r timeout 200 $C bench --model wrn-28-10 --precision bf16 --channels-last --devices cuda:0 --batch-size 128 --steps 20 --warmup 8 2>&1 | grep img/s
CUDA_INJECTION64_PATH=$L CHORUS_KERNEL_TRACE=$OUT/tt/r timeout 400 python3 scripts/torch_step_profile.py wrn-28-10 bf16 1 ${TMODE:-max-autotune} 20 > $OUT/tt.log 2>&1; tail -2 $OUT/tt.log
ct=$(ls $OUT/tc/*.csv | head -1); tt=$(ls $OUT/tt/*.csv | head -1)
python3 scripts/gpu_timeline.py $ct 20 chorus | head -12
python3 scripts/gpu_timeline.py $tt 20 torch | head -12
python3 scripts/gpu_kernel_diff.py 20 chorus=$ct torch=$tt 2>/dev/null | head -20
python3 - $ct $tt <<'PY'
import csv, sys, re
from collections import defaultdict
for path in sys.argv[1:]:
    t, n = defaultdict(float), defaultdict(int)
    for r in csv.DictReader(open(path)):
        k = {kk.split(' ')[0]: v for kk, v in r.items()}
        name = r.get('Name') or k.get('Name')
        if name.lower().strip('"').startswith(('memcpy', 'memset')): continue
        key = re.sub(r"\(.*$", "", name.strip('"'))[:110]
        t[key] += float(r.get('Duration') or k.get('Duration')); n[key] += 1
    tot = sum(t.values())
    print("==", path, f"total {tot/20/1e3:.1f} us/step")
    for key in sorted(t, key=lambda k: -t[k])[:30]:
        print(f"{t[key]/20/1e3:9.1f} us {n[key]/20:5.0f}x  {key}")
PY
